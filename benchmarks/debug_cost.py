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
(for the code before issue #44, whose compile took minutes). ``--runs N`` measures it all
in N fresh processes, one after the other, and gives each cell's median (its ratio the
median of the runs' ratios, each run's tool against that run's step), with the ratios'
range: the small models' steps take a fraction of a second, and one run's ratio moves by
a third from one run to the next on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
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
    row["describe"] = model.describe
    return row


def _s(t: float | None, limit: float = 0) -> str:
    return f"> {limit:.0f}" if t is None else f"{t:.2f}"


def _cell(t: float | None, step: float, limit: float, ratios: list[float] | None = None) -> str:
    if t is None:
        return f"> {limit:.0f} s (> {limit / step:.0f}x)"
    ratio = t / step if ratios is None else statistics.median(ratios)
    spread = "" if ratios is None or len(ratios) < 2 else f"; {min(ratios):.1f}-{max(ratios):.1f}x"
    return f"{t:.2f} s ({ratio:.1f}x{spread})" + ("" if ratio <= TARGET else " **over**")


def _median_row(runs: list[dict]) -> dict:
    """Each time's median over the runs, and beside it each run's ratio to its own step
    (``ratios``); a tool stopped by ``--limit`` in any run is stopped (None)."""
    row: dict[str, Any] = {"site": runs[0]["site"], "describe": runs[0]["describe"], "ratios": {}}
    for key in runs[0]:
        if key in ("site", "describe"):
            continue
        times = [r[key] for r in runs]
        row[key] = None if any(t is None for t in times) else statistics.median(times)
        if key != "step" and row[key] is not None:
            row["ratios"][key] = [r[key] / r["step"] for r in runs]
    return row


def _in_processes(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[dict, list]:
    """``--runs`` fresh processes of this benchmark, one after the other: the models' rows
    (their medians) and the models not run."""
    runs: list[dict] = []
    skipped: list = []
    for n in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            path = f"{tmp}/rows.json"
            cmd = [sys.executable, "-m", "benchmarks", "debug-cost", "--models", args.models,
                   "--dtypes", args.dtypes, "--limit", str(args.limit),
                   "--rows-json", path]  # fmt: skip
            subprocess.run(cmd + (["--tiny"] if args.tiny else []), check=True)
            with open(path) as fh:
                got = json.load(fh)
        log(f"run {n + 1} of {args.runs} done")
        runs.append(got["rows"])
        skipped = got["skipped"]
    rows = {name: _median_row([r[name] for r in runs]) for name in runs[0]}
    return rows, skipped


def section(args: argparse.Namespace, rows: dict, skipped: list,
            dtypes: list[str], elapsed: float) -> str:  # fmt: skip
    cmd = "python -m benchmarks debug-cost" + (" --tiny" if args.tiny else "")
    cmd += f" --models {args.models}" if args.models != ",".join(models.DEBUG) else ""
    cmd += f" --dtypes {args.dtypes}" if args.dtypes != "bfloat16,float16" else ""
    cmd += f" --limit {args.limit:g}" if args.limit else ""
    cmd += f" --runs {args.runs}" if args.runs > 1 else ""
    runs = (
        f"the median of {args.runs} runs, each in a fresh process, its ratio the median of "
        "the runs' ratios (the range beside it); "
        if args.runs > 1
        else ""
    )
    L = [START, "## What jamp.debug costs on real models (`benchmarks/debug_cost.py`)", "",
         *header(cmd, elapsed, ("jax", "flax", "transformers", "equinox")),
         f"- {runs}each tool's wall time (its trace, compiles and run) beside the model's own "
         "`jax.jit(jax.value_and_grad(loss))` first call (compile and one run), in one "
         "process, in this order; ratios to the step's time, issue #44's target at most "
         f"{TARGET:g}x. planted: `jamp.autocast(exp(1000 * loss / stop_gradient(loss)), "
         "float16)`, an overflow at the forward pass's end, the operation named beside it.", "",
         "| model | step (compile + run) | locate_nonfinite | locate float16, planted overflow "
         "(site) | "
         + " | ".join(f"precision_report {d}" for d in dtypes) + " |",
         "| --- | ---: | ---: | ---: |" + " ---: |" * len(dtypes)]  # fmt: skip
    for name, r in rows.items():
        ratios = r.get("ratios", {})
        cells = [
            _cell(r[k], r["step"], args.limit, ratios.get(k))
            for k in ("locate", "planted", *dtypes)
        ]
        cells[1] += f" ({r['site']})"
        L.append(f"| {name} | {r['step']:.2f} s | " + " | ".join(cells) + " |")
    L += ["", "Models:", ""] + [f"- {name}: {r['describe']}" for name, r in rows.items()]
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
    ap.add_argument("--runs", type=int, default=1,
                    help="measure in this many fresh processes, and give the medians")  # fmt: skip
    ap.add_argument("--rows-json", default="", help=argparse.SUPPRESS)  # a run's rows (--runs)


def run(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    t0, s = time.perf_counter(), shapes(args.tiny)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    keys = [m.strip() for m in args.models.split(",") if m.strip()]
    for key in keys:
        if key not in models.DEBUG:
            raise SystemExit(
                f"--models: unknown model {key!r}; choose from {','.join(models.DEBUG)}"
            )
    if args.runs < 1:
        raise SystemExit(f"--runs: at least 1, got {args.runs}")
    if args.runs > 1:
        rows, skipped = _in_processes(args, log)
    else:
        rows, skipped = {}, []
        for key in keys:
            try:
                model = models.DEBUG[key](s, "")
            except models.Skip as e:
                skipped.append((key, str(e)))
                continue
            rows[model.name] = measure(model, dtypes, args.limit, log)
        if args.rows_json:
            with open(args.rows_json, "w") as fh:
                json.dump({"rows": rows, "skipped": skipped}, fh)
            return ""
    text = section(args, rows, skipped, dtypes, time.perf_counter() - t0)
    return emit(args, text, START, END)
