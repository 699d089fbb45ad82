"""Float8 with per-tensor scaling: error against float32, training curves, GPU step time.

    python -m benchmarks.float8                  # CPU: errors and curves, ~3-5 min on 2 cores
    python -m benchmarks.float8 --tiny           # seconds: a smoke test
    python -m benchmarks.float8 --results benchmarks/RESULTS.md   # record it there
    python -m benchmarks.float8 --step-time      # GPU: bfloat16 vs float8 GPT steps, fp8 GEMMs
    python -m benchmarks.float8 --plot runs/float8_curves.png   # also draw the two curves

Every variant computes from the same float32 parameters:

``bfloat16``
    ``jamp.autocast(f, jnp.bfloat16)``, for scale.
``float8 current``
    ``jamp.autocast(f, "float8")``: every ``dot_general`` with
    ``float8_e4m3fn`` operands scaled per tensor by ``448 / amax`` of the
    same step, float32 accumulation, ``float8_e5m2`` gradients; the rest in
    bfloat16.
``float8 delayed``
    ``jamp.autocast(f, "float8", recipe=jamp.float8.DelayedScaling(16))``: the
    scales come from an amax history of 16 steps (Transformer Engine's
    recipe). In the error tables the state has seen three other batches of
    the same distribution (the history holds their amaxes, not this
    batch's). ``float8 delayed, first step`` is a fresh state, which starts
    as Transformer Engine and Flax do, with every scale 1;
    ``float8 delayed (unmeasured='current'), first step`` a fresh state of
    ``DelayedScaling(16, unmeasured="current")``, whose first step uses
    current scales.
``float8, attention in bfloat16`` (GPT only)
    float8 current with the two attention products (scores and the weighted
    values) inside a nested ``jamp.autocast(..., jnp.bfloat16)``, as
    Transformer Engine keeps attention in bfloat16 by default.
``per-tensor reference``
    no jamp: the model's matrix products go through a plain quantise-
    dequantise reference (operands rounded to ``float8_e4m3fn`` with a scale
    per tensor from its own amax, straight-through gradients, the output's
    gradient rounded to ``float8_e5m2`` likewise) computed in float32; the
    rest of the model in float32. It is the arithmetic jamp's float8
    products do, written out by hand, without the interpreter and without
    bfloat16 elsewhere.

Models (plain JAX, every matrix product through one ``einsum`` hook so the
reference can replace it): an MLP (256-1024-1024-64, gelu, biases, MSE) at
three input magnitudes (``1e3``, ``1``, ``1e-6``, targets scaled alike), and
the 4-layer GPT block stack of ``benchmarks/autocast_memory.py`` (d=256, 4
heads, batch 8x128, pre-LayerNorm, causal attention, gelu MLP, a float32
residual stream, MSE). Columns: **output error** is the relative error
``|out - out32| / |out32|``; **grad cosine** the cosine between the
variant's gradient (parameters and input, all leaves flattened) and
float32's, the worst single leaf in brackets.

Training curves: the digits CNN of ``examples/train_digits.py`` (its data,
model, loss normalised by 2**22 tokens, Adam 1e-3; the reference rounds the
dense layers' products, its convolutions stay float32, as jamp's stay
bfloat16) and a regression task (a 16-128-128-8 gelu MLP fitting a random
teacher network whose outputs are of order 1e-3, MSE, Adam 3e-3), each mode
from the same initialisation on the same batches.

``--step-time`` (for a GPU): the GPT stack at ``--step-config large`` (d=1024,
16 heads, 8 layers, batch 16x512) or ``small``; median step time of a jitted
``jax.value_and_grad`` + SGD step for bfloat16 and the float8 variants
(delayed scaling both with TE's ``unmeasured="one"``, whose amax XLA may
compute in the quantising pass, and with ``"current"``, which reads each
operand twice as current scaling does), and
the compiled HLO's GEMM custom calls, counting cuBLASLt float8 GEMMs
(``__cublas$lt$matmul$f8``): the proof XLA rewrote jamp's pattern.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/float8.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"  # noqa: A001

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jamp
from benchmarks import sections, timing

START, END = "<!-- float8:start -->", "<!-- float8:end -->"
STEP_START, STEP_END = "<!-- float8-step-time:start -->", "<!-- float8-step-time:end -->"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
OUT_TARGET, COSINE_TARGET = 0.08, 0.99  # issue #18's bar
HISTORY = 16

# --------------------------------------------------------------------------- the reference


def _qdq(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` rounded to ``dtype`` with a per-tensor scale from its amax, back in float32."""
    big = float(jnp.finfo(dtype).max)
    x = x.astype(F32)
    scale = big / jnp.maximum(jnp.max(jnp.abs(x)), big * 2.0**-126)
    return jnp.clip(x * scale, -big, big).astype(dtype).astype(F32) / scale


