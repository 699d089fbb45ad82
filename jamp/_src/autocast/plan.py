"""The plan of a jaxpr: what autocast's interpreter decides about each equation from the
whole jaxpr, before it evaluates any (``Plan``, built once per evaluation of a jaxpr).

The pre-passes, each a walk over the jaxpr's equations:

- ``float32_operands``: the values a float32-rule primitive reads; a promote primitive
  computing one runs in float32 (``x - max(x)`` feeding ``exp``);
- ``reaching_float32``: where a bounded activation (sigmoid, tanh) runs in float32, from
  its half input (``log(1 - sigmoid(z))``);
- ``sigmoid_logits``: the logits of such a sigmoid, computed in float32 from their matmul;
- ``picked``: the values a consumer passes on as they are (a label's logit), which get no
  float32 computation (``Lift``);
- ``mask_broadcasts``: the broadcast that made a ``select_n``'s mask (its backward pass
  keeps the small mask: ``autocast.residuals.select_keeping_mask``);
- ``autocast.residuals.find_softmax``: the softmaxes, with their dropout and the matmul
  that reads them, which get their own backward passes.

Each equation then gets an ``Action`` (what its handler needs of these), and each softmax
its group.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.core
from jax.extend import core as jex_core
from jax.typing import DTypeLike

from jamp._src.autocast.residuals import Group, find_softmax
from jamp._src.autocast.rules import ARITHMETIC, BOUNDED, FLOAT32, rule_of
from jamp._src.jaxprs import MARKER, RELAYOUTS, call_body


class Action(NamedTuple):
    """What the pre-passes say about one equation (``PLAIN``: nothing)."""

    disabled: bool = False  # inside autocast(f, enabled=False): runs as traced
    feeds_float32: bool = False  # an output feeds float32 (float32_operands, reaching_float32)
    mask: jex_core.JaxprEqn | None = None  # a select_n's mask broadcast (mask_broadcasts)
    logit: bool = False  # computes a float32 sigmoid's logits alone (sigmoid_logits)
    lift: bool = True  # its output may get a Lift (not picked)


PLAIN = Action()


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every equation's ``Action`` (by index; ``PLAIN`` where absent) and the softmax groups:
    by the index of their first equation (``softmaxes``), of the matmul that reads their
    probabilities (``fused``: evaluated as one custom_vjp with it) and of the shift of a
    fused one (``shifts``: evaluated from the shift's half input)."""

    actions: dict[int, Action]
    softmaxes: dict[int, Group]
    fused: dict[int | None, Group]  # by the matmul (set wherever the group has a p)
    shifts: dict[int, Group]

    def action(self, k: int) -> Action:
        return self.actions.get(k, PLAIN)


def make_plan(jaxpr: jex_core.Jaxpr, dtype: DTypeLike, fuse: bool) -> Plan:
    """The plan of ``jaxpr`` under the low dtype ``dtype``; ``fuse``: softmaxes may be fused
    with their matmul (not under a float8 rule)."""
    to_float32 = float32_operands(jaxpr)
    reach = reaching_float32(jaxpr)
    logits, chain = sigmoid_logits(jaxpr, reach)
    to_float32 |= logits
    softmaxes = find_softmax(jaxpr, dtype)
    fused = {g.dot: g for g in softmaxes.values() if g.p} if fuse else {}
    shifts = {g.pre[0]: g for g in fused.values() if g.pre and g.drop}
    masks = mask_broadcasts(jaxpr)
    kept_rounded = picked(jaxpr)  # values whose rounding is passed on: no Lift
    actions: dict[int, Action] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        fed = reach if eqn.primitive.name in BOUNDED else to_float32
        action = Action(
            disabled=MARKER in str(eqn.source_info.name_stack),
            feeds_float32=any(v in fed for v in eqn.outvars),
            mask=masks.get(k),
            logit=any(v in chain for v in eqn.outvars),
            lift=not any(v in kept_rounded for v in eqn.outvars),
        )
        if action != PLAIN:
            actions[k] = action
    return Plan(actions, softmaxes, fused, shifts)


def float32_operands(jaxpr: jex_core.Jaxpr) -> set[jex_core.Var]:
    """The variables of ``jaxpr`` that a float32-rule primitive (not ``div``, ``x**n``) consumes.

    ``x**3`` under float16 (gelu) reads its half input, as torch's gelu does.
    """
    found = set()
    for eqn in jaxpr.eqns:
        if rule_of(eqn) == FLOAT32 and eqn.primitive.name not in ("div", "integer_pow"):
            found.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    return found


