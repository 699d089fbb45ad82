"""jamp benchmarks: loss-scaled training steps vs a plain Optax step, and finite checks.

    python -m benchmarks            # full run (~8-10 min on 2 cores)
    python -m benchmarks --quick    # ~2-3 min: every peer on the MLP, a subset on the GPT
    python -m benchmarks --tiny     # seconds: smoke test (tiny models, few steps)
    python benchmarks/run.py --out PATH   # the same entry point, as a script
    bash benchmarks/gpu.sh [OUT_DIR]      # on a GPU: what ran where, then two runs

Everything runs in one process; variants are interleaved round by round (a
fresh seeded shuffle of the order each round) and every ratio is the median over rounds of the
per-round ratio to the plain float32 ``optax.adamw`` step, so load from other
processes hits all variants alike. Writes a markdown report (``--out``,
default ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import models, render, steps, targets
from benchmarks.measure import bench_finite, bench_steps, bench_torch, caching_allocator_rows

HERE = os.path.dirname(os.path.abspath(__file__))

# The GPT variants --quick compiles (the other peers cost 10-18 s of compile each
# on 2 cores); jmp's select_tree stands for the select-based peers. --all-peers
# restores them all.
QUICK_GPT = (
    "plain (f32 optax.adamw)",
    "jamp.loss_scaling",
    "jamp.loss_scaling(skip='select')",
    "jamp.GradScaler.step",
    "jamp.GradScaler(skip='select').step",
    "jmp DynamicLossScale + select_tree",
)

CONFIGS = {
    # rounds x per_round timed steps per variant; compile_reps compiles timed (the
    # first also serves the runs); guard = steps run under the transfer guard
    # (and counted for retraces) before timing; finite-check sizes and rounds;
    # torch rounds; gpt = the GPT variants kept (None: all).
    "tiny": dict(
        rounds=3,
        per_round=1,
        compile_reps=1,
        guard=20,
        sizes=(20_000,),
        frounds=1,
        trounds=2,
        gpt=QUICK_GPT,
    ),
    "quick": dict(
        rounds=6,
        per_round=2,
        compile_reps=1,
        guard=10,
        sizes=(1_000_000, 10_000_000),
        frounds=5,
        trounds=6,
        gpt=QUICK_GPT,
    ),
    "full": dict(
        rounds=30,
        per_round=3,
        compile_reps=3,
        guard=20,
        sizes=(1_000_000, 10_000_000, 50_000_000),
        frounds=8,
        trounds=30,
        gpt=None,
    ),
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", dest="mode", const="quick", help="~2-3 minutes")
    g.add_argument(
        "--tiny", action="store_const", dest="mode", const="tiny", help="seconds; smoke test"
    )
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"), help="markdown report path")
    ap.add_argument("--models", default="MLP,GPT", help="comma-separated subset of MLP,GPT")
    ap.add_argument("--no-finite", action="store_true", help="skip the finite-check section")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    ap.add_argument(
        "--all-peers",
        action="store_true",
        help="--quick: compile every variant on the GPT too (adds ~1 min on 2 cores)",
    )
    ap.add_argument(
        "--finite-sizes",
        default="",
        help="comma-separated element counts of the finite-check trees, e.g. 1e6,5e7",
    )
    ap.add_argument(
        "--compute-dtype",
        default="float32",
        help="compute dtype of the models' matmuls (GPU half-precision check)",
    )
    ap.add_argument(
        "--no-undonated",
        action="store_true",
        help="skip the MLP steps without buffer donation",
    )
    ap.add_argument(
        "--half-speedup",
        action="store_true",
        help="also time the GPT step with float16/bfloat16 matmuls vs float32 (for GPUs)",
    )
    ap.add_argument(
        "--variants", default="", help="comma-separated name prefixes to keep (plain always kept)"
    )
    ap.add_argument(
        "--caching-allocator",
        choices=("auto", "off"),
        default="auto",
        help="auto (not with --tiny; on the CPU backend only): rerun the MLP steps in a child "
        "process under jemalloc keeping freed memory, if libjemalloc is installed",
    )
    ap.add_argument("--json", default="", help="also write the step rows as JSON to this path")
    return ap


def main(argv: list[str] | None = None) -> str:
    args = parser().parse_args(argv)
    args.mode = args.mode or "full"
    args.argv = list(argv if argv is not None else sys.argv[1:])
    cfg = dict(CONFIGS[args.mode])
    if args.finite_sizes:
        cfg["sizes"] = tuple(int(float(x)) for x in args.finite_sizes.split(","))
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    variants = dict(steps.VARIANTS)
    if args.variants:
        keep = [p.strip() for p in args.variants.split(",")]
        variants = {
            k: v
            for i, (k, v) in enumerate(variants.items())
            if i == 0 or any(k.startswith(p) for p in keep)
        }
    cd = jnp.dtype(args.compute_dtype)
    tiny = args.mode == "tiny"
    mlp, gpt = (models.tiny_mlp, models.tiny_gpt) if tiny else (models.mlp, models.gpt)
    builders = {
        "MLP": functools.partial(mlp, compute_dtype=cd),
        "GPT": functools.partial(gpt, compute_dtype=cd),
    }
    step_results = []
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    quick_subset = cfg["gpt"] is not None and not args.all_peers

    def kept(vs: dict) -> dict:
        """--quick: plain, jamp's forms and jmp (standing for the select-based peers)."""
        if not quick_subset:
            return vs
        return {k: v for i, (k, v) in enumerate(vs.items()) if i == 0 or k in cfg["gpt"]}

    def add_rows(model: models.Model, rows: list[dict]) -> None:
        step_results.append((model, rows))
        for r in rows:
            log(
                f"    {r['name']:55s} {r['ms']:8.1f} ms  x{r['ratio']:.3f}"
                f"  cpu x{r['cpu_ratio']:.3f}"
            )

    def run_model(model: models.Model, vs: dict, donate: bool = True) -> None:
        add_rows(model, bench_steps(model, vs, cfg, log, donate=donate))

    for name in names:
        model = builders[name]()
        log(f"{model.describe}: {model.n_params / 1e6:.2f}M params, {model.n_leaves} leaves")
        run_model(model, kept(variants) if name == "GPT" else variants)
    if "MLP" in names and not args.no_undonated:
        # The same MLP steps with the state not donated (a jax.jit without
        # donate_argnums, as many training loops are written): XLA's choices flip.
        model = builders["MLP"]()
        model = dataclasses.replace(
            model,
            name="MLP-undonated",
            describe=model.describe + ", state **not** donated",
        )
        log(f"{model.describe}")
        vs = {k: v for k, v in variants.items() if "report_nonfinite" not in k}
        run_model(model, kept(vs), donate=False)
    if "MLP" in names and args.caching_allocator == "auto" and not tiny:
        # A host allocator's page faults are XLA:CPU's cost; a GPU has its own caching allocator.
        on_cpu = jax.default_backend() == "cpu"
        if not on_cpu:
            log(f"caching allocator: skipped on the {jax.default_backend()} backend")
        rows = caching_allocator_rows(args, log) if on_cpu else None
        if rows:
            model = builders["MLP"]()
            model = dataclasses.replace(
                model,
                name="MLP-caching-allocator",
                describe=model.describe + ", under a caching allocator (jemalloc, freed memory "
                "kept)",
            )
            add_rows(model, rows)
    if args.half_speedup:
        base = gpt()  # float32 matmuls, whatever --compute-dtype says
        half = {}
        for dt in ("float16", "bfloat16"):
            m = gpt(compute_dtype=jnp.dtype(dt))
            m = dataclasses.replace(base, loss=m.loss)
            half[f"jamp.GradScaler.step, {dt} matmuls"] = functools.partial(
                lambda mm, _m: steps.jamp_grad_scaler(mm), m
            )
            half[f"plain, {dt} matmuls (no scaling)"] = functools.partial(
                lambda mm, _m: steps.plain(mm), m
            )
        variants_h = {"plain (f32 optax.adamw)": steps.plain, **half}
        log("half-precision GPT step speed-up")
        rows = bench_steps(base, variants_h, cfg, log)
        base = dataclasses.replace(
            base, name="GPT-half", describe=base.describe + ", float16/bfloat16 matmuls vs float32"
        )
        step_results.append((base, rows))
    torch_res = None
    if not args.no_torch:
        sizes = (16, 32, 10) if tiny else (784, 2048, 2048, 2048, 1024, 10)
        torch_res = bench_torch(sizes, 4 if tiny else 128, cfg["trounds"], cfg["per_round"])
        log(
            f"torch: {torch_res and [(r['name'], round(r['ratio'], 3)) for r in torch_res['rows']]}"
        )
    finite_res = []
    if not args.no_finite:
        finite_res = bench_finite(
            cfg["sizes"], (jnp.float32, jnp.float16, jnp.bfloat16), cfg["frounds"], log
        )
    if args.json:
        with open(args.json, "w") as fh:
            dump = [dict(model=m.name, rows=rows) for m, rows in step_results]
            json.dump(dump, fh, default=float)
    scorecard = targets.table(step_results, finite_res, cfg["guard"], jax.default_backend())
    elapsed = time.perf_counter() - t_start
    text = render.report(args, cfg, step_results, torch_res, finite_res, elapsed, scorecard)
    with open(args.out, "w") as fh:
        fh.write(text)
    log(f"wrote {args.out}")
    return text
