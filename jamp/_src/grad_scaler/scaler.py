"""``jamp.GradScaler``: torch.amp.GradScaler's API, made of pure functions.

The scaler is an immutable, hashable configuration; the state is a
[`jamp.GradScalerState`][] that every method takes and returns. Like
torch's scaler, the state records where the iteration stands (unscaled,
stepped) and the inf checks made so far, so a PyTorch training loop ports
line by line, and its misuses fail as they do in PyTorch::

    torch                                   jamp
    scaler = GradScaler()          scaler = jamp.GradScaler(); state = scaler.init()
    scaler.scale(loss).backward()  grads = jax.grad(lambda p: scaler.scale(state, loss(p)))(params)
    scaler.unscale_(optimizer)     grads, state = scaler.unscale(state, grads)
    scaler.step(optimizer)         params, opt_state, state = scaler.step(
                                       state, tx, grads, opt_state, params)
    scaler.update()                state = scaler.update(state)

The stage is static pytree metadata and every misuse is refused while the
step is traced, so the bookkeeping compiles to nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ParamSpec, TypeVar, overload

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from jamp._src import loss_scale as ls
from jamp._src.finite.check import check_unscaled, unscaled_and_finite
from jamp._src.grad_scaler.records import check_step, record, trace_state
from jamp._src.leaves import is_real_number
from jamp._src.lookup import holds_loss_scale
from jamp._src.loss_scale import StateT
from jamp._src.loss_scaling import loss_scaling
from jamp._src.skip import optimizer_step
from jamp._src.types import AxisName, Filter, Grads, OptState, Params, PyTree
from jamp._src.validate import (
    Config,
    check_axis_name,
    check_config,
    check_flag,
    check_not_swapped,
    check_skip,
    check_step_arguments,
    refuse_axis_name,
)

P = ParamSpec("P")
R = TypeVar("R")

_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _check_state(state: object, method: str) -> ls.LossScaleState:
    """``state`` if it is a loss-scale state, else a TypeError that says where one comes from."""
    if isinstance(state, ls.LossScaleState):
        return state
    if holds_loss_scale(state):
        hint = (
            "; this looks like a jamp.loss_scaling optimizer state: its loss-scale state is "
            "jamp.get_loss_scale(opt_state)"
        )
    else:
        hint = (
            "; every GradScaler method takes the scaler's state first (PyTorch keeps it inside "
            f"the scaler): `scaler.{method}(state, ...)`"
        )
    raise TypeError(
        f"`GradScaler.{method}` expected `state` to be the scaler's GradScalerState (from "
        f"scaler.init() or scaler.load_state_dict), got {type(state).__name__} instead{hint}."
    )


def _python_scalar(value: object) -> object:
    """A 0-d NumPy/JAX array (a dict restored by Orbax or ``np.load``) as a Python number."""
    if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0:
        if isinstance(value, jax.core.Tracer):
            return value
        arr = np.asarray(value)
        if arr.dtype.kind in "iu":
            return int(arr)
        if arr.dtype.kind == "f":
            return float(arr)
    return value


# ---------------------------------------------------------------- the state

READY = "ready"  # nothing recorded since the last update: the start of an iteration
UNSCALED = "unscaled"  # the last inf check is unscale's; its gradients await step
STEPPED = "stepped"  # the last inf check is step's
STAGES = (READY, UNSCALED, STEPPED)


@dataclasses.dataclass(frozen=True)
class GradScalerState(ls.LossScaleState):
    """The state of a [`jamp.GradScaler`][]: a loss-scale state that knows its stage.

    A [`jamp.LossScaleState`][] (``jamp.scale``, ``jamp.get_loss_scale``,
    ``jamp.metrics`` and checkpoints take it as one), plus what
    ``torch.amp.GradScaler`` keeps per optimizer between ``scale`` and
    ``update``:

    Dynamic leaves, besides the loss-scale state's:
      found_infs: a tuple of boolean scalars, one per inf check recorded
        since the last update (by [`GradScaler.unscale`][jamp.GradScaler.unscale] or
        [`GradScaler.step`][jamp.GradScaler.step], one per optimizer);
        [`GradScaler.update`][jamp.GradScaler.update] backs off once if any is set, and
        empties it.

    Static metadata, besides the loss-scale state's:
      stage: ``"ready"`` (nothing recorded: the start of an iteration),
        ``"unscaled"`` (the last check is [`GradScaler.unscale`][jamp.GradScaler.unscale]'s, and
        [`GradScaler.step`][jamp.GradScaler.step] will take its gradients as unscaled) or
        ``"stepped"``.
      checked_by: one entry per check in ``found_infs``: which optimizer
        step recorded it (its transformation, the structure of its
        parameters and the arrays it returned), or ``None`` for a check of
        [`GradScaler.unscale`][jamp.GradScaler.unscale] that no step has taken yet. It tells a
        second step of the same optimizer (refused, as torch refuses it)
        from the next optimizer's step.

    The stage is static, so the checks that refuse a misuse run while the
    step is traced and cost nothing when it runs. After ``update`` the state
    is ``"ready"`` again with no ``found_infs``: a jitted iteration returns a
    state of the structure it took, and ``lax.scan`` can carry it.

    A state passed to [`GradScaler.unscale`][jamp.GradScaler.unscale],
    [`GradScaler.step`][jamp.GradScaler.step] or
    [`GradScaler.update`][jamp.GradScaler.update] is *consumed*: the method
    returns the state to go on with, and given the old one again, any of them
    raises a ``RuntimeError`` in torch's words (it would unscale twice, or
    lose an inf check). The mark is ``consumed_by``, the one field a method
    sets on the object it took: it is no leaf and not compared, so it never
    reaches a computation, and every new state object starts unconsumed. To
    reuse a consumed state on purpose (to replay a step), clone it:
    ``jax.tree_util.tree_map(lambda x: x, state)`` is a new, usable object
    with the same values. One exception: a state consumed while traced and
    returned out of that trace (a jitted iteration that returns the state
    ``step`` took, not the one it returned, with no ``update``: every call
    would start from the same state, the scale frozen) carries the mark as
    pytree metadata, so the next call retraces and its ``step`` refuses it;
    a clone taken inside the consuming trace is unconsumed, and outside it
    ``dataclasses.replace(state)`` copies one on purpose. A state captured
    from outside the function being traced (a global, while the method's
    other arguments are traced) is not marked: the next trace would see the
    mark. A plain [`jamp.LossScaleState`][] given to these
    methods carries no stage and is never consumed: each method takes it as
    a ready state, so start from [`GradScaler.init`][jamp.GradScaler.init]
    to have its reuse refused.

    Attributes:
      consumed_by: ``None``, or the method (``"unscale"``, ``"step"`` or
        ``"update"``) that took this state object and returned its successor.
    """

    found_infs: tuple = ()
    stage: str = dataclasses.field(default=READY, metadata=dict(static=True))
    checked_by: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    # Not a pytree field (init=False), not compared: within the trace that consumed it (or
    # eagerly), a flatten / unflatten, or dataclasses.replace, makes an unconsumed object.
    consumed_by: str | None = dataclasses.field(default=None, init=False, compare=False, repr=False)
    # The trace a method consumed this (traced) state in: a state consumed there and
    # returned out of it stays consumed (``_Stale``).
    _consumed_in: object = dataclasses.field(default=None, init=False, compare=False, repr=False)

    def __getstate__(self) -> dict:
        """Pickled without the consuming trace (a weak reference): a stale state comes back
        consumed, as an eagerly consumed one is."""
        return {**self.__dict__, "_consumed_in": None}


_LOSS_SCALE_FIELDS = [f.name for f in dataclasses.fields(ls.LossScaleState)]
_DATA_FIELDS = (
    *(f.name for f in dataclasses.fields(ls.LossScaleState) if not f.metadata.get("static")),
    "found_infs",
)
_META_FIELDS = (
    *(f.name for f in dataclasses.fields(ls.LossScaleState) if f.metadata.get("static")),
    "stage",
    "checked_by",
)
_KEYS = tuple(jax.tree_util.GetAttrKey(name) for name in _DATA_FIELDS)


@dataclasses.dataclass(frozen=True, eq=False)
class _Stale:
    """The pytree metadata of a state consumed while traced: it leaves that trace marked.

    A jitted iteration that returns the state ``step`` took (not the one it returned,
    with no ``update``) would start every call from the same ready state, the scale
    frozen; nothing else in the state tells it from a fresh one. Carried as metadata,
    the mark changes the state's tree structure, so the next call retraces and its
    ``step`` refuses the state. Unflattened in the trace that consumed it (a clone
    taken there on purpose, ``jax.tree_util.tree_map(lambda x: x, state)``) the state
    is a new, unconsumed object, as an eager clone is. Equal for one method whatever
    the trace, so a pytree holding a stale state still hashes and compares.
    """

    method: str
    trace: object  # get_opaque_trace_state() of the consuming trace (a weak reference)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stale) and self.method == other.method

    def __hash__(self) -> int:
        return hash((_Stale, self.method))

    def __repr__(self) -> str:
        return f"consumed by scaler.{self.method}: pass on the state it returned"


def _flatten(state: GradScalerState) -> tuple[tuple, tuple]:
    stale = None
    if state.consumed_by is not None and state._consumed_in is not None:
        stale = _Stale(state.consumed_by, state._consumed_in)
    children = tuple(getattr(state, name) for name in _DATA_FIELDS)
    return children, (*(getattr(state, name) for name in _META_FIELDS), stale)


def _flatten_with_keys(state: GradScalerState) -> tuple[tuple, tuple]:
    children, aux = _flatten(state)
    return tuple(zip(_KEYS, children, strict=True)), aux


def _unflatten(aux: tuple, children: Iterable[Any]) -> GradScalerState:  # leaves: any
    *meta, stale = aux
    state = GradScalerState(
        **dict(zip(_DATA_FIELDS, children, strict=True)),
        **dict(zip(_META_FIELDS, meta, strict=True)),
    )
    if stale is not None and stale.trace != trace_state():  # out of the consuming trace
        object.__setattr__(state, "consumed_by", stale.method)
        object.__setattr__(state, "_consumed_in", stale.trace)
    return state


jax.tree_util.register_pytree_with_keys(
    GradScalerState, _flatten_with_keys, _unflatten, flatten_func=_flatten
)


def _stage(state: ls.LossScaleState) -> str:
    return state.stage if isinstance(state, GradScalerState) else READY


def _found_infs(state: ls.LossScaleState) -> tuple:
    return state.found_infs if isinstance(state, GradScalerState) else ()


def _checked_by(state: ls.LossScaleState) -> tuple:
    """One record (or ``None``) per recorded check."""
    found_infs = _found_infs(state)
    records = state.checked_by[: len(found_infs)] if isinstance(state, GradScalerState) else ()
    return (*records, *[None] * (len(found_infs) - len(records)))


def _as_grad_scaler_state(state: ls.LossScaleState) -> GradScalerState:
    if isinstance(state, GradScalerState):
        return state
    return GradScalerState(**{name: getattr(state, name) for name in _LOSS_SCALE_FIELDS})


def _with_checks(
    state: ls.LossScaleState, found_infs: tuple, stage: str, checked_by: tuple
) -> GradScalerState:
    """``state`` at ``stage`` (unscaled or stepped) with ``found_infs``."""
    return dataclasses.replace(
        _as_grad_scaler_state(state), found_infs=found_infs, stage=stage, checked_by=checked_by
    )


def _ready(state: StateT) -> StateT:
    """``state`` ready for the next iteration; a plain loss-scale state stays one."""
    if not isinstance(state, GradScalerState):
        return state
    return dataclasses.replace(state, found_infs=(), stage=READY, checked_by=())


def _any(flags: tuple) -> jax.Array:
    out = flags[0]
    for flag in flags[1:]:
        out = out | flag
    return out


# What a PyTorch user writes, and what torch says when it goes wrong. torch's
# own sentences come first, then what to write instead.
_LOOP = (
    "grads, state = scaler.unscale(state, grads)` (optional, e.g. to clip), then "
    "`params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)`, then "
    "`state = scaler.update(state)"
)
_NO_INF_CHECKS = "No inf checks were recorded prior to update."
_UNSCALED_TWICE = "unscale_() has already been called on this optimizer since the last update()."
_AFTER_UPDATE = "update() has already been called with this state."
_SENTENCES = {
    ("unscale", "unscale"): _UNSCALED_TWICE,
    ("unscale", "step"): (
        "unscale_() has already been called since the last update(), so `grads` are unscaled "
        "already and `step` would unscale them a second time."
    ),
    ("unscale", "update"): _NO_INF_CHECKS,
    ("step", "step"): "step() has already been called since the last update().",
    ("step", "unscale"): "unscale_() is being called after step().",
    ("step", "update"): _NO_INF_CHECKS,
}
_CALLS = {
    "unscale": "grads, state = scaler.unscale(state, grads)",
    "step": "params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)",
    "update": "state = scaler.update(state)",
}

_CLONE = "jax.tree_util.tree_map(lambda x: x, state)"


def _is_tracer(x: object) -> bool:
    return isinstance(x, jax.core.Tracer)


def _consume(state: ls.LossScaleState, method: str, others: PyTree = ()) -> None:
    """Mark ``state`` consumed by ``method``, which took it and returned its successor
    (``GradScalerState.consumed_by``).

    torch keeps its stage in the scaler, so reusing the scaler after
    ``unscale_`` is safe; here the old state object still exists, and passing
    it on instead of the one returned would unscale twice or lose a check.
    Nothing of this reaches the computation. A state captured from outside
    the function being traced (concrete, among traced ``others``) is not
    marked: the next trace would see the mark. A plain loss-scale state has
    no stage and is never consumed.
    """
    if not isinstance(state, GradScalerState):
        return
    if _is_tracer(state.scale):  # consumed in this trace: it leaves it marked (``_Stale``)
        object.__setattr__(state, "consumed_by", method)
        object.__setattr__(state, "_consumed_in", trace_state())
    elif not any(map(_is_tracer, jax.tree_util.tree_leaves(others))):
        object.__setattr__(state, "consumed_by", method)


def _check_not_consumed(state: ls.LossScaleState, method: str) -> None:
    """A RuntimeError, in torch's words, if a method already took ``state`` and replaced it."""
    if not isinstance(state, GradScalerState) or state.consumed_by is None:
        return
    used = state.consumed_by
    sentence = _SENTENCES.get((used, method), _AFTER_UPDATE)
    if state._consumed_in is not None and state._consumed_in != trace_state():
        raise RuntimeError(
            f"{sentence} This state was already passed to `scaler.{used}` in another trace: an "
            f"earlier call of a jitted function took it and returned it, instead of the state "
            f"the iteration ends with. Every call would start from that same state, and the "
            f"scale would never change. Inside the jitted function write `{_LOOP}`, and return "
            f"that state. To reuse this state on purpose, copy it: `state = "
            f"dataclasses.replace(state)` is a new, unconsumed object with the same values."
        )
    raise RuntimeError(
        f"{sentence} This state was already passed to `scaler.{used}`, which returned the one "
        f"to use from then on: write `{_CALLS[used]}` and pass that state on. An iteration is "
        f"`{_LOOP}`. To reuse this state on purpose (to replay a step), clone it first: "
        f"`state = {_CLONE}` is a new, unconsumed object with the same values."
    )


