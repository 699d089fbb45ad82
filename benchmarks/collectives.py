"""Mixed precision across devices: the collectives of an FSDP step on 8 GPUs (a spoke).

Issue #45. Every step is compiled ahead of time for 8 described H200s on one host
(``xla_gpu.mesh(target, 8)``, topology ``1x1x8``; no device) and read from the compiled
program: its collectives (all-gather, reduce-scatter, all-reduce, ... with their element
dtype and elements, ``xla_gpu.collectives``), the modelled HBM bytes and XLA's temp memory,
per device. Nothing is timed.

The model: an MLP of ``--layers`` square layers ``--width`` wide (relu), the mean squared
error of a batch of ``--batch`` rows; parameters sharded FSDP-style, ``P("data", None)``,
the batch ``P("data", None)``, ``optax.adamw``, the state donated. The steps:

- ``float32``: the plain step;
- ``autocast(bf16)``: ``jamp.autocast(loss, jnp.bfloat16)``, float32 parameters;
- ``autocast(f16) + loss_scaling``: float16, ``jamp.loss_scaling(adamw)``;
- ``bf16 params (master_weights)``: bfloat16 parameters, ``jamp.master_weights`` with
  stochastic rounding over adamw whose moments ``jamp.low_precision_state`` keeps in
  bfloat16, under ``autocast(bf16)``;
- ``autocast(float8)``: ``jamp.autocast(loss, "float8")`` (current scaling), float32
  parameters;

and, where the option exists, the same steps with ``reduce_dtype`` set to the half dtype.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import jamp
from benchmarks import xla_gpu
from benchmarks.report import emit, header

START, END = "<!-- collectives:start -->", "<!-- collectives:end -->"
DEVICES = 8
BF16, F16 = jnp.bfloat16, jnp.float16


def mlp_loss(params: list, x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    for w in params:
        h = jax.nn.relu(h @ w)
    return jnp.mean(jnp.square(h.astype(jnp.float32) - y))


def _adamw(moments: Any = None) -> optax.GradientTransformation:
    tx = optax.adamw(1e-3)
    if moments is None:
        return tx
    return jamp.low_precision_state(tx, dtypes={"mu": moments, "nu": moments})


def _plain(loss: Callable, tx: optax.GradientTransformation) -> Callable:
    def step(params: Any, opt: Any, x: jax.Array, y: jax.Array) -> tuple:
        grads = jax.grad(loss)(params, x, y)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    return step


def _scaled(loss: Callable, tx: optax.GradientTransformation) -> Callable:
    def step(params: Any, opt: Any, x: jax.Array, y: jax.Array) -> tuple:
        ls = jamp.get_loss_scale(opt)
        grads = jax.grad(lambda p: jamp.scale(ls, loss(p, x, y)))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    return step


def _autocast(dtype: Any, **kw: Any) -> Callable:
    return jamp.autocast(mlp_loss, dtype, **kw)


# name: (parameter dtype, the step of (loss, tx), the loss, the optimizer)
STEPS: dict[str, Callable[[dict], tuple[Any, Callable]]] = {
    "float32": lambda kw: (jnp.float32, _plain(mlp_loss, _adamw())),
    "autocast(bf16)": lambda kw: (jnp.float32, _plain(_autocast(BF16, **kw), _adamw())),
    "autocast(f16) + loss_scaling": lambda kw: (
        jnp.float32, _scaled(_autocast(F16, **kw), jamp.loss_scaling(_adamw()))),
    "bf16 params (master_weights)": lambda kw: (
        BF16, _plain(_autocast(BF16, **kw),
                     jamp.master_weights(_adamw(BF16), rounding="stochastic"))),
    "autocast(float8)": lambda kw: (jnp.float32, _plain(_autocast("float8", **kw), _adamw())),
}  # fmt: skip
HALF = {"autocast(bf16)": "bfloat16", "autocast(f16) + loss_scaling": "float16",
        "bf16 params (master_weights)": "bfloat16", "autocast(float8)": "bfloat16"}  # fmt: skip


def has_reduce_dtype() -> bool:
    """Whether ``jamp.autocast`` takes ``reduce_dtype`` (issue #45's option)."""
    import inspect

    return "reduce_dtype" in inspect.signature(jamp.autocast).parameters


def compile_step(
    name: str,
    width: int,
    layers: int,
    batch: int,
    devices: int = DEVICES,
    target: xla_gpu.Target = xla_gpu.TARGETS["H200"],
    **kw: Any,
) -> Any:
    """The compiled 8-GPU program of ``STEPS[name]`` (``kw``: autocast's keywords)."""
    mesh = xla_gpu.mesh(target, devices, "data")
    dtype, step = STEPS[name](kw)
    params = [jax.ShapeDtypeStruct((width, width), dtype) for _ in range(layers)]
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32)

    def spec(a: Any) -> P:  # a parameter-shaped leaf: FSDP; the rest replicated
        sharded = len(a.shape) == 2 and a.shape[0] % devices == 0
        return P("data", None) if sharded else P()

    with jax.numpy_dtype_promotion("standard"):  # optax's adamw
        tx_state = jax.eval_shape(lambda p: _opt_init(name, kw)(p), params)
        args = [xla_gpu.placed(t, mesh, spec) for t in (params, tx_state, x, x)]
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(*args)
    return xla_gpu.compile_lowered(lowered)


