"""What ``jamp.debug`` costs on real models, against the model's own step (a spoke).

For each model (``models.DEBUG``: transformers' Flax GPT-2 and BERT, an NNX model with
dropout, the digits demo's CNN, an Equinox MLP, a linen GRU under ``scan``), in one
process, in this order: the wall time of ``jax.jit(jax.value_and_grad(loss))``'s first
call (its compile and one run), then ``jamp.debug.locate_nonfinite`` on the finite
step, ``locate_nonfinite`` on the step under ``jamp.autocast(float16)`` with a planted
overflow (``exp(1000 * loss / stop_gradient(loss))``, the end of the forward pass: the
search, then its located operation's values), and
``jamp.debug.precision_report`` per dtype; each beside the step's time as a ratio
(issue #44's target: at most 5x). ``--limit`` stops a tool after that many seconds
(for the code before issue #44, whose compile took minutes).
"""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jamp
from benchmarks import models
from benchmarks.models import Model
from benchmarks.report import emit, header

START, END = "<!-- debug-cost:start -->", "<!-- debug-cost:end -->"
TARGET = 5.0


class _Late(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Late


def timed(fn: Callable[[], Any], limit: float) -> tuple[float | None, Any]:
    """``fn()``'s wall time and result, or (None, None) past ``limit`` seconds (0: none)."""
    old = signal.signal(signal.SIGALRM, _alarm) if limit else None
    if limit:
        signal.setitimer(signal.ITIMER_REAL, limit)
    t0 = time.perf_counter()
    try:
        out = jax.block_until_ready(fn())
        return time.perf_counter() - t0, out
    except _Late:
        return None, None
    finally:
        if limit:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def shapes(tiny: bool) -> models.Shapes:
    return models.Shapes(32, 16, 2, 1, 32, 2, 8) if tiny else models.Shapes(
        128, 64, 4, 2, 256, 2, 16)  # fmt: skip


def measure(model: Model, dtypes: list[str], limit: float, log: Callable[[str], None]) -> dict:
    loss = model.scalar()
    args = (model.params, model.batch)

    def planted(p: Any, batch: Any) -> jax.Array:
        value = loss(p, batch)  # exp(1000): inf, the forward pass's last operation
        return jnp.exp(1e3 * value / jax.lax.stop_gradient(value))

    row: dict[str, Any] = {}
    row["step"], _ = timed(lambda: jax.jit(jax.value_and_grad(loss))(*args), 0)
    row["locate"], site = timed(lambda: jamp.debug.locate_nonfinite(loss, *args), limit)
    if row["locate"] is not None and site is not None:
        raise AssertionError(f"{model.name}: the step is finite, locate_nonfinite named {site}")
    half = jamp.autocast(planted, jnp.float16)
    row["planted"], site = timed(lambda: jamp.debug.locate_nonfinite(half, *args), limit)
    row["site"] = "-" if site is None else f"{site.primitive}, {site.pass_}"
    for d in dtypes:
        row[d], _ = timed(lambda d=d: jamp.debug.precision_report(loss, *args, dtype=d), limit)
    log(
        f"{model.name}: "
        + ", ".join(f"{k} {v if k == 'site' else _s(v, limit)}" for k, v in row.items())
    )
    return row


def _s(t: float | None, limit: float = 0) -> str:
    return f"> {limit:.0f}" if t is None else f"{t:.2f}"


def _cell(t: float | None, step: float, limit: float) -> str:
    if t is None:
        return f"> {limit:.0f} s (> {limit / step:.0f}x)"
    ratio = t / step
    return f"{t:.2f} s ({ratio:.1f}x)" + ("" if ratio <= TARGET else " **over**")


def section(args: argparse.Namespace, chosen: list[Model], rows: dict, skipped: list,
            dtypes: list[str], elapsed: float) -> str:  # fmt: skip
    cmd = "python -m benchmarks debug-cost" + (" --tiny" if args.tiny else "")
    cmd += f" --models {args.models}" if args.models != ",".join(models.DEBUG) else ""
    cmd += f" --dtypes {args.dtypes}" if args.dtypes != "bfloat16,float16" else ""
    cmd += f" --limit {args.limit:g}" if args.limit else ""
    L = [START, "## What jamp.debug costs on real models (`benchmarks/debug_cost.py`)", "",
         *header(cmd, elapsed, ("jax", "flax", "transformers", "equinox")),
         "- each tool's wall time (its trace, compiles and run) beside the model's own "
         "`jax.jit(jax.value_and_grad(loss))` first call (compile and one run), in one "
         "process, in this order; ratios to the step's time, issue #44's target at most "
         f"{TARGET:g}x. planted: `jamp.autocast(exp(1000 * loss / stop_gradient(loss)), "
         "float16)`, an overflow at the forward pass's end, the operation named beside it.", "",
         "| model | step (compile + run) | locate_nonfinite | locate float16, planted overflow "
         "(site) | "
         + " | ".join(f"precision_report {d}" for d in dtypes) + " |",
         "| --- | ---: | ---: | ---: |" + " ---: |" * len(dtypes)]  # fmt: skip
    for model in chosen:
        r = rows[model.name]
        cells = [_cell(r[k], r["step"], args.limit) for k in ("locate", "planted", *dtypes)]
        cells[1] += f" ({r['site']})"
        L.append(f"| {model.name} | {r['step']:.2f} s | " + " | ".join(cells) + " |")
    L += ["", "Models:", ""] + [f"- {m.name}: {m.describe}" for m in chosen]
    if skipped:
        L += ["", "Not run:", ""] + [f"- {name}: {why}" for name, why in skipped]
    return "\n".join(L + ["", END])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", default=",".join(models.DEBUG),
                    help=f"comma-separated subset of {','.join(models.DEBUG)}")  # fmt: skip
    ap.add_argument(
        "--dtypes", default="bfloat16,float16", help="the reports' dtypes, comma-separated"
    )
    ap.add_argument("--limit", type=float, default=0,
                    help="stop a tool after this many seconds (0: never)")  # fmt: skip


def run(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    t0, s = time.perf_counter(), shapes(args.tiny)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    chosen, rows, skipped = [], {}, []
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        if key not in models.DEBUG:
            raise SystemExit(
                f"--models: unknown model {key!r}; choose from {','.join(models.DEBUG)}"
            )
        try:
            model = models.DEBUG[key](s, "")
        except models.Skip as e:
            skipped.append((key, str(e)))
            continue
        rows[model.name] = measure(model, dtypes, args.limit, log)
        chosen.append(model)
    text = section(args, chosen, rows, skipped, dtypes, time.perf_counter() - t0)
    return emit(args, text, START, END)
