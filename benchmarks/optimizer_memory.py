"""Optimizer memory: bfloat16 parameters and low-precision optimizer state (a spoke).

Issue #33: ``jamp.master_weights`` (bfloat16 parameters, the float32 master kept exactly,
by stochastic rounding, by Kahan summation or not at all) and ``jamp.low_precision_state``
(adamw's moments in bfloat16 or 8 bits) beside float32 adamw and optax's
``mu_dtype=bfloat16``: bytes per parameter between steps, counted from the pytrees;
convergence on real data (a character-level GPT on the Python standard library's source,
the digits CNN), each recipe against the float32-master reference on the same batches;
the optimizer step alone compiled for an H200 (bytes, kernels). ``benchmarks/README.md``
defines every recipe.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sysconfig
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp
from benchmarks import models, xla_gpu
from benchmarks.models import BF16, F32
from benchmarks.report import emit, header, log, target_row

START, END = "<!-- optimizer-memory:start -->", "<!-- optimizer-memory:end -->"
REF = "float32 master (reference)"
BARS = {"kahan, bf16 moments": 0.005, "stochastic, bf16 moments": 0.01,
        "8-bit moments, f32 master": 0.01}  # fmt: skip  # issue #33: |final loss / ref - 1|
NEAREST = "nearest, f32 moments"
NOISE = "reference, another batch order"  # the noise floor of a comparison
SMOOTH = 100  # the final train loss: the mean of the last SMOOTH steps
BYTES_BARS = {"stochastic, bf16 moments": 0.51, "exact, f32 moments": 0.94}  # x plain adamw
PARTS = "gpt,digits,gpu-compile"
NEAREST_SLACK = 1.02  # stochastic rounding's bytes over nearest's, same moments


def _adamw(lr: Any, moments: Any = None, rounding: str = "stochastic") -> Any:
    """adamw, its moments stored by ``jamp.low_precision_state`` (``moments``: a dtype)."""
    tx = optax.adamw(lr)
    if moments is None:
        return tx
    kw = {} if moments == "8bit" else {"rounding": rounding}
    return jamp.low_precision_state(tx, dtypes={"mu": moments, "nu": moments}, **kw)


# name -> (the parameters' dtype, lr -> the optax transformation); README.md defines each
RECIPES: dict[str, tuple[Any, Callable[[Any], Any]]] = {
    REF: (F32, _adamw),
    "optax adamw(mu_dtype=bf16)": (F32, lambda lr: optax.adamw(lr, mu_dtype=BF16)),
    "bf16 moments, f32 master": (F32, lambda lr: _adamw(lr, BF16)),
    "8-bit moments, f32 master": (F32, lambda lr: _adamw(lr, "8bit")),
    "exact, f32 moments": (BF16, lambda lr: jamp.master_weights(_adamw(lr), rounding="exact")),
    "stochastic, bf16 moments": (
        BF16, lambda lr: jamp.master_weights(_adamw(lr, BF16), rounding="stochastic")),
    "kahan, bf16 moments": (
        BF16, lambda lr: jamp.master_weights(_adamw(lr, BF16), rounding="kahan")),
    NEAREST: (BF16, lambda lr: jamp.master_weights(_adamw(lr), rounding="nearest")),
    "nearest, bf16 moments": (
        BF16, lambda lr: jamp.master_weights(_adamw(lr, BF16, "nearest"), rounding="nearest")),
}  # fmt: skip
BASELINES = (REF, "optax adamw(mu_dtype=bf16)")


def recipes() -> tuple[dict, str]:
    """The recipes this jamp builds, and why the others are left out ('' if none is)."""
    lacking = [f"jamp.{n}" for n in ("master_weights", "low_precision_state")
               if not hasattr(jamp, n)]  # fmt: skip
    if not lacking:
        return dict(RECIPES), ""
    left = ", ".join(k for k in RECIPES if k not in BASELINES)
    return {k: RECIPES[k] for k in BASELINES}, f"{left}: {' and '.join(lacking)} not in this jamp"


# The peers' layouts, bytes per parameter between steps: derived from what each documents
# (/work/shared/LOW-PRECISION.md cites the sources), not measured here.
PUBLISHED = [
    ("TE FusedAdam(store_param_remainders=True)", "bf16 param + int16 remainder + fp32 m, v", 12),
    ("TE FusedAdam, remainders + bf16 moments", "bf16 param + int16 remainder + bf16 m, v", 8),
    ("torchao AdamW8bit, fp32 params", "fp32 param + 8-bit m, v + fp32 scale per 256", 6.03),
    ("torchao AdamW8bit, bf16_stochastic_round", "bf16 param + 8-bit m, v + scales", 4.03),
    ("optimi AdamW(kahan_sum=True), bf16", "bf16 param + bf16 Kahan buffer + bf16 m, v", 8),
]


def _as(tree: Any, dtype: Any = BF16) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype), tree)


_cast = jax.jit(_as)  # to bfloat16: the forward's parameters, outside its program


def _nbytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------- the data


def stdlib_text(n_files: int | None = None) -> tuple[np.ndarray, int]:
    """The standard library's ``*.py`` files (``site-packages`` aside), sorted by path (the
    first ``n_files``) and concatenated, as bytes; and how many files."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if "site-packages" not in p.relative_to(root).parts)[:n_files]  # fmt: skip
    return np.frombuffer(b"".join((root / f).read_bytes() for f in files), np.uint8), len(files)