def fsdp_spec(a: Any, devices: int = DEVICES) -> P:
    """A leaf's FSDP sharding: its first axis over "data" where it divides, else replicated."""
    if len(a.shape) >= 2 and a.shape[0] % devices == 0:
        return P("data", *[None] * (len(a.shape) - 1))
    return P()


# a model's step (compile_model): (parameter dtype, autocast's dtype, optimizer, loss scaled)
MODEL_STEPS: dict[str, Callable[[], tuple[Any, Any, optax.GradientTransformation, bool]]] = {
    "autocast(bf16)": lambda: (jnp.float32, BF16, _adamw(), False),
    "autocast(f16) + loss_scaling": lambda: (jnp.float32, F16, jamp.loss_scaling(_adamw()), True),
    "bf16 params (master_weights)": lambda: (
        BF16, BF16, jamp.master_weights(_adamw(BF16), rounding="stochastic"), False),
    "autocast(float8)": lambda: (jnp.float32, "float8", _adamw(), False),
}  # fmt: skip


def compile_model(
    model: Any,
    target: xla_gpu.Target = xla_gpu.TARGETS["H200"],
    *,
    step: str = "autocast(bf16)",
    **kw: Any,
) -> Any:
    """The compiled 8-GPU program of a training step of a benchmark ``model`` (``models``:
    float32 parameters): ``MODEL_STEPS[step]``, by default adamw under
    ``jamp.autocast(loss, jnp.bfloat16, **kw)``; FSDP (``fsdp_spec``), the batch sharded
    over its first axis, donated. ``"bf16 params (master_weights)"`` casts the parameters
    to bfloat16 (the optimizer state is built for those)."""
    mesh = xla_gpu.mesh(target, DEVICES, "data")
    param_dtype, dtype, tx, scaled = MODEL_STEPS[step]()
    loss = jamp.autocast(model.scalar(), dtype, **kw)
    train = (_scaled if scaled else _plain)(lambda p, batch, _: loss(p, batch), tx)

    def step(params: Any, opt: Any, batch: Any) -> tuple:
        return train(params, opt, batch, None)

    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, param_dtype), model.params)

    def batch_spec(a: Any) -> P:
        return P("data") if a.shape and a.shape[0] % DEVICES == 0 else P()

    with jax.numpy_dtype_promotion("standard"):  # optax's adamw
        params = xla_gpu.placed(shapes, mesh, fsdp_spec)
        opt = xla_gpu.placed(jax.eval_shape(tx.init, shapes), mesh, fsdp_spec)
        batch = xla_gpu.placed(model.batch, mesh, batch_spec)
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt, batch)
    return xla_gpu.compile_lowered(lowered)