@jax.custom_vjp
def _q_operand(x: jax.Array) -> jax.Array:
    return _qdq(x, E4M3)


_q_operand.defvjp(lambda x: (_qdq(x, E4M3), None), lambda _, g: (g,))  # straight through


@jax.custom_vjp
def _q_grad(y: jax.Array) -> jax.Array:
    return y


_q_grad.defvjp(lambda y: (y, None), lambda _, g: (_qdq(g, E5M2),))


def reference_einsum(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """A float8 product written out: e4m3 operands, an e5m2 output gradient, float32 math."""
    return _q_grad(jnp.einsum(subscripts, _q_operand(a), _q_operand(b)))


def reference_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type
    out = lax.dot_general(_q_operand(lhs), _q_operand(rhs), dimension_numbers)
    return _q_grad(out)


# --------------------------------------------------------------------------- models


def _normal(seed: int, *shape: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, F32)


def mlp_params(sizes: tuple[int, ...], seed: int = 0) -> dict:
    return {
        f"l{i}": {"w": _normal(seed + i, a, b, scale=a**-0.5), "b": jnp.zeros(b, F32)}
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    }


def mlp(params: dict, x: jax.Array, einsum: Callable = jnp.einsum) -> jax.Array:
    n = len(params)
    for i in range(n):
        x = einsum("bi,io->bo", x, params[f"l{i}"]["w"]) + params[f"l{i}"]["b"][None, :]
        if i < n - 1:
            x = jax.nn.gelu(x)
    return x


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-6) * g + b


def gpt_params(d: int, layers: int, seed: int = 0) -> dict:
    out = {}
    for i in range(layers):
        s = seed + 10 * i
        out[f"h{i}"] = {
            "ln1": (jnp.ones(d, F32), jnp.zeros(d, F32)),
            "qkv": _normal(s, d, 3 * d, scale=d**-0.5),
            "proj": _normal(s + 1, d, d, scale=d**-0.5),
            "ln2": (jnp.ones(d, F32), jnp.zeros(d, F32)),
            "fc": _normal(s + 2, d, 4 * d, scale=d**-0.5),
            "fc_b": jnp.zeros(4 * d, F32),
            "out": _normal(s + 3, 4 * d, d, scale=(4 * d) ** -0.5),
        }
    return out


def gpt(
    params: dict,
    x: jax.Array,
    heads: int,
    einsum: Callable = jnp.einsum,
    attention_dtype: Any = None,
) -> jax.Array:
    """The GPT block stack: x (batch, time, d) float32 residual stream -> same shape."""
    b, t, d = x.shape
    causal = jnp.tril(jnp.ones((t, t), bool))

    def attend(q, k, v):
        scores = einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // heads)
        scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
        return einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)

    if attention_dtype is not None:  # a nested autocast: the innermost setting wins
        attend = jamp.autocast(attend, attention_dtype)
    for i in range(len(params)):
        p = params[f"h{i}"]
        h = layer_norm(x, *p["ln1"])
        q, k, v = jnp.split(einsum("btd,de->bte", h, p["qkv"]), 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
        x = x + einsum("btd,de->bte", attend(q, k, v).reshape(b, t, d), p["proj"])
        h = layer_norm(x, *p["ln2"])
        h = jax.nn.gelu(einsum("btd,df->btf", h, p["fc"]) + p["fc_b"][None, None, :])
        x = x + einsum("btf,fd->btd", h, p["out"])
    return x


def _mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(out.astype(F32) - y))


# --------------------------------------------------------------------------- error vs float32


