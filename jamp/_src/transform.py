"""The Optax transformation ``loss_scaling``, ``get_loss_scale`` and ``value_and_grad``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jamp._src import finite as fin
from jamp._src import loss_scale as ls
from jamp._src import report


class LossScalingState(NamedTuple):
    """State of :func:`loss_scaling`; field names are unique for ``optax.tree.get``.

    Attributes:
      loss_scale: the :class:`jamp.LossScaleState` used to scale the next loss.
      inner_state: the wrapped transformation's state; frozen on skipped steps.
      last_finite: bool scalar, whether the last step's gradients were finite
        (``False`` means the step was skipped).
      skipped_steps: int32 scalar, total skipped steps; saturates at 2**31 - 1.
    """

    loss_scale: ls.LossScaleState
    inner_state: Any
    last_finite: jax.Array
    skipped_steps: jax.Array


def _varying_axes(x: Any) -> frozenset:
    manual = getattr(x, "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def match_varying(tree: Any, like: Any) -> Any:
    """Mark ``tree``'s leaves as varying over the ``shard_map`` axes ``like``'s vary over.

    Under ``shard_map`` (with its default ``check_vma=True``) both branches of a
    ``lax.cond`` must agree on which manual axes each output varies over; the
    "skip" branch returns zeros or the old state, which may not vary where
    the updated values do.
    """

    def one(x: Any, ref: Any) -> Any:
        want = _varying_axes(ref if isinstance(ref, jax.ShapeDtypeStruct) else jax.typeof(ref))
        missing = want - _varying_axes(jax.typeof(x))
        return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    return jax.tree_util.tree_map(one, tree, like)


def cond_or_keep(pred: jax.Array, apply: Callable[[], Any], keep: Callable[[Any], Any]) -> Any:
    """``lax.cond(pred, apply, keep)``, with ``keep``'s outputs typed like ``apply``'s.

    ``keep`` is called with ``apply``'s output shapes (``jax.eval_shape(apply)``).
    """
    shapes = jax.eval_shape(apply)
    return lax.cond(pred, apply, lambda: match_varying(keep(shapes), shapes))


SKIP_MODES = ("cond", "select")


def check_skip(skip: Any) -> str:
    """``skip`` if it names a skipping mode, else a ``ValueError`` naming the argument."""
    if not isinstance(skip, str) or skip not in SKIP_MODES:
        raise ValueError(
            f"Expected `skip` to be one of {SKIP_MODES} ('cond': apply the update under "
            f"lax.cond; 'select': compute it, then keep or drop it), got {skip!r} instead."
        )
    return skip


def apply_or_keep(
    pred: jax.Array,
    apply: Callable[[], Any],
    keep: Callable[[Any], Any],
    *,
    skip: str = "cond",
) -> Any:
    """``apply()`` where ``pred`` holds, else ``keep(shapes of apply())``, by cond or select.

    ``"cond"`` runs only the chosen branch. ``"select"`` runs both and picks
    leaf by leaf; a non-finite value in the dropped branch never reaches the
    result (a select, unlike ``a * pred``, does not propagate it).
    """
    if skip == "cond":
        return cond_or_keep(pred, apply, keep)
    new = apply()
    old = match_varying(keep(new), new)
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)


def _zeros(shapes: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _same_or_zeros(tree: Any, shapes: Any) -> Any:
    """``tree`` where it matches ``shapes`` leaf for leaf, else zeros of ``shapes``."""
    leaves = jax.tree_util.tree_leaves(tree)
    same = jax.tree_util.tree_structure(tree) == jax.tree_util.tree_structure(shapes) and all(
        getattr(a, "shape", None) == b.shape and getattr(a, "dtype", None) == b.dtype
        for a, b in zip(leaves, jax.tree_util.tree_leaves(shapes), strict=True)
    )
    return tree if same else _zeros(shapes)


def _check_inner(inner: Any) -> optax.GradientTransformation:
    """``inner`` as a GradientTransformation, or a TypeError naming the argument."""
    if isinstance(inner, optax.MultiSteps):
        inner = inner.gradient_transformation()
    if not isinstance(inner, optax.GradientTransformation):
        hint = " (call it: optax.adam(1e-3), not optax.adam)" if callable(inner) else ""
        raise TypeError(
            f"Expected `inner` to be an optax.GradientTransformation, got "
            f"{getattr(inner, '__name__', type(inner).__name__)} instead{hint}."
        )
    return inner


def refuse_axis_name(extra_args: dict, fn: str, receiver: str, owner: str) -> None:
    """A TypeError if ``axis_name`` came as an extra argument that ``receiver`` would ignore."""
    if "axis_name" in extra_args:
        raise TypeError(
            f"{fn} got `axis_name`, which it would pass on to {receiver} and ignore: give it "
            f"to {owner}(..., axis_name=...)."
        )


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: ls.LossScaleState | None = None,
    *,
    axis_name: Any = None,
    report_nonfinite: bool = False,
    skip: str = "cond",
) -> optax.GradientTransformationExtraArgs:
    """Wrap an Optax transformation so it takes gradients of a *scaled* loss.

    ``update`` unscales the gradients with the current loss scale, checks that
    the unscaled values are finite (agreeing across ``axis_name`` when given),
    runs ``inner`` on them, and on a non-finite step returns zero updates and
    leaves ``inner``'s state exactly as it was (Adam's count, schedules and
    moments do not advance). Then it updates the loss scale. Everything runs
    on device, under ``jit``, with no host sync.

    Gradient clipping placed inside ``inner`` sees unscaled gradients, like
    ``scaler.unscale_(opt)`` before ``clip_grad_norm_`` in PyTorch.

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
      loss_scale: the initial :class:`jamp.LossScaleState`; defaults to
        ``jamp.dynamic_loss_scale()`` (PyTorch's defaults).
      axis_name: a ``pmap``/``shard_map`` axis name (or tuple) over which all
        replicas agree on skipping. Not needed under ``jit`` with sharded
        arrays.
      report_nonfinite: on skipped steps only, log which gradient leaves held
        inf/NaN (see :func:`jamp.log_nonfinite`). Clean steps never call the
        host, but pay a small fixed dispatch cost (``benchmarks/RESULTS.md``).
      skip: how a non-finite step is dropped; both give the same results.
        ``"cond"`` (default) runs ``inner`` under ``lax.cond``, only on
        finite steps: fastest when the train step donates its state
        (``jax.jit(..., donate_argnums=...)``). ``"select"`` runs ``inner``
        on every step and keeps its result or the old state with a select,
        which XLA can fuse with ``optax.apply_updates``: faster without
        donation, and on some many-leaf models. ``benchmarks/RESULTS.md``
        measures both.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; extra keyword arguments
      are forwarded to ``inner``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(8.0))
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> loss = lambda p: jnp.sum(p["w"] ** 2)
      >>> grads = jax.grad(lambda p: jamp.scale(jamp.get_loss_scale(state), loss(p)))(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"]
      Array([-0.2, -0.2], dtype=float32)
    """
    inner = _check_inner(inner)
    if loss_scale is None:
        loss_scale = ls.dynamic_loss_scale()
    elif not isinstance(loss_scale, ls.LossScaleState):
        raise TypeError(
            "Expected `loss_scale` to be a jamp.LossScaleState (jamp.dynamic_loss_scale(), "
            f"static_loss_scale(s) or no_loss_scale()), got {type(loss_scale).__name__} instead."
        )
    if not isinstance(report_nonfinite, bool):
        raise TypeError(
            f"Expected `report_nonfinite` to be a bool, got {report_nonfinite!r} instead."
        )
    check_skip(skip)
    fin.check_axis_name(axis_name)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> LossScalingState:
        return LossScalingState(
            loss_scale=loss_scale,
            inner_state=inner.init(params),
            last_finite=jnp.asarray(True),
            skipped_steps=jnp.zeros((), jnp.int32),
        )

    def update_fn(
        updates: Any, state: LossScalingState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LossScalingState]:
        if not isinstance(state, LossScalingState):
            raise TypeError(
                "Expected `state` to be the LossScalingState from this transformation's init, "
                f"got {type(state).__name__} instead."
            )
        refuse_axis_name(extra_args, "`update`", "the inner transformation", "jamp.loss_scaling")
        finite = fin.check_unscaled(state.loss_scale, updates, axis_name=axis_name)

        # Unscaling inside the branch lets XLA fuse it into the optimizer's pass.
        def apply() -> tuple[Any, Any]:
            grads = ls.unscale(state.loss_scale, updates)
            return inner.update(grads, state.inner_state, params, **extra_args)

        def keep(shapes: Any) -> tuple[Any, Any]:
            if skip == "select":
                return _zeros(shapes[0]), state.inner_state
            # Zeroed below, where the select fuses into the caller's
            # apply_updates: zeros made here would cost a compiled kernel per
            # leaf, and the branch's output a second gradient-sized buffer.
            return _same_or_zeros(updates, shapes[0]), state.inner_state

        new_updates, new_inner = apply_or_keep(finite, apply, keep, skip=skip)
        if skip == "cond":
            new_updates = jax.tree_util.tree_map(
                lambda u: jnp.where(finite, u, jnp.zeros((), u.dtype)), new_updates
            )
        if report_nonfinite:
            # Counted only on skipped steps, on the unscaled values, a chunk at
            # a time (no unscaled copy of the gradients).
            def log_skipped() -> None:
                report._log(
                    updates,
                    prefix="skipped step: ",
                    transform=lambda v: ls.unscale(state.loss_scale, v),
                )

            lax.cond(finite, lambda: None, log_skipped)
        counters = LossScalingState(
            loss_scale=ls.update(state.loss_scale, finite),
            inner_state=None,
            last_finite=finite,
            skipped_steps=ls.saturating_increment(state.skipped_steps, jnp.logical_not(finite)),
        )
        # Under shard_map, a state that came in varying per replica goes out
        # varying too (the agreed flag alone would not be), so it can be carried
        # through lax.scan / lax.cond by the caller.
        counters = match_varying(counters, state._replace(inner_state=None))
        return new_updates, counters._replace(inner_state=new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class MultiStepsTransformation(optax.GradientTransformationExtraArgs):
    """What :func:`multi_steps` returns: a transformation with ``has_updated``."""

    def has_updated(self, state: optax.MultiStepsState) -> jax.Array:
        """Whether the last ``update`` emitted an accumulated step (``optax.MultiSteps``'s)."""
        return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)


def multi_steps(
    inner: optax.GradientTransformation, every_k_schedule: Any, **kwargs: Any
) -> MultiStepsTransformation:
    """``optax.MultiSteps(inner, every_k_schedule, **kwargs)`` that survives an overflow.

    Gradient accumulation over a loss-scaled optimizer with the scale constant
    across micro-steps (torch's recipe)::

        tx = jamp.multi_steps(jamp.loss_scaling(optax.adamw(1e-3)), every_k_schedule=4)

    An inf in any micro-batch makes the accumulated step non-finite, and
    ``loss_scaling`` skips it at the boundary. ``optax.MultiSteps`` then resets
    its accumulator as ``(1 - emit) * acc``, and ``0 * inf`` is NaN, so with
    plain ``optax.MultiSteps`` every later accumulated step is non-finite too
    and training silently stops. This wrapper starts each accumulation from
    zeros instead. The state is the same ``optax.MultiStepsState``.

    The other nesting, ``jamp.loss_scaling(optax.MultiSteps(inner, k))``,
    checks every micro-batch and drops only the one that overflowed; the scale
    may then change between micro-steps, which is harmless since what is
    accumulated is already unscaled.

    Keep ``should_skip_update_fn`` unset here: a skip before ``loss_scaling``
    (``optax.skip_not_finite``) hides every overflow from it, so the scale
    never backs off and every later step is skipped too.

    The result is an Optax transformation with ``optax.MultiSteps``'s
    ``has_updated(state)``.
    """
    inner = _check_inner(inner)
    k = every_k_schedule
    if not callable(k) and not (isinstance(k, int) and not isinstance(k, bool)):
        raise TypeError(
            "Expected `every_k_schedule` to be an int >= 1 or a schedule (a function of the "
            f"step count), got {k!r} instead."
        )
    if not callable(k) and k < 1:
        raise ValueError(f"Expected `every_k_schedule` >= 1, got every_k_schedule={k} instead.")
    ms = optax.MultiSteps(inner, every_k_schedule, **kwargs).gradient_transformation()

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        new_updates, new_state = ms.update(updates, state, params, **extra_args)

        def zeros() -> Any:
            return jax.tree_util.tree_map(jnp.zeros_like, new_state.acc_grads)

        acc = cond_or_keep(new_state.mini_step == 0, zeros, lambda _: new_state.acc_grads)
        return new_updates, new_state._replace(acc_grads=acc)

    return MultiStepsTransformation(ms.init, update_fn)


# --------------------------------------------------------------------------
# Finding the loss-scale state.


def _unwrap(x: Any) -> Any:
    """The array inside an NNX ``Variable`` (or anything with ``get_value``)."""
    if isinstance(x, jax.Array) or not hasattr(x, "get_value"):
        return x
    return x.get_value()


def _unwrapped(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        _unwrap, tree, is_leaf=lambda x: hasattr(x, "get_value") and not isinstance(x, jax.Array)
    )


def _find_in(tree: Any, kind: type) -> list[tuple[Any, Any]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, kind))
    return [(path, leaf) for path, leaf in leaves if isinstance(leaf, kind)]


