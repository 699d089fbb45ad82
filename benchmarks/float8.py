"""Float8 with per-tensor scaling: error against float32, curves, GPU step time (a spoke).

bfloat16, float8 with current and delayed scaling and a per-tensor reference written out
by hand, on an MLP and a GPT block stack: the error against float32 and training curves;
with ``--step-time``, GPT step time and the float8 GEMMs of each compiled step.
``benchmarks/README.md`` defines every variant.
"""

from __future__ import annotations

import argparse
import functools
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp
from benchmarks import models, steps, timing
from benchmarks.measure import finite, grad_cosines, rel_err
from benchmarks.models import F32, normal
from benchmarks.report import emit, header, log, marked

START, END = "<!-- float8:start -->", "<!-- float8:end -->"
STEP_START, STEP_END = "<!-- float8-step-time:start -->", "<!-- float8-step-time:end -->"
OUT_TARGET, COSINE_TARGET = 0.08, 0.99  # issue #18's bar
HISTORY = steps.HISTORY
CURVES = ("float32", "bfloat16", "float8 current", "float8 delayed", "per-tensor reference")


def _mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return models.mse(out.astype(F32), y)


# --------------------------------------------------------------------------- error vs float32


def variants(forward: Callable, gpt_like: bool) -> dict[str, tuple[str, Callable | None]]:
    """The error table's rows: ``name -> (kind, forward)``; ``None`` is the forward of the
    row before it, from a fresh state (``first step``)."""
    reference = functools.partial(forward, einsum=models.reference_einsum)
    f = steps.float8_forwards(forward, reference, attention=gpt_like)
    out = {k: f[k] for k in ("float32", "bfloat16", "float8 current", "float8 delayed")}
    out["float8 delayed, first step"] = ("delayed", None)
    measuring = f["float8 delayed, unmeasured='current'"]
    out["float8 delayed (unmeasured='current'), first step"] = measuring
    if gpt_like:
        out["float8, attention in bfloat16"] = f["float8, attention in bfloat16"]
    out["per-tensor reference"] = f["per-tensor reference"]
    return out


def build_steps(forward: Callable, gpt_like: bool) -> dict[str, tuple[str, Callable, Callable]]:
    """name -> (kind, forward, jitted value_and_grad step taking the targets): compiled once
    for every case of the same model and shapes."""
    out = {}
    for vname, (kind, f) in variants(forward, gpt_like).items():
        if f is None:  # a variant of the function before it: its compiled step too
            out[vname] = out[list(out)[-1]]
            continue

        def loss(*args, f=f):  # ([state,] params, x, y)
            out = f(*args[:-1])
            return _mse(out, args[-1]), out

        wrt = (0, 1, 2) if kind == "delayed" else (0, 1)
        out[vname] = (kind, f, jax.jit(jax.value_and_grad(loss, wrt, has_aux=True)))
    return out


def measure_error(
    name: str, built: dict, params: Any, x: Any, y: Any, warmup: list, log
) -> list[dict]:
    """One row per variant: output error, gradient cosine (worst leaf), loss error.

    Delayed scaling's state first sees the ``warmup`` batches (other ``(x, y)``).
    """
    rows, ref = [], None
    for vname, (kind, f, step) in built.items():
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
        whole, worst = grad_cosines(grads, ref[1])
        row = dict(
            name=vname,
            out_err=rel_err(out, ref[0]),
            cosine=whole,
            worst=worst,
            loss_err=abs(float(value) - float(ref[2])) / abs(float(ref[2])),
            finite=finite(grads),
        )
        rows.append(row)
        log(
            f"  {name} {vname}: out err {row['out_err']:.4f}, cosine {row['cosine']:.5f} "
            f"({time.perf_counter() - t0:.1f} s)"
        )
    return rows


def error_cases(tiny: bool, names=("MLP", "GPT")) -> list[tuple]:
    """(name, forward, params, x, y, warm-up batches) per model."""

    def batches(seed, x_shape, y_shape, scale=1.0):
        seeds = [(seed + 2 * i, seed + 2 * i + 1) for i in range(4)]
        return [
            (normal(a, *x_shape, scale=scale), normal(b, *y_shape, scale=scale)) for a, b in seeds
        ]

    cases = []
    sizes, batch = ((16, 32, 32, 8), 8) if tiny else ((256, 1024, 1024, 64), 128)
    params = models.mlp_params(sizes)
    for mag in (1e3, 1.0, 1e-6) if "MLP" in names else ():
        (x, y), *warmup = batches(100, (batch, sizes[0]), (batch, sizes[-1]), mag)
        cases.append((f"MLP, inputs ~{mag:g}", models.mlp_forward, params, x, y, warmup))
    d, heads, layers, b, t = (32, 2, 1, 2, 16) if tiny else (256, 4, 4, 8, 128)
    if "GPT" in names:
        (x, y), *warmup = batches(200, (b, t, d), (b, t, d))
        forward = functools.partial(models.gpt_forward, heads=heads)
        name = f"GPT ({layers} layers, d={d}, batch {b}x{t})"
        cases.append((name, forward, models.gpt_params(d, layers), x, y, warmup))
    return cases


