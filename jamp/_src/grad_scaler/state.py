"""A ``GradScalerState`` and the machinery that refuses the misuses torch refuses.

The state's stages, its pytree (whose metadata carries a state consumed while
traced out of that trace: ``_Stale``), the consumption of a state a method took
(explained once, in [`jamp.GradScalerState`][]'s docstring), torch's
sentences for each misuse and what to write instead, and ``takes_state``, which
tells a PyTorch-style call to pass the state first. ``scaler`` holds the
PyTorch API and calls these; nothing here computes a step.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from collections.abc import Callable, Iterable
from typing import Any, ParamSpec, TypeVar

import jax

from jamp._src import loss_scale as ls
from jamp._src.grad_scaler.records import trace_state
from jamp._src.lookup import holds_loss_scale
from jamp._src.loss_scale import StateT
from jamp._src.types import PyTree, is_tracer
from jamp._src.validate import hide_from_tracebacks

hide_from_tracebacks(__file__)  # a misuse it refuses shows the user's line

P = ParamSpec("P")
R = TypeVar("R")


def check_scaler_state(state: object, method: str) -> ls.LossScaleState:
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
    lose an inf check; torch keeps the stage in the scaler, where no old
    state object is left to pass on). The mark is ``consumed_by``, the one field a method
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
    # Consumption (the docstring above): no pytree field, not compared.
    consumed_by: str | None = dataclasses.field(default=None, init=False, compare=False, repr=False)
    # The trace a method consumed this (traced) state in (``_Stale``).
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
# Read in one C call each: a jitted step flattens its state argument on every dispatch.
_data_of, _meta_of = operator.attrgetter(*_DATA_FIELDS), operator.attrgetter(*_META_FIELDS)


@dataclasses.dataclass(frozen=True, eq=False)
class _Stale:
    """The pytree metadata of a state consumed while traced (``GradScalerState`` says why
    it leaves that trace marked): a new tree structure, so the next call retraces.

    Equal for one method whatever the trace, so a pytree holding a stale state still
    hashes and compares.
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
    return _data_of(state), (*_meta_of(state), stale)


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


def stage_of(state: ls.LossScaleState) -> str:
    return state.stage if isinstance(state, GradScalerState) else READY


def found_infs_of(state: ls.LossScaleState) -> tuple:
    return state.found_infs if isinstance(state, GradScalerState) else ()


def checked_by_of(state: ls.LossScaleState) -> tuple:
    """One record (or ``None``) per recorded check."""
    found_infs = found_infs_of(state)
    records = state.checked_by[: len(found_infs)] if isinstance(state, GradScalerState) else ()
    return (*records, *[None] * (len(found_infs) - len(records)))


def as_grad_scaler_state(state: ls.LossScaleState) -> GradScalerState:
    if isinstance(state, GradScalerState):
        return state
    return GradScalerState(**{name: getattr(state, name) for name in _LOSS_SCALE_FIELDS})


def with_checks(
    state: ls.LossScaleState, found_infs: tuple, stage: str, checked_by: tuple
) -> GradScalerState:
    """``state`` at ``stage`` (unscaled or stepped) with ``found_infs``."""
    return dataclasses.replace(
        as_grad_scaler_state(state), found_infs=found_infs, stage=stage, checked_by=checked_by
    )


def ready(state: StateT) -> StateT:
    """``state`` ready for the next iteration; a plain loss-scale state stays one."""
    if not isinstance(state, GradScalerState):
        return state
    return dataclasses.replace(state, found_infs=(), stage=READY, checked_by=())


def any_found(flags: tuple) -> jax.Array:
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
NO_INF_CHECKS = "No inf checks were recorded prior to update."
UNSCALED_TWICE = "unscale_() has already been called on this optimizer since the last update()."
_AFTER_UPDATE = "update() has already been called with this state."
_SENTENCES = {
    ("unscale", "unscale"): UNSCALED_TWICE,
    ("unscale", "step"): (
        "unscale_() has already been called since the last update(), so `grads` are unscaled "
        "already and `step` would unscale them a second time."
    ),
    ("unscale", "update"): NO_INF_CHECKS,
    ("step", "step"): "step() has already been called since the last update().",
    ("step", "unscale"): "unscale_() is being called after step().",
    ("step", "update"): NO_INF_CHECKS,
}
CALLS = {
    "unscale": "grads, state = scaler.unscale(state, grads)",
    "step": "params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)",
    "update": "state = scaler.update(state)",
}

_CLONE = "jax.tree_util.tree_map(lambda x: x, state)"


def consume(state: ls.LossScaleState, method: str, others: PyTree = ()) -> None:
    """Mark ``state`` consumed by ``method``, which took it and returned its successor: what
    that means, and which states are not marked, is ``GradScalerState``'s docstring (``others``:
    the method's other arguments, traced when a captured, concrete ``state`` is not marked)."""
    if not isinstance(state, GradScalerState):
        return
    if is_tracer(state.scale):  # consumed in this trace: it leaves it marked (``_Stale``)
        object.__setattr__(state, "consumed_by", method)
        object.__setattr__(state, "_consumed_in", trace_state())
    elif not any(map(is_tracer, jax.tree_util.tree_leaves(others))):
        object.__setattr__(state, "consumed_by", method)


def check_not_consumed(state: ls.LossScaleState, method: str) -> None:
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
        f"to use from then on: write `{CALLS[used]}` and pass that state on. An iteration is "
        f"`{_LOOP}`. To reuse this state on purpose (to replay a step), clone it first: "
        f"`state = {_CLONE}` is a new, unconsumed object with the same values."
    )


def refuse_found_inf(method: str) -> TypeError:
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


def takes_state(call: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A GradScaler method that says, when called the PyTorch way, to pass the state first."""

    def decorate(method: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(method)
        name = getattr(method, "__name__", "")

        @functools.wraps(method)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:  # args[0] is the scaler
            if "found_inf" in kwargs and name in ("step", "update"):
                raise refuse_found_inf(name)
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