def variants(forward: Callable, gpt_like: bool) -> dict[str, tuple[str, Callable]]:
    """name -> (kind, forward): kind "plain" takes (params, x); "delayed" (state, params, x)."""
    recipe = jamp.float8.DelayedScaling(HISTORY)
    measuring = jamp.float8.DelayedScaling(HISTORY, unmeasured="current")
    out = {
        "float32": ("plain", forward),
        "bfloat16": ("plain", jamp.autocast(forward, jnp.bfloat16)),
        "float8 current": ("plain", jamp.autocast(forward, "float8")),
        "float8 delayed": ("delayed", jamp.autocast(forward, "float8", recipe=recipe)),
        "float8 delayed, first step": ("delayed", None),  # the same function, a fresh state
        "float8 delayed (unmeasured='current'), first step": (
            "delayed", jamp.autocast(forward, "float8", recipe=measuring)
        ),
    }  # fmt: skip
    if gpt_like:
        attn = functools.partial(forward, attention_dtype=jnp.bfloat16)
        out["float8, attention in bfloat16"] = ("plain", jamp.autocast(attn, "float8"))
    out["per-tensor reference"] = ("plain", functools.partial(forward, einsum=reference_einsum))
    return out


def _flat(tree: Any) -> list[np.ndarray]:
    return [np.asarray(g, np.float64).ravel() for g in jax.tree_util.tree_leaves(tree)]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    return float(a @ b / max(na * nb, 1e-300))


def rel_err(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def build_steps(forward: Callable, gpt_like: bool) -> dict[str, tuple[str, Callable, Callable]]:
    """name -> (kind, forward, jitted value_and_grad step taking the targets): compiled once
    for every case of the same model and shapes."""
    out = {}
    for vname, (kind, f) in variants(forward, gpt_like).items():
        if f is None:  # a variant of the function before it: its compiled step too
            out[vname] = out[list(out)[-1]]
        elif kind == "plain":

            def loss(p, x, y, f=f):
                out = f(p, x)
                return _mse(out, y), out

            out[vname] = (kind, f, jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True)))
        else:

            def loss(s, p, x, y, f=f):
                out = f(s, p, x)
                return _mse(out, y), out

            out[vname] = (kind, f, jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True)))
    return out


def measure_error(
    name: str, steps: dict, params: Any, x: Any, y: Any, warmup: list, log
) -> list[dict]:
    """One row per variant: output error, gradient cosine (worst leaf), loss error.

    Delayed scaling's state first sees the ``warmup`` batches (other ``(x, y)``).
    """
    rows, ref = [], None
    for vname, (kind, f, step) in steps.items():
        t0 = time.perf_counter()
        if kind == "plain":
            (value, out), grads = step(params, x, y)
        else:
            state = jamp.float8.init(f, params, x)
            if "first step" not in vname:
                for wx, wy in warmup:
                    _, (state, *_) = step(state, params, wx, wy)
            (value, out), (_, *grads) = step(state, params, x, y)
        if ref is None:
            ref = (out, grads, value)
        g, r = _flat(grads), _flat(ref[1])
        top = max(np.linalg.norm(b) for b in r)
        worst = min(
            (cosine(a, b) for a, b in zip(g, r, strict=True) if np.linalg.norm(b) >= 1e-3 * top),
            default=1.0,
        )
        row = dict(
            name=vname,
            out_err=rel_err(out, ref[0]),
            cosine=cosine(np.concatenate(g), np.concatenate(r)),
            worst=worst,
            loss_err=abs(float(value) - float(ref[2])) / abs(float(ref[2])),
            finite=all(bool(np.isfinite(a).all()) for a in g),
        )
        rows.append(row)
        log(
            f"  {name} {vname}: out err {row['out_err']:.4f}, cosine {row['cosine']:.5f} "
            f"({time.perf_counter() - t0:.1f} s)"
        )
    return rows


