"""Finite checks fused into the step, and tree selection.

The check reads each gradient once, with the cheapest full reduction XLA has:
a float32 sum per leaf. A finite total proves every element finite (an inf or
NaN anywhere makes any sum inf or NaN), and when the loss scale is >= 1,
unscaling cannot overflow, so the *unscaled* gradients are finite too. Only
when that fast path fails (a real overflow, a finite sum too large for
float32, or a scale below 1) does an exact ``all(isfinite)`` pass run, under a
``lax.cond``, so a clean step pays for one read. A ``max|x|`` check would be
no cheaper and drops NaN on XLA's CPU backend; ``all(isfinite(x))`` writes a
boolean array per leaf on the CPU and costs 2-6x the sum
(``benchmarks/FINDINGS.md``), except for float16 leaves: a CPU without float16
arithmetic converts every element for the sum, so they take the exact check
on the fast path too.

On a CPU, the sum of a large float32 leaf is a matrix-vector product with a
vector of ``2**-40`` (``_cpu_sum32``): XLA:CPU tiles a large sum of a gradient
into slow ``reduce-window`` kernels, and the weighted product cannot overflow,
so it is exact on its own.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jamp._src import loss_scale as ls

AxisName = Any  # a hashable axis name, or a tuple of them


def _float_leaves(tree: Any, fn: str) -> list[Any]:
    leaves: list[Any] = []

    def visit(path: Any, leaf: Any) -> None:
        if ls.leaf_kind(path, leaf, fn) == "float":
            leaves.append(jnp.asarray(leaf))

    jax.tree_util.tree_map_with_path(visit, tree)
    return leaves


def _sum32(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.sum(jnp.real(x), dtype=jnp.float32) + jnp.sum(jnp.imag(x), dtype=jnp.float32)
    return jnp.sum(x, dtype=jnp.float32)


# A float32 leaf of at least this many elements, and at least this many in its
# last dimension, is summed by a matrix-vector product on a CPU (_cpu_sum32).
_DOT_MIN_SIZE = 2**14
_DOT_MIN_COLS = 32
# The vector's entries: finite float32 values times 2**-40 cannot overflow a
# float32 sum of fewer than 2**40 elements, so only an inf or NaN makes the
# product non-finite. (A power of two: the products are the values, exactly,
# bar underflow to zero, which cannot hide an inf or NaN.)
_DOT_WEIGHT = 2.0**-40


def _cpu_sum32(x: jax.Array) -> jax.Array:
    """On XLA:CPU, the sum of a large float32 leaf through a matrix-vector product.

    XLA:CPU splits a large sum of a computed value (a gradient) into 32x32
    ``reduce-window`` tiles that read memory across rows, several times slower
    than the same sum of a parameter: most of what a loss-scaled MLP step cost
    over a plain one. A product with a vector of ``2**-40`` over the last
    dimension reads the leaf once in the library's matrix kernels on every
    core (``benchmarks/FINDINGS.md``, section 10), and it is non-finite
    exactly when the leaf holds an inf or NaN. Contracting the last dimension
    without a reshape keeps a sharded leaf where it is.
    """
    if x.dtype != jnp.float32 or x.size < _DOT_MIN_SIZE or x.shape[-1] < _DOT_MIN_COLS:
        return _sum32(x)
    weights = jnp.full((x.shape[-1],), _DOT_WEIGHT, jnp.float32)
    # HIGHEST: a user's jax_default_matmul_precision must not round the values.
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    return jnp.sum(lax.dot_general(x, weights, dims, precision=lax.Precision.HIGHEST))


def _exact(leaves: list[jax.Array]) -> jax.Array:
    """Whether every element of every leaf is finite: one pass per leaf.

    Each leaf's non-finite flags are reduced as a ``uint8`` max: XLA:CPU
    reduces booleans (``jnp.all``) through tiled ``reduce-window`` kernels,
    which run about 2x slower and compile to more kernels
    (``benchmarks/FINDINGS.md``, section 10).
    """
    flags = [jnp.max(jnp.logical_not(jnp.isfinite(x)).astype(jnp.uint8), initial=0) for x in leaves]
    return functools.reduce(jnp.maximum, flags) == 0


def _after_all(leaves: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """``leaves`` such that reductions of them wait until all are computed.

    XLA:CPU would otherwise start each reduction as soon as its gradient
    exists, next to the backward pass's matrix products, which then lose a
    core (about 2% of an MLP step, ``benchmarks/FINDINGS.md``, section 9).
    Used on CPUs only: other platforms schedule as they see fit.
    """
    return lax.optimization_barrier(leaves)


def _fast(*leaves: jax.Array, cpu: bool = False) -> jax.Array:
    """Whether the one-read check finds every leaf finite.

    A finite float32 total proves every element finite; float16 leaves are
    checked exactly here too: on a CPU without float16 arithmetic, converting
    every element for a float32 sum costs 2-3x more than ``all(isfinite)``
    (``benchmarks/FINDINGS.md``, section 6).

    On a CPU (``cpu=True``) the check waits for every leaf (``_after_all``)
    and sums large float32 leaves with ``_cpu_sum32``.
    """
    if cpu:
        leaves = _after_all(leaves)
    half = [x for x in leaves if x.dtype == jnp.float16]
    rest = [x for x in leaves if x.dtype != jnp.float16]
    fast = jnp.asarray(True)
    if rest:
        sum32 = _cpu_sum32 if cpu else _sum32
        fast = jnp.isfinite(functools.reduce(jnp.add, [sum32(x) for x in rest]))
    if half:
        fast = fast & _exact(half)
    return fast


def _finite(leaves: list[jax.Array], inv: jax.Array | None = None) -> jax.Array:
    """Whether every leaf (times ``inv``, when given) is finite."""
    if not leaves:
        return jnp.asarray(True)
    fast = lax.platform_dependent(*leaves, cpu=functools.partial(_fast, cpu=True), default=_fast)
    if inv is None:
        leaves_to_check = lambda: leaves  # noqa: E731
    else:
        # |g * inv| <= |g| when inv <= 1: finite g stay finite once unscaled.
        fast = fast & (inv <= 1)
        leaves_to_check = lambda: [ls._unscale_leaf(x, inv) for x in leaves]  # noqa: E731
    # Both branches derive from the same leaves, so under shard_map they vary
    # over the same axes.
    return lax.cond(fast, lambda: fast, lambda: _exact(leaves_to_check()))


def _agree(finite: jax.Array, axis_name: AxisName | None) -> jax.Array:
    if axis_name is None:
        return finite
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
    return _agree(_finite(_float_leaves(tree, "all_finite")), axis_name)


def check_unscaled(
    state: ls.LossScaleState, grads: Any, *, axis_name: AxisName | None = None
) -> jax.Array:
    """Whether ``unscale(state, grads)`` is all finite, from one read of ``grads``.

    The unscaled gradients are not formed on the fast path, so a caller can
    unscale inside the branch that uses them, where XLA fuses the multiply
    into the optimizer's own pass.
    """
    inv = ls.inverse_scale(state) if state.enabled else None
    return _agree(_finite(_float_leaves(grads, "unscale_and_check"), inv), axis_name)


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
