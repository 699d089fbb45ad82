"""Which optimizer step recorded each inf check of a ``GradScalerState``.

torch's scaler keys its per-optimizer stage by ``id(optimizer)``, so a
second ``scaler.step(optimizer)`` before ``scaler.update()`` raises "step()
has already been called since the last update()". An Optax transformation is
stateless and may serve several models, so here one optimizer is a
transformation *and* the parameters it steps: each check ``GradScaler.step``
records carries a ``StepRecord`` (static metadata) naming the
transformation, the structure of the parameters and weak references to the
arrays the step returned (not their ``id``s: an id is reused once its array
is freed, and a new array would pass for a returned one). ``check_step``
refuses, while the step is traced:

- the same transformation stepping the parameters its recorded step returned
  (a loop that forgot ``scaler.update``, or one model stepped twice); and
- a step of parameters of a recorded structure, when that record was made in
  another trace: the state left a jitted call with its checks and came back
  into the next one. Accepted, every iteration would add one check, so the
  state would grow and the jitted function retrace on every call.

Several optimizers chained between two updates (``step(state, tx0, ...)``,
then ``step(state, tx1, ...)`` with the state the first returned) pass: they
step other parameters (or another structure).
"""

from __future__ import annotations

import dataclasses
import weakref

import jax
import jax.extend.core

from jamp._src.types import Params, is_tracer
from jamp._src.validate import hide_from_tracebacks

hide_from_tracebacks(__file__)  # a misuse it refuses shows the user's line

_LOOP = (
    "`params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)`, then "
    "`state = scaler.update(state)`, once per iteration"
)
_SEVERAL = (
    "Several optimizers step once each between two updates, each given the state the "
    "previous `scaler.step` returned: `p0, o0, state = scaler.step(state, tx0, g0, o0, p0)`, "
    "`p1, o1, state = scaler.step(state, tx1, g1, o1, p1)`, then `state = scaler.update(state)`."
)
STEPPED_TWICE = "step() has already been called since the last update()."


def trace_state() -> object:
    """The current JAX trace, as an opaque token (equal within one trace; the eager trace
    when nothing is traced)."""
    return jax.extend.core.get_opaque_trace_state(convention="jamp")


def _arrays(tree: Params) -> list[jax.Array]:
    """The arrays (and tracers) among ``tree``'s leaves."""
    return [
        leaf
        for leaf in jax.tree_util.tree_leaves(tree)
        if (isinstance(leaf, jax.Array) or is_tracer(leaf))
    ]


@dataclasses.dataclass(frozen=True, eq=False)
class StepRecord:
    """The optimizer step that recorded one inf check (static metadata: costs nothing).

    Attributes:
      tx: the Optax transformation, held so that its identity stays unique
        while the check is recorded.
      structure: the tree structure of the parameters it stepped.
      outputs: a weak reference to each array the step returned as
        parameters (and did not pass through unchanged): the arrays a second
        step of the same optimizer would be given. Weak, so the record keeps
        no array alive, and a freed one matches nothing (where its ``id``
        would match the next array given its address).
      trace: the JAX trace the step ran in (an opaque token; the eager
        trace when not traced).

    Two records are equal when they name the same transformation and
    structure, so a state keeps its tree structure (and a jitted function
    its cache entry) from one iteration to the next.
    """

    tx: object
    structure: object
    outputs: tuple[weakref.ref[jax.Array], ...]
    trace: object

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, StepRecord)
            and self.tx is other.tx
            and self.structure == other.structure
        )

    def __hash__(self) -> int:
        return hash((id(self.tx), self.structure))

    def __repr__(self) -> str:
        return f"StepRecord(tx={type(self.tx).__name__} at {id(self.tx):#x}, {self.structure})"

    def returned_any_of(self, arrays: list[jax.Array]) -> bool:
        """Whether one of ``arrays`` is an array this step returned (and is still alive)."""
        given = {id(a) for a in arrays}  # alive while compared: an id names one object
        return any((out := ref()) is not None and id(out) in given for ref in self.outputs)


def record(tx: object, params: Params, new_params: Params) -> StepRecord:
    """The record of a step of ``tx`` from ``params`` to ``new_params``."""
    given = {id(a) for a in _arrays(params)}
    return StepRecord(
        tx=tx,
        structure=jax.tree_util.tree_structure(params),
        outputs=tuple(weakref.ref(a) for a in _arrays(new_params) if id(a) not in given),
        trace=trace_state(),
    )


def check_step(records: tuple[StepRecord | None, ...], tx: object, params: Params) -> None:
    """A RuntimeError, in torch's words, if ``tx`` stepping ``params`` is not a new optimizer.

    Args:
      records: the state's records, one per recorded check (``None`` for a
        check of ``GradScaler.unscale`` that no step has taken yet).
      tx: the transformation about to step.
      params: the parameters it is about to step.
    """
    structure = jax.tree_util.tree_structure(params)
    arrays = _arrays(params)
    trace = trace_state()
    for rec in records:
        if rec is None or rec.structure != structure:
            continue
        if rec.tx is tx and rec.returned_any_of(arrays):
            raise RuntimeError(
                f"{STEPPED_TWICE} This `tx` already stepped these parameters since the last "
                "`scaler.update` (they are what that `scaler.step` returned), and `state` holds "
                "that step's inf check: the loop carried the state into the next iteration "
                f"without `state = scaler.update(state)`. Write {_LOOP}. {_SEVERAL}"
            )
        if rec.trace != trace:
            raise RuntimeError(
                f"{STEPPED_TWICE} `state` holds an inf check that a step of parameters of this "
                "structure recorded in another trace (an earlier call of a jitted function): "
                "the state left that call without `state = scaler.update(state)`. Accepted, "
                "every iteration would record one more check, so the state would grow and the "
                f"jitted function retrace on every call. Write {_LOOP}, inside the jitted "
                "function. (Two models of the same structure stepped in separately jitted "
                "functions meet this too: step both in one, then update.)"
            )
