"""The GPU compile as the benchmark: what XLA:GPU makes of every loss-scaled step (a spoke).

Every step is compiled ahead of time for a described H200 (no device; ``xla_gpu.py`` says
how) and read from the compiled program: modelled HBM bytes (each kernel's operands plus
outputs), kernels launched, XLA's temp memory, conditionals, matrix FLOPs by operand dtype
and a roofline time. Nothing is timed: the figures repeat exactly, and tests assert on
them (``tests/test_gpu_compile.py``). GEMMs keep XLA's default configurations (autotuning
needs a device).

Models (float32, ``optax.adamw(1e-3)``; ``models``): ``optimizer``, the optimizer step
alone, 24 leaves (12 x 1024x1024 weights, 12 x 1024 biases), the gradients an input;
``GPT``, 4 Flax pre-LayerNorm blocks (causal self-attention, gelu MLP), d 512, 8 heads,
batch 16x512, MSE; ``ResNet``, a Flax ResNet with BatchNorm (its ``batch_stats`` kept on a
skipped step), 3 stages of 2 basic blocks, 32x32x3 images, batch 64, cross-entropy;
``CNN``, 3 x (Conv 3x3 + bias, GroupNorm(8), relu), 32x32x3 images, batch 32.

Variants (``steps.py``), on the same model and inputs, state donated and not: the unscaled
step, every jamp path (``loss_scaling`` by each skip, ``GradScaler.step``, ``value_and_grad``
+ ``step_if_finite``, a ``multi_steps`` micro-step) and the peers (jmp,
``optax.apply_if_finite``, flax ``DynamicScale``).

``--float8`` (a section of its own): float8 beside bfloat16 (``jamp.autocast``), the GPT's
plain adamw step (float8 with its attention in bfloat16 too, as Transformer Engine's
default) and an MLP ``d -> 4d -> d`` SGD step (``steps.mlp_train_step``) at sizes where the
step is bound by memory and where it is bound by the GEMMs (issue #35).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import jamp
from benchmarks import models, steps, xla_gpu
from benchmarks.models import Model
from benchmarks.report import emit, header, marked

START, END = "<!-- gpu-compile:start -->", "<!-- gpu-compile:end -->"
# The floor of check-then-update on the optimizer step: one more read of the gradients
# (8 passes over a parameter's size where adamw makes 7).
FLOOR = 8 / 7
BYTES_LIMIT = 1.143  # issue #24: the default loss-scaled optimizer step, x plain
GPT_BYTES_LIMIT, GPT_KERNELS_LIMIT = 1.02, 1.10  # the GPT step with loss scaling, x unscaled


GPT_SIZES = {True: (32, 2, 2, 2, 16), False: (512, 8, 4, 16, 512)}  # d, heads, layers, b, t
# The models at their sizes here, ``MODELS[name](tiny)``.
MODELS: dict[str, Callable[[bool], Model]] = {
    "optimizer": lambda tiny: models.optimizer(*((64, 256) if tiny else ())),
    "GPT": lambda tiny, **kw: models.gpt_stack(*GPT_SIZES[tiny], **kw),
    "ResNet": lambda tiny: models.resnet(
        *(((8, 16), 1, 8, 4) if tiny else ((64, 128, 256), 2, 32, 64))
    ),
    "CNN": lambda tiny: models.cnn(
        *(((8, 16, 16), 4, 4, 8) if tiny else ((32, 64, 128), 8, 32, 32))
    ),
}
VARIANTS: dict[str, Callable[[Model], tuple]] = {
    "plain (optax.adamw)": steps.plain,
    "jamp.loss_scaling": steps.loss_scaling,
    "jamp.loss_scaling(skip='cond')": functools.partial(steps.loss_scaling, skip="cond"),
    "jamp.loss_scaling(skip='select')": functools.partial(steps.loss_scaling, skip="select"),
    "jamp.GradScaler.step": steps.grad_scaler,
    "jamp.GradScaler(skip='cond').step": functools.partial(steps.grad_scaler, skip="cond"),
    "jamp.value_and_grad + step_if_finite": steps.value_and_grad,
    "jamp.multi_steps (a micro-step)": steps.multi_steps,
    "jmp all_finite + select_tree": functools.partial(steps.jmp_dynamic, restart=True),
    "optax.apply_if_finite (no scaling)": steps.apply_if_finite,
    "flax DynamicScale + where": steps.flax_dynamic_scale,
}
UNDONATED = ("optimizer", "GPT")  # the models also compiled without donation
DEFAULTS = ("jamp.loss_scaling", "jamp.GradScaler.step")  # the paths a user gets
PEERS = ("jmp all_finite + select_tree", "optax.apply_if_finite (no scaling)")

F8_START, F8_END = "<!-- gpu-compile-float8:start -->", "<!-- gpu-compile-float8:end -->"
# The MLPs of --float8, (d, hidden, batch): bound by memory; the telemetry tests' MLP; bound
# by the GEMMs.
F8_MLPS = {False: ((1024, 4096, 256), (1024, 4096, 2048), (4096, 16384, 8192)),
           True: ((64, 256, 128),)}  # fmt: skip
F8_VARIANTS = ("bfloat16", "float8 current", "float8 delayed")

# --------------------------------------------------------------------------- measuring


def compile_variant(
    model: Model, name: str, donate: bool, target: xla_gpu.Target = xla_gpu.TARGETS["H200"]
) -> xla_gpu.Program:
    """The compiled GPU program of one step of ``VARIANTS[name]`` on ``model``."""
    state, step = VARIANTS[name](model)
    compiled = xla_gpu.compile_for(
        step, state, model.batch, donate_argnums=(0,) if donate else (), target=target
    )
    return xla_gpu.analyse(compiled)


def finite_check(model: Model, target: xla_gpu.Target) -> dict[str, xla_gpu.Program]:
    """The finite check alone over ``model``'s gradients, beside the peers' and a read."""
    import jmp

    def optax_check(g: Any) -> jax.Array:  # optax.apply_if_finite's check
        return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(g)]))

    def scaled(g: Any) -> jax.Array:  # the flag of the check a loss-scaled step runs
        return jamp.unscale_and_check(jamp.dynamic_loss_scale(steps.INIT_SCALE), g)[1]

    checks = {
        "read floor: sum of every leaf": lambda g: sum(jnp.sum(x) for x in jax.tree.leaves(g)),
        "jamp.all_finite": jamp.all_finite,
        "jamp.unscale_and_check flag": scaled,
        "jmp.all_finite": jmp.all_finite,
        "optax.apply_if_finite's check": optax_check,
    }
    return {
        name: xla_gpu.analyse(xla_gpu.compile_for(fn, model.params, target=target))
        for name, fn in checks.items()
    }


def measure(model: Model, donations: tuple[bool, ...], target: xla_gpu.Target, log: Callable):
    rows = []
    for donate in donations:
        for name in VARIANTS:
            t = time.perf_counter()
            p = compile_variant(model, name, donate, target)
            rows.append({"name": name, "donate": donate, "program": p})
            log(
                f"  {name:40s} donated={donate!s:5} kernels {p.n_kernels:4d} "
                f"bytes {p.bytes / 1e9:8.3f} GB temp {p.temp_bytes / 2**20:8.1f} MiB "
                f"cond {p.conditionals} ({time.perf_counter() - t:.1f} s)"
            )
    return rows


# --------------------------------------------------------------------------- the section


def _gflop(flops: dict[str, float]) -> str:
    parts = [f"{d} {f / 1e9:,.1f}" for d, f in sorted(flops.items()) if f > 0]
    return ", ".join(parts) or "-"


def _table(rows: list[dict], target: xla_gpu.Target) -> list[str]:
    out = [
        "| variant | donated | bytes x plain | kernels | temp (MiB) | conditionals | copies "
        "| roofline x plain | GEMM GFLOP by dtype | HBM bytes (GB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for donate in sorted({r["donate"] for r in rows}, reverse=True):
        group = [r for r in rows if r["donate"] == donate]
        base = group[0]["program"]
        for r in group:
            p = r["program"]
            out.append(
                f"| {r['name']} | {'yes' if donate else 'no'} | {p.bytes / base.bytes:.4f} | "
                f"{p.n_kernels} | {p.temp_bytes / 2**20:.1f} | {p.conditionals} | {p.copies} | "
                f"{p.roofline(target) / base.roofline(target):.4f} | {_gflop(p.flops)} | "
                f"{p.bytes / 1e9:.3f} |"
            )
    return out


def targets(results: dict[str, list[dict]]) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for issue #24's targets, from this run's rows."""
    out = []
    opt = results.get("optimizer", [])
    for donate in (True, False):
        group = {r["name"]: r["program"] for r in opt if r["donate"] == donate}
        if not group:
            continue
        base = group["plain (optax.adamw)"]
        peer_kernels = min(group[p].n_kernels for p in PEERS)
        d = "donated" if donate else "not donated"
        for name in DEFAULTS:
            p = group[name]
            target = (
                f"optimizer step, {d}: `{name}` has no conditional, <= {BYTES_LIMIT}x plain "
                f"bytes, no more kernels than jmp and optax.apply_if_finite ({peer_kernels})"
            )
            measured = (
                f"{p.conditionals} conditionals, {p.bytes / base.bytes:.4f}x bytes "
                f"(floor {FLOOR:.4f}), {p.n_kernels} kernels (plain {base.n_kernels})"
            )
            met = round(p.bytes / base.bytes, 3) <= BYTES_LIMIT and p.n_kernels <= peer_kernels
            out.append((target, measured, met and p.conditionals == 0))
    for model in ("GPT", "ResNet", "CNN"):
        group = {r["name"]: r["program"] for r in results.get(model, []) if r["donate"]}
        if not group:
            continue
        base = group["plain (optax.adamw)"]
        peer = min((group[p] for p in PEERS), key=lambda q: q.n_kernels)
        peer_note = (
            f"; the peers: {min(group[p].n_kernels for p in PEERS) / base.n_kernels:.3f}x "
            f"kernels, {peer.bytes / base.bytes:.4f}x bytes"
        )
        bar = "" if model == "GPT" else " (the GPT's bar on another model: not an issue target)"
        bn = "; the BatchNorm statistics' select adds a kernel per statistic"
        why = (
            " (checking before updating: the plain step fuses each small leaf's update into the "
            f"reduction that makes its gradient, and a checked step cannot"
            f"{bn if model == 'ResNet' else ''})"
        )
        for name in DEFAULTS:
            p = group[name]
            br, kr = p.bytes / base.bytes, p.n_kernels / base.n_kernels
            met = br <= GPT_BYTES_LIMIT and kr <= GPT_KERNELS_LIMIT and p.conditionals == 0
            target = (
                f"{model} train step, donated: `{name}` <= +{GPT_BYTES_LIMIT - 1:.0%} bytes, "
                f"<= +{GPT_KERNELS_LIMIT - 1:.0%} kernels, no conditional{bar}"
            )
            measured = (
                f"{br:.4f}x bytes, {kr:.3f}x kernels ({p.n_kernels} vs {base.n_kernels}), "
                f"{p.conditionals} conditionals{peer_note}{'' if met else why}"
            )
            out.append((target, measured, met))
    return out


