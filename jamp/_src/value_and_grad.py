"""``jamp.value_and_grad``: scale, differentiate, unscale, check and update in one call."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jamp._src.finite import check_axis_name, unscale_and_check
from jamp._src.loss_scale import LossScaleState, backoff, scale, update


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
    loss_scale: LossScaleState
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
    check_axis_name(axis_name)
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(
            f"Expected `max_retries` to be an int >= 0, got max_retries={max_retries!r} instead."
        )

    def scaled(state: LossScaleState, *args: Any, **kwargs: Any) -> Any:
        out = fun(*args, **kwargs)
        if has_aux and not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "Expected `fun` to return a pair (loss, aux) with has_aux=True, got "
                f"{type(out).__name__} instead."
            )
        loss, aux = out if has_aux else (out, None)
        return scale(state, loss), (loss, aux)

    _check_argnums(argnums)

    @functools.wraps(fun)
    def wrapped(loss_scale: LossScaleState, *args: Any, **kwargs: Any) -> ScaledValueAndGrad:
        if not isinstance(loss_scale, LossScaleState):
            raise TypeError(
                "The function from jamp.value_and_grad takes the loss-scale state as its "
                f"first argument, got {type(loss_scale).__name__} instead."
            )
        grad_fn = jax.grad(scaled, argnums=_shift(argnums, len(args)), has_aux=True)

        def attempt(state: LossScaleState) -> tuple[Any, Any, Any, jax.Array]:
            grads, (loss, aux) = grad_fn(state, *args, **kwargs)
            grads, finite = unscale_and_check(state, grads, axis_name=axis_name)
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
                state = backoff(state)
                return retries + 1, state, attempt(state)

            retries, loss_scale, (loss, aux, grads, finite) = lax.while_loop(
                cond, body, (retries, loss_scale, (loss, aux, grads, finite))
            )
        new_scale = update(loss_scale, finite)
        if retrying:
            # The last failed attempt backs off too, ignoring hysteresis.
            backed_off = backoff(loss_scale).scale
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
