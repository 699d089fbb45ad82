"""Leaf utilities shared by scaling, the finite checks and the report.

Which leaves of a pytree are floating (scaled, unscaled, checked) and which
pass through, how a Python number becomes an array, and the per-leaf
multiplies of ``scale`` and ``unscale``. Imports only jax and numpy.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import KeyPath
from jax.typing import ArrayLike, DTypeLike

from jamp._src.types import Filter, PyTree

FLOAT = "float"  # a leaf that is scaled, unscaled and checked
PASS = "pass"  # a leaf returned as it is (integer, boolean, float0)


def is_real_number(x: object) -> TypeGuard[numbers.Real]:
    """A Python (or NumPy) real number, not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_integer(x: object) -> TypeGuard[numbers.Integral]:
    """A Python (or NumPy) integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_float_dtype(dtype: DTypeLike) -> bool:
    """A floating or complex dtype, but not ``float0`` (the tangent type of integers)."""
    return jnp.issubdtype(dtype, jnp.inexact) and dtype != jax.dtypes.float0


def is_numeric_dtype(dtype: DTypeLike) -> bool:
    """A dtype JAX computes with: boolean, integer, floating, complex or ``float0``; not an
    object, string, bytes or datetime dtype (NumPy arrays may have those)."""
    dtype = np.dtype(dtype)
    return (
        dtype == jax.dtypes.float0
        or jnp.issubdtype(dtype, jnp.bool_)
        or jnp.issubdtype(dtype, jnp.number)
    )


def is_half(dtype: DTypeLike) -> bool:
    """A real floating dtype narrower than float32 (float16, bfloat16, float8...)."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def is_inexact_array(leaf: object) -> bool:
    """A floating or complex JAX/NumPy array: Equinox's ``eqx.is_inexact_array``."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) and is_float_dtype(leaf.dtype)


def selected(filter: Filter, leaf: object) -> bool:
    """Whether ``filter`` (``None``: every leaf) selects ``leaf``; a TypeError unless the
    filter answers with a bool (an array cannot say which leaves to take, and a traced
    one cannot be read at all)."""
    if filter is None:
        return True
    out = filter(leaf)
    if isinstance(out, (bool, np.bool_)):
        return bool(out)
    raise TypeError(
        f"Expected `filter` to return a bool for each leaf (as eqx.is_inexact_array does), got "
        f"{type(out).__name__}{_shape_of(out)} for a leaf of type {type(leaf).__name__} "
        "instead; return a Python bool that says whether to take the leaf."
    )


def _shape_of(x: object) -> str:
    shape = getattr(x, "shape", None)
    return "" if shape is None else f" of shape {tuple(shape)}"


def leaf_kind(path: jax.tree_util.KeyPath, leaf: PyTree, fn: str) -> str:
    """Classify a leaf: ``FLOAT`` (scaled, checked) or ``PASS`` (returned as is).

    Raises a TypeError naming the path and the public function ``fn`` for
    anything that is not an array or a number.
    """
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or hasattr(leaf, "__jax_array__"):
        if not is_numeric_dtype(leaf.dtype):
            raise TypeError(
                f"`jamp.{fn}` expected a pytree of numeric arrays, got an array of dtype "
                f"{np.dtype(leaf.dtype)} at path {jax.tree_util.keystr(path) or '<root>'} "
                "instead: its values (strings, Python objects) cannot be checked or scaled. "
                "Convert it to a numeric dtype, or leave it out with `filter`."
            )
        return FLOAT if is_float_dtype(leaf.dtype) else PASS
    if isinstance(leaf, bool) or isinstance(leaf, numbers.Integral):
        return PASS
    if isinstance(leaf, (float, complex)):
        return FLOAT
    raise TypeError(
        f"`jamp.{fn}` expected a pytree of arrays, got a leaf of type "
        f"{type(leaf).__name__} at path {jax.tree_util.keystr(path) or '<root>'} "
        f"({leaf!r:.60}) instead. To leave such leaves untouched (an Equinox module's "
        "functions), pass filter=eqx.is_inexact_array."
    )


def as_array(x: ArrayLike) -> jax.Array:
    """A leaf as an array: a Python float as float32 (complex as complex64), as
    in PyTorch; a NumPy scalar (``np.float64(1.5)``) keeps its dtype."""
    if isinstance(x, (float, complex)) and not isinstance(x, np.generic):
        x = jnp.asarray(x, dtype=jnp.float32 if isinstance(x, float) else jnp.complex64)
    return jnp.asarray(x)


def scale_leaf(x: ArrayLike, s: jax.Array) -> jax.Array:
    """``x * s`` in ``x``'s dtype; a 0-d half-precision leaf (a loss) comes back float32."""
    x = as_array(x)
    if is_half(x.dtype):
        prod = x.astype(jnp.float32) * s
        # A 0-d half loss comes back float32 (torch's promotion of a 0-d
        # tensor against the float32 scale), so the scaled loss cannot overflow.
        return prod if x.ndim == 0 else prod.astype(x.dtype)
    return x * s.astype(x.dtype)