def section(args: argparse.Namespace, chosen: list[Model], results: dict, checks: dict,
            target: xla_gpu.Target, elapsed: float) -> str:  # fmt: skip
    cmd = "python -m benchmarks gpu-compile" + (" --tiny" if args.tiny else "")
    lines = [
        START,
        "## The GPU compile: what XLA:GPU makes of each step (`benchmarks/gpu_compile.py`)",
        "",
        *header(cmd, elapsed, ("jax", "jaxlib", "optax", "flax", "jmp")),
        f"- **compiled for an {target.name} target, no device, autotuning off** (deviceless "
        f"ahead-of-time compilation with jax's CUDA plugin; GEMMs keep XLA's default "
        f"configurations): nothing here is timed, and every figure repeats exactly",
        "- bytes: modelled HBM traffic, for each kernel the bytes of its operands plus its "
        "outputs (a `conditional` counts its costliest branch); kernels: launches per step "
        "(a conditional counts its thunk and its costliest branch's kernels); temp: XLA's temp "
        "allocation; roofline: per kernel the larger of FLOPs / dense peak for its dtype "
        f"(bf16/fp16 989, fp8 1979, tf32 494 TFLOPS) and bytes / {target.bandwidth / 1e12:.2f} "
        "TB/s, summed. The model definitions are in the module docstring.",
        "- on a GPU a `conditional` is a host sync: XLA:GPU copies the predicate to the host "
        "and waits for the stream before it launches a branch (`conditional_thunk.cc`).",
    ]
    for model in chosen:
        lines += ["", f"### {model.name}: {model.describe}", "",
                  f"{model.n_params / 1e6:.2f}M float32 parameters in {model.n_leaves} leaves, "
                  "`optax.adamw(1e-3)`.", "", *_table(results[model.name], target)]  # fmt: skip
    if checks:
        floor = checks["read floor: sum of every leaf"]
        lines += ["", "### The finite check alone, over the optimizer model's 24 leaves", "",
                  "| check | bytes x one read | kernels | conditionals |",
                  "| --- | ---: | ---: | ---: |"]  # fmt: skip
        lines += [f"| {name} | {p.bytes / floor.bytes:.4f} | {p.n_kernels} | {p.conditionals} |"
                  for name, p in checks.items()]  # fmt: skip
    rows = targets(results)
    if rows:
        lines += ["", "### Targets (issue #24)", "", "| target | measured | met |",
                  "| --- | --- | --- |"]  # fmt: skip
        lines += [f"| {t} | {m} | {'yes' if ok else '**no**'} |" for t, m, ok in rows]
    lines += ["", END]
    return "\n".join(lines)