def _opt_init(name: str, kw: dict) -> Callable:
    tx = {"autocast(f16) + loss_scaling": lambda: jamp.loss_scaling(_adamw()),
          "bf16 params (master_weights)": lambda: jamp.master_weights(
              _adamw(BF16), rounding="stochastic")}.get(name, _adamw)()  # fmt: skip
    return tx.init


def measure(name: str, width: int, layers: int, batch: int, **kw: Any) -> dict:
    """The step's collectives, bytes and temp per device."""
    compiled = compile_step(name, width, layers, batch, **kw)
    p = xla_gpu.analyse(compiled)
    return {
        "collectives": xla_gpu.collectives(p.text),
        "described": xla_gpu.describe_collectives(p.text),
        "bytes": p.bytes,
        "temp": p.temp_bytes,
        "kernels": p.n_kernels,
    }


# --------------------------------------------------------------------------- the section


def _small_all_reduces(result: dict) -> list[str]:
    """The op names of the bfloat16 all-reduces of fewer than 1024 elements."""
    return [c.op_name for c in result["collectives"]
            if c.kind == "all-reduce" and c.dtype == "bf16" and c.elements < 1024]  # fmt: skip


def section(results: dict, args: argparse.Namespace, elapsed: float) -> str:
    L = [START, "## Collectives of an FSDP step on 8 GPUs (issue #45)", "",
         *header(" ".join(["python -m benchmarks", *args.argv]), elapsed, ("jax", "optax")), "",
         f"An MLP of {args.layers} layers {args.width} wide, batch {args.batch}, parameters "
         f"`P(\"data\", None)` over {DEVICES} H200s (deviceless XLA:GPU, topology `1x1x8`), "
         "batch sharded, adamw, donated. Per device: the modelled HBM bytes of one step and "
         "XLA's temp memory.", "",
         "| step | collectives in the compiled program | modelled bytes / device | "
         "x float32 | temp / device |",
         "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
    base = results["float32"]["bytes"]
    for name, r in results.items():
        L.append(f"| {name} | {r['described']} | {r['bytes'] / 1e9:.3f} GB | "
                 f"{r['bytes'] / base:.3f} | {r['temp'] / 1e6:.1f} MB |")  # fmt: skip
    L += ["", "By default (`reduce_dtype=None`) jamp.autocast's weight-gradient products "
          "accumulate into float32 in a sharded program, so the reduce-scatters are float32; "
          "the `reduce_dtype=` rows keep the half products' own transposes (the programs "
          "before issue #45)."]  # fmt: skip
    small = _small_all_reduces(results.get("autocast(float8)", {"collectives": []}))
    if small:
        L += ["", f"The float8 step's {len(small)} small bfloat16 all-reduces (fewer than 1024 "
              "elements) are each a scalar max, the amax that current scaling takes of a "
              "batch-sharded tensor (the hidden activations forward, the output gradients "
              "backward; a max is exact in bfloat16), by jax's name stack:", ""]  # fmt: skip
        L += [f"- `{n}`" for n in small]
    return "\n".join([*L, "", END])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8192, help="the global batch")


def run(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    if args.tiny:
        args.width, args.layers, args.batch = 256, 3, 256
    t0 = time.perf_counter()
    results = {}
    variants = [(n, {}) for n in STEPS]
    if has_reduce_dtype():
        variants += [(f"{n}, reduce_dtype={HALF[n]}", {"reduce_dtype": HALF[n]})
                     for n in STEPS if n in HALF]  # fmt: skip
    for label, kw in variants:
        name = label.split(", reduce_dtype")[0]
        results[label] = measure(name, args.width, args.layers, args.batch, **kw)
        log(f"{label}: {results[label]['described']}")
    return emit(args, section(results, args, time.perf_counter() - t0), START, END)
