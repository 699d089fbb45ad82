"""Finding jamp's state inside optimizer states: ``get_loss_scale`` and ``metrics``.

Looks through any nesting of Optax states, a Flax ``TrainState``, an
``nnx.Optimizer`` (whose NNX variables are unwrapped), and trees whose
pytree nodes were flattened into mappings: ``nnx.state(optimizer)``, or a
checkpoint restored without a target. Those keep the arrays but not the
configuration, so the state found there is a static snapshot of the scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import KeyPath

from jamp._src.float8.recipe import Float8State, check_values
from jamp._src.leaves import find_nodes
from jamp._src.loss_scale import DATA_FIELDS, STATIC, LossScaleState, placed_like, restore
from jamp._src.loss_scaling import ScaledOptimizerState
from jamp._src.optimizer.master import MasterWeightsState
from jamp._src.types import OptState, PyTree, is_tracer
from jamp._src.validate import check_bool_scalar, checked_counter, checked_scale
from jamp._src.value_and_grad import ScaledValueAndGrad


def _unwrap(x: PyTree) -> PyTree:
    """The array inside an NNX ``Variable`` (or anything with ``get_value``)."""
    if isinstance(x, jax.Array) or not hasattr(x, "get_value"):
        return x
    return x.get_value()


def _unwrapped(tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map(
        _unwrap, tree, is_leaf=lambda x: hasattr(x, "get_value") and not isinstance(x, jax.Array)
    )


def _flattened(tree: PyTree) -> dict[KeyPath, dict[str, object]]:
    """Mappings of ``tree`` holding a loss-scale state's fields: ``{path: {field: array}}``.

    ``nnx.state(optimizer)`` (and a checkpoint restored without a target)
    turns every pytree node into a mapping, so a [`LossScaleState`][jamp.LossScaleState]
    becomes ``{"scale": ..., "growth_tracker": ..., "overflow_streak": ...}``
    beside ``last_finite`` and ``skipped_steps``. A real state's fields are
    attributes, not mapping keys, so it is never found here.
    """
    groups: dict[KeyPath, dict[str, object]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(_unwrapped(tree))[0]:
        if not path:
            continue
        last = path[-1]
        if isinstance(last, jax.tree_util.DictKey) and isinstance(last.key, str):
            groups.setdefault(tuple(path[:-1]), {})[last.key] = leaf
    return groups


_UNVALIDATED = (
    "A tree restored without a target (Orbax, flax) has lost the state's configuration and "
    "was never validated: restore into a target (`StandardCheckpointer().restore(path, "
    "target)`) and pass the result through jamp.check_restored"
)


def _field(path: KeyPath, key: str, value: object, kind: str, arg: str = "opt_state") -> jax.Array:
    """A flattened state's field as a typed device array, validated: ``kind`` is
    ``"scale"`` (positive and finite), ``"count"`` (an integer in [0, 2**31 - 1]) or
    ``"flag"`` (a bool). A traced value (``nnx.state`` under ``jit``) is checked by its
    dtype and shape only."""
    name = f"{arg}{jax.tree_util.keystr((*path, jax.tree_util.DictKey(key)))}"
    if is_tracer(value) or (isinstance(value, jax.Array) and not value.is_fully_addressable):
        dtype, shape = np.dtype(value.dtype), tuple(value.shape)
        want = {"scale": np.floating, "count": np.integer, "flag": np.bool_}[kind]
        if shape != () or not np.issubdtype(dtype, want):
            raise TypeError(
                f"Expected `{name}` to be a {want.__name__} scalar, got an array of dtype "
                f"{dtype} and shape {shape} instead. {_UNVALIDATED}."
            )
        return value.astype({"scale": jnp.float32, "count": jnp.int32, "flag": jnp.bool_}[kind])
    try:
        if kind == "scale":
            return jnp.asarray(checked_scale(name, value), jnp.float32)
        if kind == "count":
            return jnp.asarray(checked_counter(name, value), jnp.int32)
        return jnp.asarray(check_bool_scalar(value, name, "as jamp.loss_scaling saved it"))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e} {_UNVALIDATED}.") from None


def _snapshot(path: KeyPath, fields: dict[str, object], arg: str = "opt_state") -> LossScaleState:
    """A static state holding a flattened state's scale and counters (no configuration),
    validated (``_field``)."""
    return LossScaleState(
        scale=_field(path, "scale", fields["scale"], "scale", arg),
        growth_tracker=_field(path, "growth_tracker", fields["growth_tracker"], "count", arg),
        overflow_streak=_field(path, "overflow_streak", fields["overflow_streak"], "count", arg),
        kind=STATIC,
    )


def _find_flattened(tree: PyTree) -> list[tuple[KeyPath, dict[str, object]]]:
    return [
        (path, fields)
        for path, fields in _flattened(tree).items()
        if all(f in fields for f in DATA_FIELDS)
    ]


def _find(tree: PyTree, kind: type) -> list[tuple[KeyPath, PyTree]]:
    """Every ``kind`` in ``tree``; for an object with an ``opt_state`` (flax
    TrainState, nnx.Optimizer), those in its ``opt_state``, else those in the
    whole object (a TrainState with a ``loss_scale`` field of its own)."""
    if hasattr(tree, "opt_state") and not isinstance(tree, tuple):
        found = find_nodes(tree.opt_state, kind)
        if found:
            return found
    return find_nodes(tree, kind)


def holds_loss_scale(tree: PyTree) -> bool:
    """Whether ``tree`` holds a loss-scale state anywhere [`jamp.get_loss_scale`][] looks."""
    return bool(_find(tree, LossScaleState) or _find_flattened(tree))


def get_loss_scale(opt_state: OptState) -> LossScaleState:
    """The [`jamp.LossScaleState`][] inside any optimizer state.

    Looks through any nesting of Optax states (``chain``, ``named_chain``,
    ``MultiSteps``, ``inject_hyperparams``, ...), a Flax ``TrainState`` (its
    ``opt_state``, else its other fields, such as a ``loss_scale`` field kept
    beside [`value_and_grad`][jamp.value_and_grad]) and an ``nnx.Optimizer`` (or its
    ``opt_state``, whose NNX variables are unwrapped).

    ``nnx.state(optimizer)`` (and a checkpoint restored without a target)
    keeps the state's arrays in mappings but drops its configuration (the
    growth factor, interval and bounds are static pytree metadata). There the
    state comes back as a *static* snapshot of the scale and counters: right
    for scaling a loss and for logging, not for [`jamp.update`][] (pass the
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
    found = _find(opt_state, LossScaleState)
    flattened = not found
    if flattened:
        found = _find_flattened(opt_state)
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
    path, state = found[0]
    if flattened:
        return _snapshot(path, state)
    return _unwrapped(state)


def check_restored(tree: PyTree) -> PyTree:
    """``tree`` with every loss-scale state in it validated as a restored one.

    ``flax.serialization`` and [`jamp.GradScaler.load_state_dict`][] validate
    what they restore; a checkpointer that rebuilds the pytree itself (Orbax's
    ``StandardCheckpointer.restore(path, target)``) cannot call jamp. Pass its
    result through this: a NaN or non-positive scale raises a ``ValueError``
    naming where it is, a scale outside ``[min_scale, max_scale]`` is clamped
    into them, a growth tracker at or past ``growth_interval`` is held one
    short of it, and Python or NumPy numbers become float32/int32 device
    arrays. A disabled target (``jamp.no_loss_scale()``) keeps its scale of 1.
    The counters of a [`jamp.loss_scaling`][] state are checked too
    (``skipped_steps`` an integer in ``[0, 2**31 - 1]``, ``last_finite`` a
    bool), and so is every [`jamp.float8.Float8State`][]: its amaxes >= 0, its
    scales finite, >= 0 and the ones its amax history gives
    (``finfo.max / amax / 2**margin``). Arrays that pass keep their
    placement (a step resumed from Orbax compiles no more often than
    without this); everything else in ``tree`` is returned as it is.

    Args:
      tree: a restored optimizer state, Flax ``TrainState``, or any pytree.

    Returns:
      ``tree`` with its [`jamp.LossScaleState`][] leaves, its
      [`jamp.loss_scaling`][] counters and its [`jamp.float8.Float8State`][]
      leaves validated.

    Raises:
      ValueError: a scale that is not positive and finite, a counter out of
        range, a float8 scale its amax history does not give.
      TypeError: a value of the wrong type (a traced value: call it outside ``jit``).

    Examples:
      >>> import dataclasses, jax.numpy as jnp, optax, jamp
      >>> state = jamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> restored = dataclasses.replace(state.loss_scale, growth_tracker=jnp.int32(5000))
      >>> fixed = jamp.check_restored(state._replace(loss_scale=restored))
      >>> int(fixed.loss_scale.growth_tracker)  # held one short of growth_interval=2000
      1999
    """

    def prefix(path: KeyPath) -> str:
        where = jax.tree_util.keystr(path, simple=True, separator="/")
        return f"{where}/" if where else ""

    def counters(path: KeyPath, x: PyTree) -> PyTree:
        if not isinstance(x, ScaledOptimizerState):
            return x
        where = prefix(path)
        skipped = checked_counter(f"{where}skipped_steps", x.skipped_steps)
        if is_tracer(x.last_finite):
            raise TypeError(
                f"Expected `{where}last_finite` to be a concrete bool, got a traced value "
                "instead; call jamp.check_restored outside `jit`."
            )
        last = check_bool_scalar(
            x.last_finite, f"{where}last_finite", "as jamp.loss_scaling saved it"
        )
        return x._replace(
            last_finite=placed_like(jnp.asarray(bool(np.asarray(last))), x.last_finite),
            skipped_steps=placed_like(jnp.asarray(skipped, jnp.int32), x.skipped_steps),
        )

    def one(path: KeyPath, x: PyTree) -> PyTree:
        if isinstance(x, Float8State):
            check_values(x, prefix(path).rstrip("/") or "the float8 state")
            return x
        if not isinstance(x, LossScaleState):
            return x
        return restore(x, x.scale, x.growth_tracker, x.overflow_streak, where=prefix(path))

    tree = jax.tree_util.tree_map_with_path(
        counters, tree, is_leaf=lambda x: isinstance(x, ScaledOptimizerState)
    )
    return jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: isinstance(x, (LossScaleState, Float8State))
    )


