"""jamp's benchmarks, one command line: ``python -m benchmarks <experiment> [options]``.

Experiments: loss-scaling, gpu-compile, autocast-memory, float8, real-models,
optimizer-memory, batchnorm, debug-cost, collectives; ``--tiny`` runs one as a smoke test in
seconds, ``<experiment> --help`` lists its options. Each is one module (a spoke) on the shared
models and variants (the hub): ``benchmarks/README.md`` has the map, and which section of
``RESULTS.md`` each writes.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from benchmarks import (
    autocast_memory,
    batchnorm,
    collectives,
    debug_cost,
    finite_checks,
    float8,
    gpu_compile,
    loss_scaling,
    optimizer_memory,
    real_models,
    report,
)

EXPERIMENTS = {
    "loss-scaling": loss_scaling,
    "gpu-compile": gpu_compile,
    "autocast-memory": autocast_memory,
    "float8": float8,
    "real-models": real_models,
    "optimizer-memory": optimizer_memory,
    "batchnorm": batchnorm,
    "debug-cost": debug_cost,
    "collectives": collectives,
}
# --step-time's GPT by default, for the experiments that time GPT steps: d=256, 4 layers,
# batch 8x128 (small) or d=1024, 8 layers, batch 16x512 (large).
STEP_CONFIGS = {"autocast-memory": "small", "float8": "large"}


def parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                 formatter_class=raw)  # fmt: skip
    sub = ap.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for name, spoke in EXPERIMENTS.items():
        doc = spoke.__doc__
        p = sub.add_parser(name, help=doc.splitlines()[0], description=doc, formatter_class=raw)
        if name == "loss-scaling":  # its own --tiny/--quick and --out; the finite checks join
            finite_checks.add_arguments(p)
        else:
            p.add_argument("--tiny", action="store_true", help="tiny models: a smoke test")
            p.add_argument("--out", default="", help="also write the section to this file")
            p.add_argument("--results", default="",
                           help="splice the section into this file, between markers")  # fmt: skip
        if name in STEP_CONFIGS:
            p.add_argument("--step-time", action="store_true",
                           help="time GPT training steps instead (for a GPU)")  # fmt: skip
            p.add_argument("--step-config", choices=("small", "large"), default=STEP_CONFIGS[name],
                           help="GPT: d=256, 4 layers, batch 8x128 (small) or d=1024, 8 layers, "
                           "batch 16x512 (large)")  # fmt: skip
            p.add_argument("--step-rounds", type=int, default=10)
            p.add_argument("--step-reps", type=int, default=10)
        spoke.add_arguments(p)
    return ap


def use_cpu() -> None:
    """Compile for a described GPU without opening one: jax's CUDA plugin must not start a
    CUDA backend (``benchmarks/xla_gpu.py``). A ``JAX_PLATFORMS`` of the caller's stays."""
    if "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        jax.config.update("jax_platforms", "cpu")


def main(argv: list[str] | None = None) -> str:
    """Runs one experiment; returns the markdown it wrote."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv
    name = args.experiment
    if name in ("gpu-compile", "real-models", "optimizer-memory", "batchnorm", "collectives") or (
        name == "autocast-memory" and not args.step_time
    ):  # GPU-compile rows; real-models measures residuals, on any backend alike;
        use_cpu()  # optimizer-memory's training is sized for two CPU cores
    if name == "loss-scaling":
        finite = None if args.no_finite else (lambda log: finite_checks.run(args, log))
        return loss_scaling.run(args, report.log, finite)
    return EXPERIMENTS[name].run(args, report.log)
