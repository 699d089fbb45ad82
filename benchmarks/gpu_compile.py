"""The GPU compile as the benchmark: what XLA:GPU makes of every loss-scaled step.

    python -m benchmarks.gpu_compile                  # H200 target, ~10 min on 2 cores
    python -m benchmarks.gpu_compile --results benchmarks/RESULTS.md   # record it there
    python -m benchmarks.gpu_compile --tiny           # seconds: a smoke test
    python -m benchmarks.gpu_compile --target H100    # H100 SXM (3.35 TB/s)

Every step is compiled ahead of time for a described H200 (no device;
``benchmarks/xla_gpu.py`` says how) and read from the compiled GPU program:
modelled HBM bytes (each kernel's operands plus outputs), kernels launched,
XLA's temp memory, conditionals, matrix FLOPs by operand dtype and a roofline
time. Nothing is timed: the compiler's output is deterministic, so the
numbers repeat exactly, and tests assert on them (tests/test_gpu_compile.py).
Autotuning cannot run without a device, so GEMMs keep XLA's default
configurations.

Models (all float32, ``optax.adamw(1e-3)``):

``optimizer``
    the optimizer step alone: 24 leaves (12 x 1024x1024 weights, 12 x 1024
    biases), 12.6M parameters; the gradients are an input.
``GPT``
    4 Flax pre-LayerNorm blocks (causal self-attention, gelu MLP), d 512, 8
    heads, batch 16x512, MSE loss: a whole train step.
``ResNet``
    a Flax ResNet with BatchNorm (its ``batch_stats`` kept on a skipped step,
    ``docs/model-state.md``), 3 stages of 2 basic blocks, 32x32x3 images,
    batch 64, cross-entropy.
``CNN``
    3 x (Conv 3x3 + bias, GroupNorm(8), relu), 32x32x3 images, batch 32.

Variants, each on the same model and inputs: the unscaled step (``plain``),
every jamp path (``loss_scaling`` by each skip, ``GradScaler.step``,
``value_and_grad`` + ``step_if_finite``, ``multi_steps``: one micro-step), and
the peers (jmp, ``optax.apply_if_finite``, flax ``DynamicScale``); each with
its state donated (``donate_argnums``) and not.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python benchmarks/gpu_compile.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"  # noqa: A001
# The plugin must not try to start a CUDA backend: only the topology is compiled for.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import jamp  # noqa: E402
from benchmarks import sections, xla_gpu  # noqa: E402

START, END = "<!-- gpu-compile:start -->", "<!-- gpu-compile:end -->"
INIT_SCALE = 2.0**15
# The floor of check-then-update on the optimizer step: one more read of the gradients
# (8 passes over a parameter's size where adamw makes 7).
FLOOR = 8 / 7
BYTES_LIMIT = 1.143  # issue #24: the default loss-scaled optimizer step, x plain
GPT_BYTES_LIMIT, GPT_KERNELS_LIMIT = 1.02, 1.10  # the GPT step with loss scaling, x unscaled

# --------------------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class Model:
    """A model's float32 parameters, state and batch (arrays or shape structs).

    ``loss(params, mstate, batch) -> (loss, new_mstate)``; ``loss`` is ``None``
    for the optimizer step alone, whose batch is the gradients.
    """

    name: str
    describe: str
    params: Any
    mstate: Any
    batch: Any
    loss: Callable | None

    @property
    def n_params(self) -> int:
        return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(self.params)))

    @property
    def n_leaves(self) -> int:
        return len(jax.tree_util.tree_leaves(self.params))


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def optimizer_model(tiny: bool = False, layers: int = 12) -> Model:
    n = 64 if tiny else 1024
    m = 256 if tiny else 1024
    params = {f"l{i}": {"w": _f32(n, m), "b": _f32(m)} for i in range(layers)}
    describe = (
        f"the optimizer step alone: {2 * layers} leaves ({layers} x {n}x{m} + {layers} x {m})"
    )
    return Model("optimizer", describe, params, {}, params, None)


def _flax_model(name: str, describe: str, module: nn.Module, x: Any, loss: Callable) -> Model:
    """A Flax module's model: its parameters (and batch statistics) as shape structs."""
    variables = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), jnp.zeros(x.shape)))
    params = variables["params"]
    mstate = {k: v for k, v in variables.items() if k != "params"}

    def train_loss(p: Any, ms: Any, batch: Any) -> tuple[jax.Array, Any]:
        inputs, targets = batch
        if ms:
            out, new = module.apply({"params": p, **ms}, inputs, mutable=list(ms))
        else:
            out, new = module.apply({"params": p}, inputs), {}
        return loss(out.astype(jnp.float32), targets), new

    return Model(name, describe, params, mstate, None, train_loss)


