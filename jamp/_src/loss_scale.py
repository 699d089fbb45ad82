"""The loss-scale state, its constructors, and the pure `scale`/`unscale`/`update`.

The state is an immutable pytree: the scale and the counters are device arrays,
the configuration is static metadata. Every function here is pure and
traceable; nothing reads a value back to the host. The ground floor of jamp:
imports only jax, numpy and the other ground-floor modules.
"""

from __future__ import annotations

import dataclasses
from typing import TypedDict, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jamp._src.leaves import find_nodes, map_floating, scale_leaf, unscale_leaf
from jamp._src.torch_rounding import mul_as_torch
from jamp._src.types import Filter, PyTree, is_tracer
from jamp._src.validate import (
    INT32_MAX,
    MAX_SCALE,
    MIN_SCALE,
    NO_SCALE,
    Config,
    check_bool_scalar,
    check_config,
    check_filter,
)

# The state's leaves, in their pytree order (what a checkpoint holds, by these names).
DATA_FIELDS = ("scale", "growth_tracker", "overflow_streak")
# The static configuration: metadata of the pytree, arguments of check_config.
CONFIG_FIELDS = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_scale",
    "max_scale",
    "hysteresis",
)

DYNAMIC = "dynamic"
STATIC = "static"
NONE = "none"


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """Immutable loss-scale state, a pytree.

    Dynamic leaves (JAX arrays):
      scale: float32 scalar, the current loss scale.
      growth_tracker: int32 scalar, finite steps in a row since the scale last
        changed (torch's ``_growth_tracker``).
      overflow_streak: int32 scalar, non-finite steps in a row (used by
        ``hysteresis``; saturates at ``hysteresis``); always 0 with ``hysteresis=1``,
        where every overflow backs off and the streak is not counted.

    Static metadata (part of the tree structure, so changing it recompiles but
    changing the scale never does): ``kind`` (``"dynamic"``, ``"static"`` or
    ``"none"``), ``growth_factor``, ``backoff_factor``, ``growth_interval``,
    ``min_scale``, ``max_scale``, ``hysteresis``.

    Build one with [`dynamic_loss_scale`][jamp.dynamic_loss_scale],
    [`static_loss_scale`][jamp.static_loss_scale] or [`no_loss_scale`][jamp.no_loss_scale];
    they validate their arguments.
    """

    scale: jax.Array
    growth_tracker: jax.Array
    overflow_streak: jax.Array
    kind: str = dataclasses.field(default=DYNAMIC, metadata=dict(static=True))
    growth_factor: float = dataclasses.field(default=2.0, metadata=dict(static=True))
    backoff_factor: float = dataclasses.field(default=0.5, metadata=dict(static=True))
    growth_interval: int = dataclasses.field(default=2000, metadata=dict(static=True))
    min_scale: float = dataclasses.field(default=MIN_SCALE, metadata=dict(static=True))
    max_scale: float = dataclasses.field(default=MAX_SCALE, metadata=dict(static=True))
    hysteresis: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def is_dynamic(self) -> bool:
        return self.kind == DYNAMIC

    @property
    def enabled(self) -> bool:
        return self.kind != NONE


jax.tree_util.register_dataclass(
    LossScaleState,
    data_fields=list(DATA_FIELDS),
    meta_fields=["kind", *CONFIG_FIELDS],
)

# A loss-scale state or a subclass of it (a GradScalerState): what the update
# functions take, they return, as ``dataclasses.replace`` keeps the class.
StateT = TypeVar("StateT", bound=LossScaleState)


def saturating_increment(count: jax.Array, where: ArrayLike) -> jax.Array:
    """``count + where`` for an int32 counter, held at 2**31 - 1 instead of wrapping."""
    return jnp.where(where & (count < INT32_MAX), count + 1, count)


