"""The Optax front end: ``loss_scaling`` and ``multi_steps``.

``loss_scaling(inner)`` is an ``optax.GradientTransformationExtraArgs`` that
unscales, checks, skips a non-finite step and updates the loss scale, so it
drops into ``optax.chain``, ``optax.MultiSteps``, Flax ``TrainState`` and
``nnx.Optimizer`` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jamp._src.finite.check import check_unscaled
from jamp._src.finite.report import log_counts
from jamp._src.float8.telemetry import refuse_in
from jamp._src.leaves import is_real_number
from jamp._src.loss_scale import (
    LossScaleState,
    dynamic_loss_scale,
    fresh,
    saturating_increment,
    unscale_tree,
    update_state,
)
from jamp._src.skip import (
    by_platform,
    cond_or_keep,
    keep_nothing,
    match_varying,
    no_updates,
    same_or_zeros,
    select_or_keep,
)
from jamp._src.types import AxisName, OptState, Params, PyTree, Updates, is_tracer
from jamp._src.validate import (
    check_axis_name,
    check_count,
    check_counters,
    check_flag,
    check_optimizer,
    check_own_state,
    check_skip,
    check_state_matches,
    check_updates,
    diagnosing,
    first_mismatch,
    refuse_axis_name,
)


class ScaledOptimizerState(NamedTuple):
    """The state of an optimizer that takes scaled gradients: [`loss_scaling`][jamp.loss_scaling]'s.

    Field names are unique, for ``optax.tree.get``. Not to be confused with
    [`jamp.LossScaleState`][], the scale itself, which is its
    ``loss_scale`` field.

    Attributes:
      loss_scale: the [`jamp.LossScaleState`][] used to scale the next loss.
      inner_state: the wrapped transformation's state; frozen on skipped steps.
      last_finite: bool scalar, whether the last step's gradients were finite
        (``False`` means the step was skipped).
      skipped_steps: int32 scalar, total skipped steps; saturates at 2**31 - 1.
    """

    loss_scale: LossScaleState
    inner_state: OptState
    last_finite: jax.Array
    skipped_steps: jax.Array


def checked_inner(inner: object) -> optax.GradientTransformation:
    """``inner`` as a GradientTransformation (an ``optax.MultiSteps`` as the one it makes),
    or a TypeError naming the argument."""
    if isinstance(inner, optax.MultiSteps):
        inner = inner.gradient_transformation()
    check_optimizer(inner, "inner", optax.GradientTransformation)
    return cast(optax.GradientTransformation, inner)


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScaleState | None = None,
    *,
    axis_name: AxisName | None = None,
    report_nonfinite: bool = False,
    skip: str = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Wrap an Optax transformation so it takes gradients of a *scaled* loss.

    ``update`` unscales the gradients with the current loss scale, checks that
    the unscaled values are finite (agreeing across ``axis_name`` when given),
    runs ``inner`` on them, and on a non-finite step returns zero updates and
    leaves ``inner``'s state exactly as it was (Adam's count, schedules and
    moments do not advance). Then it updates the loss scale. Everything runs
    on device, under ``jit``, with no host sync.

    The zero updates of a skipped step are ``-0.0``, so ``optax.apply_updates``
    leaves every parameter bit-identical: ``p + -0.0`` is ``p`` for every
    ``p``, ``-0.0`` included, where ``+0.0`` would turn a ``-0.0`` parameter
    into ``+0.0``. One exception is XLA:CPU's: it flushes float32 subnormal
    numbers (below ``2**-126`` in magnitude) to zero in arithmetic, so on a
    CPU a subnormal parameter can come back ``0.0`` from ``p + update``,
    skipped step or not (it keeps its bits only where XLA fuses the add with
    the select that made the update). [`jamp.GradScaler.step`][] and
    [`jamp.step_if_finite`][] hand back the old parameters themselves on a
    skipped step, so they keep those bits too.

    Gradient clipping placed inside ``inner`` sees unscaled gradients, like
    ``scaler.unscale_(opt)`` before ``clip_grad_norm_`` in PyTorch.

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
      loss_scale: the initial [`jamp.LossScaleState`][]; defaults to
        ``jamp.dynamic_loss_scale()`` (PyTorch's defaults).
      axis_name: a ``pmap``/``shard_map`` axis name (or tuple) over which all
        replicas agree on skipping. It does not average the gradients:
        under ``pmap`` do that yourself with ``lax.pmean`` before ``update``
        (flax's ``DynamicScale(axis_name=...)`` did it for you). Not needed
        under ``jit`` with sharded arrays. See ``docs/data-parallel.md``.
      report_nonfinite: on skipped steps only, log which gradient leaves held
        inf/NaN (see [`jamp.debug.log_nonfinite`][]). Clean steps never call the
        host, but pay a small fixed dispatch cost (``benchmarks/RESULTS.md``).
      skip: how a non-finite step is dropped; every form gives the same
        results. ``"auto"`` (default) chooses by the platform the step is
        compiled for: ``"select"`` on GPUs and TPUs, ``"cond"`` on CPUs.
        ``"select"`` runs ``inner`` on every step and keeps its result or the
        old state with a select, which XLA fuses into the optimizer's pass
        and ``optax.apply_updates``: no conditional in the program. ``"cond"``
        runs ``inner`` under ``lax.cond``, only on finite steps: XLA:GPU runs
        that conditional as a host sync in every step, and with a donated
        state copies the parameters and moments first, so keep it for CPUs.
        ``benchmarks/RESULTS.md`` measures every form on both compilers.

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
    inner = checked_inner(inner)
    if loss_scale is None:
        loss_scale = dynamic_loss_scale()
    elif not isinstance(loss_scale, LossScaleState):
        raise TypeError(
            "Expected `loss_scale` to be a jamp.LossScaleState (jamp.dynamic_loss_scale(), "
            f"static_loss_scale(s) or no_loss_scale()), got {type(loss_scale).__name__} instead."
        )
    check_flag("report_nonfinite", report_nonfinite)
    check_skip(skip)
    check_axis_name(axis_name)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Params) -> ScaledOptimizerState:
        refuse_in(params, "the parameters of jamp.loss_scaling's init")
        # New buffers on every call, as optax's states: a train step that
        # donates one state must not delete another made by the same `tx`.
        return ScaledOptimizerState(
            loss_scale=fresh(loss_scale),
            inner_state=inner.init(params),
            last_finite=jnp.asarray(True),
            skipped_steps=jnp.zeros((), jnp.int32),
        )

    def update_fn(
        updates: Updates,
        state: ScaledOptimizerState,
        params: Params | None = None,
        **extra_args: object,
    ) -> tuple[Updates, ScaledOptimizerState]:
        check_own_state(state, ScaledOptimizerState, "ScaledOptimizerState")
        refuse_axis_name(extra_args, "`update`", "the inner transformation", "jamp.loss_scaling")
        refuse_in(updates, "the gradients given to jamp.loss_scaling's update")
        if not isinstance(state.loss_scale, LossScaleState):
            raise TypeError(
                "Expected `state.loss_scale` to be a jamp.LossScaleState, got "
                f"{type(state.loss_scale).__name__} instead; {_RESTORED}."
            )
        check_counters(state.skipped_steps, state.last_finite, _RESTORED)
        check_updates(updates, params, _UPDATE)
        reference = updates if params is None else params
        inner_state = state.inner_state
        name = "state.inner_state"
        check_state_matches(inner_state, inner.init, reference, name, _UPDATE, strict=False)
        with diagnosing(_UPDATE, inner_state, name, inner.init, reference, updates, params):
            return run(updates, state, params, **extra_args)

    def run(
        updates: Updates,
        state: ScaledOptimizerState,
        params: Params | None = None,
        **extra_args: object,
    ) -> tuple[Updates, ScaledOptimizerState]:
        finite = check_unscaled(state.loss_scale, updates, axis_name=axis_name, fn=_UPDATE)

        # Unscaling inside the branch lets XLA fuse it into the optimizer's pass.
        def apply() -> tuple[Updates, OptState]:
            grads = unscale_tree(state.loss_scale, updates)
            return inner.update(grads, state.inner_state, params, **extra_args)

        def by_cond() -> tuple[Updates, OptState]:
            # The kept branch passes the gradients through, zeroed below, where
            # the select fuses into the caller's apply_updates: zeros made in
            # the branch would cost a kernel per leaf, and its output a second
            # gradient-sized buffer.
            new_updates, new_inner = cond_or_keep(
                finite, apply, lambda shapes: (same_or_zeros(updates, shapes[0]), state.inner_state)
            )
            return keep_nothing(finite, new_updates), new_inner

        def by_select() -> tuple[Updates, OptState]:
            return select_or_keep(
                finite, apply, lambda new: (no_updates(new[0]), state.inner_state)
            )

        new_updates, new_inner = by_platform(skip, by_cond, by_select)
        if report_nonfinite:
            # Counted only on skipped steps, on the unscaled values, a chunk at
            # a time (no unscaled copy of the gradients).
            def log_skipped() -> None:
                log_counts(
                    updates,
                    prefix="skipped step: ",
                    transform=lambda v: unscale_tree(state.loss_scale, v),
                )

            lax.cond(finite, lambda: None, log_skipped)
        counters = ScaledOptimizerState(
            loss_scale=update_state(state.loss_scale, finite),
            inner_state=None,
            last_finite=finite,
            skipped_steps=saturating_increment(state.skipped_steps, jnp.logical_not(finite)),
        )
        # Under shard_map, a state that came in varying per replica goes out
        # varying too (the agreed flag alone would not be), so it can be carried
        # through lax.scan / lax.cond by the caller.
        counters = match_varying(counters, state._replace(inner_state=None))
        return new_updates, counters._replace(inner_state=new_inner)

    # optax types a state as an ArrayTree (nested arrays), which a NamedTuple holding a
    # LossScaleState dataclass is not to a type checker, though it is a pytree.
    return optax.GradientTransformationExtraArgs(
        cast(optax.TransformInitFn, init_fn), cast(optax.TransformUpdateExtraArgsFn, update_fn)
    )


_UPDATE = "jamp.loss_scaling(...).update"
_RESTORED = "pass a restored state through jamp.check_restored, or start from tx.init(params)"


class MultiStepsTransformation(optax.GradientTransformationExtraArgs):
    """What [`multi_steps`][jamp.multi_steps] returns: a transformation with ``has_updated``."""

    def has_updated(self, state: optax.MultiStepsState) -> jax.Array:
        """Whether the last ``update`` emitted an accumulated step (``optax.MultiSteps``'s)."""
        return jnp.logical_and(state.mini_step == 0, jnp.greater(state.gradient_step, 0))


def _check_schedule(schedule: Callable[[ArrayLike], ArrayLike]) -> None:
    """A clear error, at construction, unless ``schedule`` given the first gradient step
    (an int32 0, as ``init`` counts it) returns a number of micro-steps >= 1: an optimizer
    factory such as ``optax.sgd`` would fail at the first update, inside it."""
    name = getattr(schedule, "__name__", type(schedule).__name__)
    want = (
        "Expected `every_k_schedule` to be an integer >= 1 or a function of the step count "
        "returning one"
    )
    try:
        # Only what it returns is checked here: the promotion rules are the caller's at
        # each update (optax's schedules mix int32 and float32 under "standard").
        with jax.numpy_dtype_promotion("standard"):
            k = schedule(jnp.zeros((), jnp.int32))
    except Exception as e:  # not a function of the step count
        raise TypeError(
            f"{want}, got {name}, which raised {type(e).__name__} given the step count 0: "
            f"{str(e):.200}"
        ) from e
    if isinstance(k, (np.ndarray, np.generic, jax.Array)):
        number = np.ndim(k) == 0 and np.dtype(k.dtype).kind in "iuf"
    else:
        number = is_real_number(k)
    if not number:
        hint = (
            ": an optimizer is no schedule (the optimizer is `inner`)"
            if isinstance(k, optax.GradientTransformation)
            else ""
        )
        shape = getattr(k, "shape", None)
        what = type(k).__name__ + ("" if shape is None else f" of shape {tuple(shape)}")
        raise TypeError(
            f"{want}, got {name}, which returned {what} given the step count 0 instead{hint}."
        )
    if not is_tracer(k) and not float(cast(float, k)) >= 1:
        raise ValueError(
            f"{want}, got {name}, which returned {float(cast(float, k))!r} micro-steps given "
            "the step count 0 instead."
        )


def multi_steps(
    inner: optax.GradientTransformation,
    every_k_schedule: int | Callable[[ArrayLike], ArrayLike],
    *,
    use_grad_mean: bool = True,
    should_skip_update_fn: optax.ShouldSkipUpdateFunction | None = None,
    accumulator_dtype: DTypeLike | None = jnp.float32,
) -> MultiStepsTransformation:
    """``optax.MultiSteps(inner, every_k_schedule, ...)`` that survives an overflow.

    Gradient accumulation over a loss-scaled optimizer with the scale constant
    across micro-steps, as in torch's recipe::

        tx = jamp.multi_steps(jamp.loss_scaling(optax.adamw(1e-3)), every_k_schedule=4)

    It averages the ``k`` gradients (``use_grad_mean=True``): do not divide
    the loss by ``k`` as torch's recipe does (its ``.grad`` sums them), or
    every step is ``k`` times smaller; keep the division only with
    ``use_grad_mean=False``.

    The arguments, the state (``optax.MultiStepsState``), the accumulation and
    the updates are ``optax.MultiSteps``'s, with two differences:

    - An inf in any micro-batch makes the accumulated step non-finite, and
      ``loss_scaling`` skips it at the boundary. ``optax.MultiSteps`` then
      resets its accumulator as ``(1 - emit) * acc``, and ``0 * inf`` is NaN,
      so every later accumulated step is non-finite too and training silently
      stops. Here each accumulation starts from zeros.
    - ``optax.MultiSteps`` runs ``inner`` on every micro-step and throws the
      result away but on the last one; here ``inner`` runs only on the last
      micro-step (under ``lax.cond``), so ``loss_scaling(...,
      report_nonfinite=True)`` logs once per real skip, not on every
      micro-step after a bad micro-batch, and the micro-steps cost only the
      accumulation.

    The other nesting, ``jamp.loss_scaling(optax.MultiSteps(inner, k))``,
    checks every micro-batch and drops only the one that overflowed; the scale
    may then change between micro-steps, which is harmless since what is
    accumulated is already unscaled.

    Keep ``should_skip_update_fn`` unset here: a skip before ``loss_scaling``
    (``optax.skip_not_finite``) hides every overflow from it, so the scale
    never backs off and every later step is skipped too.

    Returns:
      An Optax transformation with ``optax.MultiSteps``'s ``has_updated(state)``.

    Raises:
      TypeError: ``every_k_schedule`` is neither an integer nor a function of the
        step count returning a number: a function is called once, here, with the
        step count 0 (an optimizer factory such as ``optax.sgd`` is refused here,
        not at the first update).
      ValueError: ``every_k_schedule`` is below 1, or past ``2**31 - 1``, or its
        function returns fewer than 1 micro-step for the step count 0.
    """
    inner = checked_inner(inner)
    k = every_k_schedule
    if not callable(k):
        k = check_count("every_k_schedule", k, alternative=" or a function of the step count")
    else:
        _check_schedule(k)
    check_flag("use_grad_mean", use_grad_mean)
    if should_skip_update_fn is not None and not callable(should_skip_update_fn):
        raise TypeError(
            "Expected `should_skip_update_fn` to be None or a function "
            "(updates, gradient_step, params) -> (skip, skip_state), got "
            f"{should_skip_update_fn!r:.60} instead."
        )
    if accumulator_dtype is not None:
        dtype = None
        if not isinstance(accumulator_dtype, (bool, np.ndarray, np.generic, jax.Array)):
            try:
                dtype = jnp.dtype(accumulator_dtype)
            except Exception:  # a string or an object naming no dtype
                dtype = None
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                "Expected `accumulator_dtype` to be None or a floating dtype such as "
                f"jnp.float32, got {accumulator_dtype!r:.60} instead: an integer or boolean "
                "accumulator rounds every gradient it sums (optax.MultiSteps does too)."
            )
    reference = optax.MultiSteps(
        inner,
        k,
        use_grad_mean=use_grad_mean,
        should_skip_update_fn=should_skip_update_fn,
        # optax types it DTypeLike but takes None too (its canonicalize_dtype's default)
        accumulator_dtype=cast(DTypeLike, accumulator_dtype),
    )
    schedule: Callable[[ArrayLike], ArrayLike] = k if callable(k) else (lambda step: k)
    acc_dtype = None if accumulator_dtype is None else jnp.dtype(accumulator_dtype)

    def accumulate(grad: ArrayLike, acc: ArrayLike, n: jax.Array) -> jax.Array:
        # optax.MultiSteps's rules: Welford's running mean, or a sum, with the
        # casts standard promotion makes written out (strict promotion passes).
        grad, acc = jnp.asarray(grad), jnp.asarray(acc)  # Python numbers, as optax takes them
        with jax.numpy_dtype_promotion("standard"):
            dtype = jnp.promote_types(grad.dtype, acc.dtype)
        grad, acc = grad.astype(dtype), acc.astype(dtype)
        if not use_grad_mean:
            return grad + acc
        delta = grad - acc
        return acc + delta / (n + 1).astype(delta.dtype)

    def should_skip(
        updates: Updates, step: ArrayLike, params: Params | None
    ) -> tuple[ArrayLike, PyTree]:
        if should_skip_update_fn is None:
            return jnp.asarray(False), ()
        return should_skip_update_fn(updates, step, params)

    def update_fn(
        updates: Updates,
        state: optax.MultiStepsState,
        params: Params | None = None,
        **extra_args: object,
    ) -> tuple[Updates, optax.MultiStepsState]:
        check_own_state(state, optax.MultiStepsState, "optax.MultiStepsState")
        fn = "jamp.multi_steps(...).update"
        check_updates(updates, params, fn)
        where = first_mismatch(updates, state.acc_grads)
        if where is not None:
            raise ValueError(
                f"`{fn}` expected the gradients to match `state.acc_grads` (made by init for "
                "the parameters) leaf for leaf, got "
                f"{'another tree structure' if where == 'structure' else where}: pass the state "
                "from `tx.init(params)` for these parameters."
            )
        reference = updates if params is None else params
        inner_state, name = state.inner_opt_state, "state.inner_opt_state"
        check_state_matches(inner_state, inner.init, reference, name, fn, strict=False)
        with diagnosing(fn, inner_state, name, inner.init, reference, updates, params):
            return run(updates, state, params, **extra_args)

    def run(
        updates: Updates,
        state: optax.MultiStepsState,
        params: Params | None = None,
        **extra_args: object,
    ) -> tuple[Updates, optax.MultiStepsState]:
        # optax types the counters as ArrayLike: init makes them int32 arrays
        mini_step, gradient_step = (
            cast(jax.Array, state.mini_step),
            cast(jax.Array, state.gradient_step),
        )
        k_steps = schedule(gradient_step)
        skip, skip_state = should_skip(updates, gradient_step, params)
        acc = jax.tree_util.tree_map(
            lambda g, a: accumulate(g, a, mini_step), updates, state.acc_grads
        )
        emit = mini_step == k_steps - 1

        def apply() -> tuple[Updates, OptState]:
            final, new_inner = inner.update(
                optax.tree.cast_like(acc, updates), state.inner_opt_state, params, **extra_args
            )
            # optax.MultiSteps keeps the inner state in its dtypes.
            new_inner = jax.tree_util.tree_map(
                lambda old, new: new.astype(old.dtype), state.inner_opt_state, new_inner
            )
            return final, new_inner

        final, new_inner = cond_or_keep(
            emit & jnp.logical_not(skip),
            apply,
            lambda shapes: (no_updates(shapes[0]), state.inner_opt_state),
        )

        def reset(a: jax.Array) -> jax.Array:
            # A select, not (1 - emit) * acc: 0 * inf would be NaN.
            out = jnp.where(emit, jnp.zeros((), a.dtype), a)
            return out if acc_dtype is None else out.astype(acc_dtype)

        advanced = optax.MultiStepsState(
            # optax types safe_increment's result ArrayLike; it is an array like its input
            mini_step=cast(jax.Array, optax.safe_increment(mini_step)) % k_steps,
            gradient_step=jnp.where(emit, optax.safe_increment(gradient_step), gradient_step),
            inner_opt_state=new_inner,
            acc_grads=jax.tree_util.tree_map(reset, acc),
            skip_state=skip_state,
        )
        if should_skip_update_fn is None:
            return final, advanced
        # A skipped micro-batch leaves the state as it was, bar skip_state.
        kept = state._replace(skip_state=skip_state)
        return final, jax.tree_util.tree_map(lambda a, b: jnp.where(skip, a, b), kept, advanced)

    # optax types states as ArrayTrees: an update taking its MultiStepsState is not one.
    return MultiStepsTransformation(
        reference.init, cast(optax.TransformUpdateExtraArgsFn, update_fn)
    )