# --------------------------------------------------------------------------- training


def train(tx: Any, params: Any, grad: Callable, batch_of: Callable, n: int) -> tuple:
    """``n`` steps of ``tx`` from ``params``; ``grad(bfloat16 params, batch) -> (loss,
    bfloat16 grads)`` is one program for every recipe (a float32 master's are upcast, as
    classic mixed precision's flow back through the cast). The losses, the parameters after
    the first step and the last."""

    @jax.jit
    def update(p, s, g):
        u, s = tx.update(jax.tree.map(lambda g, p: g.astype(p.dtype), g, p), s, p)
        return optax.apply_updates(p, u), s

    state, losses, first = tx.init(params), [], None
    for i in range(n):
        value, g = grad(_cast(params), batch_of(i))
        params, state = update(params, state, g)
        losses.append(value)
        first = params if i == 1 else first  # step 0's learning rate is 0 (the warmup's)
    return np.asarray(jax.device_get(losses), np.float64), first, params


def run_task(task: dict, chosen: dict, log: Callable) -> dict[str, dict]:
    """Each recipe of ``chosen`` on ``task`` from the same bfloat16 values (and the reference
    on another batch order, the noise floor): losses, evaluation, params."""
    out, grad = {}, jax.jit(jax.value_and_grad(task["loss"]))
    sched = optax.warmup_cosine_decay_schedule(0.0, task["lr"], task["warmup"], task["steps"])
    runs = [(k, v, 0) for k, v in chosen.items()]
    for name, (dtype, build), seed in [runs[0], (NOISE, chosen[REF], 1), *runs[1:]]:
        t0 = time.perf_counter()
        losses, first, p = train(build(sched), _as(_as(task["params"]), dtype), grad,
                                 task["batches"](seed), task["steps"])  # fmt: skip
        out[name] = r = {"losses": losses, "first": first, "params": p, **task["evaluate"](p)}
        r["seconds"] = time.perf_counter() - t0
        log(f"  {task['name']} {name}: train {losses[-SMOOTH:].mean():.4f}, validation "
            f"{r['val']:.4f} ({r['seconds']:.0f} s)")  # fmt: skip
    return out