def _refuse_found_inf(method: str) -> TypeError:
    if method == "step":
        return TypeError(
            "`GradScaler.step` takes no `found_inf`: `scaler.unscale` records its check in the "
            "state it returns, and `step` given that state neither unscales again nor needs the "
            "flag. Write `grads, state = scaler.unscale(state, grads)`, then "
            "`params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)`."
        )
    return TypeError(
        "`GradScaler.update` takes no `found_inf`: like PyTorch's `scaler.update()`, it reads "
        "the inf checks that `scaler.step` and `scaler.unscale` recorded in the state they "
        "return. Write `params, opt_state, state = scaler.step(state, tx, grads, opt_state, "
        "params)`, then `state = scaler.update(state)`; the flag is `scaler.found_inf(state)`. "
        "To update a loss-scale state with a flag of your own, use "
        "`jamp.update(state, jnp.logical_not(found_inf))`."
    )


def _takes_state(call: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A GradScaler method that says, when called the PyTorch way, to pass the state first."""

    def decorate(method: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(method)
        name = getattr(method, "__name__", "")

        @functools.wraps(method)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:  # args[0] is the scaler
            if "found_inf" in kwargs and name in ("step", "update"):
                raise _refuse_found_inf(name)
            try:
                signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(
                    f"`GradScaler.{name}`: {e}. Every GradScaler method takes the "
                    "scaler's state first (PyTorch keeps it inside the scaler; jamp passes it in "
                    f"and returns it): write `{call}`, with `state = scaler.init()` before the "
                    "loop."
                ) from None
            return method(*args, **kwargs)

        return checked

    return decorate


@dataclasses.dataclass(frozen=True)
class GradScaler:
    """PyTorch's ``torch.amp.GradScaler``, as pure functions over an immutable state.

    Same constructor arguments, defaults, method names and ``state_dict``
    keys as PyTorch. The differences come from JAX: the state is passed in
    and returned (``state = scaler.update(state)``), nothing syncs with the
    host (``get_scale`` returns a device array), ``scale`` accepts any pytree
    (dicts included), and the scale never leaves ``[2**-126, 2**126]``, so it
    cannot collapse to 0 as torch's does.

    The state (a [`jamp.GradScalerState`][]) records, as torch's scaler
    does per optimizer, whether the gradients were unscaled and which inf
    checks were made since the last ``update``. So ``step`` after ``unscale``
    does not unscale again, ``update`` takes no flag, and what PyTorch
    refuses is refused here too, with PyTorch's words, while the step is
    traced: unscaling twice, ``update`` without an inf check (or twice), and
    reusing a state that ``unscale``, ``step`` or ``update`` already replaced.

    Args:
      init_scale: initial scale.
      growth_factor: > 1.
      backoff_factor: in (0, 1).
      growth_interval: finite steps in a row before the scale grows; >= 1.
      enabled: ``False`` makes every method the identity / a plain step, as
        in PyTorch (and skips validation, as PyTorch does).
      skip: how [`step`][jamp.GradScaler.step] drops a non-finite step (not in PyTorch):
        ``"auto"`` (default: ``"select"`` on GPUs and TPUs, ``"cond"`` on
        CPUs), ``"cond"`` or ``"select"``; see [`jamp.loss_scaling`][].
      axis_name: a ``shard_map``/``pmap`` axis name (or tuple of them) over
        which [`unscale`][jamp.GradScaler.unscale] and [`step`][jamp.GradScaler.step] agree
        on ``found_inf``, so every replica skips together (not in PyTorch, whose
        DDP all-reduces the gradients first). It does not average the gradients:
        do that yourself (``lax.pmean``) before
        [`unscale`][jamp.GradScaler.unscale]/[`step`][jamp.GradScaler.step], as flax's
        ``DynamicScale(axis_name=...)`` did for you. Not needed under plain
        ``jit`` with sharded arrays.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> scaler = jamp.GradScaler(init_scale=1024.0)
      >>> state = scaler.init()
      >>> tx = optax.sgd(0.5)
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> grads = jax.grad(lambda p: scaler.scale(state, jnp.sum(p["w"] ** 2)))(params)
      >>> params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)
      >>> bool(scaler.found_inf(state))
      False
      >>> state = scaler.update(state)
      >>> params["w"], state.stage
      (Array([0., 0.], dtype=float32), 'ready')
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True
    skip: str = "auto"
    axis_name: AxisName | None = None

    def __post_init__(self) -> None:
        # GradScaler is configuration, not a pytree, so validating here is safe.
        check_flag("enabled", self.enabled)
        if isinstance(self.init_scale, str):
            raise TypeError(
                f"Expected `init_scale` to be a real number, got {self.init_scale!r} instead; "
                "torch.amp.GradScaler's first argument is the device, jamp.GradScaler has none "
                "(JAX places arrays itself): drop it, or pass init_scale=... by name."
            )
        check_skip(self.skip)
        check_axis_name(self.axis_name)
        if self.enabled:
            self._config()

    # ------------------------------------------------------------ state

    def _config(self) -> Config:
        return check_config(
            scale=self.init_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )

    def _loss_scale(self) -> ls.LossScaleState:
        if not self.enabled:
            return ls.no_loss_scale()
        return ls.from_config(ls.DYNAMIC, self._config())

    def init(self) -> GradScalerState:
        """The initial state, with fresh arrays: ready, no inf check recorded.

        When disabled, its scale is 1 (``no_loss_scale()``'s).
        """
        return _as_grad_scaler_state(self._loss_scale())

    def is_enabled(self) -> bool:
        return self.enabled

    @_takes_state("scaler.get_scale(state)")
    def get_scale(self, state: ls.LossScaleState) -> jax.Array:
        """The scale, a float32 device array (1.0 when disabled). No host sync."""
        return _check_state(state, "get_scale").scale

    @_takes_state("scaler.get_growth_tracker(state)")
    def get_growth_tracker(self, state: ls.LossScaleState) -> jax.Array:
        return _check_state(state, "get_growth_tracker").growth_tracker

    @_takes_state("scaler.get_growth_factor(state)")
    def get_growth_factor(self, state: ls.LossScaleState) -> float:
        return _check_state(state, "get_growth_factor").growth_factor

    @_takes_state("scaler.get_backoff_factor(state)")
    def get_backoff_factor(self, state: ls.LossScaleState) -> float:
        return _check_state(state, "get_backoff_factor").backoff_factor

    @_takes_state("scaler.get_growth_interval(state)")
    def get_growth_interval(self, state: ls.LossScaleState) -> int:
        return _check_state(state, "get_growth_interval").growth_interval

    def _reconfigure(self, state: StateT, method: str, **changes: object) -> StateT:
        _check_state(state, method)
        if not state.is_dynamic:
            return state
        checked = check_config(**{**ls.config_of(state), **changes})
        # A tracker already at or past a lowered interval would never equal it
        # again (torch's rule grows on equality): the scale would stop growing
        # for good, as torch's does. Held one short, it grows on the next
        # finite step instead.
        tracker = jnp.minimum(state.growth_tracker, jnp.int32(checked.growth_interval - 1))
        return dataclasses.replace(
            state,
            growth_tracker=tracker,
            growth_factor=checked.growth_factor,
            backoff_factor=checked.backoff_factor,
            growth_interval=checked.growth_interval,
        )

    @_takes_state("state = scaler.set_growth_factor(state, new_factor)")
    def set_growth_factor(self, state: StateT, new_factor: float) -> StateT:
        """A state with a new growth factor (static: changing it recompiles)."""
        return self._reconfigure(state, "set_growth_factor", growth_factor=new_factor)

    @_takes_state("state = scaler.set_backoff_factor(state, new_factor)")
    def set_backoff_factor(self, state: StateT, new_factor: float) -> StateT:
        return self._reconfigure(state, "set_backoff_factor", backoff_factor=new_factor)

    @_takes_state("state = scaler.set_growth_interval(state, new_interval)")
    def set_growth_interval(self, state: StateT, new_interval: int) -> StateT:
        """A state with a new growth interval (static: changing it recompiles).

        Unlike PyTorch, a growth tracker already at or past the new interval is
        held one short of it, so the scale grows on the next finite step;
        PyTorch's tracker would never equal the interval again, and its scale
        would stop growing until the next inf.
        """
        return self._reconfigure(state, "set_growth_interval", growth_interval=new_interval)

    # ------------------------------------------------------------ the loop

    @_takes_state("scaler.scale(state, loss)")
    def scale(self, state: ls.LossScaleState, outputs: PyTree) -> PyTree:
        """``outputs`` times the scale: a loss, or any pytree (list, tuple, dict)."""
        return ls.scale_tree(_check_state(state, "scale"), outputs)

    @overload
    def unscale(self, state: GradScalerState, grads: Grads) -> tuple[Grads, GradScalerState]: ...
    @overload
    def unscale(
        self, state: ls.LossScaleState, grads: Grads
    ) -> tuple[Grads, ls.LossScaleState]: ...
    @_takes_state(_CALLS["unscale"])
    def unscale(self, state: ls.LossScaleState, grads: Grads) -> tuple[Grads, ls.LossScaleState]:
        """``(unscaled_grads, state)``: torch's ``unscale_(optimizer)``; clip after this.

        The returned state records the inf check and that these gradients are
        unscaled, so [`step`][jamp.GradScaler.step] given it takes them as they are (it does not
        unscale again) and [`update`][jamp.GradScaler.update] sees the check. Unscale each
        optimizer's gradients at most once per iteration, and step them
        before unscaling the next optimizer's. When disabled, returns
        ``(grads, state)`` unchanged, as PyTorch does nothing.

        Raises:
          RuntimeError: ``state`` is unscaled already ("unscale_() has already
            been called on this optimizer since the last update()"), or was
            already passed to ``unscale``, ``step`` or ``update``.
        """
        state = _check_state(state, "unscale")
        if not self.enabled:
            return grads, state
        _check_not_consumed(state, "unscale")
        if _stage(state) == UNSCALED:
            raise RuntimeError(
                f"{_UNSCALED_TWICE} `scaler.unscale` returned gradients that are unscaled already, "
                "and the state says so: `scaler.step` takes them as they are. With several "
                "optimizers, step each one's gradients before unscaling the next one's: "
                f"`{_CALLS['unscale']}`, then `{_CALLS['step']}`, for each optimizer in turn."
            )
        unscaled, finite = unscaled_and_finite(state, grads, self.axis_name)
        _consume(state, "unscale", grads)
        found_infs = (*_found_infs(state), jnp.logical_not(finite))
        return unscaled, _with_checks(state, found_infs, UNSCALED, (*_checked_by(state), None))

    @overload
    def step(
        self,
        state: GradScalerState,
        tx: optax.GradientTransformation,
        grads: Grads,
        opt_state: OptState,
        params: Params,
        *,
        filter: Filter = None,
        **extra_args: object,
    ) -> tuple[Params, OptState, GradScalerState]: ...
    @overload
    def step(
        self,
        state: ls.LossScaleState,
        tx: optax.GradientTransformation,
        grads: Grads,
        opt_state: OptState,
        params: Params,
        *,
        filter: Filter = None,
        **extra_args: object,
    ) -> tuple[Params, OptState, ls.LossScaleState]: ...
    @_takes_state(_CALLS["step"])
    def step(
        self,
        state: ls.LossScaleState,
        tx: optax.GradientTransformation,
        grads: Grads,
        opt_state: OptState,
        params: Params,
        *,
        filter: Filter = None,
        **extra_args: object,
    ) -> tuple[Params, OptState, ls.LossScaleState]:
        """Apply ``tx`` unless a gradient is inf/NaN: torch's ``scaler.step(optimizer)``.

        Unless ``state`` comes from [`unscale`][jamp.GradScaler.unscale] (whose gradients are taken
        as they are), ``grads`` are unscaled and checked first. The update is
        applied or dropped as ``skip`` says (a select on GPUs, ``lax.cond`` on CPUs):
        on a skipped step the parameters and ``opt_state`` come back unchanged
        (Adam's count does not advance). Extra keyword arguments go to
        ``tx.update``. When disabled, the step is always applied, as in
        PyTorch.

        ``params`` may be an Equinox module, with ``filter`` (not in PyTorch):
        ``tx`` and the skip see only the leaves it selects
        (``eqx.filter(params, filter)``; pass the filter the optimizer state
        was initialised with, e.g. ``eqx.is_array``), the others come back
        untouched, and ``None`` gradients (``eqx.filter_grad``'s) leave their
        parameter as it is.

        Returns:
          ``(params, opt_state, state)``: ``state`` records this step's inf
          check; pass it to the next optimizer's ``step`` or to
          [`update`][jamp.GradScaler.update]. [`found_inf`][jamp.GradScaler.found_inf] tells
          whether the step was skipped.

        Raises:
          RuntimeError: ``state`` was already passed to ``unscale`` (its
            gradients would be unscaled twice), ``step`` or ``update``; or
            ``tx`` already stepped these parameters since the last
            ``update`` ("step() has already been called since the last
            update()": the loop left ``update`` out); or ``state`` holds a
            check that a step of parameters of this structure recorded in
            another trace (it left a jitted call without ``update``, and
            would grow and retrace every iteration).
          TypeError: ``tx`` is not an Optax transformation, ``params`` and
            ``opt_state`` are swapped, or ``found_inf=`` was passed.
        """
        state = _check_state(state, "step")
        refuse_axis_name(extra_args, "`GradScaler.step`", "`tx`", "jamp.GradScaler")
        check_not_swapped(grads, opt_state, params)
        check_step_arguments(tx, grads, opt_state, params, filter=filter, fn="GradScaler.step")

        def step(pred: jax.Array | None, grads_fn: Callable[[], Grads]) -> tuple[Params, OptState]:
            return optimizer_step(
                pred,
                tx,
                grads_fn,
                opt_state,
                params,
                grads=grads,
                filter=filter,
                skip=self.skip,
                extra_args=extra_args,
                fn="GradScaler.step",
            )

        if not self.enabled:
            params, opt_state = step(None, lambda: grads)
            return params, opt_state, state
        _check_not_consumed(state, "step")
        found_infs, checked_by = _found_infs(state), _checked_by(state)
        check_step(checked_by, tx, params)
        if _stage(state) == UNSCALED:  # grads unscaled by scaler.unscale, its check recorded
            found_infs, found_inf = found_infs[:-1], found_infs[-1]
            checked_by = checked_by[:-1]
            finite = jnp.logical_not(found_inf)
            unscaled = lambda: grads  # noqa: E731
        else:
            finite = check_unscaled(
                state, grads, axis_name=self.axis_name, filter=filter, fn="GradScaler.step"
            )
            found_inf = None
            unscaled = lambda: ls.unscale_tree(state, grads, filter)  # noqa: E731

        # Unscaling inside the branch lets XLA fuse it into the optimizer's pass.
        new_params, new_opt_state = step(finite, unscaled)
        if found_inf is None:
            found_inf = jnp.logical_not(finite)
        _consume(state, "step", grads)
        checked_by = (*checked_by, record(tx, params, new_params))
        new_state = _with_checks(state, (*found_infs, found_inf), STEPPED, checked_by)
        return new_params, new_opt_state, new_state

    @_takes_state(_CALLS["update"])
    def update(self, state: StateT, new_scale: ArrayLike | None = None) -> StateT:
        """The state for the next iteration: ``scaler.update()``.

        Backs the scale off once if any inf check recorded since the last
        update (one per optimizer, by [`unscale`][jamp.GradScaler.unscale] or
        [`step`][jamp.GradScaler.step]) found an inf/NaN, else counts a finite step,
        and returns a state that is ready for the next iteration, with no check
        recorded.

        Args:
          state: the state [`step`][jamp.GradScaler.step] (or
            [`unscale`][jamp.GradScaler.unscale]) returned.
          new_scale: set the scale to this value instead (a float or a
            scalar array); like PyTorch, the growth tracker is left unchanged
            and no inf check is needed. A value that is not positive and
            finite raises ``ValueError``; under ``jit``, where it cannot be
            read, such a value leaves the scale as it was (PyTorch would take
            a NaN and skip every step after), and one outside
            ``[min_scale, max_scale]`` is clamped.

        Raises:
          RuntimeError: no inf check was recorded ("No inf checks were
            recorded prior to update."), or ``state`` was already passed to
            ``unscale``, ``step`` or ``update``.
          TypeError: a ``found_inf`` flag was passed (``step`` records it), or
            a ``new_scale`` that is no number (a list, a state).
        """
        _check_state(state, "update")
        if not self.enabled:
            return state
        if isinstance(new_scale, ls.LossScaleState):  # the state step returned, as a flag
            raise TypeError(
                "Expected `new_scale` to be a Python float or a scalar array, got a "
                f"{type(new_scale).__name__} instead: `update` takes the state once, and "
                "`new_scale` only to set the scale (`scaler.update(state, new_scale=1024.0)`). "
                "The third value `scaler.step` returns is the state, not a found_inf flag: "
                f"{_refuse_found_inf('update')}"
            )
        flags = new_scale if isinstance(new_scale, (list, tuple)) else [new_scale]
        if flags and all(
            isinstance(f, (bool, np.bool_)) or getattr(f, "dtype", None) == np.bool_ for f in flags
        ):
            raise _refuse_found_inf("update")
        if isinstance(new_scale, (list, tuple, dict)):
            raise TypeError(
                "Expected `new_scale` to be a Python float or a scalar array, got "
                f"{type(new_scale).__name__} {new_scale!r:.40} instead; `update` reads the inf "
                "checks from the state, so it takes no list of found_inf flags either."
            )
        _check_not_consumed(state, "update")
        if new_scale is not None:
            if isinstance(new_scale, jax.core.Tracer):
                dtype = np.dtype(new_scale.dtype)
                if dtype not in (np.float32, np.float64) and not np.issubdtype(dtype, np.integer):
                    raise TypeError(
                        "Expected `new_scale` to be a float32 (or integer) scalar, got a traced "
                        f"array of dtype {dtype} instead: converting it would drop what a "
                        f"float32 scale cannot hold. Pass `new_scale.astype(jnp.float32)` if "
                        "that is what you mean."
                    )
                if jnp.shape(new_scale) != ():
                    raise ValueError(
                        "Expected `new_scale` to be a scalar, got an array of shape "
                        f"{jnp.shape(new_scale)} instead."
                    )
                v = jnp.asarray(new_scale, jnp.float32)
                lo, hi = jnp.float32(state.min_scale), jnp.float32(state.max_scale)
                usable = jnp.isfinite(v) & (v > 0)
                value = jnp.where(usable, jnp.clip(v, lo, hi), state.scale)
            else:
                checked = check_config(**ls.config_of(state, new_scale), scale_name="new_scale")
                value = jnp.asarray(checked.scale, jnp.float32)
            new = dataclasses.replace(state, scale=value)
        else:
            found_infs = _found_infs(state)
            if not found_infs:
                raise RuntimeError(
                    f"{_NO_INF_CHECKS} `scaler.update(state)` acts on the inf checks that "
                    "`scaler.step` (or `scaler.unscale`) recorded in the state it returned: write "
                    f"`{_CALLS['step']}`, then `{_CALLS['update']}`, once per iteration. To set "
                    "the scale without a step, pass `new_scale`."
                )
            new = ls.update_state(state, jnp.logical_not(_any(found_infs)))
        if _found_infs(state):  # a ready state (new_scale only) can be reused harmlessly
            _consume(state, "update", _found_infs(state))
        return _ready(new)

    @_takes_state("scaler.found_inf(state)")
    def found_inf(self, state: ls.LossScaleState) -> jax.Array:
        """Whether an inf/NaN was found since the last update (not in PyTorch): a skipped step.

        The OR of the checks recorded by [`unscale`][jamp.GradScaler.unscale] and
        [`step`][jamp.GradScaler.step] (one per optimizer; each is also in
        ``state.found_infs``), which is what [`update`][jamp.GradScaler.update] acts
        on. Read it before ``update``, which clears them; ``False`` when nothing
        is recorded. A device array: no sync.
        """
        found_infs = _found_infs(_check_state(state, "found_inf"))
        return _any(found_infs) if found_infs else jnp.asarray(False)

    def as_optax(
        self, inner: optax.GradientTransformation
    ) -> optax.GradientTransformationExtraArgs:
        """The same scaler as an Optax transformation: [`jamp.loss_scaling`][].

        When disabled, the transformation scales by 1 but still skips
        non-finite steps (PyTorch would apply them).
        """
        return loss_scaling(inner, self._loss_scale(), skip=self.skip, axis_name=self.axis_name)

    # ------------------------------------------------------------ checkpoints

    @_takes_state("scaler.state_dict(state)")
    def state_dict(self, state: ls.LossScaleState) -> dict[str, float | int]:
        """PyTorch's state dict: ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker`` (``{}`` when disabled).

        Reads two scalars from the device (a sync): call it when checkpointing.
        """
        _check_state(state, "state_dict")
        if not self.enabled:
            return {}
        return {
            "scale": float(np.asarray(state.scale)),
            "growth_factor": float(state.growth_factor),
            "backoff_factor": float(state.backoff_factor),
            "growth_interval": int(state.growth_interval),
            "_growth_tracker": int(np.asarray(state.growth_tracker)),
        }

    def load_state_dict(self, state_dict: Mapping[str, object]) -> GradScalerState:
        """A state from a dict saved by [`state_dict`][jamp.GradScaler.state_dict] or by PyTorch.

        The dict's growth/backoff configuration is carried in the returned
        state. When disabled, returns [`init`][jamp.GradScaler.init]'s state, as PyTorch ignores
        the dict.
        """
        if not self.enabled:
            return self.init()
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"Expected `state_dict` to be a mapping, got {type(state_dict).__name__} instead."
            )
        if not state_dict:
            raise ValueError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler."
            )
        missing = [k for k in _TORCH_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"Expected `state_dict` to have the keys {list(_TORCH_KEYS)}, missing {missing}."
            )
        # Orbax and np.load hand back 0-d arrays where torch saved numbers.
        state_dict = {k: _python_scalar(state_dict[k]) for k in _TORCH_KEYS}
        if state_dict["_growth_tracker"] is None:  # check_config reads None as "not given"
            raise TypeError(
                "Expected state_dict['_growth_tracker'] to be an integer >= 0, got None "
                "instead; a dict saved by PyTorch or by GradScaler.state_dict holds the count."
            )
        scale_value = state_dict["scale"]
        if is_real_number(scale_value) and not (
            isinstance(scale_value, int) or math.isfinite(scale_value) and float(scale_value) > 0
        ):
            raise ValueError(
                f"Expected state_dict['scale'] to be positive and finite, got {scale_value!r:.60} "
                "instead; a PyTorch scaler whose scale collapsed to 0 cannot be resumed."
            )
        # A restore: a scale torch let grow past max_scale (up to 2**127) is
        # clamped to it, and a tracker at or past the interval held one short.
        config = check_config(
            scale=scale_value,
            scale_name="state_dict['scale']",
            growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"],
            growth_tracker=state_dict["_growth_tracker"],
            restore=True,
            names={
                "growth_tracker": "state_dict['_growth_tracker']",
                **{k: f"state_dict['{k}']" for k in _TORCH_KEYS[1:4]},
            },
        )
        return _as_grad_scaler_state(ls.from_config(ls.DYNAMIC, config))