def from_config(kind: str, config: Config) -> LossScaleState:
    """A state of ``kind`` from a checked configuration, with fresh counters unless restored.

    Every leaf is a strongly typed device array, built anew on each call, so a
    jitted step never sees a weak type, never copies a host value on its first
    call, and donating one state never deletes another's buffers.
    """
    return LossScaleState(
        scale=jnp.asarray(config.scale, dtype=jnp.float32),
        growth_tracker=jnp.asarray(config.growth_tracker or 0, dtype=jnp.int32),
        overflow_streak=jnp.asarray(config.overflow_streak or 0, dtype=jnp.int32),
        kind=kind,
        **{f: getattr(config, f) for f in CONFIG_FIELDS},
    )


class ConfigArgs(TypedDict):
    """A state's configuration (and a scale) as keyword arguments of ``check_config``."""

    scale: object
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float
    max_scale: float
    hysteresis: int


def config_of(state: LossScaleState, scale: object = NO_SCALE) -> ConfigArgs:
    """``state``'s configuration as keyword arguments of ``check_config``."""
    return ConfigArgs(
        scale=scale,
        growth_factor=state.growth_factor,
        backoff_factor=state.backoff_factor,
        growth_interval=state.growth_interval,
        min_scale=state.min_scale,
        max_scale=state.max_scale,
        hysteresis=state.hysteresis,
    )


def restore(
    target: LossScaleState,
    scale: object,
    growth_tracker: object = 0,
    overflow_streak: object = 0,
    *,
    where: str = "",
) -> LossScaleState:
    """``target``'s configuration with values read from a checkpoint, validated.

    The one validation (``check_config(restore=True)``): a scale that is not
    positive and finite is a ``ValueError``; a scale outside ``target``'s
    ``[min_scale, max_scale]`` is clamped into it; a growth tracker at or
    past ``growth_interval`` is held one short of it, so the scale grows on
    the next finite step (it would never grow again otherwise); an overflow
    streak past ``hysteresis`` is held at it. Python numbers and NumPy values
    become float32/int32 device arrays; a JAX array already holding the
    validated value is kept as it is (with its placement), and a new value
    is put where the restored one was. A disabled target
    ([`no_loss_scale`][jamp.no_loss_scale]) keeps its scale of 1 and counters of 0: a
    dynamic checkpoint resumed without loss scaling is not scaled by what
    it saved.

    Args:
      target: the state restored into; its configuration is kept.
      scale, growth_tracker, overflow_streak: the checkpoint's values.
      where: a prefix naming the values in messages (e.g. a checkpoint path).

    Returns:
      A new [`LossScaleState`][jamp.LossScaleState].
    """
    check_state(target, "restore")
    names = {f: f"{where}{f}" for f in DATA_FIELDS}
    for name, value in (("growth_tracker", growth_tracker), ("overflow_streak", overflow_streak)):
        if value is None:  # check_config reads None as "not given"
            raise TypeError(
                f"Expected `{names[name]}` to be an integer >= 0, got None instead; restore it "
                "from the checkpoint that saved it, or start from a fresh state."
            )
    config = check_config(
        **config_of(target, scale),
        scale_name=names["scale"],
        growth_tracker=growth_tracker,
        overflow_streak=overflow_streak,
        restore=True,
        names=names,
    )
    if target.kind == NONE:
        # A disabled target's scale is 1 whatever was saved (a dynamic checkpoint resumed
        # without loss scaling): its configuration, like every other, is the target's.
        config = config._replace(scale=1.0, growth_tracker=0, overflow_streak=0)
    values = from_config(target.kind, config)
    # The target's own type and fields (a GradScalerState's stage) are kept, and so is the
    # placement of what was restored: a step resumed with arrays placed (committed) as
    # Orbax placed them compiles no more often than one resumed from Orbax directly.
    return dataclasses.replace(
        target,
        scale=placed_like(values.scale, scale),
        growth_tracker=placed_like(values.growth_tracker, growth_tracker),
        overflow_streak=placed_like(values.overflow_streak, overflow_streak),
    )