def reaching_float32(jaxpr: jex_core.Jaxpr) -> set[jex_core.Var]:
    """Where a bounded activation (sigmoid, tanh) runs in float32: the operands of a
    float32-rule primitive that is not a sum (``log``, ``exp``, ``pow``...), and the inputs
    of the add/sub/mul whose result is one (``log(1 - p)``). A sum of squares of tanh
    (a loss) does not need it: rounded to 1.0, the value stays finite."""
    found = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if rule_of(eqn) == FLOAT32 and name not in ("div", "integer_pow", *_SUMS):
            found.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    reach = set(found)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ARITHMETIC and any(v in found for v in eqn.outvars):
            reach.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    return reach


_SUMS = ("reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_window_sum")


def sigmoid_logits(jaxpr: jex_core.Jaxpr, reach: set[jex_core.Var]) -> tuple[set, set]:
    """The logits of a sigmoid or tanh that runs in float32 (``reach``: ``log(sigmoid(z))``,
    a sigmoid loss), and what computes them alone from a matmul: ``(logits, chain)``, the
    chain being the matmul's output and its moves (a transpose under ``vmap``) up to the
    logits or the sum that adds their bias.

    Rounded to the half dtype, such logits carry the same error wherever a classifier is
    saturated (its logits cluster at a few values), and the loss's gradient, a sum of
    ``sigmoid(z) - y`` that cancels, multiplies it: they are computed in float32, the
    matmul accumulating into float32 and its bias added in float32.
    """
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    uses: dict[jex_core.Var, int] = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not isinstance(v, jex_core.Literal):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not isinstance(v, jex_core.Literal):
            uses[v] = uses.get(v, 0) + 1

    def back(v: jax.core.Atom) -> list[jex_core.Var] | None:  # v ... the matmul's output
        seen = []
        while isinstance(v, jex_core.Var) and uses.get(v) == 1 and v in made:
            seen.append(v)
            e = made[v]
            if e.primitive.name == "dot_general":
                return seen
            if e.primitive.name not in RELAYOUTS:  # a transpose under vmap
                return None
            v = e.invars[0]
        return None

    logits: set[jex_core.Var] = set()
    chain: set[jex_core.Var] = set()
    for e in jaxpr.eqns:
        if e.primitive.name not in BOUNDED or not any(v in reach for v in e.outvars):
            continue
        z = e.invars[0]
        if not isinstance(z, jex_core.Var) or uses.get(z) != 1 or z not in made:
            continue
        logits.add(z)
        by = made[z]
        found = back(z) if by.primitive.name != "add" else None
        for v in by.invars if by.primitive.name == "add" else ():
            found = found or back(v)
        chain.update(found or ())
    return logits, chain


# Consumers that pass a value's elements on as they are: picked (a label's logit), sliced,
# selected, joined or sorted. What they pass on keeps the value's rounding.
_PICKERS = frozenset(
    {"gather", "dynamic_slice", "slice", "select_n", "concatenate", "sort", "top_k",
     "dynamic_update_slice", "pad", "rev"}
)  # fmt: skip


def picked(jaxpr: jex_core.Jaxpr) -> set[jex_core.Var]:
    """The values whose elements a consumer passes on as they are (``_PICKERS``; a select's
    cases, not its mask), or that the jaxpr returns.

    Such a value gets no float32 computation (``Lift``) for its float32 consumers: a value
    and everything computed from it in one expression must see the same rounding. A
    cross-entropy's log-sum-exp computed from float32 logits minus the label's logit picked
    from the rounded ones is negative whenever the rounding favours the label.
    """
    out: set[jex_core.Var] = set()
    for e in jaxpr.eqns:
        body = call_body(e)
        if body is not None:  # jnp.take_along_axis is a jit: its operand, if it picks it
            inner = picked(body)
            ins = [v for v, w in zip(e.invars, body.invars, strict=False) if w in inner]
        elif e.primitive.name in _PICKERS:
            ins = e.invars[1:] if e.primitive.name == "select_n" else e.invars
        else:
            continue
        out.update(v for v in ins if isinstance(v, jex_core.Var))
    return out


def mask_broadcasts(jaxpr: jex_core.Jaxpr) -> dict[int, jex_core.JaxprEqn]:
    """``{k: b}``: the ``select_n`` equations ``k`` whose mask is the output of the
    ``broadcast_in_dim`` equation ``b`` of a smaller value, used by ``k`` alone
    (``jnp.where(causal_mask, scores, fill)``)."""
    made: dict[jax.core.Atom, jex_core.JaxprEqn] = {}
    uses: dict[jax.core.Atom, int] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal):
                uses[v] = uses.get(v, 0) + 1
    out = {}
    for k, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name == "broadcast_in_dim" and not isinstance(
            eqn.invars[0], jex_core.Literal
        ):
            made[eqn.outvars[0]] = eqn
        if eqn.primitive.name == "select_n":
            b = made.get(eqn.invars[0])
            if b is not None and uses[eqn.invars[0]] == 1 and eqn.invars[0] not in jaxpr.outvars:
                out[k] = b
    return out
