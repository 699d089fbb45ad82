"""The Optax front end: ``loss_scaling`` and ``multi_steps``.

``loss_scaling(inner)`` is an ``optax.GradientTransformationExtraArgs`` that
unscales, checks, skips a non-finite step and updates the loss scale, so it
drops into ``optax.chain``, ``optax.MultiSteps``, Flax ``TrainState`` and
``nnx.Optimizer`` unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jamp._src.finite import check_axis_name, check_unscaled, refuse_axis_name
from jamp._src.loss_scale import (
    LossScaleState,
    dynamic_loss_scale,
    saturating_increment,
    unscale,
    update,
)
from jamp._src.report import log_counts
from jamp._src.skip import (
    apply_or_keep,
    check_skip,
    cond_or_keep,
    match_varying,
    same_or_zeros,
    zeros,
)


class LossScalingState(NamedTuple):
    """State of :func:`loss_scaling`; field names are unique for ``optax.tree.get``.

    Attributes:
      loss_scale: the :class:`jamp.LossScaleState` used to scale the next loss.
      inner_state: the wrapped transformation's state; frozen on skipped steps.
      last_finite: bool scalar, whether the last step's gradients were finite
        (``False`` means the step was skipped).
      skipped_steps: int32 scalar, total skipped steps; saturates at 2**31 - 1.
    """

    loss_scale: LossScaleState
    inner_state: Any
    last_finite: jax.Array
    skipped_steps: jax.Array


def check_inner(inner: Any) -> optax.GradientTransformation:
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


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScaleState | None = None,
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
        replicas agree on skipping. It does not average the gradients:
        under ``pmap`` do that yourself with ``lax.pmean`` before ``update``
        (flax's ``DynamicScale(axis_name=...)`` did it for you). Not needed
        under ``jit`` with sharded arrays. See ``docs/data-parallel.md``.
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
    inner = check_inner(inner)
    if loss_scale is None:
        loss_scale = dynamic_loss_scale()
    elif not isinstance(loss_scale, LossScaleState):
        raise TypeError(
            "Expected `loss_scale` to be a jamp.LossScaleState (jamp.dynamic_loss_scale(), "
            f"static_loss_scale(s) or no_loss_scale()), got {type(loss_scale).__name__} instead."
        )
    if not isinstance(report_nonfinite, bool):
        raise TypeError(
            f"Expected `report_nonfinite` to be a bool, got {report_nonfinite!r} instead."
        )
    check_skip(skip)
    check_axis_name(axis_name)
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
        finite = check_unscaled(state.loss_scale, updates, axis_name=axis_name)

        # Unscaling inside the branch lets XLA fuse it into the optimizer's pass.
        def apply() -> tuple[Any, Any]:
            grads = unscale(state.loss_scale, updates)
            return inner.update(grads, state.inner_state, params, **extra_args)

        def keep(shapes: Any) -> tuple[Any, Any]:
            if skip == "select":
                return zeros(shapes[0]), state.inner_state
            # Zeroed below, where the select fuses into the caller's
            # apply_updates: zeros made here would cost a compiled kernel per
            # leaf, and the branch's output a second gradient-sized buffer.
            return same_or_zeros(updates, shapes[0]), state.inner_state

        new_updates, new_inner = apply_or_keep(finite, apply, keep, skip=skip)
        if skip == "cond":
            new_updates = jax.tree_util.tree_map(
                lambda u: jnp.where(finite, u, jnp.zeros((), u.dtype)), new_updates
            )
        if report_nonfinite:
            # Counted only on skipped steps, on the unscaled values, a chunk at
            # a time (no unscaled copy of the gradients).
            def log_skipped() -> None:
                log_counts(
                    updates,
                    prefix="skipped step: ",
                    transform=lambda v: unscale(state.loss_scale, v),
                )

            lax.cond(finite, lambda: None, log_skipped)
        counters = LossScalingState(
            loss_scale=update(state.loss_scale, finite),
            inner_state=None,
            last_finite=finite,
            skipped_steps=saturating_increment(state.skipped_steps, jnp.logical_not(finite)),
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
    inner = check_inner(inner)
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