def placed_like(value: jax.Array, restored: object) -> jax.Array:
    """``value``, or ``restored`` itself when it is a JAX array holding the same bits; else
    ``value`` put where ``restored`` is, when ``restored`` is a committed JAX array.

    A restored array's placement is part of what a jitted step is compiled for:
    mixing committed arrays (Orbax's) with uncommitted ones (new ones) would
    compile the step once more.
    """
    if not isinstance(restored, jax.Array) or is_tracer(restored):
        return value
    if not restored.is_fully_addressable:
        return value
    if (
        restored.dtype == value.dtype
        and restored.shape == value.shape
        and np.asarray(restored).tobytes() == np.asarray(value).tobytes()
    ):
        return restored
    if getattr(restored, "committed", False):
        return jax.device_put(value, restored.sharding)
    return value


def fresh(state: LossScaleState) -> LossScaleState:
    """A copy of ``state`` with new buffers, so donating one never deletes the other."""
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), state)


def _holds_state(tree: PyTree) -> bool:
    """Whether a loss-scale state is inside ``tree`` (or its ``opt_state``, for Flax objects)."""
    tree = getattr(tree, "opt_state", tree)
    return bool(find_nodes(tree, LossScaleState))


def check_state(state: object, fn: str) -> LossScaleState:
    """``state`` if it is a [`jamp.LossScaleState`][], else a TypeError naming ``jamp.{fn}``."""
    if not isinstance(state, LossScaleState):
        hint = ""
        if _holds_state(state):
            hint = (
                "; this holds one, like the state of jamp.loss_scaling(...): pass "
                f"`jamp.{fn}(jamp.get_loss_scale(opt_state), ...)`"
            )
        raise TypeError(
            f"`jamp.{fn}` expected `state` to be a LossScaleState (from "
            f"jamp.dynamic_loss_scale, static_loss_scale or no_loss_scale), got "
            f"{type(state).__name__} instead{hint}."
        )
    return state


# --------------------------------------------------------------------------
# Constructors.


def dynamic_loss_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    *,
    min_scale: float = MIN_SCALE,
    max_scale: float = MAX_SCALE,
    hysteresis: int = 1,
) -> LossScaleState:
    """A dynamic loss scale with ``torch.amp.GradScaler``'s update rule.

    The defaults are PyTorch's. After every step, [`update`][jamp.update] applies::

        if not finite:
            overflow_streak = min(overflow_streak + 1, hysteresis)
            if overflow_streak == hysteresis:       # always, when hysteresis == 1
                scale = max(scale * backoff_factor, min_scale)
            growth_tracker = 0
        else:
            overflow_streak = 0
            growth_tracker += 1
            if growth_tracker == growth_interval:
                grown = scale * growth_factor
                if isfinite(grown):
                    scale = min(grown, max_scale)
                growth_tracker = 0

    Products are computed as torch computes them, in double precision and then
    rounded to float32, so non-power-of-two factors match torch bit for bit
    (emulated exactly in integer arithmetic; x64 is never turned on).
    Unlike torch, the scale never leaves ``[min_scale, max_scale]``, so
    ``1/scale`` is always a normal float32 and the scale cannot collapse to 0.

    Args:
      init_scale: the first scale; positive, finite, within the bounds.
      growth_factor: multiplies the scale after ``growth_interval`` finite
        steps in a row; must be > 1.
      backoff_factor: multiplies the scale on a non-finite step; in (0, 1).
      growth_interval: finite steps in a row before the scale grows; an
        integer >= 1.
      min_scale: lower bound of the scale, in [2**-126, 2**126].
      max_scale: upper bound of the scale, in [min_scale, 2**126].
      hysteresis: back off only on the ``hysteresis``-th non-finite step in a
        row (and on every one after it), as DeepSpeed does with
        ``consecutive_hysteresis=True``; a finite step starts the count over.
        (Megatron-LM and DeepSpeed's default count non-finite steps since the
        scale last grew.) Every non-finite step is still reported and
        skipped. 1 is torch's rule.

    Returns:
      A [`LossScaleState`][jamp.LossScaleState].

    Raises:
      ValueError: an argument is out of range; the message names it.
      TypeError: an argument has the wrong type.

    Examples:
      >>> import jamp
      >>> state = jamp.dynamic_loss_scale(init_scale=1024.0, growth_interval=2)
      >>> float(state.scale)
      1024.0
    """
    config = check_config(
        scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
    )
    return from_config(DYNAMIC, config)


