"""Saved residuals of ``jamp.autocast`` on real public models, beside their ``dtype=`` (a spoke).

flax's examples lm1b, wmt and gemma, transformers' Flax BERT and a model of flax NNX's
layers (``benchmarks/models.py``), one train step each as float32, under
``jamp.autocast(bfloat16)`` and built with ``dtype=bfloat16``: the bytes each keeps for
the backward pass, and where autocast keeps more than Flax (issue #25 section 2).
``benchmarks/README.md`` defines the variants.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable

import numpy as np

import jamp
from benchmarks import models, steps
from benchmarks.measure import compare, residual_groups
from benchmarks.models import BF16, Model
from benchmarks.report import by_dtype, emit, header, mib

START, END = "<!-- real-models:start -->", "<!-- real-models:end -->"
VARIANTS = ("float32", "jamp.autocast bfloat16", "Flax dtype=bfloat16")
TOP = 8

# --------------------------------------------------------------------------- measurement


def shapes(tiny: bool) -> models.Shapes:
    return models.Shapes(64, 32, 2, 1, 64, 2, 16) if tiny else models.Shapes(
        1024, 256, 4, 2, 1024, 8, 128)  # fmt: skip


def measure(model: Model, log: Callable[[str], None]) -> dict:
    losses = steps.precision_losses(model.scalar_at)
    rows = compare(model, losses, log)
    report = jamp.debug.autocast_report(losses["float32"], model.params, model.batch, dtype=BF16)
    ours = {(np.dtype(r.dtype).name, r.shape, r.source): (r.count, r.nbytes)
            for r in report.residuals}  # fmt: skip
    flax = residual_groups(losses["Flax dtype=bfloat16"], model.params, model.batch)
    note = report.residuals_note
    listed, counted = sum(n for _, n in ours.values()), sum(rows[VARIANTS[1]]["residuals"].values())
    if listed != counted:  # the report and residual_bytes trace the same function
        note += f" the report lists {listed} bytes, residual_bytes counts {counted}"
    return dict(rows=rows, ours=ours, flax=flax, note=note.strip())


# --------------------------------------------------------------------------- report


def short(source: str, examples: str) -> str:
    """A residual's source with the install and checkout prefixes taken off."""
    if examples:
        source = source.replace(os.path.abspath(examples).rstrip("/") + "/", "examples/")
    source = re.sub(r"/\S*/site-packages/", "", source)
    source = re.sub(r"from \S*/(benchmarks/real_models\.py)", r"from \1", source)
    source = source.replace("output of ", "").replace(" from ", " at ")
    return source + "(no source line outside jax)" if source.endswith(" at ") else source


def _shape(dtype: str, shape: tuple) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def _by_shape(groups: dict) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for (dt, shape, _), (_, nbytes) in groups.items():
        out[(dt, shape)] = out.get((dt, shape), 0) + nbytes
    return out