def _find(tree: Any, kind: type) -> list[tuple[Any, Any]]:
    """Every ``kind`` in ``tree``; for an object with an ``opt_state`` (flax
    TrainState, nnx.Optimizer), those in its ``opt_state``, else those in the
    whole object (a TrainState with a ``loss_scale`` field of its own)."""
    if hasattr(tree, "opt_state") and not isinstance(tree, tuple):
        found = _find_in(tree.opt_state, kind)
        if found:
            return found
    return _find_in(tree, kind)


def holds_loss_scale(tree: Any) -> bool:
    """Whether ``tree`` holds a loss-scale state anywhere :func:`get_loss_scale` looks."""
    return bool(_find(tree, ls.LossScaleState))


def get_loss_scale(opt_state: Any) -> ls.LossScaleState:
    """The :class:`jamp.LossScaleState` inside any optimizer state.

    Looks through any nesting of Optax states (``chain``, ``named_chain``,
    ``MultiSteps``, ``inject_hyperparams``, ...), a Flax ``TrainState`` (its
    ``opt_state``, else its other fields, such as a ``loss_scale`` field kept
    beside :func:`value_and_grad`) and an ``nnx.Optimizer`` (or its
    ``opt_state``, whose NNX variables are unwrapped).

    Args:
      opt_state: an optimizer state, or an object with an ``opt_state``.

    Returns:
      The loss-scale state, with plain arrays as leaves.

    Raises:
      ValueError: there is no loss-scale state, or more than one.

    Examples:
      >>> import jax.numpy as jnp, optax, jamp
      >>> tx = jamp.loss_scaling(optax.chain(optax.clip(1.0), optax.adam(1e-3)))
      >>> float(jamp.get_loss_scale(tx.init({"w": jnp.ones(2)})).scale)
      65536.0
    """
    found = _find(opt_state, ls.LossScaleState)
    if not found:
        raise ValueError(
            "Expected `opt_state` to contain a jamp loss-scale state, found none in "
            f"{type(opt_state).__name__}; wrap the optimizer with jamp.loss_scaling(...)."
        )
    if len(found) > 1:
        paths = ", ".join(jax.tree_util.keystr(p) for p, _ in found)
        raise ValueError(
            f"Expected exactly one loss-scale state in `opt_state`, found {len(found)} at "
            f"{paths}; pass the sub-state that holds the one you want."
        )
    return _unwrapped(found[0][1])


