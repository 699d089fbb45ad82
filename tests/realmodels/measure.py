"""The real-model accuracy gate: measure, compare with the table, rewrite the table.

``python -m tests.realmodels.measure`` (from the repository root) measures every model of
``_models.py`` and prints each figure beside the table's; ``--write`` rewrites this jax
version's column of ``accuracy_table.json`` (run it under every jax version CI runs, and
say why in the commit). ``tests/realmodels/test_accuracy_gate.py`` runs the same
measurement and fails when a figure is worse than the table's beyond the tolerance.

Every variant runs under ``jax.jit`` from the same float32 parameters and batch:
``float32`` (the model as written, the reference), ``autocast <dtype>``
(``jamp.autocast(loss, dtype)`` of the float32 model) and ``dtype= <dtype>`` (the model
built with its own ``dtype=``, float32 parameters; only where it has one). Float16 runs
with a static loss scale of ``2**12`` (the gradient of ``loss * 2**12``, divided by it in
float32), as a float16 step is run: without it, the smallest cotangents flush to zero.
The figures, each "lower is better":

- ``grad_rel_err``: ``||g - g32|| / ||g32||`` over the whole gradient, flattened;
- ``loss_rel_err``: ``|L - L32| / |L32|``;
- ``residual_ratio``: the bytes saved for the backward pass (``saved_residuals``, the
  arguments excluded) over float32's;
- ``negative_losses`` (the cross-entropy head only): how many of its 50 draws give a
  negative loss under ``jax.jit``; its errors are over all draws at once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jamp
from benchmarks.measure import finite, flat, rel_err, residual_bytes

from . import _models

TABLE = Path(__file__).with_name("accuracy_table.json")
COMMAND = "python -m tests.realmodels.measure --write"
BF16, F16 = jnp.bfloat16, jnp.float16
HALF = {"bfloat16": BF16, "float16": F16}
LOSS_SCALE = {"bfloat16": 1.0, "float16": 2.0**12}
CE_HEAD = "ce_head"
NAMES = (*_models.MODELS, CE_HEAD)

# A figure fails when it exceeds the table's by more than RELATIVE of it plus its ABSOLUTE
# slack: the errors' slack lets a figure below about 1e-5 move by 1e-6 (float32's own
# rounding), a count of negative losses never grows past 10%, byte ratios are exact.
RELATIVE = 0.10
ABSOLUTE = {"grad_rel_err": 1e-6, "loss_rel_err": 1e-6, "residual_ratio": 0.0,
            "negative_losses": 0.0}  # fmt: skip


# jamp's own variants: what the gate holds (test_accuracy_gate.py). The ``dtype=`` ones are
# Flax's and transformers' own mixed precision, the anchor the table records beside them
# (measured and written by the command line, compared in the docs), not jamp's to gate.
GATED = ("autocast bfloat16", "autocast float16")


def variants(name: str, anchors: bool = True) -> tuple[str, ...]:
    """The variants measured on ``name``: jamp's, and with ``anchors`` the ``dtype=`` ones
    where the model has the argument."""
    out = GATED
    if anchors and name != CE_HEAD and case(name).loss_at is not None:
        out += ("dtype= bfloat16", "dtype= float16")
    return out


@functools.cache
def case(name: str) -> _models.Case:
    return _models.MODELS[name]()


def _variant_loss(c: _models.Case, variant: str):
    if variant == "float32":
        return c.loss
    kind, half = variant.split(" ")
    if kind == "autocast":
        return jamp.autocast(c.loss, HALF[half])
    assert c.loss_at is not None
    return c.loss_at(HALF[half])


@contextlib.contextmanager
def _promotion(c: _models.Case, variant: str):
    """Flax's own ``dtype=`` modules mix dtypes inside their code (BatchNorm's float32
    statistics with a bfloat16 activation), and transformers' models broadcast ranks too,
    which the suite's strict promotion rejects: those run under jax's defaults (standard
    dtype promotion, rank promotion allowed), which change no value. The rest stays strict."""
    with contextlib.ExitStack() as stack:
        if c.default_promotion or variant.startswith("dtype="):
            stack.enter_context(jax.numpy_dtype_promotion("standard"))
        if c.default_promotion:
            stack.enter_context(jax.numpy_rank_promotion("allow"))
        yield


def _step(loss, scale: float):
    return jax.jit(jax.value_and_grad(lambda p, b: loss(p, b) * scale))


def _unscaled(value, grads, scale: float) -> tuple[float, np.ndarray]:
    g = np.concatenate(flat(grads)) / scale
    return float(value) / scale, g


@functools.cache
def run(name: str, variant: str) -> dict:
    """The loss, the flattened gradient (float64) and the residual bytes of one variant."""
    c = case(name)
    scale = LOSS_SCALE.get(variant.split(" ")[-1], 1.0)
    with _promotion(c, variant):
        loss = _variant_loss(c, variant)
        value, grads = _step(loss, scale)(c.params, c.batch)
        nbytes = sum(residual_bytes(loss, c.params, c.batch).values())
    assert finite(grads), (name, variant)
    value, g = _unscaled(value, grads, scale)
    return dict(loss=value, grad=g, bytes=nbytes)


@functools.cache
def ce_runs(variant: str) -> dict:
    """The cross-entropy head over its draws: the loss of ``jax.jit(loss)``, as the issue
    ran it, and the gradient of the jitted step, each one compiled function for all draws."""
    loss = lambda p, b: _models.ce_head(b[0], *p, b[1])  # noqa: E731
    if variant != "float32":
        loss = jamp.autocast(loss, HALF[variant.split(" ")[1]])
    scale = LOSS_SCALE.get(variant.split(" ")[-1], 1.0)
    value_of, step = jax.jit(loss), _step(loss, scale)
    values, grads = [], []
    for seed in range(_models.CE_DRAWS):
        params, batch = _models.ce_draw(seed)
        values.append(float(value_of(params, batch)))
        grads.append(_unscaled(*step(params, batch), scale)[1])
    params, batch = _models.ce_draw(0)
    nbytes = sum(residual_bytes(loss, params, batch).values())
    return dict(loss=np.asarray(values), grad=np.concatenate(grads), bytes=nbytes)


def figures(name: str, variant: str) -> dict[str, float]:
    """``figure -> value`` of one variant against float32's."""
    get = ce_runs if name == CE_HEAD else functools.partial(run, name)
    ref, got = get("float32"), get(variant)
    out = dict(
        grad_rel_err=rel_err(got["grad"], ref["grad"]),
        loss_rel_err=rel_err(got["loss"], ref["loss"]),
        residual_ratio=got["bytes"] / ref["bytes"],
    )
    if name == CE_HEAD:
        out["negative_losses"] = int(np.sum(got["loss"] < 0))
    return out