def gpt_task(tiny: bool, n_steps: int) -> dict:
    d, layers, heads, seq, batch = (32, 1, 2, 16, 4) if tiny else (128, 2, 4, 64, 12)
    text, n_files = stdlib_text(12 if tiny else None)
    n_val = len(text) // 20  # the last 5% held out
    train_text, val_text = text[:-n_val], text[-n_val:]
    params, loss = models.char_gpt(d, layers, heads, seq)
    window = np.arange(seq + 1)
    val_batches = [
        jnp.asarray(val_text[s[:, None] + window], jnp.int32)
        for s in np.random.default_rng(1).integers(0, n_val - seq - 1, (4 if tiny else 96, batch))
    ]
    val_loss = jax.jit(loss)

    def batches(seed: int) -> Callable:
        starts = np.random.default_rng(seed).integers(0, len(train_text) - seq - 1,
                                                      (n_steps, batch))  # fmt: skip
        return lambda i: jnp.asarray(train_text[starts[i][:, None] + window], jnp.int32)

    def evaluate(p: Any) -> dict:
        return {"val": float(np.mean([val_loss(_cast(p), b) for b in val_batches]))}

    describe = (
        f"character-level GPT, d {d}, {layers} layers, {heads} heads, context {seq}, batch "
        f"{batch}, bytes as tokens (vocab 256), {sum(x.size for x in jax.tree.leaves(params)):,} "
        f"parameters; data: the {n_files} `*.py` files of Python {platform.python_version()}'s "
        f"standard library (`sysconfig.get_paths()['stdlib']`, `site-packages` aside), sorted "
        f"by path and concatenated, {len(text) / 1e6:.1f} MB, the last 5% held out; validation "
        f"loss over {len(val_batches)} fixed batches of it"
    )
    return dict(name="GPT", describe=describe, params=params, loss=loss, batches=batches,
                steps=n_steps, lr=2e-3, warmup=max(2, n_steps // 30),
                evaluate=evaluate)  # fmt: skip


def digits_task(tiny: bool) -> dict:
    demo = models.digits_demo()
    x_train, y_train, x_test, y_test = demo.load_data(0)
    n_steps, model = 10 if tiny else 600, demo.CNN()
    params = model.init(jax.random.PRNGKey(0), x_train[:1])

    def loss(p: Any, batch: tuple) -> jax.Array:
        return models.xent(model.apply(p, batch[0].astype(BF16)), batch[1])

    def batches(seed: int) -> Callable:
        ids = np.random.default_rng(seed).integers(0, len(x_train), (n_steps, demo.BATCH))
        return lambda i: (x_train[ids[i]], y_train[ids[i]])

    @jax.jit
    def test(p):
        logits = model.apply(p, jnp.asarray(x_test, BF16)).astype(F32)
        return models.xent(logits, y_test), jnp.mean(jnp.argmax(logits, -1) == y_test)

    def evaluate(p: Any) -> dict:
        value, acc = test(_cast(p))
        return {"val": float(value), "acc": float(acc)}

    describe = (
        f"`examples/train_digits.py`'s CNN and data (sklearn digits, {len(x_train)} train, "
        f"{len(x_test)} test images), batch {demo.BATCH}, the mean cross-entropy; validation: "
        "the test images"
    )
    return dict(name="digits CNN", describe=describe, params=params, loss=loss,
                batches=batches, steps=n_steps, lr=1e-3,
                warmup=max(2, n_steps // 30), evaluate=evaluate)  # fmt: skip


# --------------------------------------------------------------------------- memory, GPU


def memory(params: Any, chosen: dict) -> dict[str, tuple[float, float]]:
    """Per recipe: (params, optimizer state) bytes per parameter between steps."""
    n = sum(x.size for x in jax.tree.leaves(params))
    out = {}
    for name, (dtype, build) in chosen.items():
        p = _as(params, dtype)
        out[name] = (_nbytes(p) / n, _nbytes(jax.eval_shape(build(1e-3).init, p)) / n)
    return out


def gpu_compile(tiny: bool, chosen: dict, log: Callable) -> tuple[dict, str]:
    """Per recipe, the optimizer step alone compiled for an H200 (or why not)."""
    why = xla_gpu.unavailable()
    if why:
        return {}, why
    n, shape = (2, (64, 256)) if tiny else (8, (1024, 1024))
    out: dict[str, Any] = {"n": n * shape[0] * shape[1], "what": f"{n} leaves of {shape}"}
    for name, (dtype, build) in chosen.items():
        tx, p = build(1e-3), {f"w{i}": jax.ShapeDtypeStruct(shape, dtype) for i in range(n)}

        def step(p, g, s, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        compiled = xla_gpu.compile_for(step, p, p, jax.eval_shape(tx.init, p),
                                       donate_argnums=(0, 2))  # fmt: skip
        out[name] = q = xla_gpu.analyse(compiled)
        log(f"  GPU compile {name}: {q.bytes / 1e6:.1f} MB, {q.n_kernels} kernels")
    return out, ""


# --------------------------------------------------------------------------- the section


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def _gaps(r: dict, ref: dict) -> tuple[float, float]:
    """(smoothed train, validation) loss over the reference's, minus 1."""
    tail = lambda x: x["losses"][-SMOOTH:].mean()  # noqa: E731
    return tail(r) / tail(ref) - 1, r["val"] / ref["val"] - 1


def _judge(target: str, res: dict, name: str, measure: Callable) -> str:
    """A targets row: ``measure(res[name]) -> (measured, met, miss by, why)``."""
    if name not in res:
        return target_row(target, "not measured", False, "", "left out (see above)")
    return target_row(target, *measure(res[name]))


def memory_lines(mem: dict) -> list[str]:
    L = ["| recipe | params | optimizer state | total | x adamw float32 | source |",
         "| --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    L += [f"| {k} | {a:.2f} | {b:.2f} | {a + b:.2f} | {(a + b) / sum(mem[REF]):.3f} | measured: "
          "these pytrees |" for k, (a, b) in mem.items()]  # fmt: skip
    return L + [f"| {k} | | | {b:.2f} | {b / 12:.3f} | derived from the documented layout: "
                f"{layout} |" for k, layout, b in PUBLISHED]  # fmt: skip


def task_lines(task: dict, res: dict) -> list[str]:
    ref, acc = res[REF], "acc" in res[REF]
    L = [f"### {task['name']}: {task['describe']}", "",
         f"adamw (optax's defaults: b1 0.9, b2 0.999, weight decay 1e-4), {task['steps']} steps, "
         f"learning rate warmed up to {task['lr']:g} over {task['warmup']} steps, cosine decay "
         "to 0. Every recipe starts from the same bfloat16 values (a float32 master holds them "
         "in float32) and runs one forward-backward program on its parameters in bfloat16 (a "
         "float32 master's cast; its bfloat16 gradients upcast: classic mixed precision), on "
         f"the same batches ({NOISE}: the reference on others, the noise floor). train: the mean "
         f"of the last {SMOOTH} steps' losses; max \\|Δ loss\\|: over every step, against the "
         "reference's.", "",
         "| recipe | train loss | vs reference | validation loss | vs reference | max \\|Δ loss\\| "
         f"|{' test acc |' if acc else ''} CPU s |",
         f"| --- | ---: | ---: | ---: | ---: | ---: |{' ---: |' if acc else ''} ---: |",
         ]  # fmt: skip
    for name, r in res.items():
        tr, va = _gaps(r, ref)
        d = f"{np.max(np.abs(r['losses'] - ref['losses'])):.3g}"
        tr, d = ("other batches", "") if name == NOISE else (_pct(tr), d)
        cell = f" {r['acc']:.4f} |" if acc else ""
        L.append(f"| {name} | {r['losses'][-SMOOTH:].mean():.4f} | {tr} | {r['val']:.4f} "
                 f"| {_pct(va)} | {d} |{cell} {r['seconds']:.0f} |")  # fmt: skip
    return [*L, ""]


def convergence_targets(res: dict) -> list[str]:
    """Issue #33's convergence targets, on the GPT."""
    ref = res[REF]

    def differ(a, b):  # bf16 parameters whose bits differ from the reference's cast
        pairs = zip(jax.tree.leaves(a), jax.tree.leaves(_cast(b)), strict=True)
        return sum(int(jnp.sum(x.view(jnp.uint16) != y.view(jnp.uint16))) for x, y in pairs)

    def exact(r):
        dmax, first = float(np.max(np.abs(r["losses"] - ref["losses"]))), r["first"]
        return (f"max \\|Δ loss\\| {dmax:.3g} over {len(r['losses'])} steps; bf16 params "
                f"differing from the reference's: {differ(first, ref['first'])} after the second "
                f"step (the first to move), {differ(r['params'], ref['params'])} at the end, of "
                f"{sum(x.size for x in jax.tree.leaves(first)):,}", dmax == 0, f"{dmax:.3g}",
                "where a step is larger than where the parameter lands (near zero), no bf16 "
                "update reaches it through `optax.apply_updates` and its master restarts there "
                "(`jamp.master_weights`' documented exception); the runs part there")  # fmt: skip

    floor = abs(_gaps(res[NOISE], ref)[1])  # the validation's: its train loss is on others
    noise = f"±{100 * floor:.2f}%"

    def within(bar):
        def measure(r):
            tr, va = _gaps(r, ref)
            worst = max(abs(tr), abs(va))
            return (f"train {_pct(tr)}, validation {_pct(va)} (validation's noise floor "
                    f"{noise})", worst <= bar, f"{100 * (worst - bar):.2f} points",
                    f"{worst / max(floor, 1e-9):.1f}x the noise floor (one seed)")  # fmt: skip

        return measure

    def behind(r):
        tr, va = _gaps(r, ref)
        return (f"train {_pct(tr)}, validation {_pct(va)} (validation's noise floor {noise})",
                va > 0.01, "",
                "it keeps up at this length and schedule")  # fmt: skip

    out = [_judge("exact: bit-identical to the reference (every step's loss)",
                  res, "exact, f32 moments", exact)]  # fmt: skip
    out += [_judge(f"{k}: train and validation loss within {bar:.1%} of the reference's", res, k,
                   within(bar)) for k, bar in BARS.items()]  # fmt: skip
    return [*out, _judge(f"{NEAREST}: falls behind (validation loss > 1% above the "
                         "reference's)", res, NEAREST, behind)]  # fmt: skip


def gpu_lines(gpu: dict, why: str) -> tuple[list[str], list[str]]:
    L = ["### On the GPU compile (H200 target, no device): the optimizer step alone", ""]
    if why:
        return [*L, f"Not measured here: {why}.", ""], []
    n, what = gpu.pop("n"), gpu.pop("what")
    plain = gpu[REF]
    L += ["`u, s = tx.update(g, s, p)` then `optax.apply_updates(p, u)`, jitted, the parameters "
          f"and the state donated, on {what} ({n / 1e6:.1f}M parameters); the gradients in the "
          "parameters' dtype. Bytes: modelled HBM traffic, each kernel's operands + outputs "
          "(`benchmarks/xla_gpu.py`); plain: float32 `optax.adamw`, the reference.", "",
          "| recipe | params, grads | HBM bytes (MB) | bytes / param | x plain | kernels | "
          "temp (MiB) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    L += [f"| {k} | {jnp.dtype(RECIPES[k][0]).name} | {p.bytes / 1e6:.1f} | {p.bytes / n:.2f} "
          f"| {p.bytes / plain.bytes:.4f} | {p.n_kernels} | {p.temp_bytes / 2**20:.1f} |"
          for k, p in gpu.items()]  # fmt: skip

    def bytes_below(bar, base=plain):
        def measure(p):
            r = p.bytes / base.bytes
            return f"{r:.4f}x ({p.bytes / n:.2f} B/param)", r <= bar, f"{r - bar:.4f}x", ""

        return measure

    out = [_judge(f"GPU step: {k} <= {bar}x plain adamw's bytes ({plain.bytes / n:.0f} B/param)",
                  gpu, k, bytes_below(bar)) for k, bar in BYTES_BARS.items()]  # fmt: skip
    if "nearest, bf16 moments" in gpu:
        out.append(_judge(f"GPU step: stochastic rounding <= {NEAREST_SLACK}x nearest's bytes "
                          "(both with bf16 moments)", gpu, "stochastic, bf16 moments",
                          bytes_below(NEAREST_SLACK, gpu["nearest, bf16 moments"])))  # fmt: skip
    over = {k: p.n_kernels for k, p in gpu.items() if p.n_kernels > plain.n_kernels}
    more = ", ".join(f"{k} {n}" for k, n in over.items())
    worst = max(over.values(), default=0) - plain.n_kernels
    out.append(target_row(f"GPU step: no recipe launches more kernels than plain adamw "
                          f"({plain.n_kernels})", f"more: {more}" if over else "none more",
                          not over, f"up to {worst}"))  # fmt: skip
    return [*L, ""], out


def section(args, mem, left_out, tasks, gpu, elapsed) -> str:
    cmd = "python -m benchmarks optimizer-memory" + (" --tiny" if args.tiny else "")
    cmd += "" if args.tiny or args.steps == 3000 else f" --steps {args.steps}"
    cmd += "" if args.parts == PARTS else f" --parts {args.parts}"
    cmd += f" --recipes {args.recipes}" if args.recipes else ""
    L = [START, "## Optimizer memory: bf16 parameters, low-precision optimizer state "
         "(`benchmarks/optimizer_memory.py`, issue #33)", "",
         *header(cmd, elapsed, ("jax", "optax", "flax")),
         "- the recipes are defined in `benchmarks/README.md`"
         + (f"; left out: {left_out}" if left_out else ""), "",
         "### Bytes per parameter between steps (the GPT's parameters)", "",
         *memory_lines(mem), ""]  # fmt: skip
    targets = []
    for task, res in tasks:
        L += task_lines(task, res)
        targets += convergence_targets(res) if task["name"] == "GPT" else []
    gpu_rows, gpu_targets = gpu
    L += [*gpu_rows, "### Targets (issue #33)", "",
          "| target | measured | met | miss by | why |", "| --- | --- | --- | --- | --- |",
          *targets, *gpu_targets, "", END]  # fmt: skip
    return "\n".join(L)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=3000, help="the GPT's training steps")
    ap.add_argument("--parts", default=PARTS, help="a subset of " + PARTS)
    ap.add_argument("--recipes", default="", help="train only the recipes whose names start "
                    "with one of these words (comma-separated), beside the reference")  # fmt: skip


def run(args: argparse.Namespace, log: Callable[[str], None] = log) -> str:
    t0 = time.perf_counter()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    chosen, left_out = recipes()
    gpt = gpt_task(args.tiny, 12 if args.tiny else args.steps)
    mem, tasks = memory(gpt["params"], chosen), []
    for name, build in (("gpt", lambda: gpt), ("digits", lambda: digits_task(args.tiny))):
        if name in parts:
            task = build()
            log(f"{task['name']}: {task['steps']} steps")
            words = tuple(w.strip() for w in args.recipes.split(",") if w.strip()) or ("",)
            trained = {k: v for k, v in chosen.items() if k == REF or k.startswith(words)}
            tasks.append((task, run_task(task, trained, log)))
    gpu = gpu_compile(args.tiny, chosen, log) if "gpu-compile" in parts else ({}, "left out")
    text = section(args, mem, left_out, tasks, gpu_lines(*gpu), time.perf_counter() - t0)
    return emit(args, text, START, END)