# --------------------------------------------------------------------------
# value_and_grad


class ScaledValueAndGrad(NamedTuple):
    """What :func:`value_and_grad`'s function returns.

    Attributes:
      value: the unscaled loss, in the dtype ``fun`` returned.
      aux: ``fun``'s auxiliary output with ``has_aux=True``, else ``None``.
      grads: unscaled gradients, each leaf in its parameter's dtype.
      finite: bool scalar, whether every gradient is finite (agreed across
        ``axis_name``); skip the step when it is ``False``.
      loss_scale: the loss-scale state updated with ``finite``.
      retries: int32 scalar, recomputations at a lower scale (0 unless
        ``max_retries`` > 0).
    """

    value: Any
    aux: Any
    grads: Any
    finite: jax.Array
    loss_scale: ls.LossScaleState
    retries: jax.Array


def value_and_grad(
    fun: Callable[..., Any],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    axis_name: Any = None,
    max_retries: int = 0,
) -> Callable[..., ScaledValueAndGrad]:
    """``jax.value_and_grad`` of a scaled loss, unscaled and checked in one call.

    The returned function takes the loss-scale state first, then ``fun``'s
    arguments. It scales ``fun``'s value, differentiates, unscales the
    gradients, checks them, and updates the scale: flax's
    ``DynamicScale.value_and_grad``, with growth on the ``growth_interval``-th
    finite step (torch's rule, not one step later) and gradients kept in their
    own dtypes.

    Args:
      fun: returns a scalar loss (and auxiliary data with ``has_aux=True``).
      argnums: which positional argument(s) of ``fun`` to differentiate.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      axis_name: a ``pmap``/``shard_map`` axis over which replicas agree on
        ``finite``. Gradients are not averaged: use ``lax.pmean`` for that.
      max_retries: instead of giving up on an overflow, back the scale off and
        recompute the loss and gradients, inside the same jitted call (a
        ``lax.while_loop``), up to this many times. The gradients returned are
        those of the first finite attempt; ``retries`` says how many
        recomputations it took. Each retry costs one more forward and
        backward pass, so it pays when overflows are rare and a batch is
        expensive to lose; with a static or disabled scale there is nothing
        to retry. Every failed attempt backs the scale off, ignoring
        ``hysteresis``, and retrying stops at ``min_scale``. A NaN that is
        not an overflow (bad data) fails at every scale, so it costs
        ``max_retries`` passes and a scale ``2**(max_retries + 1)`` times
        smaller. The loop is a ``lax.while_loop``: differentiate through
        this function (``jax.grad`` of it) only with ``max_retries=0``.

    Returns:
      A function ``(loss_scale, *args, **kwargs) -> ScaledValueAndGrad``.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> vg = jamp.value_and_grad(lambda w: jnp.sum(w ** 2))
      >>> out = vg(jamp.dynamic_loss_scale(), jnp.array([1.0, 2.0]))
      >>> float(out.value), out.grads, bool(out.finite)
      (5.0, Array([2., 4.], dtype=float32), True)
    """
    if not callable(fun):
        raise TypeError(f"Expected `fun` to be callable, got {type(fun).__name__} instead.")
    fin.check_axis_name(axis_name)
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(
            f"Expected `max_retries` to be an int >= 0, got max_retries={max_retries!r} instead."
        )

    def scaled(state: ls.LossScaleState, *args: Any, **kwargs: Any) -> Any:
        out = fun(*args, **kwargs)
        if has_aux and not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "Expected `fun` to return a pair (loss, aux) with has_aux=True, got "
                f"{type(out).__name__} instead."
            )
        loss, aux = out if has_aux else (out, None)
        return ls.scale(state, loss), (loss, aux)

    _check_argnums(argnums)

    @functools.wraps(fun)
    def wrapped(loss_scale: ls.LossScaleState, *args: Any, **kwargs: Any) -> ScaledValueAndGrad:
        if not isinstance(loss_scale, ls.LossScaleState):
            raise TypeError(
                "The function from jamp.value_and_grad takes the loss-scale state as its "
                f"first argument, got {type(loss_scale).__name__} instead."
            )
        grad_fn = jax.grad(scaled, argnums=_shift(argnums, len(args)), has_aux=True)

        def attempt(state: ls.LossScaleState) -> tuple[Any, Any, Any, jax.Array]:
            grads, (loss, aux) = grad_fn(state, *args, **kwargs)
            grads, finite = fin.unscale_and_check(state, grads, axis_name=axis_name)
            return loss, aux, grads, finite

        retries = jnp.zeros((), jnp.int32)
        loss, aux, grads, finite = attempt(loss_scale)
        retrying = bool(max_retries) and loss_scale.is_dynamic
        if retrying:

            def cond(carry: tuple) -> jax.Array:
                retries, state, (_, _, _, finite) = carry
                # At min_scale a retry would compute the same thing again.
                above_min = state.scale > jnp.float32(state.min_scale)
                return jnp.logical_not(finite) & (retries < max_retries) & above_min

            def body(carry: tuple) -> tuple:
                retries, state, _ = carry
                state = ls.backoff(state)
                return retries + 1, state, attempt(state)

            retries, loss_scale, (loss, aux, grads, finite) = lax.while_loop(
                cond, body, (retries, loss_scale, (loss, aux, grads, finite))
            )
        new_scale = ls.update(loss_scale, finite)
        if retrying:
            # The last failed attempt backs off too, ignoring hysteresis.
            backed_off = ls.backoff(loss_scale).scale
            new_scale = dataclasses.replace(
                new_scale, scale=jnp.where(finite, new_scale.scale, backed_off)
            )
        return ScaledValueAndGrad(
            value=loss,
            aux=aux,
            grads=grads,
            finite=finite,
            loss_scale=new_scale,
            retries=retries,
        )

    return wrapped