# --------------------------------------------------------------------------- training curves


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
    """Adam on ``loss_of_output(forward(*state, params, x), y)``; returns the losses, the
    params and ``state``: ``[]``, or ``[float8 state]`` for a ``delayed`` forward."""
    tx = optax.adam(lr)
    opt_state = tx.init(params)
    state = [jamp.float8.init(forward, params, *init_args)] if kind == "delayed" else []

    @jax.jit
    def step(params, state, opt_state, x, y):
        loss = lambda s, p: loss_of_output(forward(*s, p, x), y)  # noqa: E731
        value, (state, grads) = jax.value_and_grad(loss, argnums=(0, 1))(state, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, value

    losses = []
    for i in range(steps):
        x, y = batches(i)
        params, state, opt_state, value = step(params, state, opt_state, x, y)
        losses.append(value)
    return [float(v) for v in jax.device_get(losses)], params, state


def curves(forward, reference, loss, params, batches, n_steps, lr, init, evaluate, log) -> list:
    """Each mode's losses over ``n_steps`` of Adam from ``params``, and ``evaluate(f)`` of the
    trained mode's ``f(x)`` (the table's last column)."""
    rows, variants = [], steps.float8_forwards(forward, reference)
    for name in CURVES:
        kind, f = variants[name]
        t0 = time.perf_counter()
        losses, p, state = train(kind, f, loss, params, batches, n_steps, lr, init)
        # One compiled forward (the trained parameters as arguments), not an eager one.
        extra = evaluate(functools.partial(jax.jit(lambda s, p, x, f=f: f(*s, p, x)), state, p))
        rows.append(dict(name=name, losses=losses, extra=extra))
        log(f"  {name}: final {np.mean(losses[-50:]):.4g}, {extra} "
            f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    return rows


def digits_curves(tiny: bool, log) -> tuple[str, list[dict]]:
    demo = models.digits_demo()
    x_train, y_train, x_test, y_test = demo.load_data(0)
    n_steps = 20 if tiny else 600
    model = demo.CNN()
    params = model.init(jax.random.PRNGKey(0), x_train[:1])
    batch_ids = np.random.default_rng(0).integers(0, len(x_train), (n_steps, demo.BATCH))

    def batches(i):
        return x_train[batch_ids[i]], y_train[batch_ids[i]]

    def loss_of_output(logits, y):  # the demo's loss: summed, normalised by 2**22 tokens
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), y)
        return jnp.sum(ce) / demo.GLOBAL_TOKENS

    def accuracy(f):
        return f"{float(jnp.mean(jnp.argmax(f(x_test), -1) == y_test)):.3f}"

    rows = curves(model.apply, models.ReferenceCNN().apply, loss_of_output, params, batches,
                  n_steps, 1e-3, (x_train[:1],), accuracy, log)  # fmt: skip
    for r in rows:  # per example
        r["losses"] = [v * demo.GLOBAL_TOKENS / demo.BATCH for v in r["losses"]]
    describe = (
        f"digits CNN of examples/train_digits.py: {n_steps} steps of Adam 1e-3, batch "
        f"{demo.BATCH}, loss normalised by 2**22 tokens (shown per example); last column: "
        "test accuracy"
    )
    return describe, rows