def measure(name: str, anchors: bool = True) -> dict[str, dict[str, float]]:
    return {v: figures(name, v) for v in variants(name, anchors)}


# --------------------------------------------------------------------------- the table


def jax_key(version: str | None = None) -> str:
    """The table's column for a jax version: its minor release (``jax 0.12``)."""
    return "jax " + ".".join((version or jax.__version__).split(".")[:2])


def load(path: Path = TABLE) -> dict:
    return json.loads(path.read_text())


def gate(columns: dict[str, float], key: str) -> float:
    """A figure's gate under the jax version ``key``: its column, or, for a jax version
    the table lacks, the worst of the columns."""
    return columns[key] if key in columns else max(columns.values())


def allowed(figure: str, value: float) -> float:
    """The largest value of ``figure`` that passes against a gate of ``value``."""
    return value * (1 + RELATIVE) + ABSOLUTE[figure]


def regressions(
    name: str, measured: dict, table: dict, key: str | None = None, anchors: bool = True
) -> list[str]:
    """What fails against the table under jax version ``key`` (this one's by default): a
    figure worse than allowed, one the table lacks, or one the table has but was not
    measured (without ``anchors``, of jamp's variants only)."""
    key = key or jax_key()
    rows, out = table["rows"].get(name, {}).get("variants", {}), []
    for variant, figs in measured.items():
        for figure, value in figs.items():
            columns = rows.get(variant, {}).get(figure)
            where = f"{name} / {variant} / {figure}: {value:.4g}"
            if not columns:
                out.append(f"{where}, not in the table (re-measure: {COMMAND})")
                continue
            g = gate(columns, key)
            if not value <= allowed(figure, g):  # a NaN fails too
                col = key if key in columns else "the worst column"
                out.append(f"{where}, worse than the table's {g:.4g} ({col}; allowed up to "
                           f"{allowed(figure, g):.4g})")  # fmt: skip
    for variant, figs in rows.items():
        if not anchors and variant not in GATED:
            continue
        out += [f"{name} / {variant} / {figure}: in the table, no longer measured "
                f"(re-measure: {COMMAND})" for figure in figs
                if figure not in measured.get(variant, {})]  # fmt: skip
    return out