def metrics(state: PyTree) -> dict[str, jax.Array]:
    """Loss-scaling metrics as a dict of device scalars, ready for any logger.

    Accepts an optimizer state holding a [`loss_scaling`][jamp.loss_scaling] state (in any
    nesting, a Flax ``TrainState`` or an ``nnx.Optimizer``), a bare
    [`jamp.LossScaleState`][], or the result of [`value_and_grad`][jamp.value_and_grad].
    Nothing is read back to the host: convert with ``float()``/``int()`` (or
    ``jax.device_get``) when you log.

    An optimizer state holding one [`jamp.master_weights`][] state with
    ``rounding="exact"`` or ``"kahan"`` adds its ``restarted_steps``: the steps whose
    parameters were not the ones its previous update gave (a transformation chained
    after it; see ``jamp.optimizer.MasterWeightsState``). Such a state alone, without
    loss scaling, gives that one metric.

    Returns:
      ``loss_scale`` and ``growth_tracker``, plus ``last_finite`` and
      ``skipped_steps`` for an optimizer state, or ``last_finite`` and
      ``retries`` for a [`value_and_grad`][jamp.value_and_grad] result; and
      ``restarted_steps`` for a state holding an exact or Kahan master.

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
    found = [_unwrap(s.restarted_steps) for _, s in _find(state, MasterWeightsState)]
    counts = [count for count in found if count is not None]
    extra = {"restarted_steps": counts[0]} if len(counts) == 1 else {}
    if extra and not holds_loss_scale(state):
        return extra
    return {**_loss_scale_metrics(state), **extra}


def _loss_scale_metrics(state: PyTree) -> dict[str, jax.Array]:
    """``metrics`` of a state holding a loss-scale state (or a clear error)."""
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
        inner_path = (*path, jax.tree_util.DictKey("loss_scale"))
        inner = flat.get(inner_path, {})
        if all(f in inner for f in DATA_FIELDS) and {"last_finite", "skipped_steps"} <= set(fields):
            snapshot = _snapshot(inner_path, inner, "state")
            last, skipped = fields["last_finite"], fields["skipped_steps"]
            return {
                "loss_scale": snapshot.scale,
                "growth_tracker": snapshot.growth_tracker,
                "last_finite": _field(path, "last_finite", last, "flag", "state"),
                "skipped_steps": _field(path, "skipped_steps", skipped, "count", "state"),
            }
    ls_state = get_loss_scale(state)  # a clear error for none, or several
    return {"loss_scale": ls_state.scale, "growth_tracker": ls_state.growth_tracker}
