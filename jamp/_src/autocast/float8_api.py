"""float8's entry points: the first state of a delayed-scaling autocast function
(``jamp.float8.init``) and the telemetry argument of one with telemetry
(``jamp.float8.telemetry_init``). Each traces the function (``autocast.transform``) and
finds its float8 products (``autocast.float8.sites``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jamp._src.autocast.float8 import init_states, init_telemetry, sites
from jamp._src.autocast.transform import Float8Function, trace
from jamp._src.float8.recipe import Float8State
from jamp._src.float8.telemetry import Telemetry

__all__ = ["float8_init", "telemetry_init"]


def float8_init(fun: Callable, *args: Any, **kwargs: Any) -> dict[str, Float8State]:
    """The first float8 state of a delayed-scaling autocast function.

    ``fun`` is what ``jamp.autocast(f, "float8", recipe=jamp.float8.DelayedScaling(...))``
    returned; ``args`` and ``kwargs`` are ``f``'s arguments (arrays or
    ``jax.ShapeDtypeStruct``), without the state. ``f`` is traced, not run.
    The state holds one [`jamp.float8.Float8State`][] per float8 matrix product,
    keyed ``"<i>:<scope>"`` in program order (``scope`` is the product's name
    stack, e.g. a Flax module path, with ``.`` for ``/``: ``"0:MLP.Dense_0"``;
    ``"<i>:dot_general"`` without one), with an empty amax history and scales
    of 1, as Transformer Engine starts (0, "not measured yet", so that the
    first step uses current scales, with ``unmeasured="current"``: see
    [`jamp.float8.DelayedScaling`][]). A product inside a ``lax.scan`` of
    length ``n`` has ``n`` states, stacked along a leading axis; products
    inside ``while_loop``, ``cond`` and custom-derivative bodies use current
    scaling and have none.

    Args:
      fun: a function returned by [`autocast`][jamp.autocast] with ``dtype="float8"`` and
        a ``recipe``.
      *args: ``f``'s positional arguments after the state.
      **kwargs: ``f``'s keyword arguments.

    Returns:
      A dict ``{key: Float8State}``, to pass as ``fun``'s first argument.

    Raises:
      TypeError: ``fun`` is not a delayed-scaling autocast function.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> def loss(w, x):
      ...   return jnp.sum(x @ w)
      >>> f = jamp.autocast(loss, "float8", recipe=jamp.float8.DelayedScaling(amax_history_len=4))
      >>> w, x = jnp.full((3, 3), 0.5), jnp.ones((2, 3))
      >>> state = jamp.float8.init(f, w, x)
      >>> list(state), state["0:dot_general"].amax_history.shape
      (['0:dot_general'], (3, 4))
      >>> state, grads = jax.grad(f, argnums=(0, 1))(state, w, x)  # the next state
      >>> state["0:dot_general"].amax_history[:, 0]  # the amaxes of x, w and the gradient
      Array([1. , 0.5, 1. ], dtype=float32)
      >>> state["0:dot_general"].scale  # 448 / 1, 448 / 0.5, 57344 / 1: the next step's
      Array([  448.,   896., 57344.], dtype=float32)
    """
    if not isinstance(fun, Float8Function) or fun.recipe is None:
        raise TypeError(
            "Expected for `fun` a function returned by jamp.autocast(f, 'float8', "
            f"recipe=jamp.float8.DelayedScaling(...)), got {fun!r} instead; jamp.float8.init "
            "creates the state that such a function takes first."
        )
    closed, _, _ = trace(fun.traced, args, kwargs, shapes=True)
    return init_states(sites(closed), fun.recipe)


def telemetry_init(fun: Callable, *args: Any, **kwargs: Any) -> dict[str, Telemetry]:
    """The telemetry argument of a float8 autocast function made with ``telemetry=True``.

    ``fun`` is what ``jamp.autocast(f, "float8", telemetry=True)`` returned
    (with a ``recipe`` or without); ``args`` and ``kwargs`` are ``f``'s
    arguments (arrays or ``jax.ShapeDtypeStruct``), without the state and
    the telemetry. ``f`` is traced, not run. The telemetry holds one
    [`jamp.float8.Telemetry`][] of zeros per float8 matrix product, with the
    keys of the delayed-scaling state (``"<i>:<scope>"``, see
    [`jamp.float8.init`][]); a product inside a ``lax.scan`` of length ``n``
    has ``n``, stacked along a leading axis; products inside ``while_loop``,
    ``cond`` and custom-derivative bodies have none (they report nothing).

    ``fun`` ignores the values of its telemetry argument: its *cotangent* is
    the step's telemetry. ``jax.grad`` (or ``jax.value_and_grad``) with
    respect to it returns the amax, scale and fractions underflowed and
    saturated of each product's operands and output gradient, as arrays, in
    the pass that computes the gradients: no host callback, no
    synchronisation. Pass the same zeros every step.

    Args:
      fun: a function returned by [`autocast`][jamp.autocast] with ``dtype="float8"`` and
        ``telemetry=True``.
      *args: ``f``'s positional arguments after the state and the telemetry.
      **kwargs: ``f``'s keyword arguments.

    Returns:
      A dict ``{key: Telemetry}`` of float32 zeros ``(..., 3)``, to pass as
      ``fun``'s first argument (its second, after the state, with a recipe).

    Raises:
      TypeError: ``fun`` is not a float8 autocast function with telemetry.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> def loss(w, x):
      ...   return jnp.sum(x @ w)
      >>> f = jamp.autocast(loss, "float8", telemetry=True)
      >>> w, x = jnp.full((3, 3), 0.5), jnp.ones((2, 3))
      >>> zeros = jamp.float8.telemetry_init(f, w, x)
      >>> list(zeros), zeros["0:dot_general"].amax.shape
      (['0:dot_general'], (3,))
      >>> stats, grads = jax.grad(f, argnums=(0, 1))(zeros, w, x)
      >>> stats["0:dot_general"].scale  # 448 / 1, 448 / 0.5, 57344 / 1
      Array([  448.,   896., 57344.], dtype=float32)
    """
    if not isinstance(fun, Float8Function) or not fun.telemetry:
        raise TypeError(
            "Expected for `fun` a function returned by jamp.autocast(f, 'float8', "
            f"telemetry=True), got {fun!r} instead; jamp.float8.telemetry_init creates the "
            "telemetry argument that such a function takes first (after the state, with a "
            "recipe)."
        )
    closed, _, _ = trace(fun.traced, args, kwargs, shapes=True)
    return init_telemetry(sites(closed))