# --------------------------------------------------------------------------- float8


def float8_programs(tiny: bool, log: Callable) -> dict[str, dict[str, xla_gpu.Program]]:
    """``{model: {variant: program}}``: the GPT's adamw step under ``jamp.autocast`` bfloat16
    and float8 (current scaling), the MLPs' SGD steps under bfloat16 and both recipes."""
    out: dict[str, dict[str, xla_gpu.Program]] = {}
    gpt = MODELS["GPT"](tiny)
    in_bf16 = MODELS["GPT"](tiny, attention=jamp.autocast(nn.dot_product_attention, jnp.bfloat16))
    out[f"GPT: {gpt.describe}, adamw"] = rows = {}
    for name, dtype, m in (("bfloat16", jnp.bfloat16, gpt), ("float8 current", "float8", gpt),
                           ("float8, attention in bfloat16", "float8", in_bf16)):  # fmt: skip
        model = dataclasses.replace(m, loss=jamp.autocast(m.loss, dtype))
        rows[name] = compile_variant(model, "plain (optax.adamw)", True)
        log(f"  GPT {name}: {rows[name].temp_bytes / 2**20:.1f} MiB temp")
    recipes = {"bfloat16": None, "float8 current": None,
               "float8 delayed": jamp.float8.DelayedScaling(steps.HISTORY)}  # fmt: skip
    for d, hidden, batch in F8_MLPS[tiny]:
        out[f"MLP {d} -> {hidden} -> {d}, batch {batch}, SGD"] = rows = {}
        for name in F8_VARIANTS:
            dtype = jnp.bfloat16 if name == "bfloat16" else "float8"
            step, args, n = steps.mlp_train_step(dtype, d, hidden, batch, recipes[name])
            rows[name] = xla_gpu.analyse(xla_gpu.compile_for(step, *args, donate_argnums=(n,)))
            log(f"  MLP {d} {name}: {rows[name].bytes / 1e6:.1f} MB")
    return out