def _describe(name: str) -> str:
    if name == CE_HEAD:
        return (f"`optax.softmax_cross_entropy_with_integer_labels(3 * (x @ w + b), t).mean()`"
                f", x (16, 8), w (8, 4) * 4, b (4,) ~ N(0, 1) from "
                f"`np.random.default_rng(seed)`, t = argmax(x @ w + b); {_models.CE_DRAWS} "
                "draws (seeds 0 to 49), one jitted function; the gradient is over (w, b)"
                )  # fmt: skip
    c = case(name)
    return f"{c.name}: {c.describe}"


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {d: version(d) for d in ("jax", "jaxlib", "flax", "equinox", "optax", "transformers")}
    return {"python": platform.python_version(), **out}


def write(measured: dict[str, dict], path: Path = TABLE) -> dict:
    """This jax version's column of ``measured``'s rows rewritten; the rest kept."""
    table = load(path) if path.exists() else {}
    key = jax_key()
    rows = table.get("rows", {})
    for name, per_variant in measured.items():
        row = rows.setdefault(name, {})
        row["model"] = _describe(name)
        old = row.get("variants", {})
        row["variants"] = {}
        for variant, figs in per_variant.items():
            entry = {}
            for figure, value in figs.items():
                columns = dict(old.get(variant, {}).get(figure, {}))
                columns[key] = _round(value)
                entry[figure] = dict(sorted(columns.items()))
            row["variants"][variant] = entry
    table = {
        "about": (
            "jamp's real-model accuracy gate (tests/realmodels): each figure of each model "
            "and variant, one column per jax minor version measured (`measured_with` says "
            "with what). tests/realmodels/test_accuracy_gate.py fails when a figure "
            "measured now exceeds gate * (1 + relative) + absolute[figure], the gate being "
            "the figure's column for the running jax, or the worst column for a jax the "
            "table lacks; improvements pass. Rewrite a jax version's column with "
            f"`{COMMAND}` under that version, in a commit that says why. "
            "tests/realmodels/measure.py defines the figures."
        ),
        "tolerance": {"relative": RELATIVE, "absolute": ABSOLUTE},
        "measured_with": dict(sorted({**table.get("measured_with", {}), key: _versions()}.items())),
        "rows": {n: rows[n] for n in NAMES if n in rows},
    }
    text = json.dumps(table, indent=1)  # each figure's columns on one line:
    text = re.sub(r'\{\n\s*("jax [^{}]*?)\n\s*\}',
                  lambda m: "{" + re.sub(r",\n\s*", ", ", m.group(1)) + "}", text)  # fmt: skip
    path.write_text(text + "\n")
    return table


def _round(value: float) -> float:
    return int(value) if isinstance(value, int) else float(f"{value:.4g}")


# --------------------------------------------------------------------------- the command line


def _environment() -> None:
    """The suite's XLA flags (tests/conftest.py), so a figure measured here is the one the
    gate measures: the CPU backend, -O0 code, the 8 virtual devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in ("--xla_force_host_platform_device_count=8",
                 "--xla_backend_optimization_level=0"):  # fmt: skip
        if flag.split("=")[0] not in flags:
            flags += " " + flag
    os.environ["XLA_FLAGS"] = flags.strip()  # read when the backend starts
    if "JAX_PLATFORMS" not in os.environ:  # jax read the variable when imported
        jax.config.update("jax_platforms", "cpu")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.realmodels.measure", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--write", action="store_true",
                    help="rewrite this jax version's column of the table")  # fmt: skip
    ap.add_argument("--models", default=",".join(NAMES), help="comma-separated subset")
    args = ap.parse_args(argv)
    _environment()
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as the suite runs
    jax.config.update("jax_numpy_rank_promotion", "raise")
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {','.join(NAMES)}")
    table, key = load() if TABLE.exists() else {"rows": {}}, jax_key()
    measured, failed = {}, []
    for name in names:
        t0 = time.perf_counter()
        measured[name] = measure(name)
        print(f"{name} ({time.perf_counter() - t0:.1f} s)")
        for variant, figs in measured[name].items():
            old = table["rows"].get(name, {}).get("variants", {}).get(variant, {})
            cells = [f"{f} {v:.4g}" + (f" [table {gate(old[f], key):.4g}]" if f in old else "")
                     for f, v in figs.items()]  # fmt: skip
            print(f"  {variant}: " + ", ".join(cells))
        failed += regressions(name, measured[name], table)
    if args.write:
        write(measured)
        print(f"wrote {TABLE} ({jax_key()})")
    elif failed:
        print("worse than the table:\n  " + "\n  ".join(failed))
    return 0 if args.write or not failed else 1


if __name__ == "__main__":
    sys.exit(main())
