"""Skipping a step: keep the old state or apply the new one, by ``cond`` or ``select``.

Shared by every front end that skips a non-finite step (``loss_scaling``,
``GradScaler.step``, ``multi_steps``): the branch that keeps the old values
is typed like the branch that applies the update, so both agree under
``lax.cond`` and ``shard_map``.

The default, ``skip="auto"``, chooses the form by the platform the step is
compiled for (``lax.platform_dependent``, resolved at lowering, so only one
form is in the program): ``select`` on GPUs and TPUs, ``cond`` on CPUs.
XLA:GPU runs a ``conditional`` as a host sync (the predicate is copied to the
host, which waits for the stream before launching the branch), and a
``lax.cond`` over donated parameters makes it copy every parameter and
optimizer moment first; a select fuses into the optimizer's own pass. XLA:CPU
runs a conditional on the host thread at no such cost and, with a donated
state, is faster with it (``benchmarks/RESULTS.md`` measures both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jamp._src.leaves import combine, explicit_sharding, is_numeric_dtype, partition, selected
from jamp._src.types import Filter, Grads, OptState, Params, PyTree, Updates
from jamp._src.validate import Transformation, check_bool_scalar, check_filter, diagnosing

T = TypeVar("T")  # a tree a branch returns


def _varying_axes(x: object) -> frozenset[str]:
    manual = getattr(x, "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def match_varying(tree: T, like: PyTree) -> T:
    """Mark ``tree``'s leaves as varying over the ``shard_map`` axes ``like``'s vary over.

    Under ``shard_map`` (with its default ``check_vma=True``) both branches of a
    ``lax.cond`` must agree on which manual axes each output varies over; the
    "skip" branch returns zeros or the old state, which may not vary where
    the updated values do.
    """

    def one(x: jax.Array, ref: jax.Array | jax.ShapeDtypeStruct) -> jax.Array:
        want = _varying_axes(ref if isinstance(ref, jax.ShapeDtypeStruct) else jax.typeof(ref))
        missing = want - _varying_axes(jax.typeof(x))
        return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    return jax.tree_util.tree_map(one, tree, like)


def typed_like(tree: T, like: PyTree) -> T:
    """``tree`` with each leaf in the dtype (and explicit sharding) of ``like``'s leaf.

    The kept branch of a skipped step returns the old values, typed like the
    applied branch's outputs: an optimizer whose state dtype changes on update
    (Adam's moments of float16 parameters meeting float32 gradients) or a
    sharding in the types (JAX's explicit mode) must not make the branches
    disagree. Leaves that already match are returned as they are.
    """

    def one(x: PyTree, ref: PyTree) -> PyTree:
        if not hasattr(x, "dtype") or not hasattr(ref, "dtype"):
            return x
        if x.dtype != ref.dtype:
            x = x.astype(ref.dtype)
        want = explicit_sharding(ref)
        if want is not None:
            have = explicit_sharding(x)
            if have is None or have.spec != want.spec:
                x = jax.sharding.reshard(x, want.spec)
        return x

    return jax.tree_util.tree_map(one, tree, like)


def cond_or_keep(pred: jax.Array, apply: Callable[[], T], keep: Callable[[PyTree], T]) -> T:
    """``lax.cond(pred, apply, keep)``, with ``keep``'s outputs typed like ``apply``'s.

    ``keep`` is called with ``apply``'s output shapes (``jax.eval_shape(apply)``);
    its outputs are cast to ``apply``'s dtypes (``typed_like``).
    """
    shapes = jax.eval_shape(apply)
    return lax.cond(pred, apply, lambda: match_varying(typed_like(keep(shapes), shapes), shapes))


def by_platform(skip: str, cond_form: Callable[[], T], select_form: Callable[[], T]) -> T:
    """``cond_form()`` or ``select_form()``, as ``skip`` says; ``"auto"``: the select form on
    GPUs and TPUs, the cond form on CPUs, chosen at lowering (``lax.platform_dependent``)."""
    if skip == "cond":
        return cond_form()
    if skip == "select":
        return select_form()
    return lax.platform_dependent(cpu=cond_form, default=select_form)


def select_or_keep(pred: jax.Array, apply: Callable[[], T], keep: Callable[[T], T]) -> T:
    """``apply()`` where ``pred`` holds, else ``keep(apply())``, leaf by leaf with a select.

    Both are computed; a non-finite value in the dropped one never reaches
    the result (a select, unlike ``a * pred``, does not propagate it). The
    kept values are typed like the applied ones (``typed_like``).
    """
    new = apply()
    old = match_varying(typed_like(keep(new), new), new)
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)


def apply_or_keep(
    pred: jax.Array,
    apply: Callable[[], T],
    keep: Callable[[PyTree], T],
    *,
    skip: str = "auto",
) -> T:
    """``apply()`` where ``pred`` holds, else ``keep(shapes of apply())``, by cond or select.

    ``"cond"`` runs only the chosen branch (``cond_or_keep``); ``"select"``
    runs both and picks leaf by leaf (``select_or_keep``); ``"auto"``
    chooses by platform (``by_platform``). Either way the kept values are
    typed like the applied ones (``typed_like``).
    """
    return by_platform(
        skip,
        lambda: cond_or_keep(pred, apply, keep),
        lambda: select_or_keep(pred, apply, keep),
    )


def zeros(shapes: PyTree) -> PyTree:
    """Zeros shaped like ``shapes`` (arrays or ``ShapeDtypeStruct``s), leaf by leaf.

    Under JAX's explicit sharding mode the zeros carry ``shapes``' shardings.
    """
    return jax.tree_util.tree_map(
        lambda s: jnp.zeros(s.shape, s.dtype, out_sharding=explicit_sharding(s)), shapes
    )


def nothing(dtype: DTypeLike) -> jax.Array:
    """The scalar update that changes nothing: ``-0.0`` (``p + -0.0`` is ``p``, bit for bit,
    ``-0.0`` included, where ``p + 0.0`` turns ``-0.0`` into ``+0.0``); ``0`` for other dtypes."""
    dtype = jnp.dtype(dtype)
    return jnp.asarray(-0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0, dtype)


def no_updates(shapes: PyTree) -> Updates:
    """Updates that leave every parameter bit-identical once added (``nothing``),
    shaped like ``shapes``; under the explicit sharding mode they carry its shardings."""
    return jax.tree_util.tree_map(
        lambda s: jnp.full(s.shape, nothing(s.dtype), out_sharding=explicit_sharding(s)), shapes
    )


def keep_nothing(pred: jax.Array, updates: Updates) -> Updates:
    """``updates`` where ``pred`` holds, else updates that change nothing (``nothing``)."""
    return jax.tree_util.tree_map(lambda u: jnp.where(pred, u, nothing(u.dtype)), updates)


def same_or_zeros(tree: PyTree, shapes: PyTree) -> PyTree:
    """``tree`` where it matches ``shapes``' structure and shapes, else zeros of ``shapes``."""
    leaves = jax.tree_util.tree_leaves(tree)
    same = jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(shapes) and all(
        getattr(a, "shape", None) == b.shape
        for a, b in zip(leaves, jax.tree_util.tree_leaves(shapes), strict=True)
    )
    return tree if same else zeros(shapes)


def select_tree(
    pred: ArrayLike, on_true: PyTree, on_false: PyTree, *, filter: Filter = None
) -> PyTree:
    """``on_true`` where the scalar ``pred`` holds, else ``on_false``, leaf by leaf.

    Both trees must have the same structure, and matching leaves the same
    shape and dtype; identical non-array leaves (``None``, a string, the
    activation function of an Equinox module) pass through. Prefer
    [`jamp.loss_scaling`][] for skipping optimizer steps: it skips with
    ``lax.cond`` and avoids a select over every parameter.

    Args:
      pred: a boolean scalar.
      on_true: the tree returned where ``pred`` holds.
      on_false: the tree returned elsewhere, of ``on_true``'s structure.
      filter: a predicate on leaves, such as ``eqx.is_inexact_array``: only
        the leaves of ``on_true`` it selects are selected between; the others
        must be the same object in both trees (or equal non-arrays) and are
        returned as they are. By default every array leaf is selected.

    Returns:
      A tree of ``on_true``'s structure.

    Raises:
      TypeError: two matching leaves differ in shape or dtype, or are
        different non-array leaves (or, with ``filter``, different leaves it
        leaves out), or a leaf has a dtype but no values (a
        ``jax.ShapeDtypeStruct``); the message names the argument and path.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> jamp.compat.select_tree(jnp.bool_(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
      {'a': Array([0., 0.], dtype=float32)}
    """
    pred = check_bool_scalar(pred, "pred", "e.g. from jamp.all_finite")
    check_filter(filter, "compat.select_tree")
    t_true = jax.tree_util.tree_structure(on_true)
    t_false = jax.tree_util.tree_structure(on_false)
    if t_true != t_false:
        raise ValueError(
            "Expected `on_true` and `on_false` to have the same tree structure, got "
            f"{t_true} and {t_false} instead."
        )

    def pick(path: jax.tree_util.KeyPath, a: PyTree, b: PyTree) -> PyTree:
        where = jax.tree_util.keystr(path) or "<root>"
        if not selected(filter, a):
            if a is b or (
                not hasattr(a, "dtype")
                and not hasattr(b, "dtype")
                and type(a) is type(b)
                and a == b
            ):
                return a
            raise TypeError(
                f"`jamp.compat.select_tree` got different leaves at path {where}, which "
                f"`filter` leaves out: {a!r:.40} and {b!r:.40}. Select them too (a wider "
                "filter), or keep them the same object in both trees."
            )
        if not hasattr(a, "dtype") or not hasattr(b, "dtype"):
            if a is b or (type(a) is type(b) and a == b):
                return a
            raise TypeError(
                f"`jamp.compat.select_tree` cannot select between non-array leaves {a!r:.40} and "
                f"{b!r:.40} at path {where}."
            )
        for arg, x in (("on_true", a), ("on_false", b)):
            if not isinstance(x, (jax.Array, np.ndarray, np.generic)) and not hasattr(
                x, "__jax_array__"
            ):  # a jax.ShapeDtypeStruct, or anything else with a dtype and no values
                raise TypeError(
                    f"`jamp.compat.select_tree` expected `{arg}` to hold arrays, got a "
                    f"{type(x).__name__} ({x!r:.60}) at path {where} instead: it has a dtype "
                    "but no values to select (a ShapeDtypeStruct is what jax.eval_shape "
                    "returns). Pass the arrays themselves."
                )
            if not is_numeric_dtype(x.dtype):
                raise TypeError(
                    "`jamp.compat.select_tree` expected numeric array leaves, got an array of "
                    f"dtype {np.dtype(x.dtype)} at path {where} instead: strings and Python "
                    "objects cannot be selected on device. Leave them out with `filter` (they "
                    "are then returned as they are, if the same object in both trees)."
                )
        a, b = jnp.asarray(a), jnp.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise TypeError(
                f"`jamp.compat.select_tree` expected matching leaves at path {where}, got "
                f"{a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)} instead."
            )
        return lax.select(pred, a, b)

    return jax.tree_util.tree_map_with_path(pick, on_true, on_false)


def apply_updates(params: Params, updates: Updates) -> Params:
    """``optax.apply_updates`` that also takes ``None`` updates (Equinox's gradients of
    leaves it does not differentiate): such a parameter is returned as it is."""

    def one(p: ArrayLike | None, u: ArrayLike | None) -> ArrayLike | None:
        if p is None:
            return None
        if u is None:
            return p
        p, u = jnp.asarray(p), jnp.asarray(u)
        # optax's p + u with standard promotion, written out (strict promotion passes); a
        # float8 parameter or update, which no promotion takes, is added in float32 (or in
        # the parameter's own dtype, when wider) and rounded back to the parameter's dtype.
        try:
            with jax.numpy_dtype_promotion("standard"):
                dtype = jnp.promote_types(p.dtype, u.dtype)
        except jax.dtypes.TypePromotionError:
            dtype = p.dtype if jnp.finfo(p.dtype).bits >= 32 else jnp.dtype(jnp.float32)
        return (p.astype(dtype) + u.astype(dtype)).astype(p.dtype)

    return jax.tree_util.tree_map(one, params, updates, is_leaf=lambda x: x is None)


def optimizer_step(
    pred: jax.Array | None,
    tx: Transformation,
    grads_fn: Callable[[], Grads],
    opt_state: OptState,
    params: Params,
    *,
    grads: Grads,
    filter: Filter = None,
    skip: str = "auto",
    extra_args: Mapping[str, object] | None = None,
    fn: str = "step",
) -> tuple[Params, OptState]:
    """``tx``'s step applied to ``params`` where ``pred`` holds, else both kept, by cond or
    select: ``(params, opt_state)``. ``pred=None`` applies it unconditionally.

    ``grads_fn()`` makes the gradients inside the applied branch (so XLA fuses
    an unscale into the optimizer's pass); ``grads`` are what it is made
    from, as the user passed them. With ``filter``, ``tx`` and the skip see
    only the leaves of ``params`` it selects (``eqx.filter(params,
    filter)``); the others (an Equinox module's functions and flags) are
    returned untouched. A ``None`` update (a leaf ``eqx.filter_grad`` did
    not differentiate) leaves its parameter as it is.

    Nothing is checked here: the public function that calls it has checked
    its arguments (``validate.check_step_arguments``). A failure inside
    ``tx`` is explained by ``validate.diagnosing``; ``fn`` names the caller.
    """
    dynamic, static = (params, None) if filter is None else partition(params, filter)
    with diagnosing(f"jamp.{fn}", opt_state, "opt_state", tx.init, dynamic, grads, dynamic):
        new_params, new_opt_state = _step(pred, tx, grads_fn, opt_state, dynamic, skip, extra_args)
    return (new_params if filter is None else combine(new_params, static)), new_opt_state


def _step(pred, tx, grads_fn, opt_state, dynamic, skip, extra_args):
    """``optimizer_step`` on the leaves it selected."""

    def apply() -> tuple[Params, OptState]:
        updates, new_opt_state = tx.update(grads_fn(), opt_state, dynamic, **(extra_args or {}))
        return apply_updates(dynamic, updates), new_opt_state

    if pred is None:
        return apply()
    return apply_or_keep(pred, apply, lambda _: (dynamic, opt_state), skip=skip)