def gpt_model(tiny: bool = False, layers: int | None = None) -> Model:
    from benchmarks.autocast_memory import GPTStack

    d, heads, n, b, t = (32, 2, 2, 2, 16) if tiny else (512, 8, 4, 16, 512)
    layers = n if layers is None else layers
    x = _f32(b, t, d)

    def loss(out: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean(jnp.square(out - y))

    describe = f"{layers} Flax GPT blocks, d {d}, {heads} heads, batch {b}x{t}, MSE loss"
    m = _flax_model("GPT", describe, GPTStack(layers, heads), x, loss)
    return dataclasses.replace(m, batch=(x, _f32(b, t, d)))


class ResBlock(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        bn = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9)
        h = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
        h = nn.relu(bn()(h))
        h = bn()(nn.Conv(self.features, (3, 3), use_bias=False)(h))
        if x.shape[-1] != self.features or self.strides != 1:
            x = bn()(nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + h)


class ResNet(nn.Module):
    stages: tuple[int, ...]
    blocks: int = 2

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(self.stages[0], (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9)(x))
        for i, f in enumerate(self.stages):
            for j in range(self.blocks):
                x = ResBlock(f, 2 if (i > 0 and j == 0) else 1)(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def resnet_model(tiny: bool = False) -> Model:
    stages, blocks, size, b = ((8, 16), 1, 8, 4) if tiny else ((64, 128, 256), 2, 32, 64)
    x = _f32(b, size, size, 3)
    describe = (
        f"Flax ResNet with BatchNorm: {len(stages)} stages {stages} of {blocks} basic blocks, "
        f"{size}x{size}x3 images, batch {b}, cross-entropy"
    )
    m = _flax_model("ResNet", describe, ResNet(stages, blocks), x, _xent)
    return dataclasses.replace(m, batch=(x, jax.ShapeDtypeStruct((b,), jnp.int32)))


def cnn_model(tiny: bool = False) -> Model:
    from benchmarks.autocast_memory import CNN

    size, b, feats, groups = (8, 4, (8, 16, 16), 4) if tiny else (32, 32, (32, 64, 128), 8)
    x = _f32(b, size, size, 3)
    describe = (
        f"3 x (Conv 3x3 + bias, GroupNorm({groups}), relu), features {feats}, "
        f"{size}x{size}x3 images, batch {b}, cross-entropy"
    )
    m = _flax_model("CNN", describe, CNN(feats, groups), x, _xent)
    return dataclasses.replace(m, batch=(x, jax.ShapeDtypeStruct((b,), jnp.int32)))


MODELS = {"optimizer": optimizer_model, "GPT": gpt_model, "ResNet": resnet_model, "CNN": cnn_model}

# --------------------------------------------------------------------------- variants
#
# Each builder returns (state, step): step(state, batch) -> state, a pure function;
# the state is (params, opt_state, mstate, extra). On the optimizer step alone the
# batch is the (scaled, for a scaled variant) gradients.


def _tx() -> optax.GradientTransformation:
    return optax.adamw(1e-3)


def _grads(model: Model, params: Any, mstate: Any, batch: Any, scale: Callable) -> tuple:
    """(gradients of ``scale(loss)``, new model state); the batch itself for the optimizer."""
    if model.loss is None:
        return batch, mstate

    def scaled(p: Any) -> tuple[jax.Array, Any]:
        loss, new = model.loss(p, mstate, batch)
        return scale(loss), new

    return jax.grad(scaled, has_aux=True)(params)


def _keep(finite: jax.Array, new: Any, old: Any) -> Any:
    """The model state of a finite step, else the old one (docs/model-state.md)."""
    return jamp.compat.select_tree(finite, new, old) if jax.tree_util.tree_leaves(new) else new


def _init(model: Model, tx: Any, extra: Any = ()) -> tuple:
    return (model.params, jax.eval_shape(tx.init, model.params), model.mstate, extra)


def plain(model: Model) -> tuple:
    tx = _tx()

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, extra = state
        grads, ms = _grads(model, params, ms, batch, lambda x: x)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, ms, extra

    return _init(model, tx), step


def loss_scaling(model: Model, skip: str = "auto") -> tuple:
    tx = jamp.loss_scaling(_tx(), jamp.dynamic_loss_scale(INIT_SCALE), skip=skip)

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, extra = state
        ls = jamp.get_loss_scale(opt)
        grads, new_ms = _grads(model, params, ms, batch, lambda x: jamp.scale(ls, x))
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, _keep(opt.last_finite, new_ms, ms), extra

    return _init(model, tx), step


def grad_scaler(model: Model, skip: str = "auto") -> tuple:
    scaler = jamp.GradScaler(init_scale=INIT_SCALE, skip=skip)
    tx = _tx()

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, sc = state
        grads, new_ms = _grads(model, params, ms, batch, lambda x: scaler.scale(sc, x))
        params, opt, sc = scaler.step(sc, tx, grads, opt, params)
        new_ms = _keep(jnp.logical_not(scaler.found_inf(sc)), new_ms, ms)
        return params, opt, new_ms, scaler.update(sc)

    return _init(model, tx, jax.eval_shape(scaler.init)), step


def value_and_grad(model: Model) -> tuple:
    """``jamp.value_and_grad`` + ``step_if_finite`` (the optimizer step alone:
    ``unscale_and_check`` + ``step_if_finite``, the same pure functions)."""
    tx = _tx()

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, ls = state
        if model.loss is None:
            grads, finite = jamp.unscale_and_check(ls, batch)
            new_ms, ls = ms, jamp.update(ls, finite)
        else:
            out = jamp.value_and_grad(model.loss, has_aux=True)(ls, params, ms, batch)
            grads, finite, new_ms, ls = out.grads, out.finite, out.aux, out.loss_scale
        params, opt = jamp.step_if_finite(finite, tx, grads, opt, params)
        return params, opt, _keep(finite, new_ms, ms), ls

    ls0 = jax.eval_shape(lambda: jamp.dynamic_loss_scale(INIT_SCALE))
    return _init(model, tx, ls0), step


def multi_steps(model: Model) -> tuple:
    """One micro-step of ``jamp.multi_steps(jamp.loss_scaling(adamw), 4)``."""
    inner = jamp.loss_scaling(_tx(), jamp.dynamic_loss_scale(INIT_SCALE))
    tx = jamp.multi_steps(inner, every_k_schedule=4)

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, extra = state
        ls = jamp.get_loss_scale(opt)
        grads, new_ms = _grads(model, params, ms, batch, lambda x: jamp.scale(ls, x))
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, new_ms, extra

    return _init(model, tx), step


def jmp_dynamic(model: Model) -> tuple:
    import jmp

    tx = _tx()

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, scale = state
        ls = jmp.DynamicLossScale(scale)
        grads, new_ms = _grads(model, params, ms, batch, ls.scale)
        grads = ls.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt = tx.update(grads, opt, params)
        new_params = optax.apply_updates(params, updates)
        params, opt, ms = jmp.select_tree(finite, (new_params, new_opt, new_ms), (params, opt, ms))
        return params, opt, ms, ls.adjust(finite).loss_scale

    return _init(model, tx, jax.ShapeDtypeStruct((), jnp.float32)), step


def apply_if_finite(model: Model) -> tuple:
    tx = optax.apply_if_finite(_tx(), max_consecutive_errors=5)

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, extra = state
        grads, new_ms = _grads(model, params, ms, batch, lambda x: x)
        updates, opt = tx.update(grads, opt, params)
        ms = _keep(opt.last_finite, new_ms, ms)
        return optax.apply_updates(params, updates), opt, ms, extra

    return _init(model, tx), step


def flax_dynamic_scale(model: Model) -> tuple:
    """flax's ``DynamicScale``: its ``value_and_grad`` (on the optimizer step alone, the
    same unscale, per-leaf ``all(isfinite)`` and scale update on the given gradients)."""
    from flax.training.dynamic_scale import DynamicScale

    tx = _tx()

    def unscale_check(ds: DynamicScale, grads: Any) -> tuple:
        # flax.training.dynamic_scale.DynamicScale.value_and_grad, after its jax.grad.
        grads = jax.tree_util.tree_map(lambda g: jnp.asarray(g, jnp.float32) / ds.scale, grads)
        finite = jnp.array(True)
        for g in jax.tree_util.tree_leaves(grads):
            finite &= jnp.all(jax.lax.is_finite(g))
        grow = ds.fin_steps == ds.growth_interval
        fin_scale = jnp.where(
            grow & finite, jnp.minimum(ds.scale * ds.growth_factor, 3.4e38), ds.scale
        )
        new_scale = jnp.where(finite, fin_scale, ds.scale * ds.backoff_factor)
        steps = jnp.where(grow | (~finite), 0, ds.fin_steps + 1)
        return ds.replace(fin_steps=steps, scale=new_scale), finite, grads

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, (scale, fin_steps) = state
        ds = DynamicScale(scale=scale, fin_steps=fin_steps)
        if model.loss is None:
            ds, finite, grads = unscale_check(ds, batch)
            new_ms = ms
        else:
            ds, finite, (_, new_ms), grads = ds.value_and_grad(model.loss, has_aux=True)(
                params, ms, batch
            )
        updates, new_opt = tx.update(grads, opt, params)
        new_params = optax.apply_updates(params, updates)

        def keep(new: Any, old: Any) -> Any:
            return jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)

        return (
            keep(new_params, params),
            keep(new_opt, opt),
            keep(new_ms, ms),
            (ds.scale, ds.fin_steps),
        )

    extra = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32))
    return _init(model, tx, extra), step