def error_cases(tiny: bool) -> list[tuple]:
    """(name, forward, params, x, y, warm-up batches) per model."""

    def batches(seed, x_shape, y_shape, scale=1.0):
        return [
            (
                _normal(seed + 2 * i, *x_shape, scale=scale),
                _normal(seed + 2 * i + 1, *y_shape, scale=scale),
            )
            for i in range(4)
        ]

    cases = []
    sizes, batch = ((16, 32, 32, 8), 8) if tiny else ((256, 1024, 1024, 64), 128)
    params = mlp_params(sizes)
    for mag in (1e3, 1.0, 1e-6):
        (x, y), *warmup = batches(100, (batch, sizes[0]), (batch, sizes[-1]), mag)
        cases.append((f"MLP, inputs ~{mag:g}", mlp, params, x, y, warmup))
    d, heads, layers, b, t = (32, 2, 1, 2, 16) if tiny else (256, 4, 4, 8, 128)
    (x, y), *warmup = batches(200, (b, t, d), (b, t, d))
    forward = functools.partial(gpt, heads=heads)
    name = f"GPT ({layers} layers, d={d}, batch {b}x{t})"
    cases.append((name, forward, gpt_params(d, layers), x, y, warmup))
    return cases


# --------------------------------------------------------------------------- training curves


