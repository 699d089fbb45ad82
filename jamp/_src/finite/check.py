"""Finite checks fused into the step: ``all_finite``, ``unscale_and_check``.

Each check is one boolean scalar computed on device, with no host sync, exact
for every input (NaN and inf anywhere are found; large finite values are not
mistaken for overflows), and a clean step reads each gradient once. The work
is done by one of two branches chosen by the platform the step compiles for
(``lax.platform_dependent``): ``finite.cpu.cpu_finite`` on CPUs and
``finite.default.default_finite`` everywhere else; each module's docstring
says how it reads the gradients. With ``axis_name`` the answer is agreed
across the replicas of a ``shard_map``/``pmap`` axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jamp._src.finite.cpu import cpu_finite
from jamp._src.finite.default import default_finite
from jamp._src.leaves import float_leaves
from jamp._src.loss_scale import LossScaleState, check_state, inverse_scale, unscale_tree
from jamp._src.types import AxisName, Filter, Grads, PyTree
from jamp._src.validate import check_axis_name, check_filter


def finite(leaves: list[jax.Array], inv: jax.Array | None = None) -> jax.Array:
    """Whether every leaf (times ``inv``, when given) is finite, by the platform's branch."""
    if not leaves:
        return jnp.asarray(True)
    return lax.platform_dependent(
        *leaves,
        cpu=functools.partial(cpu_finite, inv=inv),
        default=functools.partial(default_finite, inv=inv),
    )


def agree(flag: jax.Array, axis_name: AxisName | None) -> jax.Array:
    """``flag`` on every replica of ``axis_name`` (the AND over them), when given; the
    caller checked ``axis_name`` (``validate.check_axis_name``)."""
    if axis_name is None:
        return flag
    for name in axis_name if isinstance(axis_name, tuple) else (axis_name,):
        try:
            lax.axis_size(name)
        except NameError:
            raise ValueError(
                f"Expected `axis_name` to name axes bound here, but {name!r} is not: call this "
                "inside a shard_map or pmap over that axis. Under plain jit with sharded arrays "
                "the check is already global: pass no axis_name."
            ) from None
    bad = jnp.logical_not(flag).astype(jnp.int32)
    return lax.pmax(bad, axis_name) == 0


def all_finite(
    tree: PyTree, *, axis_name: AxisName | None = None, filter: Filter = None
) -> jax.Array:
    """One boolean scalar: whether every floating element of ``tree`` is finite.

    Computed on device, with no host sync, and exact for every input: a NaN
    or an inf anywhere is found, and large finite values never count as an
    overflow. A finite tree costs one read of each leaf; only a rare tree
    (one whose float32 sum overflows) pays for a second, exact pass. Integer,
    boolean and ``float0`` leaves and ``None`` are ignored; an empty tree is
    finite.

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

      Only the leaves ``filter`` selects (a function held in the tree is not):

      >>> tree = {"w": jnp.ones(3), "act": jnp.tanh}
      >>> bool(jamp.all_finite(tree, filter=lambda x: hasattr(x, "dtype")))
      True
    """
    check_filter(filter, "all_finite")
    check_axis_name(axis_name)
    return agree(finite(float_leaves(tree, "all_finite", filter)), axis_name)


def check_unscaled(
    state: LossScaleState,
    grads: Grads,
    *,
    axis_name: AxisName | None = None,
    filter: Filter = None,
    fn: str = "unscale_and_check",
) -> jax.Array:
    """Whether ``unscale(state, grads)`` is all finite, from one read of ``grads``.

    The unscaled gradients are not formed on the fast path, so a caller can
    unscale inside the branch that uses them, where XLA fuses the multiply
    into the optimizer's own pass. ``fn`` names the caller in messages.
    Unchecked: the caller checked ``state``, ``axis_name`` and ``filter``.
    """
    inv = inverse_scale(state) if state.enabled else None
    return agree(finite(float_leaves(grads, fn, filter), inv), axis_name)


def unscale_and_check(
    state: LossScaleState,
    grads: Grads,
    *,
    axis_name: AxisName | None = None,
    filter: Filter = None,
) -> tuple[Grads, jax.Array]:
    """Unscale ``grads`` and check whether the *unscaled* values are all finite.

    The check reads the scaled gradients once (see [`all_finite`][jamp.all_finite]); with
    a scale >= 1 a finite scaled gradient stays finite once unscaled, and
    otherwise the unscaled values themselves are checked. So an overflow that
    unscaling creates (a scale below 1) is caught, which torch's kernel,
    checking the scaled values, misses. A disabled state still checks, so
    non-finite steps can be skipped.

    Args:
      state: a [`LossScaleState`][jamp.LossScaleState].
      grads: the gradients of a scaled loss.
      axis_name: as in [`all_finite`][jamp.all_finite].
      filter: as in [`all_finite`][jamp.all_finite]; the leaves it is False for are
        neither unscaled nor checked, and come back untouched.

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
    check_state(state, "unscale_and_check")
    check_filter(filter, "unscale_and_check")
    check_axis_name(axis_name)
    return unscaled_and_finite(state, grads, axis_name, filter)


def unscaled_and_finite(
    state: LossScaleState,
    grads: Grads,
    axis_name: AxisName | None = None,
    filter: Filter = None,
) -> tuple[Grads, jax.Array]:
    """``jamp.unscale_and_check``, unchecked: for callers that checked ``state``,
    ``axis_name`` and ``filter``."""
    finite = check_unscaled(state, grads, axis_name=axis_name, filter=filter)
    return unscale_tree(state, grads, filter), finite