def unscale_leaf(x: ArrayLike, inv: jax.Array) -> jax.Array:
    """``x * inv`` in ``x``'s dtype, rounded once, exactly as torch's unscale kernel."""
    x = as_array(x)
    if is_half(x.dtype):
        # torch: round_to_dtype(float(x) * inv_scale): float32 arithmetic, one rounding.
        return (x.astype(jnp.float32) * inv).astype(x.dtype)
    return x * inv.astype(x.dtype)


def explicit_sharding(like: PyTree) -> jax.sharding.NamedSharding | None:
    """The sharding in ``like``'s type under JAX's explicit sharding mode, else ``None``.

    ``like`` is an array, a tracer or a ``ShapeDtypeStruct``. In the default
    (auto) mode, and outside a mesh, types carry no sharding: ``None``.
    """
    if isinstance(like, jax.ShapeDtypeStruct):
        sharding = like.sharding
    else:
        sharding = getattr(jax.typeof(like), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return sharding
    return None


def is_sharded(like: PyTree) -> bool:
    """Whether ``like``'s type shards some dimension (JAX's explicit sharding mode)."""
    sharding = explicit_sharding(like)
    return sharding is not None and any(p is not None for p in sharding.spec)


def map_floating(
    fn: Callable[[ArrayLike], ArrayLike], tree: PyTree, name: str, filter: Filter = None
) -> PyTree:
    """Apply ``fn`` to every floating leaf ``filter`` selects; pass the others through."""

    def visit(path: jax.tree_util.KeyPath, leaf: PyTree) -> PyTree:
        if selected(filter, leaf) and leaf_kind(path, leaf, name) == FLOAT:
            return fn(leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(visit, tree)


def float_leaves(tree: PyTree, fn: str, filter: Filter = None) -> list[jax.Array]:
    """The floating leaves of ``tree`` that ``filter`` selects, as arrays, as ``unscale``
    sees them."""
    leaves: list[jax.Array] = []

    def visit(path: jax.tree_util.KeyPath, leaf: PyTree) -> None:
        if selected(filter, leaf) and leaf_kind(path, leaf, fn) == FLOAT:
            leaves.append(as_array(leaf))

    jax.tree_util.tree_map_with_path(visit, tree)
    return leaves


def partition(tree: PyTree, filter: Filter) -> tuple[PyTree, PyTree]:
    """``(chosen, rest)``: ``tree`` with ``None`` where ``filter`` is False, and with
    ``None`` where it is True (Equinox's ``eqx.partition``)."""
    chosen = jax.tree_util.tree_map(lambda x: x if selected(filter, x) else None, tree)
    rest = jax.tree_util.tree_map(lambda x: None if selected(filter, x) else x, tree)
    return chosen, rest


def combine(chosen: PyTree, rest: PyTree) -> PyTree:
    """The tree ``partition`` split: each leaf from ``chosen``, else from ``rest``."""
    return jax.tree_util.tree_map(
        lambda a, b: b if a is None else a, chosen, rest, is_leaf=lambda x: x is None
    )


def find_nodes(tree: PyTree, kind: type | tuple[type, ...]) -> list[tuple[KeyPath, Any]]:
    """Every node of ``tree`` that is a ``kind`` (a state class), with its path, in
    ``tree_flatten`` order; a node of ``kind`` is not searched further."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, kind))
    return [(path, x) for path, x in flat if isinstance(x, kind)]
