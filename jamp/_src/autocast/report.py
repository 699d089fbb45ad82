"""``jamp.debug.autocast_report``: which primitives an autocast function ran, under which
rule and in which dtype, and what its backward pass saves (``AutocastReport``).

The function is traced twice, never run: once with a ``Recorder`` in its ``Context``,
which every handler of the interpreter tells what it did, and once under ``jax.vjp``
for the residuals.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.typing import DTypeLike

from jamp._src.autocast.transform import check_fun, flattened, resolve, transform
from jamp._src.autocast.values import Recorder
from jamp._src.policy import Policy

__all__ = ["AutocastReport", "Residual", "autocast_report"]


@dataclasses.dataclass(frozen=True)
class Residual:
    """Values of one dtype, shape and source that the backward pass keeps.

    Attributes:
      dtype: the dtype they are saved in.
      shape: their shape.
      count: how many values of this dtype and shape the same source saves.
      nbytes: the bytes of all of them.
      source: what computed them: a primitive and the user's source line, as
        ``jax.ad_checkpoint.print_saved_residuals`` names it.
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    count: int
    nbytes: int
    source: str


@dataclasses.dataclass(frozen=True)
class AutocastReport:
    """Which primitives an autocast function ran, under which rule, in which dtype.

    Attributes:
      dtype: the low-precision dtype of the autocast.
      rows: ``(primitive, rule, dtype, count)`` tuples, sorted. ``dtype`` is
        the floating dtype the primitive computed in (its widest floating
        input after casting, else its first output's dtype).
      unknown: the primitives the table does not know; they ran as traced.
      residuals: what the backward pass of the autocast function saves (the
        arguments excluded), as ``Residual`` rows, largest first; ``()``
        when the function cannot be differentiated with respect to its array
        arguments (``residuals_note`` says why).
      residuals_note: why ``residuals`` is empty, or ``""``.
    """

    dtype: np.dtype
    rows: tuple[tuple[str, str, str, int], ...]
    unknown: tuple[str, ...]
    residuals: tuple[Residual, ...] = ()
    residuals_note: str = ""

    @property
    def residual_bytes(self) -> dict[str, int]:
        """``{dtype name: bytes}`` saved for the backward pass, arguments excluded."""
        out: dict[str, int] = {}
        for r in self.residuals:
            out[np.dtype(r.dtype).name] = out.get(np.dtype(r.dtype).name, 0) + r.nbytes
        return out

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """``{primitive: {dtype: count}}``."""
        out: dict[str, dict[str, int]] = {}
        for prim, _, dtype, count in self.rows:
            out.setdefault(prim, {})
            out[prim][dtype] = out[prim].get(dtype, 0) + count
        return out

    def __str__(self) -> str:
        header = ("primitive", "rule", "dtype", "count")
        body = [(p, r, d, str(c)) for p, r, d, c in self.rows]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(4)]

        def line(row: Sequence[str]) -> str:
            return "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()

        lines = [f"autocast report (low precision: {np.dtype(self.dtype).name})", line(header)]
        lines.append(line(["-" * w for w in widths]))
        lines.extend(line(row) for row in body)
        if self.unknown:
            lines.append(
                "unknown primitives (ran as traced, float32 for a float32 program): "
                + ", ".join(self.unknown)
            )
        lines.extend(_residual_lines(self))
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    if nbytes < 2**10:
        return f"{nbytes} B"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"


def _residual_lines(report: AutocastReport) -> list[str]:
    if report.residuals_note:
        return ["", f"saved for the backward pass: not computed ({report.residuals_note})"]
    totals = ", ".join(f"{name} {_mib(n)}" for name, n in report.residual_bytes.items())
    lines = ["", f"saved for the backward pass (arguments excluded): {totals or 'nothing'}"]
    header = ("dtype", "shape", "count", "bytes", "source")
    body = [
        (np.dtype(r.dtype).name, str(r.shape), str(r.count), _mib(r.nbytes), r.source)
        for r in report.residuals
    ]
    if body:
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(4)]
        for row in [header, *body]:
            cells = [cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)]
            lines.append("  ".join([*cells, row[4]]).rstrip())
    return lines


def _check_report_keywords(fun: Callable, args: tuple, kwargs: dict, **own: object) -> None:
    """A clear error when ``fun`` needs a ``dtype``/``policy`` the report took."""
    try:
        signature = inspect.signature(fun)
        bound = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature, or a call error fun will report
        return
    for name, value in own.items():
        param = signature.parameters.get(name)
        if (
            value is not None
            and param is not None
            and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
            and param.default is param.empty
            and name not in bound
        ):
            raise TypeError(
                f"Expected the argument `{name}` of `fun` to be given, got only "
                f"autocast_report's own `{name}=` (the autocast {name}) instead. Bind "
                f"fun's argument first: jamp.debug.autocast_report(functools.partial(fun, "
                f"{name}=...), *args, {name}=...)."
            )


