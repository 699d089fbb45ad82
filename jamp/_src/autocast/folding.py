"""The small constants autocast computes when it traces ``fun``, computed in NumPy where
NumPy's result is XLA's bit for bit.

The interpreter computes an equation of constants when ``fun`` is traced (its
``_foldable``: a mask's arithmetic, ``jnp.sqrt(head_dim)``), so that the constant rule
sees the value. jax runs such an equation as a program of its own, compiled once per
primitive, shape and dtype: transformers' Flax GPT-2 has 34 of them, about half of its
autocast trace (0.7 of 1.4 s, jax 0.12.1). The structural operations, comparisons,
logic, selections, integer arithmetic and float32 ``+``, ``-``, ``*`` below have one
exact result (IEEE's, rounded once to nearest even), which NumPy gives without a
compile. Anything else is left to jax (``None``): other floating arithmetic (a square
root, a division, a transcendental: the backend's own), half-precision arithmetic, a
conversion from a float but to an integer in range, an operand or a result holding a
subnormal (XLA:CPU reads and writes it as zero, in a comparison too), a PRNG key, and an
output jax types weakly (``weak_type``: a NumPy array is strongly typed).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp._src.types import is_tracer

# Set by the interpreter around an equation it computes when tracing.
FOLDING: contextvars.ContextVar[bool] = contextvars.ContextVar("jamp_folding", default=False)

# The operands an operation is exact on: any dtype (it rounds nothing), integers (and
# bools), or integers and float32 (IEEE's rounding to nearest even: one rounding in
# XLA's kernels and NumPy's alike; subnormals are refused before and after).
_ANY, _INT, _F32 = "any", "int", "float32"


def _is_int(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.integer) or dtype == np.bool_


def _broadcast(x: np.ndarray, shape: Sequence[int], broadcast_dimensions: Sequence[int],
               **_: Any) -> np.ndarray:  # fmt: skip
    expanded = [1] * len(shape)
    for axis, size in zip(broadcast_dimensions, x.shape, strict=True):
        expanded[axis] = size
    return np.broadcast_to(x.reshape(expanded), tuple(shape))


def _iota(dtype: Any, shape: Sequence[int], dimension: int, **_: Any) -> np.ndarray:
    along = [1] * len(shape)
    along[dimension] = shape[dimension]
    return np.broadcast_to(np.arange(shape[dimension], dtype=dtype).reshape(along), shape)


def _convert(x: np.ndarray, new_dtype: Any, **_: Any) -> np.ndarray | None:
    new = np.dtype(new_dtype)
    if _is_int(x.dtype):  # an integer's float32 (or float64) rounds to nearest even in both
        return x.astype(new) if _is_int(new) or new in (np.float32, np.float64) else None
    if _is_int(new) and new != np.bool_ and np.all(np.isfinite(x)):
        info = np.iinfo(new)  # in range, both truncate toward zero
        if np.all((x >= info.min) & (x < float(info.max) + 1)):
            return x.astype(new)
    return None  # a float to a float or a bool, NaN, out of range: XLA's own


def _select(which: np.ndarray, *cases: np.ndarray) -> np.ndarray:
    return np.choose(which.astype(np.intp), cases)


# primitive name: (the operands it is exact on: _ANY, _INT or _F32; NumPy's computation)
_TABLE: Mapping[str, tuple[Any, Callable[..., Any]]] = {
    "broadcast_in_dim": (_ANY, _broadcast),
    "reshape": (_ANY, lambda x, new_sizes, **_: x.reshape(tuple(new_sizes))),
    "squeeze": (_ANY, lambda x, dimensions, **_: np.squeeze(x, tuple(dimensions))),
    "transpose": (_ANY, lambda x, permutation, **_: np.transpose(x, permutation)),
    "rev": (_ANY, lambda x, dimensions, **_: np.flip(x, tuple(dimensions))),
    "concatenate": (_ANY, lambda *xs, dimension, **_: np.concatenate(xs, axis=dimension)),
    "slice": (
        _ANY,
        lambda x, start_indices, limit_indices, strides, **_: x[
            tuple(
                slice(a, b, s)
                for a, b, s in zip(
                    start_indices, limit_indices, strides or [1] * x.ndim, strict=True
                )
            )
        ],
    ),
    "iota": (_ANY, _iota),
    "copy": (_ANY, lambda x, **_: x),
    "copy_p": (_ANY, lambda x, **_: x),
    "convert_element_type": (_ANY, _convert),
    "select_n": (_ANY, _select),
    "eq": (_ANY, lambda x, y, **_: np.equal(x, y)),
    "ne": (_ANY, lambda x, y, **_: np.not_equal(x, y)),
    "lt": (_ANY, lambda x, y, **_: np.less(x, y)),
    "le": (_ANY, lambda x, y, **_: np.less_equal(x, y)),
    "gt": (_ANY, lambda x, y, **_: np.greater(x, y)),
    "ge": (_ANY, lambda x, y, **_: np.greater_equal(x, y)),
    "neg": (_ANY, lambda x, **_: np.negative(x)),
    "and": (_INT, lambda x, y, **_: np.bitwise_and(x, y)),
    "or": (_INT, lambda x, y, **_: np.bitwise_or(x, y)),
    "xor": (_INT, lambda x, y, **_: np.bitwise_xor(x, y)),
    "not": (_INT, lambda x, **_: np.invert(x)),
    "add": (_F32, lambda x, y, **_: np.add(x, y)),
    "sub": (_F32, lambda x, y, **_: np.subtract(x, y)),
    "mul": (_F32, lambda x, y, **_: np.multiply(x, y)),
    "max": (_INT, lambda x, y, **_: np.maximum(x, y)),
    "min": (_INT, lambda x, y, **_: np.minimum(x, y)),
}


def _subnormal(x: np.ndarray) -> bool:
    if not np.issubdtype(x.dtype, np.floating):
        return False
    tiny = np.asarray(jnp.finfo(x.dtype).tiny, x.dtype)
    with np.errstate(all="ignore"):
        return bool(np.any((x != 0) & (np.abs(x) < tiny)))


def fold(
    primitive: Any, vals: Sequence[Any], params: Mapping[str, Any], outs: Sequence[Any]
) -> list[np.ndarray] | None:
    """``primitive`` on the concrete ``vals``, computed in NumPy: its outputs, each of the
    dtype and shape of ``outs`` (the equation's output avals), or ``None`` where jax
    computes it (not in the table, not exact on these dtypes, typed weakly)."""
    entry = _TABLE.get(primitive.name)
    if entry is None or primitive.multiple_results or len(outs) != 1:
        return None
    exact_on, compute = entry
    aval = outs[0]
    if params.get("sharding") is not None or aval.weak_type or params.get("weak_type"):
        return None  # a weak type is jax's to give (a NumPy array is strongly typed)
    if any(is_tracer(x) for x in vals):
        return None
    if any(jnp.issubdtype(getattr(x, "dtype", float), jax.dtypes.extended) for x in vals):
        return None  # a PRNG key
    # A weakly typed literal (jax 0.12's TypedFloat) as the dtype it stands for.
    arrays = [np.asarray(x, dtype=getattr(x, "dtype", None)) for x in vals]
    operands = arrays[1:] if primitive.name == "select_n" else arrays
    if len({x.dtype for x in operands}) > 1:
        return None  # jax's operands share a dtype: leave anything else to jax
    if exact_on == _INT and not all(_is_int(x.dtype) for x in operands):
        return None
    if exact_on == _F32 and not all(_is_int(x.dtype) or x.dtype == np.float32 for x in operands):
        return None
    if any(_subnormal(x) for x in arrays):
        return None  # XLA:CPU reads a subnormal as zero (its comparisons too)
    with np.errstate(all="ignore"):  # integer arithmetic wraps, as XLA's does
        out = compute(*arrays, **params)
    if out is None:
        return None
    out = np.array(out, order="C")  # owned, writable, C order (a broadcast is a view)
    if out.shape != tuple(aval.shape) or out.dtype != np.dtype(aval.dtype) or _subnormal(out):
        return None  # XLA:CPU flushes a subnormal result to zero
    return [out]