def float8_section(args: argparse.Namespace, programs: dict, target: xla_gpu.Target,
                   elapsed: float) -> str:  # fmt: skip
    cmd = "python -m benchmarks gpu-compile --float8" + (" --tiny" if args.tiny else "")
    lines = [
        "## The GPU compile: float8 beside bfloat16 (`benchmarks/gpu_compile.py --float8`)", "",
        *header(cmd, elapsed),
        "- compiled for an H200 target, no device, autotuning off, as the section above; "
        "`jamp.autocast(loss, bfloat16)` against `jamp.autocast(loss, \"float8\")` (the "
        "gradient GEMMs with float32 accumulation, `docs/float8-design.md`); parameters donated",
        "- bound: the roofline's larger share, the GEMMs' FLOPs at the dense peak or every "
        "kernel's bytes at the bandwidth",
    ]  # fmt: skip
    head = ("| variant | bytes (GB) | x bf16 | temp (MiB) | x bf16 | roofline (ms) | x bf16 | "
            "bound | kernels | GEMM dtypes |")  # fmt: skip
    for model, rows in programs.items():
        bf = rows["bfloat16"]
        lines += ["", f"### {model}", "", head, "| --- |" + " ---: |" * 6 + " --- | ---: | --- |"]
        for name, p in rows.items():
            flops = sum(f / target.peaks[d] for d, f in p.flops.items())
            bound = "GEMMs" if flops > p.bytes / target.bandwidth else "memory"
            lines.append(
                f"| {name} | {p.bytes / 1e9:.3f} | {p.bytes / bf.bytes:.3f} | "
                f"{p.temp_bytes / 2**20:.1f} | {p.temp_bytes / bf.temp_bytes:.3f} | "
                f"{p.roofline(target) * 1e3:.3f} | {p.roofline(target) / bf.roofline(target):.3f}"
                f" | {bound} | {p.n_kernels} | {', '.join(sorted(p.gemm_dtypes()))} |"
            )
    gpt = next(rows for model, rows in programs.items() if model.startswith("GPT"))
    f8, bf = gpt["float8 current"], gpt["bfloat16"]
    met = "yes" if f8.temp_bytes <= bf.temp_bytes else "**no**"
    measured = f"{f8.temp_bytes / 2**20:.1f} MiB against {bf.temp_bytes / 2**20:.1f} MiB"
    lines += ["", "### Target (issue #35)", "", "| target | measured | met |", "| --- " * 3 + "|",
              f"| GPT train step: float8 temp <= bfloat16's | {measured} | {met} |"]  # fmt: skip
    return marked("\n".join(lines), F8_START, F8_END)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    ap.add_argument("--float8", action="store_true", help="only float8 beside bfloat16")


def run(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    why = xla_gpu.unavailable()
    if why:
        raise SystemExit(f"benchmarks gpu-compile: {why}")
    target = xla_gpu.TARGETS["H200"]
    t0 = time.perf_counter()
    if getattr(args, "float8", False):
        with jax.numpy_dtype_promotion("standard"):  # optax's adamw
            programs = float8_programs(args.tiny, log)
        text = float8_section(args, programs, target, time.perf_counter() - t0)
        return emit(args, text, F8_START, F8_END)
    chosen = [MODELS[m.strip()](args.tiny) for m in args.models.split(",") if m.strip()]
    results = {}
    for model in chosen:
        log(f"{model.name}: {model.describe}")
        donations = (True, False) if model.name in UNDONATED else (True,)
        results[model.name] = measure(model, donations, target, log)
    checks = finite_check(MODELS["optimizer"](args.tiny), target)
    text = section(args, chosen, results, checks, target, time.perf_counter() - t0)
    return emit(args, text, START, END)