def _load_digits_demo() -> Any:
    path = os.path.join(ROOT, "examples", "train_digits.py")
    spec = importlib.util.spec_from_file_location("train_digits", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_digits", module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def train(
    kind: str,
    forward: Callable,
    loss_of_output: Callable,
    params: Any,
    batches: Callable[[int], tuple],
    steps: int,
    lr: float,
    init_args: tuple,
) -> tuple[list[float], Any, Any]:
    """Adam on ``loss_of_output(forward(...), y)``; returns losses, params and the state."""
    tx = optax.adam(lr)
    opt_state = tx.init(params)
    state = jamp.float8.init(forward, params, *init_args) if kind == "delayed" else None

    @jax.jit
    def step(params, state, opt_state, x, y):
        if kind == "delayed":
            loss = lambda s, p: loss_of_output(forward(s, p, x), y)  # noqa: E731
            value, (state, grads) = jax.value_and_grad(loss, argnums=(0, 1))(state, params)
        else:
            value, grads = jax.value_and_grad(lambda p: loss_of_output(forward(p, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, value

    losses = []
    for i in range(steps):
        x, y = batches(i)
        params, state, opt_state, value = step(params, state, opt_state, x, y)
        losses.append(value)
    return [float(v) for v in jax.device_get(losses)], params, state


def curve_modes(forward: Callable, reference: Callable) -> dict[str, tuple[str, Callable]]:
    recipe = jamp.float8.DelayedScaling(HISTORY)
    return {
        "float32": ("plain", forward),
        "bfloat16": ("plain", jamp.autocast(forward, jnp.bfloat16)),
        "float8 current": ("plain", jamp.autocast(forward, "float8")),
        "float8 delayed": ("delayed", jamp.autocast(forward, "float8", recipe=recipe)),
        "per-tensor reference": ("plain", reference),
    }


def digits_curves(tiny: bool, log) -> tuple[str, list[dict]]:
    from flax import linen as nn

    demo = _load_digits_demo()
    x_train, y_train, x_test, y_test = demo.load_data(0)
    steps = 20 if tiny else 600
    model = demo.CNN()

    class ReferenceCNN(nn.Module):
        """The demo's CNN (same parameter tree), its dense products through the reference."""

        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
            x = x.reshape(x.shape[0], -1)
            x = nn.relu(nn.Dense(64, dot_general=reference_dot_general)(x))
            return nn.Dense(10, dot_general=reference_dot_general)(x)

    params = model.init(jax.random.PRNGKey(0), x_train[:1])
    batch_ids = np.random.default_rng(0).integers(0, len(x_train), (steps, demo.BATCH))

    def batches(i):
        return x_train[batch_ids[i]], y_train[batch_ids[i]]

    def loss_of_output(logits, y):  # the demo's loss: summed, normalised by 2**22 tokens
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), y)
        return jnp.sum(ce) / demo.GLOBAL_TOKENS

    rows = []
    for name, (kind, forward) in curve_modes(model.apply, ReferenceCNN().apply).items():
        t0 = time.perf_counter()
        losses, p, state = train(
            kind, forward, loss_of_output, params, batches, steps, 1e-3, (x_train[:1],)
        )
        logits = forward(state, p, x_test) if kind == "delayed" else forward(p, x_test)
        acc = float(jnp.mean(jnp.argmax(logits, -1) == y_test))
        per_example = [v * demo.GLOBAL_TOKENS / demo.BATCH for v in losses]
        rows.append(dict(name=name, losses=per_example, extra=f"{acc:.3f}"))
        log(f"  digits {name}: final {np.mean(per_example[-50:]):.4f}, test acc {acc:.3f} "
            f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    describe = (
        f"digits CNN of examples/train_digits.py: {steps} steps of Adam 1e-3, batch "
        f"{demo.BATCH}, loss normalised by 2**22 tokens (shown per example); last column: "
        "test accuracy"
    )
    return describe, rows


def regression_curves(tiny: bool, log) -> tuple[str, list[dict]]:
    steps, pool = (20, 256) if tiny else (500, 4096)
    teacher = mlp_params((16, 64, 8), seed=50)
    xs = _normal(60, pool, 16)
    ys = 1e-3 * jnp.tanh(mlp(teacher, xs))
    params = mlp_params((16, 128, 128, 8), seed=70)
    ids = np.random.default_rng(1).integers(0, pool, (steps, 256))

    def batches(i):
        return xs[ids[i]], ys[ids[i]]

    reference = functools.partial(mlp, einsum=reference_einsum)
    rows = []
    for name, (kind, forward) in curve_modes(mlp, reference).items():
        t0 = time.perf_counter()
        losses, p, state = train(kind, forward, _mse, params, batches, steps, 3e-3, (xs[:256],))
        out = forward(state, p, xs) if kind == "delayed" else forward(p, xs)
        rows.append(dict(name=name, losses=losses, extra=f"{float(_mse(out, ys)):.3e}"))
        log(f"  regression {name}: final {np.mean(losses[-50:]):.3e} "
            f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    describe = (
        f"regression: a 16-128-128-8 gelu MLP fitting a teacher network with outputs ~1e-3, "
        f"{steps} steps of Adam 3e-3, batch 256 from {pool} points, MSE; last column: MSE on "
        "all points"
    )
    return describe, rows


# --------------------------------------------------------------------------- report


def _curve_table(rows: list[dict], extra: str) -> list[str]:
    n = len(rows[0]["losses"])
    marks = sorted({0, n // 4, n // 2, 3 * n // 4})
    window = max(1, n // 10)
    base = float(np.mean(rows[0]["losses"][-window:]))
    head = " | ".join(f"step {m}" for m in marks)
    L = [
        f"| mode | {head} | final (mean of last {window}) | final / float32 | {extra} |",
        "| --- |" + " ---: |" * (len(marks) + 3),
    ]
    for r in rows:
        final = float(np.mean(r["losses"][-window:]))
        cells = " | ".join(f"{r['losses'][m]:.4g}" for m in marks)
        L.append(f"| {r['name']} | {cells} | {final:.4g} | {final / base:.3f} | {r['extra']} |")
    return L


def section(args, errors: dict, curves: list, elapsed: float) -> str:
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    cmd = "python -m benchmarks.float8" + (" --tiny" if args.tiny else "")
    L = [
        START,
        "## Float8 with per-tensor scaling (`benchmarks/float8.py`)",
        "",
        f"- command: `{cmd}`; date {now}; {elapsed:.0f} s",
        f"- jax {jax.__version__}; backend {jax.default_backend()}, {os.cpu_count()} CPUs; "
        f"python {platform.python_version()}. On a CPU XLA upcasts float8 operands for its "
        "dot, so these are numerics only; `--step-time` on a GPU measures speed.",
        "- output error: `|out - out32| / |out32|`; grad cosine: against float32's gradient "
        "(parameters and input), worst leaf in brackets. The module docstring defines every "
        f"variant; delayed scaling keeps an amax history of {HISTORY} steps.",
        "",
    ]
    targets = []
    for name, rows in errors.items():
        L += [f"### {name}", ""]
        L += [
            "| variant | output error | grad cosine [worst leaf] | loss error |",
            "| --- | ---: | ---: | ---: |",
        ]
        for r in rows:
            fin = "" if r["finite"] else " non-finite"
            L.append(
                f"| {r['name']} | {r['out_err']:.4f} | {r['cosine']:.5f} [{r['worst']:.4f}]{fin} "
                f"| {r['loss_err']:.2e} |"
            )
            if r["name"] in ("float8 current", "float8 delayed"):
                ok = r["out_err"] <= OUT_TARGET and r["cosine"] >= COSINE_TARGET and r["finite"]
                targets.append((f"{name}: {r['name']}", r["out_err"], r["cosine"], ok))
        L.append("")
    for title, rows, extra in curves:
        L += [f"### Training: {title}", ""]
        L += _curve_table(rows, extra)
        L.append("")
    L += [
        f"### Targets (issue #18): output error <= {OUT_TARGET}, grad cosine >= {COSINE_TARGET}",
        "",
        "| model: variant | output error | grad cosine | met |",
        "| --- | ---: | ---: | --- |",
    ]
    L += [f"| {t} | {e:.4f} | {c:.5f} | {'yes' if ok else '**no**'} |" for t, e, c, ok in targets]
    L += ["", END]
    return "\n".join(L)


def plot(curves: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(7 * len(curves), 4.5))
    styles = {"float32": dict(color="0.6", lw=4), "per-tensor reference": dict(color="k", ls=":")}
    for ax, (title, rows, _) in zip(np.atleast_1d(axes), curves, strict=True):
        for r in rows:
            w = max(1, len(r["losses"]) // 40)
            smooth = np.convolve(r["losses"], np.ones(w) / w, mode="valid")
            ax.plot(np.arange(w - 1, len(r["losses"])), smooth, label=r["name"],
                    **styles.get(r["name"], dict(lw=1.3)))  # fmt: skip
        ax.set(title=title.split(":")[0], xlabel="step", ylabel="loss", yscale="log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def splice(path: str, text: str) -> None:
    """Puts ``text`` between this section's markers in ``path``, or appends it at the end."""
    sections.splice(path, text, START, END)


# --------------------------------------------------------------------------- step time

GEMM_TARGETS = ("__cublas$lt$matmul$f8", "__cublas$lt$matmul", "__cublas$gemm")


def gemm_calls(hlo: str) -> dict[str, int]:
    """GEMM custom calls by target; GEMM fusions (Triton, cuDNN); and computations holding a
    ``dot`` of float8 values (a GEMM fusion fed float8, or a CPU that did not upcast)."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    out = {t: sum(1 for x in targets if x == t) for t in GEMM_TARGETS}
    out["triton"] = len(re.findall(r'"kind":"__triton_gemm"', hlo))
    out["cudnn"] = len(re.findall(r'"kind":"__cudnn\$fusion"', hlo))
    computations = re.split(r"\n(?=\S)", hlo)  # each starts at column 0
    out["f8 dots"] = sum(
        1 for c in computations if re.search(r" dot\(", c) and re.search(r"f8e(4m3fn|5m2)\[", c)
    )
    return out


def step_time(args, log) -> str:
    """Median GPT training-step time: bfloat16 and the float8 variants, and their GEMMs."""
    big = args.step_config == "large"
    d, heads, layers, b, t = (1024, 16, 8, 16, 512) if big else (256, 4, 4, 8, 128)
    if args.tiny:
        d, heads, layers, b, t = 32, 2, 1, 2, 16
    x, y = _normal(0, b, t, d), _normal(1, b, t, d)
    params = gpt_params(d, layers)
    forward = functools.partial(gpt, heads=heads)
    attn = functools.partial(forward, attention_dtype=jnp.bfloat16)
    plain = {
        "bfloat16": jamp.autocast(forward, jnp.bfloat16),
        "float8 current": jamp.autocast(forward, "float8"),
        "float8, attention in bfloat16": jamp.autocast(attn, "float8"),
    }
    delayed = {
        "float8 delayed": jamp.float8.DelayedScaling(HISTORY),
        "float8 delayed, unmeasured='current'": jamp.float8.DelayedScaling(
            HISTORY, unmeasured="current"
        ),
    }

    def sgd(p, g):
        return jax.tree_util.tree_map(lambda a, b: a - 1e-3 * b, p, g)

    steps, args_of, hlos = {}, {}, {}
    for name, f in plain.items():

        def step(p, x, y, f=f):
            value, g = jax.value_and_grad(lambda p: _mse(f(p, x), y))(p)
            return sgd(p, g), value

        steps[name] = jax.jit(step).lower(params, x, y).compile()
        args_of[name] = (params, x, y)
    for name, recipe in delayed.items():
        f = jamp.autocast(forward, "float8", recipe=recipe)
        state = jamp.float8.init(f, params, x)

        def delayed_step(s, p, x, y, f=f):
            value, (s, g) = jax.value_and_grad(lambda s, p: _mse(f(s, p, x), y), (0, 1))(s, p)
            return s, sgd(p, g), value

        steps[name] = jax.jit(delayed_step).lower(state, params, x, y).compile()
        args_of[name] = (state, params, x, y)
    for name, compiled in steps.items():
        hlos[name] = gemm_calls(compiled.as_text())
        jax.block_until_ready(compiled(*args_of[name]))
        log(f"  compiled {name}: {hlos[name]}")
    calls = {name: functools.partial(step, *args_of[name]) for name, step in steps.items()}
    times = timing.time_calls(calls, (), args.step_rounds, args.step_reps)
    base = statistics.median(times["bfloat16"])
    device = jax.devices()[0]
    L = [
        f"### GPT step time: d={d}, {heads} heads, {layers} layers, batch {b}x{t} "
        f"({jax.default_backend()}: {device.device_kind})",
        "",
        f"`jax.value_and_grad` + SGD, jitted; median step of {args.step_rounds} interleaved "
        f"rounds of {args.step_reps} steps, each waited for. GEMMs in the compiled HLO: "
        "custom calls (`f8`: cuBLASLt float8 GEMMs `__cublas$lt$matmul$f8`; `lt`, `gemm`: "
        "other cuBLAS GEMMs), Triton and cuDNN GEMM fusions, and `f8 dots`: computations "
        "with a `dot` of float8 values left for a fusion emitter.",
        "",
        "| variant | median step (ms) | ratio to bfloat16 | f8 | lt | gemm | triton | cudnn "
        "| f8 dots |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in steps:
        med = statistics.median(times[name])
        h = hlos[name]
        L.append(
            f"| {name} | {1e3 * med:.3f} | {med / base:.3f} | {h['__cublas$lt$matmul$f8']} | "
            f"{h['__cublas$lt$matmul']} | {h['__cublas$gemm']} | {h['triton']} | {h['cudnn']} "
            f"| {h['f8 dots']} |"
        )
    f8 = hlos["float8 current"]["__cublas$lt$matmul$f8"]
    fused = hlos["float8 current"]["f8 dots"]
    L += [
        "",
        f"- float8 GEMMs in the compiled float8-current step: {f8} cuBLASLt calls, {fused} "
        "fusions with a float8 dot"
        + ("" if f8 or fused else " (none: not a GPU with float8 GEMMs, or XLA upcast them)"),
    ]
    if jax.default_backend() == "cpu":
        L.append(
            "- on a CPU XLA upcasts the float8 operands for its dots: the ratios are the cost of "
            "quantising, not the speed of a float8 GEMM (run `benchmarks/gpu.sh` on a GPU)"
        )
    return "\n".join(L)


# --------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.float8``."""
    ap = sections.parser(
        __doc__.splitlines()[0],
        "large",
        "GPT for --step-time: d=1024, 8 layers, batch 16x512 (large) or the "
        "error table's d=256, 4 layers, batch 8x128 (small)",
    )
    ap.add_argument("--no-curves", action="store_true", help="skip the training curves")
    ap.add_argument("--plot", default="", help="also draw the training curves to this PNG")
    return ap


def measure_section(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    """The section this benchmark writes into RESULTS.md."""
    t0 = time.perf_counter()
    errors, built = {}, {}
    for name, forward, params, x, y, warmup in error_cases(args.tiny):
        if id(forward) not in built:
            built[id(forward)] = build_steps(forward, name.startswith("GPT"))
        errors[name] = measure_error(name, built[id(forward)], params, x, y, warmup, log)
    curves = []
    if not args.no_curves:
        for make, extra in ((digits_curves, "test acc"), (regression_curves, "MSE, all")):
            title, rows = make(args.tiny, log)
            curves.append((title, rows, extra))
    text = section(args, errors, curves, time.perf_counter() - t0)
    if args.plot and curves:
        plot(curves, args.plot)
    return text


def main(argv: list[str] | None = None) -> str:
    args = parser().parse_args(argv)
    return sections.run(args, measure_section, step_time, (START, END), (STEP_START, STEP_END))


if __name__ == "__main__":
    main()