def static_loss_scale(scale: float) -> LossScaleState:
    """A loss scale that never changes.

    Args:
      scale: positive and finite, within [2**-126, 2**126].

    Returns:
      A [`LossScaleState`][jamp.LossScaleState] whose [`update`][jamp.update] returns it unchanged.

    Examples:
      >>> import jamp
      >>> float(jamp.static_loss_scale(128.0).scale)
      128.0
    """
    return from_config(STATIC, check_config(scale=scale, scale_name="scale"))


def no_loss_scale() -> LossScaleState:
    """A disabled loss scale: ``scale``/``unscale`` are the identity, scale 1.

    Examples:
      >>> import jamp
      >>> state = jamp.no_loss_scale()
      >>> jamp.scale(state, 3.0)
      3.0
    """
    return from_config(NONE, check_config(scale=1.0))


# --------------------------------------------------------------------------
# Pure functions.


def scale(state: LossScaleState, tree: PyTree, *, filter: Filter = None) -> PyTree:
    """Multiply every floating leaf of ``tree`` by the loss scale.

    Each array leaf keeps its dtype, except that a 0-d float16/bfloat16 leaf
    (a loss) comes back float32, as in torch, so the scaled loss itself cannot
    overflow. Integer, boolean and ``float0`` leaves and ``None`` pass through.
    With a disabled state ([`no_loss_scale`][jamp.no_loss_scale]) ``tree`` is returned as is.

    Args:
      state: a [`LossScaleState`][jamp.LossScaleState].
      tree: a loss, or any pytree of losses/outputs.
      filter: a predicate on leaves, such as ``eqx.is_inexact_array``: the
        leaves it is False for are returned untouched, whatever they are (an
        Equinox module's functions, strings). By default every leaf must be
        an array or a number.

    Returns:
      The scaled tree.

    Raises:
      TypeError: a leaf is not an array; the message names its path.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> state = jamp.static_loss_scale(4.0)
      >>> jamp.scale(state, {"a": jnp.float32(1.5), "n": jnp.int32(3)})
      {'a': Array(6., dtype=float32), 'n': Array(3, dtype=int32)}
    """
    check_state(state, "scale")
    check_filter(filter, "scale")
    return scale_tree(state, tree, filter)


def scale_tree(state: LossScaleState, tree: PyTree, filter: Filter = None) -> PyTree:
    """``jamp.scale``, unchecked: for callers that checked ``state`` and ``filter``."""
    if not state.enabled:
        map_floating(lambda x: x, tree, "scale", filter)  # validate leaves all the same
        return tree
    return map_floating(lambda x: scale_leaf(x, state.scale), tree, "scale", filter)


def unscale(state: LossScaleState, tree: PyTree, *, filter: Filter = None) -> PyTree:
    """Multiply every floating leaf of ``tree`` by ``1/scale``, keeping dtypes.

    ``1/scale`` is computed once in float32 (torch's ``inv_scale``);
    float16/bfloat16 leaves are multiplied in float32 and rounded back once,
    exactly as torch's unscale kernel does.

    Args:
      state: a [`LossScaleState`][jamp.LossScaleState].
      tree: any pytree, usually gradients.
      filter: a predicate on leaves, such as ``eqx.is_inexact_array``: the
        leaves it is False for are returned untouched (see [`scale`][jamp.scale]).

    Returns:
      The unscaled tree, every leaf in its own dtype.

    Raises:
      TypeError: a leaf is not an array; the message names its path.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> state = jamp.static_loss_scale(4.0)
      >>> jamp.unscale(state, jnp.array([8.0, 2.0], jnp.bfloat16))
      Array([2, 0.5], dtype=bfloat16)

      A tree holding a function (an Equinox module holds its activation):

      >>> tree = {"w": jnp.array([8.0]), "act": jnp.tanh}
      >>> jamp.unscale(state, tree, filter=lambda x: hasattr(x, "dtype"))["w"]
      Array([2.], dtype=float32)
    """
    check_state(state, "unscale")
    check_filter(filter, "unscale")
    return unscale_tree(state, tree, filter)