def _check_argnums(argnums: Any) -> None:
    ok = isinstance(argnums, int) and not isinstance(argnums, bool)
    if isinstance(argnums, Sequence) and not isinstance(argnums, str):
        ok = len(argnums) > 0 and all(
            isinstance(a, int) and not isinstance(a, bool) for a in argnums
        )
    if not ok:
        raise TypeError(
            f"Expected `argnums` to be an int or a sequence of ints, got {argnums!r} instead."
        )


def _shift(argnums: int | Sequence[int], nargs: int) -> int | tuple[int, ...]:
    """``fun``'s argnums as argnums of ``scaled``, whose first argument is the state."""

    def one(a: int) -> int:
        if not -nargs <= a < nargs:
            raise ValueError(
                f"Expected `argnums` to index one of the {nargs} positional arguments, got "
                f"{a} instead."
            )
        return a % nargs + 1

    if isinstance(argnums, int):
        return one(argnums)
    return tuple(one(a) for a in argnums)


def metrics(state: Any) -> dict[str, jax.Array]:
    """Loss-scaling metrics as a dict of device scalars, ready for any logger.

    Accepts an optimizer state holding a :func:`loss_scaling` state (in any
    nesting, a Flax ``TrainState`` or an ``nnx.Optimizer``), a bare
    :class:`jamp.LossScaleState`, or the result of :func:`value_and_grad`.
    Nothing is read back to the host: convert with ``float()``/``int()`` (or
    ``jax.device_get``) when you log.

    Returns:
      ``loss_scale`` and ``growth_tracker``, plus ``last_finite`` and
      ``skipped_steps`` for an optimizer state, or ``last_finite`` and
      ``retries`` for a :func:`value_and_grad` result.

    Examples:
      >>> import jax.numpy as jnp, optax, jamp
      >>> state = jamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> sorted(jamp.metrics(state))
      ['growth_tracker', 'last_finite', 'loss_scale', 'skipped_steps']
    """
    if isinstance(state, ScaledValueAndGrad):
        return {
            "loss_scale": state.loss_scale.scale,
            "growth_tracker": state.loss_scale.growth_tracker,
            "last_finite": state.finite,
            "retries": state.retries,
        }
    if isinstance(state, ls.LossScaleState):
        return {"loss_scale": state.scale, "growth_tracker": state.growth_tracker}
    found = _find(state, LossScalingState)
    if len(found) == 1:
        s = _unwrapped(found[0][1])
        return {
            "loss_scale": s.loss_scale.scale,
            "growth_tracker": s.loss_scale.growth_tracker,
            "last_finite": s.last_finite,
            "skipped_steps": s.skipped_steps,
        }
    ls_state = get_loss_scale(state)  # a clear error for none, or several
    return {"loss_scale": ls_state.scale, "growth_tracker": ls_state.growth_tracker}