def regression_curves(tiny: bool, log) -> tuple[str, list[dict]]:
    n_steps, pool = (20, 256) if tiny else (500, 4096)
    teacher = models.mlp_params((16, 64, 8), seed=50)
    xs = normal(60, pool, 16)
    ys = 1e-3 * jnp.tanh(models.mlp_forward(teacher, xs))
    params = models.mlp_params((16, 128, 128, 8), seed=70)
    ids = np.random.default_rng(1).integers(0, pool, (n_steps, 256))

    def batches(i):
        return xs[ids[i]], ys[ids[i]]

    reference = functools.partial(models.mlp_forward, einsum=models.reference_einsum)
    rows = curves(models.mlp_forward, reference, _mse, params, batches, n_steps, 3e-3,
                  (xs[:256],), lambda f: f"{float(_mse(f(xs), ys)):.3e}", log)  # fmt: skip
    describe = (
        f"regression: a 16-128-128-8 gelu MLP fitting a teacher network with outputs ~1e-3, "
        f"{n_steps} steps of Adam 3e-3, batch 256 from {pool} points, MSE; last column: MSE on "
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
    L = [f"| mode | {head} | final (mean of last {window}) | final / float32 | {extra} |",
         "| --- |" + " ---: |" * (len(marks) + 3)]  # fmt: skip
    for r in rows:
        final = float(np.mean(r["losses"][-window:]))
        cells = " | ".join(f"{r['losses'][m]:.4g}" for m in marks)
        L.append(f"| {r['name']} | {cells} | {final:.4g} | {final / base:.3f} | {r['extra']} |")
    return L


def section(args, errors: dict, curves: list, elapsed: float) -> str:
    cmd = "python -m benchmarks float8" + (" --tiny" if args.tiny else "")
    L = [
        START,
        "## Float8 with per-tensor scaling (`benchmarks/float8.py`)",
        "",
        *header(cmd, elapsed),
        "- on a CPU XLA upcasts float8 operands for its dot, so these are numerics only; "
        "`--step-time` on a GPU measures speed.",
        "- output error: `|out - out32| / |out32|`; grad cosine: against float32's gradient "
        "(parameters and input), worst leaf in brackets. `benchmarks/README.md` defines every "
        f"variant; delayed scaling keeps an amax history of {HISTORY} steps.",
        "",
    ]
    targets = []
    head = "| variant | output error | grad cosine [worst leaf] | loss error |"
    for name, rows in errors.items():
        L += [f"### {name}", "", head, "| --- | ---: | ---: | ---: |"]
        for r in rows:
            fin = "" if r["finite"] else " non-finite"
            L.append(f"| {r['name']} | {r['out_err']:.4f} | {r['cosine']:.5f} [{r['worst']:.4f}]"
                     f"{fin} | {r['loss_err']:.2e} |")  # fmt: skip
            if r["name"] in ("float8 current", "float8 delayed"):
                ok = r["out_err"] <= OUT_TARGET and r["cosine"] >= COSINE_TARGET and r["finite"]
                targets.append((f"{name}: {r['name']}", r["out_err"], r["cosine"], ok))
        L.append("")
    for title, rows, extra in curves:
        L += [f"### Training: {title}", "", *_curve_table(rows, extra), ""]
    L += [f"### Targets (issue #18): output error <= {OUT_TARGET}, grad cosine >= {COSINE_TARGET}",
          "", "| model: variant | output error | grad cosine | met |",
          "| --- | ---: | ---: | --- |"]  # fmt: skip
    L += [f"| {t} | {e:.4f} | {c:.5f} | {'yes' if ok else '**no**'} |" for t, e, c, ok in targets]
    L += ["", END]
    return "\n".join(L)


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
    t0 = time.perf_counter()
    (d, heads, layers, b, t), title = timing.gpt_step_config(args)
    x, y = normal(0, b, t, d), normal(1, b, t, d)
    params = models.gpt_params(d, layers)
    forward = functools.partial(models.gpt_forward, heads=heads)
    variants = steps.float8_forwards(forward, attention=True)
    del variants["float32"]

    compiled, hlos = {}, {}
    for name, (kind, f) in sorted(variants.items(), key=lambda v: v[1][0] == "delayed"):

        def step(s, p, x, y, f=f):  # s: [] or [the float8 state]
            loss = lambda s, p: _mse(f(*s, p, x), y)  # noqa: E731
            value, (s, g) = jax.value_and_grad(loss, (0, 1))(s, p)
            return s, timing.sgd(p, g), value

        state = [jamp.float8.init(f, params, x)] if kind == "delayed" else []
        compiled[name] = (jax.jit(step).lower(state, params, x, y).compile(), (state, params, x, y))
        hlos[name] = gemm_calls(compiled[name][0].as_text())
        log(f"  compiled {name}: {hlos[name]}")
    med = timing.time_compiled(compiled, args.step_rounds, args.step_reps)
    L = [
        title,
        "",
        *header(" ".join(["python -m benchmarks", *args.argv]), time.perf_counter() - t0),
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
    for name in compiled:
        h = hlos[name]
        L.append(
            f"| {name} | {1e3 * med[name]:.3f} | {med[name] / med['bfloat16']:.3f} | "
            f"{h['__cublas$lt$matmul$f8']} | {h['__cublas$lt$matmul']} | {h['__cublas$gemm']} "
            f"| {h['triton']} | {h['cudnn']} | {h['f8 dots']} |"
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


# --------------------------------------------------------------------------- the run


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", default="MLP,GPT",
                    help="the error tables' models: a subset of MLP,GPT")  # fmt: skip
    ap.add_argument("--curves", default="digits,regression",
                    help="the training curves: a subset of digits,regression")  # fmt: skip


def measure_section(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    """The section this benchmark writes into RESULTS.md."""
    t0 = time.perf_counter()
    errors, built = {}, {}
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    for name, forward, params, x, y, warmup in error_cases(args.tiny, names):
        if id(forward) not in built:
            built[id(forward)] = build_steps(forward, name.startswith("GPT"))
        errors[name] = measure_error(name, built[id(forward)], params, x, y, warmup, log)
    tasks = {"digits": (digits_curves, "test acc"), "regression": (regression_curves, "MSE, all")}
    curves = [(*tasks[k][0](args.tiny, log), tasks[k][1]) for k in args.curves.split(",") if k]
    return section(args, errors, curves, time.perf_counter() - t0)


def run(args: argparse.Namespace, log: Callable[[str], None] = log) -> str:
    """The section (``--step-time``: the step-time table, a section of its own, so
    ``--results`` never replaces the other), printed and written."""
    if args.step_time:
        return emit(args, marked(step_time(args, log), STEP_START, STEP_END), STEP_START, STEP_END)
    return emit(args, measure_section(args, log), START, END)
