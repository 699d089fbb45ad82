"""``jamp.value_and_grad``: scale, differentiate, unscale, check and update in one call.

``filter_value_and_grad`` is the same with Equinox's convention (an
``eqx.Module`` goes in as it is), and ``step_if_finite`` applies an optimizer
step to gradients they return, unless they were not finite.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.typing import ArrayLike

from jamp._src.finite.check import unscaled_and_finite
from jamp._src.leaves import combine, is_inexact_array, partition
from jamp._src.loss_scale import LossScaleState, backoff, scale_tree, update_state
from jamp._src.skip import optimizer_step
from jamp._src.types import AxisName, Filter, Grads, OptState, Params, PyTree, is_tracer
from jamp._src.validate import (
    check_axis_name,
    check_bool_scalar,
    check_count,
    check_flag,
    check_skip,
    check_step_arguments,
)


class ScaledValueAndGrad(NamedTuple):
    """What [`value_and_grad`][jamp.value_and_grad]'s function returns.

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

    value: PyTree
    aux: PyTree
    grads: Grads
    finite: jax.Array
    loss_scale: LossScaleState
    retries: jax.Array


def value_and_grad(
    fun: Callable[..., PyTree],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    axis_name: AxisName | None = None,
    max_retries: int = 0,
) -> Callable[..., ScaledValueAndGrad]:
    """``jax.value_and_grad`` of a scaled loss, unscaled and checked in one call.

    The returned function takes the loss-scale state first, then ``fun``'s
    arguments. It scales ``fun``'s value, differentiates, unscales the
    gradients, checks them, and updates the scale: flax's
    ``DynamicScale.value_and_grad``, with growth on the ``growth_interval``-th
    finite step (torch's rule, not one step later) and gradients kept in their
    own dtypes. For an Equinox module, use [`filter_value_and_grad`][jamp.filter_value_and_grad].

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
    max_retries = _check_options(fun, axis_name, max_retries, has_aux)
    _check_argnums(argnums)
    scaled = _scaled(fun, has_aux)

    @_named_like(fun)
    def wrapped(loss_scale: LossScaleState, *args: PyTree, **kwargs: PyTree) -> ScaledValueAndGrad:
        _check_loss_scale(loss_scale, "value_and_grad")
        shifted = _shift(argnums, len(args))
        _check_differentiable(args, argnums)
        grad_fn = jax.grad(scaled, argnums=shifted, has_aux=True)
        return _run(
            lambda state: grad_fn(state, *args, **kwargs), loss_scale, axis_name, max_retries
        )

    return wrapped


def filter_value_and_grad(
    fun: Callable[..., PyTree],
    *,
    has_aux: bool = False,
    axis_name: AxisName | None = None,
    max_retries: int = 0,
) -> Callable[..., ScaledValueAndGrad]:
    """[`jamp.value_and_grad`][] with Equinox's convention: an ``eqx.Module`` goes in as it is.

    ``eqx.filter_value_and_grad`` of a scaled loss, unscaled and checked in
    one call. The gradients are taken with respect to the floating (and
    complex) array leaves of ``fun``'s first argument, the leaves
    ``eqx.is_inexact_array`` selects; every other leaf of it (an Equinox
    module's activation functions, flags, integer arrays) and every other
    argument is treated as static, so it may be anything. Equinox is not
    needed: any pytree works.

    The returned function takes the loss-scale state first, then ``fun``'s
    arguments: ``(loss_scale, model, *args, **kwargs)``. Its ``grads`` have
    the structure of ``model``, with ``None`` in place of the leaves that
    are not differentiated, as ``eqx.filter_grad`` gives them, so they go to
    ``optimizer.update`` and ``eqx.apply_updates`` (or
    [`step_if_finite`][jamp.step_if_finite]) unchanged. Everything else is as in
    [`value_and_grad`][jamp.value_and_grad]: the value is unscaled, the gradients are
    unscaled in their own dtypes and checked, the scale is updated.

    Args:
      fun: ``fun(model, *args, **kwargs)`` returns a scalar loss (and
        auxiliary data, such as an ``eqx.nn.State``, with ``has_aux=True``).
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      axis_name: as in [`value_and_grad`][jamp.value_and_grad].
      max_retries: as in [`value_and_grad`][jamp.value_and_grad].

    Returns:
      A function ``(loss_scale, model, *args, **kwargs) -> ScaledValueAndGrad``.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> model = {"w": jnp.array([1.0, 2.0]), "act": jnp.tanh, "n": 3}  # holds a function
      >>> loss = lambda m, x: jnp.sum(m["w"] * x) * m["n"]
      >>> out = jamp.filter_value_and_grad(loss)(jamp.dynamic_loss_scale(), model, 2.0)
      >>> out.grads
      {'act': None, 'n': None, 'w': Array([6., 6.], dtype=float32)}
      >>> float(out.value), bool(out.finite)
      (18.0, True)
    """
    max_retries = _check_options(fun, axis_name, max_retries, has_aux)

    @_named_like(fun)
    def wrapped(loss_scale: LossScaleState, *args: PyTree, **kwargs: PyTree) -> ScaledValueAndGrad:
        _check_loss_scale(loss_scale, "filter_value_and_grad")
        if not args:
            raise TypeError(
                "The function from jamp.filter_value_and_grad differentiates `fun`'s first "
                "positional argument (the model), got none: call it as "
                "f(loss_scale, model, *args)."
            )
        model, rest = args[0], args[1:]
        diff, static = partition(model, is_inexact_array)
        scaled = _scaled(lambda d: fun(combine(d, static), *rest, **kwargs), has_aux)
        grad_fn = jax.grad(scaled, argnums=1, has_aux=True)
        return _run(lambda state: grad_fn(state, diff), loss_scale, axis_name, max_retries)

    return wrapped


def step_if_finite(
    finite: ArrayLike,
    tx: optax.GradientTransformation,
    grads: Grads,
    opt_state: OptState,
    params: Params,
    *,
    filter: Filter = None,
    skip: str = "auto",
    **extra_args: object,
) -> tuple[Params, OptState]:
    """Apply the optimizer step where ``finite`` holds; else keep parameters and state.

    The skip for [`value_and_grad`][jamp.value_and_grad] and
    [`filter_value_and_grad`][jamp.filter_value_and_grad], whose gradients are already
    unscaled and checked: ``tx.update``, then ``optax.apply_updates``, inside a
    ``lax.cond`` (or selected, with ``skip="select"``; see [`jamp.loss_scaling`][]),
    so on a skipped step the parameters and ``opt_state`` come back unchanged
    (Adam's count does not advance). MPX's ``optimizer_update``.

    Args:
      finite: a boolean scalar, the ``finite`` of a [`ScaledValueAndGrad`][jamp.ScaledValueAndGrad].
      tx: an Optax transformation.
      grads: unscaled gradients; ``None`` leaves (``eqx.filter_grad``'s) leave
        their parameter as it is.
      opt_state: ``tx``'s state.
      params: the parameters, or an Equinox module with ``filter``.
      filter: a predicate on leaves: ``tx`` and the skip see only the leaves
        of ``params`` it selects (``eqx.filter(params, filter)``); pass the
        filter the optimizer state was initialised with (``eqx.is_array`` for
        ``tx.init(eqx.filter(model, eqx.is_array))``). The others are
        returned untouched. By default every leaf of ``params`` is a
        parameter.
      skip: ``"auto"`` (default: ``"select"`` on GPUs and TPUs, ``"cond"`` on
        CPUs), ``"cond"`` or ``"select"``; see [`jamp.loss_scaling`][].
      **extra_args: passed on to ``tx.update``.

    Returns:
      ``(params, opt_state)``.

    Examples:
      >>> import jax.numpy as jnp, optax, jamp
      >>> tx = optax.sgd(0.5)
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> vg = jamp.value_and_grad(lambda p: jnp.sum(p["w"] ** 2))
      >>> out = vg(jamp.dynamic_loss_scale(), params)
      >>> jamp.step_if_finite(out.finite, tx, out.grads, opt_state, params)[0]
      {'w': Array([0., 0.], dtype=float32)}
      >>> jamp.step_if_finite(jnp.bool_(False), tx, out.grads, opt_state, params)[0]  # skipped
      {'w': Array([1., 1.], dtype=float32)}
    """
    finite = check_bool_scalar(finite, "finite", "the `finite` of jamp.value_and_grad")
    check_skip(skip)
    check_step_arguments(tx, grads, opt_state, params, filter=filter, fn="step_if_finite")
    return optimizer_step(
        finite,
        tx,
        lambda: grads,
        opt_state,
        params,
        grads=grads,
        filter=filter,
        skip=skip,
        extra_args=extra_args,
        fn="step_if_finite",
    )


F = TypeVar("F", bound=Callable[..., object])


def _named_like(fun: Callable[..., object]) -> Callable[[F], F]:
    """``functools.wraps(fun)`` without ``__wrapped__``: the wrapper takes the loss-scale
    state first, so its signature is its own (``eqx.filter_jit`` binds arguments by it)."""

    def decorate(wrapper: F) -> F:
        functools.update_wrapper(wrapper, fun)
        delattr(wrapper, "__wrapped__")  # set by update_wrapper, unknown to a Callable
        return wrapper

    return decorate


def _check_options(fun: object, axis_name: object, max_retries: object, has_aux: object) -> int:
    """The options of ``value_and_grad`` and ``filter_value_and_grad``, checked; returns
    ``max_retries`` as a Python int."""
    if not callable(fun):
        raise TypeError(f"Expected `fun` to be callable, got {type(fun).__name__} instead.")
    check_axis_name(axis_name)
    retries = check_count("max_retries", max_retries, lo=0)
    check_flag("has_aux", has_aux, " (True when `fun` returns (loss, aux))")
    return retries


def _check_loss_scale(loss_scale: object, fn: str) -> None:
    if not isinstance(loss_scale, LossScaleState):
        raise TypeError(
            f"The function from jamp.{fn} takes the loss-scale state as its first argument, "
            f"got {type(loss_scale).__name__} instead."
        )


def _scaled(fun: Callable[..., PyTree], has_aux: bool) -> Callable[..., PyTree]:
    """``(state, *args) -> (scale(state, loss), (loss, aux))`` for ``jax.grad(has_aux=True)``."""

    def scaled(
        state: LossScaleState, *args: PyTree, **kwargs: PyTree
    ) -> tuple[jax.Array, tuple[PyTree, PyTree]]:
        out = fun(*args, **kwargs)
        if has_aux and not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "Expected `fun` to return a pair (loss, aux) with has_aux=True, got "
                f"{type(out).__name__} instead."
            )
        loss, aux = out if has_aux else (out, None)
        return scale_tree(state, loss), (loss, aux)

    return scaled


def _run(
    grad_fn: Callable[[LossScaleState], tuple[Grads, tuple[PyTree, PyTree]]],
    loss_scale: LossScaleState,
    axis_name: AxisName | None,
    max_retries: int,
) -> ScaledValueAndGrad:
    """Differentiate at ``loss_scale`` (``grad_fn(state) -> (grads, (loss, aux))``),
    unscale, check, retry at lower scales if asked, and update the scale."""

    def attempt(state: LossScaleState) -> tuple[PyTree, PyTree, Grads, jax.Array]:
        grads, (loss, aux) = grad_fn(state)
        grads, finite = unscaled_and_finite(state, grads, axis_name)
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
    new_scale = update_state(loss_scale, finite)
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


def _check_argnums(argnums: object) -> None:
    ok = isinstance(argnums, int) and not isinstance(argnums, bool)
    if isinstance(argnums, Sequence) and not isinstance(argnums, str):
        ok = len(argnums) > 0 and all(
            isinstance(a, int) and not isinstance(a, bool) for a in argnums
        )
    if not ok:
        raise TypeError(
            f"Expected `argnums` to be an int or a sequence of ints, got {argnums!r} instead."
        )


def _check_differentiable(args: tuple, argnums: int | Sequence[int]) -> None:
    """A TypeError naming the leaf of a differentiated argument that is not a floating or
    complex array (or Python float), which ``jax.grad`` refuses from deep inside."""
    for i in (argnums,) if isinstance(argnums, int) else tuple(argnums):
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
            if (
                isinstance(leaf, (float, complex))
                or is_inexact_array(leaf)
                or (is_tracer(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact))
            ):
                continue
            dtype = getattr(leaf, "dtype", None)
            described = type(leaf).__name__ + ("" if dtype is None else f" of dtype {dtype}")
            raise TypeError(
                f"`jamp.value_and_grad` differentiates positional argument {i} of `fun` "
                f"(argnums={argnums}), got a leaf of type {described} at path "
                f"{jax.tree_util.keystr(path) or '<root>'} instead: only floating and complex "
                "arrays can be differentiated. Pass floating arrays there, or use "
                "jamp.filter_value_and_grad, which differentiates only the floating leaves."
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