def autocast_report(
    fun: Callable,
    *args: Any,
    dtype: DTypeLike | None = None,
    policy: Policy | str | None = None,
    **kwargs: Any,
) -> AutocastReport:
    """Traces ``autocast(fun)`` on the arguments and reports what ran in which dtype.

    Nothing is executed: the function is traced (twice: once as it is, once
    under ``jax.vjp``). The report counts, per primitive, the rule applied and
    the dtype it computed in, lists the primitives the table does not know
    (they ran as traced), and lists every value the backward pass saves with
    its dtype, shape, bytes and source line (``residuals``, the arguments
    excluded, with respect to every array argument). It is the tool to reach
    for when numerics look wrong, or memory high, under autocast.

    ``dtype=`` and ``policy=`` always belong to the report, never to ``fun``.
    To pass ``fun`` keyword arguments with those names, bind them first:
    ``autocast_report(functools.partial(fun, dtype=jnp.int32), x,
    dtype=jnp.float16)``. When ``fun`` requires such an argument and only the
    report's keyword is given, a ``TypeError`` says so.

    Args:
      fun: the function, as it would be passed to [`autocast`][jamp.autocast].
      *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      dtype: the low-precision dtype, as in [`autocast`][jamp.autocast]; ``"float8"``
        reports float8 products as ``dot_general`` in ``float8_e4m3fn``
        (with current scaling; delayed scaling runs the same dtypes).
      policy: optional policy, as in [`autocast`][jamp.autocast].
      **kwargs: its other keyword arguments.

    Returns:
      An [`AutocastReport`][jamp.debug.AutocastReport]; ``print`` it for a table.

    Raises:
      TypeError: as [`autocast`][jamp.autocast], or ``fun`` requires an argument named
        ``dtype`` or ``policy`` that only the report's own keyword supplies.
      ValueError: as [`autocast`][jamp.autocast].

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> report = jamp.debug.autocast_report(
      ...     lambda x: jax.nn.softmax(x @ x), jnp.ones((2, 2)), dtype=jnp.float16)
      >>> report.counts["dot_general"], report.counts["exp"]
      ({'float16': 1}, {'float32': 1})
      >>> sorted(report.residual_bytes)  # saved for the backward pass
      ['float16', 'float32']
    """
    check_fun(fun, "debug.autocast_report")
    _check_report_keywords(fun, args, kwargs, dtype=dtype, policy=policy)
    low, policy, float8 = resolve(dtype, policy)
    recorder = Recorder()
    wrapped = transform(fun, low, policy, recorder, float8)
    flat, dynamic = flattened(wrapped, args, kwargs, shapes=True)
    jax.make_jaxpr(flat)(*dynamic)
    rows = tuple(
        (prim, rule, dt, count) for (prim, rule, dt), count in sorted(recorder.counts.items())
    )
    residuals, note = _residuals(transform(fun, low, policy, None, float8), args, kwargs)
    return AutocastReport(
        dtype=low,
        rows=rows,
        unknown=tuple(sorted(recorder.unknown)),
        residuals=residuals,
        residuals_note=note,
    )


def _residuals(wrapped: Callable, args: tuple, kwargs: dict) -> tuple[tuple[Residual, ...], str]:
    """What ``jax.vjp`` of ``wrapped`` saves, with respect to its array arguments, which
    are excluded (as ``jax.ad_checkpoint.print_saved_residuals`` lists them)."""
    try:
        from jax._src.ad_checkpoint import saved_residuals
    except ImportError:  # pragma: no cover - depends on the jax version
        return (), "jax.ad_checkpoint.saved_residuals is not available in this jax"
    flat, dynamic = flattened(wrapped, args, kwargs, shapes=True)
    try:
        saved = saved_residuals(flat, *dynamic)
    except (TypeError, ValueError, NotImplementedError) as e:  # e.g. no derivative rule
        return (), (str(e).strip().splitlines() or [type(e).__name__])[0]
    groups: dict[tuple[str, tuple[int, ...], str], int] = {}
    for aval, source in saved:
        # jax types the residuals' avals as AbstractValue, which declares no dtype or shape
        dtype, shape = getattr(aval, "dtype", None), getattr(aval, "shape", ())
        if source.startswith("from the argument") or not hasattr(aval, "dtype"):
            continue
        key = (np.dtype(dtype).name, tuple(shape), source)
        groups[key] = groups.get(key, 0) + 1
    rows = [
        Residual(
            dtype=np.dtype(dt),
            shape=shape,
            count=count,
            nbytes=count * int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize,
            source=source,
        )
        for (dt, shape, source), count in groups.items()
    ]
    rows.sort(key=lambda r: (-r.nbytes, r.source))
    return tuple(rows), ""
