"""Finding jamp's state inside optimizer states: ``get_loss_scale`` and ``metrics``.

Looks through any nesting of Optax states, a Flax ``TrainState``, an
``nnx.Optimizer`` (whose NNX variables are unwrapped), and trees whose
pytree nodes were flattened into mappings: ``nnx.state(optimizer)``, or a
checkpoint restored without a target. Those keep the arrays but not the
configuration, so the state found there is a static snapshot of the scale.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jamp._src.loss_scale import STATIC, LossScaleState, restore
from jamp._src.loss_scaling import ScaledOptimizerState
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


_FIELDS = ("scale", "growth_tracker", "overflow_streak")


def _flattened(tree: Any) -> dict[tuple, dict[str, Any]]:
    """Mappings of ``tree`` holding a loss-scale state's fields: ``{path: {field: array}}``.

    ``nnx.state(optimizer)`` (and a checkpoint restored without a target)
    turns every pytree node into a mapping, so a :class:`LossScaleState`
    becomes ``{"scale": ..., "growth_tracker": ..., "overflow_streak": ...}``
    beside ``last_finite`` and ``skipped_steps``. A real state's fields are
    attributes, not mapping keys, so it is never found here.
    """
    groups: dict[tuple, dict[str, Any]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(_unwrapped(tree))[0]:
        last = path[-1] if path else None
        if isinstance(last, jax.tree_util.DictKey) and isinstance(last.key, str):
            groups.setdefault(tuple(path[:-1]), {})[last.key] = leaf
    return groups


def _snapshot(fields: dict[str, Any]) -> LossScaleState:
    """A static state holding a flattened state's scale and counters (no configuration)."""
    return LossScaleState(
        scale=jnp.asarray(fields["scale"], jnp.float32),
        growth_tracker=jnp.asarray(fields["growth_tracker"], jnp.int32),
        overflow_streak=jnp.asarray(fields["overflow_streak"], jnp.int32),
        kind=STATIC,
    )


def _find_flattened(tree: Any) -> list[tuple[Any, Any]]:
    return [
        (path, _snapshot(fields))
        for path, fields in _flattened(tree).items()
        if all(f in fields for f in _FIELDS)
    ]


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
    return bool(_find(tree, LossScaleState) or _find_flattened(tree))


def get_loss_scale(opt_state: Any) -> LossScaleState:
    """The :class:`jamp.LossScaleState` inside any optimizer state.

    Looks through any nesting of Optax states (``chain``, ``named_chain``,
    ``MultiSteps``, ``inject_hyperparams``, ...), a Flax ``TrainState`` (its
    ``opt_state``, else its other fields, such as a ``loss_scale`` field kept
    beside :func:`value_and_grad`) and an ``nnx.Optimizer`` (or its
    ``opt_state``, whose NNX variables are unwrapped).

    ``nnx.state(optimizer)`` (and a checkpoint restored without a target)
    keeps the state's arrays in mappings but drops its configuration (the
    growth factor, interval and bounds are static pytree metadata). There the
    state comes back as a *static* snapshot of the scale and counters: right
    for scaling a loss and for logging, not for :func:`jamp.update` (pass the
    optimizer itself, or the state from ``nnx.split``'s graph, for that).

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
    found = _find(opt_state, LossScaleState) or _find_flattened(opt_state)
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


def check_restored(tree: Any) -> Any:
    """``tree`` with every loss-scale state in it validated as a restored one.

    ``flax.serialization`` and :meth:`jamp.GradScaler.load_state_dict` validate
    what they restore; a checkpointer that rebuilds the pytree itself (Orbax's
    ``StandardCheckpointer.restore(path, target)``) cannot call jamp. Pass its
    result through this: a NaN or non-positive scale raises a ``ValueError``
    naming where it is, a scale outside ``[min_scale, max_scale]`` is clamped
    into them, a growth tracker at or past ``growth_interval`` is held one
    short of it, and Python or NumPy numbers become float32/int32 device
    arrays. Everything else in ``tree`` is returned as it is.

    Args:
      tree: a restored optimizer state, Flax ``TrainState``, or any pytree.

    Returns:
      ``tree`` with its :class:`jamp.LossScaleState` leaves validated.

    Raises:
      ValueError: a scale that is not positive and finite, or a negative counter.
      TypeError: a value of the wrong type (a traced value: call it outside ``jit``).

    Examples:
      >>> import dataclasses, jax.numpy as jnp, optax, jamp
      >>> state = jamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> restored = dataclasses.replace(state.loss_scale, growth_tracker=jnp.int32(5000))
      >>> fixed = jamp.check_restored(state._replace(loss_scale=restored))
      >>> int(fixed.loss_scale.growth_tracker)  # held one short of growth_interval=2000
      1999
    """

    def one(path: Any, x: Any) -> Any:
        if not isinstance(x, LossScaleState):
            return x
        where = jax.tree_util.keystr(path, simple=True, separator="/")
        return restore(
            x, x.scale, x.growth_tracker, x.overflow_streak, where=f"{where}/" if where else ""
        )

    return jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: isinstance(x, LossScaleState)
    )


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
    found = _find(state, ScaledOptimizerState)
    if len(found) == 1:
        s = _unwrapped(found[0][1])
        return {
            "loss_scale": s.loss_scale.scale,
            "growth_tracker": s.loss_scale.growth_tracker,
            "last_finite": s.last_finite,
            "skipped_steps": s.skipped_steps,
        }
    flat = _flattened(state)
    for path, fields in flat.items():  # nnx.state(optimizer): loss_scaling's fields
        inner = flat.get((*path, jax.tree_util.DictKey("loss_scale")), {})
        if all(f in inner for f in _FIELDS) and {"last_finite", "skipped_steps"} <= set(fields):
            return {
                "loss_scale": jnp.asarray(inner["scale"], jnp.float32),
                "growth_tracker": jnp.asarray(inner["growth_tracker"], jnp.int32),
                "last_finite": jnp.asarray(fields["last_finite"]),
                "skipped_steps": jnp.asarray(fields["skipped_steps"], jnp.int32),
            }
    ls_state = get_loss_scale(state)  # a clear error for none, or several
    return {"loss_scale": ls_state.scale, "growth_tracker": ls_state.growth_tracker}
