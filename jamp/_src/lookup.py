"""Finding jamp's state inside optimizer states: ``get_loss_scale`` and ``metrics``.

Looks through any nesting of Optax states, a Flax ``TrainState`` and an
``nnx.Optimizer`` (whose NNX variables are unwrapped).
"""

from __future__ import annotations

from typing import Any

import jax

from jamp._src.loss_scale import LossScaleState
from jamp._src.loss_scaling import LossScalingState
from jamp._src.value_and_grad import ScaledValueAndGrad


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
    return bool(_find(tree, LossScaleState))


def get_loss_scale(opt_state: Any) -> LossScaleState:
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
    found = _find(opt_state, LossScaleState)
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
    if isinstance(state, LossScaleState):
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