VARIANTS: dict[str, Callable[[Model], tuple]] = {
    "plain (optax.adamw)": plain,
    "jamp.loss_scaling": loss_scaling,
    "jamp.loss_scaling(skip='cond')": functools.partial(loss_scaling, skip="cond"),
    "jamp.loss_scaling(skip='select')": functools.partial(loss_scaling, skip="select"),
    "jamp.GradScaler.step": grad_scaler,
    "jamp.GradScaler(skip='cond').step": functools.partial(grad_scaler, skip="cond"),
    "jamp.value_and_grad + step_if_finite": value_and_grad,
    "jamp.multi_steps (a micro-step)": multi_steps,
    "jmp all_finite + select_tree": jmp_dynamic,
    "optax.apply_if_finite (no scaling)": apply_if_finite,
    "flax DynamicScale + where": flax_dynamic_scale,
}
DEFAULTS = ("jamp.loss_scaling", "jamp.GradScaler.step")  # the paths a user gets
PEERS = ("jmp all_finite + select_tree", "optax.apply_if_finite (no scaling)")

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

    checks = {
        "read floor: sum of every leaf": lambda g: sum(jnp.sum(x) for x in jax.tree.leaves(g)),
        "jamp.all_finite": jamp.all_finite,
        "jamp.unscale_and_check flag": lambda g: jamp.unscale_and_check(
            jamp.dynamic_loss_scale(INIT_SCALE), g
        )[1],
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
            out.append(
                (
                    f"optimizer step, {d}: `{name}` has no conditional, <= {BYTES_LIMIT}x plain "
                    f"bytes, no more kernels than jmp and optax.apply_if_finite ({peer_kernels})",
                    f"{p.conditionals} conditionals, {p.bytes / base.bytes:.4f}x bytes "
                    f"(floor {FLOOR:.4f}), {p.n_kernels} kernels (plain {base.n_kernels})",
                    p.conditionals == 0
                    and round(p.bytes / base.bytes, 3) <= BYTES_LIMIT
                    and p.n_kernels <= peer_kernels,
                )
            )
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
        for name in DEFAULTS:
            p = group[name]
            br, kr = p.bytes / base.bytes, p.n_kernels / base.n_kernels
            met = br <= GPT_BYTES_LIMIT and kr <= GPT_KERNELS_LIMIT and p.conditionals == 0
            why = ""
            if not met:
                why = (
                    " (checking before updating: the plain step fuses each small leaf's update "
                    "into the reduction that makes its gradient, and a checked step cannot; "
                    "the BatchNorm statistics' select adds a kernel per statistic)"
                    if model == "ResNet"
                    else " (checking before updating: the plain step fuses each small leaf's "
                    "update into the reduction that makes its gradient, and a checked step cannot)"
                )
            out.append(
                (
                    f"{model} train step, donated: `{name}` <= +{GPT_BYTES_LIMIT - 1:.0%} bytes, "
                    f"<= +{GPT_KERNELS_LIMIT - 1:.0%} kernels, no conditional"
                    + (
                        ""
                        if model == "GPT"
                        else " (the GPT's bar on another model: not an issue target)"
                    ),
                    f"{br:.4f}x bytes, {kr:.3f}x kernels ({p.n_kernels} vs {base.n_kernels}), "
                    f"{p.conditionals} conditionals{peer_note}{why}",
                    met,
                )
            )
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        return "-"


def section(args: argparse.Namespace, models: list[Model], results: dict, checks: dict,
            target: xla_gpu.Target, elapsed: float) -> str:  # fmt: skip
    cmd = "python -m benchmarks.gpu_compile" + (" --tiny" if args.tiny else "")
    if args.target != "H200":
        cmd += f" --target {args.target}"
    lines = [
        START,
        "## The GPU compile: what XLA:GPU makes of each step (`benchmarks/gpu_compile.py`)",
        "",
        f"- command: `{cmd}`; date {_now()}; {elapsed:.0f} s",
        f"- **compiled for an {target.name} target, no device, autotuning off** (deviceless "
        f"ahead-of-time compilation with jax's CUDA plugin; GEMMs keep XLA's default "
        f"configurations): nothing here is timed, and every figure repeats exactly",
        f"- jax {_version('jax')}, jaxlib {_version('jaxlib')}, optax {_version('optax')}, "
        f"flax {_version('flax')}, jmp {_version('jmp')}; python {platform.python_version()}",
        "- bytes: modelled HBM traffic, for each kernel the bytes of its operands plus its "
        "outputs (a `conditional` counts its costliest branch); kernels: launches per step "
        "(a conditional counts its thunk and its costliest branch's kernels); temp: XLA's temp "
        "allocation; roofline: per kernel the larger of FLOPs / dense peak for its dtype "
        f"(bf16/fp16 989, fp8 1979, tf32 494 TFLOPS) and bytes / {target.bandwidth / 1e12:.2f} "
        "TB/s, summed. The model definitions are in the module docstring.",
        "- on a GPU a `conditional` is a host sync: XLA:GPU copies the predicate to the host "
        "and waits for the stream before it launches a branch (`conditional_thunk.cc`).",
    ]
    for model in models:
        lines += [
            "",
            f"### {model.name}: {model.describe}",
            "",
            f"{model.n_params / 1e6:.2f}M float32 parameters in {model.n_leaves} leaves, "
            "`optax.adamw(1e-3)`.",
            "",
        ]
        lines += _table(results[model.name], target)
    if checks:
        lines += [
            "",
            "### The finite check alone, over the optimizer model's 24 leaves",
            "",
            "| check | bytes x one read | kernels | conditionals |",
            "| --- | ---: | ---: | ---: |",
        ]
        floor = checks["read floor: sum of every leaf"]
        for name, p in checks.items():
            lines.append(
                f"| {name} | {p.bytes / floor.bytes:.4f} | {p.n_kernels} | {p.conditionals} |"
            )
    rows = targets(results)
    if rows:
        lines += [
            "",
            "### Targets (issue #24)",
            "",
            "| target | measured | met |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {t} | {m} | {'yes' if ok else '**no**'} |" for t, m, ok in rows]
    lines += ["", END]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tiny", action="store_true", help="tiny models: a smoke test in seconds")
    ap.add_argument("--out", default="", help="also write the markdown section to this file")
    ap.add_argument(
        "--results", default="", help="splice the section into this file between its markers"
    )
    ap.add_argument("--target", choices=sorted(xla_gpu.TARGETS), default="H200")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    ap.add_argument(
        "--undonated",
        default="optimizer,GPT",
        help="models also compiled without donation (comma-separated)",
    )
    return ap


def main(argv: list[str] | None = None) -> str:
    args = parser().parse_args(argv)
    why = xla_gpu.unavailable()
    if why:
        raise SystemExit(f"benchmarks.gpu_compile: {why}")
    target = xla_gpu.TARGETS[args.target]
    t0 = time.perf_counter()
    models = [MODELS[m.strip()](args.tiny) for m in args.models.split(",") if m.strip()]
    undonated = {m.strip() for m in args.undonated.split(",")}
    results = {}
    for model in models:
        sections.log(f"{model.name}: {model.describe}")
        donations = (True, False) if model.name in undonated else (True,)
        results[model.name] = measure(model, donations, target, sections.log)
    checks = finite_check(optimizer_model(args.tiny), target)
    text = section(args, models, results, checks, target, time.perf_counter() - t0)
    return sections.emit(args, text, START, END)


if __name__ == "__main__":
    main()