def diagnosis(result: dict, examples: str) -> list[str]:
    ours, flax = result["ours"], result["flax"]
    a, f = _by_shape(ours), _by_shape(flax)
    diff = sorted(((a.get(k, 0) - f.get(k, 0), k) for k in set(a) | set(f)), reverse=True)
    more = [(d, k) for d, k in diff if d > 0][:TOP]
    less = [(d, k) for d, k in diff if d < 0][-TOP:][::-1]
    total = sum(n for _, n in ours.values()) - sum(n for _, n in flax.values())
    L = [f"Autocast keeps {mib(abs(total))} MiB {'more' if total >= 0 else 'less'} than Flax "
         "dtype=bfloat16. By dtype and shape, where autocast keeps more (and, after them, "
         "where it keeps less):", "",
         "| dtype[shape] | autocast MiB | Flax MiB | autocast - Flax |",
         "| --- | ---: | ---: | ---: |"]  # fmt: skip
    for d, k in more + less:
        L.append(f"| {_shape(*k)} | {mib(a.get(k, 0))} | {mib(f.get(k, 0))} | "
                 f"{'+' if d > 0 else '-'}{mib(abs(d))} |")  # fmt: skip
    L += ["", "Where the surplus is kept: for each shape above that autocast keeps more of, "
          "in any dtype, the source lines where autocast and Flax differ, largest difference "
          "first (count: autocast's, then Flax's):", "",
          "| dtype[shape] | primitive at source | count | autocast MiB | Flax MiB |",
          "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
    for shape in dict.fromkeys(k[1] for _, k in more):  # each shape once, in order
        keys = [g for g in set(ours) | set(flax) if g[1] == shape]
        keys = [g for g in keys if ours.get(g, (0, 0)) != flax.get(g, (0, 0))]
        keys.sort(key=lambda g: (-abs(ours.get(g, (0, 0))[1] - flax.get(g, (0, 0))[1]), g))
        for g in keys[: 2 * TOP]:
            (count, n), (fcount, fn) = ours.get(g, (0, 0)), flax.get(g, (0, 0))
            L.append(f"| {_shape(*g[:2])} | {short(g[2], examples)} | {count}, {fcount} | "
                     f"{mib(n)} | {mib(fn)} |")  # fmt: skip
    f32 = [(n, c, k) for k, (c, n) in ours.items() if k[0] == "float32"]
    f32.sort(key=lambda t: (-t[0], t[2][2]))
    L += ["", f"Autocast's largest float32 residuals ({mib(sum(t[0] for t in f32))} MiB "
          "float32 in all), and what Flax keeps at the same dtype, shape and source:", "",
          "| dtype[shape] | count | MiB | Flax MiB | primitive at source |",
          "| --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for n, count, (dt, shape, src) in f32[:TOP]:
        theirs = flax.get((dt, shape, src), (0, 0))[1]
        L.append(f"| {_shape(dt, shape)} | {count} | {mib(n)} | {mib(theirs)} | "
                 f"{short(src, examples)} |")  # fmt: skip
    if result["note"]:
        L += ["", f"autocast_report: {result['note']}"]
    return L + [""]


def section(args, models: list[Model], results: dict, skipped: list, elapsed: float) -> str:
    cmd = "python -m benchmarks real-models" + (" --tiny" if args.tiny else "")
    cmd += f" --flax-examples {args.flax_examples}" if args.flax_examples else ""
    L = [START, "## Autocast on real models: saved residuals beside Flax's module dtype "
         "(`benchmarks/real_models.py`)", "",
         *header(cmd, elapsed, ("jax", "flax", "transformers")),
         "- every variant from the same float32 parameters, batch and dropout key, a train "
         "step (dropout on) with a float32 cross-entropy; residuals: bytes saved for the "
         "backward pass (`saved_residuals`, arguments excluded); grad cosine to float32's "
         "(worst leaf in brackets). `benchmarks/README.md` defines the variants.", ""]  # fmt: skip
    summary = ["### Summary (issue #25: autocast's residuals <= Flax dtype=bfloat16's)", "",
               "| model | float32 MiB | autocast x float32 | Flax dtype x float32 | "
               "autocast x Flax | met |", "| --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    body: list[str] = []
    for model in models:
        result = results[model.name]
        base = sum(result["rows"]["float32"]["residuals"].values())
        r = {k: sum(row["residuals"].values()) / base for k, row in result["rows"].items()}
        ours, theirs = r["jamp.autocast bfloat16"], r["Flax dtype=bfloat16"]
        met = "yes" if ours <= theirs + 1e-9 else "**no**"
        summary.append(f"| {model.name} | {mib(base)} | {ours:.3f} | {theirs:.3f} | "
                       f"{ours / theirs:.3f} | {met} |")  # fmt: skip
        body += [f"### {model.name}: {model.describe}", "",
              "| variant | residual MiB (by dtype) | ratio to float32 | grad cosine [worst leaf] "
              "| loss |", "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
        for name in VARIANTS:
            row = result["rows"][name]
            total = sum(row["residuals"].values())
            cos = f"{row['cosine']:.5f} [{row['worst']:.4f}]" + ("" if row["finite"] else " NaN")
            body.append(f"| {name} | {mib(total)} ({by_dtype(row['residuals'])}) | "
                     f"{r[name]:.3f} | {cos} | {row['loss']:.5g} |")  # fmt: skip
        body += [""] + diagnosis(result, args.flax_examples)
    L += summary + [""] + body
    if skipped:
        L += ["### Not run", ""] + [f"- {name}: {why}" for name, why in skipped] + [""]
    return "\n".join(L + [END])


# --------------------------------------------------------------------------- the run


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--flax-examples", default="",
                    help="a checkout of flax's examples/ folder (lm1b, wmt, gemma)")  # fmt: skip
    ap.add_argument("--models", default=",".join(models.REAL),
                    help=f"comma-separated subset of {','.join(models.REAL)}")  # fmt: skip


def run(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    t0, s = time.perf_counter(), shapes(args.tiny)
    chosen, results, skipped = [], {}, []
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        if key not in models.REAL:
            raise SystemExit(
                f"--models: unknown model {key!r}; choose from {','.join(models.REAL)}"
            )
        try:
            model = models.REAL[key](s, args.flax_examples)
        except models.Skip as e:
            skipped.append((key, str(e)))
            log(f"{key}: skipped: {e}")
            continue
        log(f"{model.name}: {model.describe}")
        results[model.name] = measure(model, log)
        chosen.append(model)
    text = section(args, chosen, results, skipped, time.perf_counter() - t0)
    return emit(args, text, START, END)