def unscale_tree(state: LossScaleState, tree: PyTree, filter: Filter = None) -> PyTree:
    """``jamp.unscale``, unchecked: for callers that checked ``state`` and ``filter`` (a
    step unscales inside the branch that applies the update)."""
    if not state.enabled:
        map_floating(lambda x: x, tree, "unscale", filter)
        return tree
    inv = inverse_scale(state)
    return map_floating(lambda x: unscale_leaf(x, inv), tree, "unscale", filter)


def inverse_scale(state: LossScaleState) -> jax.Array:
    """``1/scale`` in float32, correctly rounded (torch's ``inv_scale``)."""
    return jnp.float32(1.0) / state.scale


# --------------------------------------------------------------------------
# The update rule.


def update(state: StateT, finite: ArrayLike) -> StateT:
    """The loss-scale state after a step whose gradients were ``finite``.

    Applies the rule documented in [`dynamic_loss_scale`][jamp.dynamic_loss_scale]. A static or
    disabled state is returned unchanged.

    Args:
      state: a [`LossScaleState`][jamp.LossScaleState].
      finite: a boolean scalar, ``True`` when the step's gradients were all
        finite (from [`jamp.all_finite`][] or [`jamp.unscale_and_check`][]).

    Returns:
      The new state, with the same static configuration.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> state = jamp.dynamic_loss_scale(init_scale=8.0, growth_interval=1)
      >>> float(jamp.update(state, jnp.bool_(True)).scale)
      16.0
      >>> float(jamp.update(state, jnp.bool_(False)).scale)
      4.0
    """
    check_state(state, "update")
    finite = check_bool_scalar(finite, "finite", "from jamp.all_finite / jamp.unscale_and_check")
    return update_state(state, finite)


def update_state(state: StateT, finite: jax.Array) -> StateT:
    """``jamp.update``, unchecked: for callers whose ``finite`` is their own boolean
    scalar (a step's finite check) and whose ``state`` is checked."""
    if not state.is_dynamic:
        return state
    s, tracker, streak = state.scale, state.growth_tracker, state.overflow_streak
    lo, hi = jnp.float32(state.min_scale), jnp.float32(state.max_scale)

    # Non-finite branch.
    # Saturating: hysteresis may be 2**31 - 1, where streak + 1 would wrap.
    streak_bad = jnp.minimum(saturating_increment(streak, True), jnp.int32(state.hysteresis))
    backed_off = jnp.maximum(mul_as_torch(s, state.backoff_factor), lo)
    s_bad = jnp.where(streak_bad >= state.hysteresis, backed_off, s)

    # Finite branch.
    k = saturating_increment(tracker, True)  # never wraps
    grow = k == jnp.int32(state.growth_interval)
    grown = mul_as_torch(s, state.growth_factor)
    grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, hi), s)
    s_good = jnp.where(grow, grown, s)
    tracker_good = jnp.where(grow, jnp.int32(0), k)

    # With hysteresis 1 every overflow backs off and the streak (always 0) is not
    # counted: passed through, it costs the step no kernel.
    if state.hysteresis > 1:
        streak = jnp.where(finite, jnp.int32(0), streak_bad)
    return dataclasses.replace(
        state,
        scale=jnp.where(finite, s_good, s_bad),
        growth_tracker=jnp.where(finite, tracker_good, jnp.int32(0)),
        overflow_streak=streak,
    )


def backoff(state: StateT) -> StateT:
    """The state after an unconditional backoff (used to retry at a lower scale).

    Unlike ``update(state, False)`` this ignores ``hysteresis``: retrying at the
    same scale would overflow again. A static or disabled state is returned
    unchanged. Internal (``value_and_grad``'s retries), so unchecked.
    """
    if not state.is_dynamic:
        return state
    lo = jnp.float32(state.min_scale)
    return dataclasses.replace(
        state,
        scale=jnp.maximum(mul_as_torch(state.scale, state.backoff_factor), lo),
        growth_tracker=jnp.zeros((), jnp.int32),
        overflow_streak=jnp.zeros((), jnp.int32),
    )
