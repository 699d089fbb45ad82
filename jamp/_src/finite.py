"""Finite checks fused into the step, and tree selection.

The check reads each gradient once. On GPUs and TPUs that read is the
cheapest full reduction XLA has, a float32 sum per leaf: a finite total
proves every element finite (an inf or NaN anywhere makes any sum inf or
NaN), and when the loss scale is >= 1, unscaling cannot overflow, so the
*unscaled* gradients are finite too. Only when that fast path fails (a real
overflow, a finite sum too large for float32, or a scale below 1) does an
exact ``all(isfinite)`` pass run, under a ``lax.cond``, so a clean step pays
for one read. A ``max|x|`` check would be no cheaper and drops NaN on XLA's
CPU backend; ``all(isfinite(x))`` writes a boolean array per leaf on the CPU
and costs 2-6x the sum (``benchmarks/FINDINGS.md``), except for float16
leaves: a CPU without float16 arithmetic converts every element for the sum,
so they take the exact check on the fast path too.

On a CPU (``_cpu_finite``) the one read is exact for almost every leaf: a
large float32 leaf is reduced to weighted row sums by a matrix-vector product
(``_rows``), which cannot overflow, and the rows and the small leaves are
checked element by element as one short vector. XLA:CPU tiles a large sum of
a gradient into slow ``reduce-window`` kernels and compiles every kernel at a
near-fixed cost; this form has no tiled sums and few kernels. Its exact
branch is left with the scale below 1, where ``max|x|`` of each large leaf
says whether unscaling overflows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jamp._src import loss_scale as ls

AxisName = Any  # an axis name (a str), or a tuple of them


def check_axis_name(axis_name: Any) -> Any:
    """``axis_name`` if it is ``None``, a str or a non-empty tuple of str, else a TypeError."""
    if axis_name is None or isinstance(axis_name, str):
        return axis_name
    if isinstance(axis_name, tuple) and axis_name and all(isinstance(a, str) for a in axis_name):
        return axis_name
    raise TypeError(
        "Expected `axis_name` to be the name of a shard_map/pmap axis (a str) or a tuple of "
        f"them, got {axis_name!r} instead."
    )


def _float_leaves(tree: Any, fn: str) -> list[Any]:
    leaves: list[Any] = []

    def visit(path: Any, leaf: Any) -> None:
        if ls.leaf_kind(path, leaf, fn) == "float":
            leaves.append(ls.as_array(leaf))  # as unscale sees it

    jax.tree_util.tree_map_with_path(visit, tree)
    return leaves


def _sum32(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.sum(jnp.real(x), dtype=jnp.float32) + jnp.sum(jnp.imag(x), dtype=jnp.float32)
    return jnp.sum(x, dtype=jnp.float32)


# The CPU check (_cpu_finite) sorts leaves by size, dtype and shape:
# - "small" leaves (fewer than _SMALL elements, of a dtype in _GATHERED) are
#   gathered into one vector per dtype;
# - "rows": float32 leaves of at least _SMALL elements whose last dimension is
#   within [_ROWS_MIN_COLS, _ROWS_MAX_COLS] are reduced to one weighted sum per
#   row by a matrix-vector product (_rows);
# - "half": other float16 leaves, whose non-finite flags are reduced (_exact);
# - "other": the rest (bfloat16, narrow float32, complex, float64 ...), summed.
_SMALL = 2**14
_ROWS_MIN_COLS = 32
_ROWS_MAX_COLS = 2**23
_GATHERED = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64)
# The product's weights: finite float32 values times 2**-40 cannot overflow a
# row's sum of at most 2**23 of them, whatever the order of the additions
# (their rounding grows the sum by less than 2x), so only an inf or NaN in the
# row makes its sum non-finite. A power of two: the products are the values,
# exactly, bar underflow to zero, which cannot hide an inf or NaN.
_DOT_WEIGHT = 2.0**-40


def _cpu_kind(x: jax.Array) -> str:
    if x.size < _SMALL and x.dtype in _GATHERED:
        return "small"
    if x.dtype == jnp.float32 and _ROWS_MIN_COLS <= x.shape[-1] <= _ROWS_MAX_COLS:
        return "rows"
    return "half" if x.dtype == jnp.float16 else "other"


def _unsharded(x: jax.Array) -> jax.Array:
    """``x`` replicated, if its type carries a sharding (JAX's explicit sharding mode).

    There, joining or flattening parts sharded differently is a type error, so
    the short parts of the CPU check (rows, small leaves) are gathered first:
    under the default (auto) mode XLA gathers them just the same.
    """
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is None or all(p is None for p in spec):
        return x
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec())


def _rows(x: jax.Array) -> jax.Array:
    """One float32 per row of ``x``: non-finite exactly where the row holds an inf or NaN.

    XLA:CPU splits a large sum of a computed value (a gradient) into 32x32
    ``reduce-window`` tiles that read memory across rows, several times slower
    than the same sum of a parameter: most of what a loss-scaled MLP step cost
    over a plain one. A product with a vector of ``2**-40`` over the last
    dimension reads the leaf once in the library's matrix kernels on every
    core (``benchmarks/FINDINGS.md``, section 10), and compiles to no kernel of
    its own. Contracting the last dimension without a reshape keeps a sharded
    leaf where it is.
    """
    weights = jnp.full((x.shape[-1],), _DOT_WEIGHT, jnp.float32)
    # HIGHEST: a user's jax_default_matmul_precision must not round the values.
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    rows = lax.dot_general(x, weights, dims, precision=lax.Precision.HIGHEST)
    return jnp.ravel(_unsharded(rows))


def _gathered(leaves: list[jax.Array]) -> list[jax.Array]:
    """The small leaves as vectors: one per dtype, a complex one as its real and imaginary parts.

    Unscaling a complex leaf multiplies each part by the same float32 factor,
    so the parts overflow as float32 values would.
    """
    parts = []
    for dtype in sorted({x.dtype for x in leaves}, key=str):
        v = jnp.concatenate([jnp.ravel(_unsharded(x)) for x in leaves if x.dtype == dtype])
        complex_ = jnp.issubdtype(dtype, jnp.complexfloating)
        parts += [jnp.real(v), jnp.imag(v)] if complex_ else [v]
    return parts


def _exact(leaves: list[jax.Array]) -> jax.Array:
    """Whether every element of every leaf is finite: one pass per leaf.

    Each leaf's non-finite flags are reduced as a ``uint8`` max: XLA:CPU
    reduces booleans (``jnp.all``) through tiled ``reduce-window`` kernels,
    which run about 2x slower and compile to more kernels
    (``benchmarks/FINDINGS.md``, section 10).
    """
    flags = [jnp.max(jnp.logical_not(jnp.isfinite(x)).astype(jnp.uint8), initial=0) for x in leaves]
    return functools.reduce(jnp.maximum, flags, jnp.uint8(0)) == 0


def _extremes(x: jax.Array) -> list[jax.Array]:
    """The values of ``x`` whose unscaling overflows first: ``max(|x|)``, or its max and min.

    XLA:CPU reads a float32 leaf for ``max(|x|)`` where it lies, in one
    library kernel, with no temporary. For float16 it would write ``|x|``
    first, so a float16 leaf takes its max and its min: two kernels, no
    temporary.
    """
    # initial=0: an empty vector of small leaves has nothing to overflow.
    if x.dtype != jnp.float16:
        return [jnp.max(jnp.abs(x), initial=0)]
    return [jnp.max(x, initial=0), jnp.min(x, initial=0)]


def _unscaled_max_finite(leaves: list[jax.Array], inv: jax.Array) -> jax.Array:
    """Whether unscaling the finite real ``leaves`` by ``inv`` leaves them finite.

    Unscaling is monotone and odd, so each leaf's largest magnitude overflows
    first, if any value does; no elementwise pass over the leaf is needed.
    """
    ok = [jnp.isfinite(ls._unscale_leaf(v, inv)) for x in leaves for v in _extremes(x)]
    return functools.reduce(jnp.logical_and, ok, jnp.asarray(True))


def _after_all(leaves: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """``leaves`` such that reductions of them wait until all are computed.

    XLA:CPU would otherwise start each reduction as soon as its gradient
    exists, next to the backward pass's matrix products, which then lose a
    core (about 2% of an MLP step, ``benchmarks/FINDINGS.md``, section 9).
    Used on CPUs only: other platforms schedule as they see fit.
    """
    return lax.optimization_barrier(leaves)


def _cpu_finite(*leaves: jax.Array, inv: jax.Array | None = None) -> jax.Array:
    """The CPU check: exact from one read for all but "other" leaves.

    The rows of large float32 leaves (``_rows``), the small leaves and the
    float16 leaves' flags say exactly whether the leaves hold an inf or NaN;
    only "other" leaves are summed, so only their sum can overflow from finite
    values. XLA:CPU compiles each kernel in the check at a near-fixed cost,
    so the check's kernels are few: a product per large leaf (none compiled),
    one reduction over every small leaf and row, one per float16 or other
    leaf. The exact branch runs when the sum of "other" leaves is not finite,
    when the leaves are not, or when unscaling by ``inv > 1`` could overflow;
    it takes the largest magnitude of each large leaf and of each dtype's
    small leaves, and checks "other" leaves element by element.
    """
    leaves = _after_all(leaves)
    kinds = [_cpu_kind(x) for x in leaves]
    small, rows, half, other = (
        [x for x, k in zip(leaves, kinds, strict=True) if k == kind]
        for kind in ("small", "rows", "half", "other")
    )
    gathered = _gathered(small)
    # The rows and small leaves' values, as one vector with one reduction of
    # its flags, where a reduction per part would cost a compiled kernel or
    # three each (7-13 ms of compile apiece on XLA:CPU, FINDINGS section 12).
    # It holds one element per small-leaf element or large-leaf row: kilobytes.
    parts = [_rows(x) for x in rows] + [v.astype(jnp.float32) for v in gathered]
    vector = [jnp.concatenate(parts)] if parts else []
    raw = _exact(vector + half)
    if inv is None and not other:
        return raw
    fast = raw
    if other:
        fast = fast & jnp.isfinite(functools.reduce(jnp.add, [_sum32(x) for x in other]))
    if inv is None:
        return lax.cond(fast, lambda: fast, lambda: raw & _exact(other))
    fast = fast & (inv <= 1)

    def exact() -> jax.Array:
        return (
            raw
            & _unscaled_max_finite(rows + half + gathered, inv)
            & _exact([ls._unscale_leaf(x, inv) for x in other])
        )

    return lax.cond(fast, lambda: fast, exact)


def _fast(*leaves: jax.Array) -> jax.Array:
    """Whether the one-read check finds every leaf finite (platforms other than CPU).

    A finite float32 total proves every element finite; float16 leaves are
    checked exactly here too: on a CPU without float16 arithmetic, converting
    every element for a float32 sum costs 2-3x more than ``all(isfinite)``
    (``benchmarks/FINDINGS.md``, section 6).
    """
    half = [x for x in leaves if x.dtype == jnp.float16]
    rest = [x for x in leaves if x.dtype != jnp.float16]
    fast = jnp.asarray(True)
    if rest:
        fast = jnp.isfinite(functools.reduce(jnp.add, [_sum32(x) for x in rest]))
    if half:
        fast = fast & _exact(half)
    return fast


def _default_finite(*leaves: jax.Array, inv: jax.Array | None = None) -> jax.Array:
    """The check on other platforms: a float32 sum per leaf, and an exact branch."""
    fast = _fast(*leaves)
    if inv is None:
        leaves_to_check = lambda: leaves  # noqa: E731
    else:
        # |g * inv| <= |g| when inv <= 1: finite g stay finite once unscaled.
        fast = fast & (inv <= 1)
        leaves_to_check = lambda: [ls._unscale_leaf(x, inv) for x in leaves]  # noqa: E731
    # Both branches derive from the same leaves, so under shard_map they vary
    # over the same axes.
    return lax.cond(fast, lambda: fast, lambda: _exact(leaves_to_check()))


def _finite(leaves: list[jax.Array], inv: jax.Array | None = None) -> jax.Array:
    """Whether every leaf (times ``inv``, when given) is finite."""
    if not leaves:
        return jnp.asarray(True)
    return lax.platform_dependent(
        *leaves,
        cpu=functools.partial(_cpu_finite, inv=inv),
        default=functools.partial(_default_finite, inv=inv),
    )


def agree(finite: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """``finite`` on every replica of ``axis_name`` (the AND over them), when given."""
    if check_axis_name(axis_name) is None:
        return finite
    for name in axis_name if isinstance(axis_name, tuple) else (axis_name,):
        try:
            lax.axis_size(name)
        except NameError:
            raise ValueError(
                f"Expected `axis_name` to name axes bound here, but {name!r} is not: call this "
                "inside a shard_map or pmap over that axis. Under plain jit with sharded arrays "
                "the check is already global: pass no axis_name."
            ) from None
    bad = jnp.logical_not(finite).astype(jnp.int32)
    return lax.pmax(bad, axis_name) == 0


def all_finite(tree: Any, *, axis_name: AxisName | None = None) -> jax.Array:
    """One boolean scalar: whether every floating element of ``tree`` is finite.

    Computed on device; a finite tree costs one read of each leaf (a float32
    sum), and only a tree whose sum is not finite pays for an exact second
    pass. Integer, boolean and ``float0`` leaves and ``None`` are ignored; an
    empty tree is finite.

    Args:
      tree: any pytree of arrays.
      axis_name: the name (or tuple of names) of a ``pmap``/``shard_map`` axis.
        When given, the answer is the AND over every replica of that axis, so
        all of them take the same decision. Under plain ``jit`` with sharded
        arrays no axis name is needed: the reduction is already global.

    Returns:
      A ``bool`` scalar array.

    Raises:
      TypeError: a leaf is not an array; the message names its path.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> bool(jamp.all_finite({"w": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    return agree(_finite(_float_leaves(tree, "all_finite")), axis_name)


def check_unscaled(
    state: ls.LossScaleState, grads: Any, *, axis_name: AxisName | None = None
) -> jax.Array:
    """Whether ``unscale(state, grads)`` is all finite, from one read of ``grads``.

    The unscaled gradients are not formed on the fast path, so a caller can
    unscale inside the branch that uses them, where XLA fuses the multiply
    into the optimizer's own pass.
    """
    inv = ls.inverse_scale(state) if state.enabled else None
    return agree(_finite(_float_leaves(grads, "unscale_and_check"), inv), axis_name)


def unscale_and_check(
    state: ls.LossScaleState, grads: Any, *, axis_name: AxisName | None = None
) -> tuple[Any, jax.Array]:
    """Unscale ``grads`` and check whether the *unscaled* values are all finite.

    The check reads the scaled gradients once (see :func:`all_finite`); with
    a scale >= 1 a finite scaled gradient stays finite once unscaled, and
    otherwise the unscaled values themselves are checked. So an overflow that
    unscaling creates (a scale below 1) is caught, which torch's kernel,
    checking the scaled values, misses. A disabled state still checks, so
    non-finite steps can be skipped.

    Args:
      state: a :class:`LossScaleState`.
      grads: the gradients of a scaled loss.
      axis_name: as in :func:`all_finite`.

    Returns:
      ``(unscaled_grads, finite)``: each leaf in its own dtype, and a boolean
      scalar.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> state = jamp.static_loss_scale(2.0)
      >>> g, finite = jamp.unscale_and_check(state, jnp.array([4.0, 6.0]))
      >>> g, bool(finite)
      (Array([2., 3.], dtype=float32), True)
    """
    return ls.unscale(state, grads), check_unscaled(state, grads, axis_name=axis_name)


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
    """``on_true`` where the scalar ``pred`` holds, else ``on_false``, leaf by leaf.

    Both trees must have the same structure, and matching leaves the same
    shape and dtype; identical non-array leaves (``None``, a string) pass
    through. Prefer :func:`jamp.loss_scaling` for skipping optimizer steps: it
    skips with ``lax.cond`` and avoids a select over every parameter.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> jamp.select_tree(jnp.bool_(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
      {'a': Array([0., 0.], dtype=float32)}
    """
    pred = ls.check_bool_scalar(pred, "pred", "e.g. from jamp.all_finite")
    t_true = jax.tree_util.tree_structure(on_true)
    t_false = jax.tree_util.tree_structure(on_false)
    if t_true != t_false:
        raise ValueError(
            "Expected `on_true` and `on_false` to have the same tree structure, got "
            f"{t_true} and {t_false} instead."
        )

    def pick(path: Sequence[Any], a: Any, b: Any) -> Any:
        where = jax.tree_util.keystr(path) or "<root>"
        if not hasattr(a, "dtype") or not hasattr(b, "dtype"):
            if a is b or (type(a) is type(b) and a == b):
                return a
            raise TypeError(
                f"`jamp.select_tree` cannot select between non-array leaves {a!r:.40} and "
                f"{b!r:.40} at path {where}."
            )
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise TypeError(
                f"`jamp.select_tree` expected matching leaves at path {where}, got "
                f"{a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)} instead."
            )
        return lax.select(pred, a, b)

    return jax.tree_util.tree_map_with_path(pick, on_true, on_false)
