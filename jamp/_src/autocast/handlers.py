"""autocast's rule handlers: one function per rule of the table, for one equation.

The interpreter (``autocast.interpreter``) picks the handler of an equation in this
order (its ``eval_eqn``): a disabled region, a rule tried first (float8), a
sub-computation (``autocast.higher_order``), the user's casts (``user_cast``), an
unknown primitive (``unknown``), a scatter-add of half values (``scatter_add``),
``as traced``, and then the table's rule (``by_rule``):

- ``lower``: matrix products in the low dtype (``promote`` where a constant does not
  fit it);
- ``keep``: each output its input, as it arrives;
- ``float32``: in float32, a half activation recomputed in the backward pass;
- ``bounded``: a sigmoid or tanh feeding float32 (``log(1 - p)``) in float32 from its
  half input;
- ``promote``: the dtype flow's (``autocast.flow.promote_target``).

``lower``, ``float32`` and ``promote`` give the dtype of each floating operand
(``Casting``); ``cast_and_bind`` then casts them and binds the equation, its gradient
summed in float32 where the backward pass sums half values (``autocast.sums``: a
broadcast operand, a broadcast, an operand with a float32 computation), a select's
backward pass keeping its mask only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.typing import DTypeLike

from jamp._src.autocast.flow import (
    categories,
    constants_allow,
    lift_of,
    liftable,
    lifts_of,
    out_infos,
    promote_target,
    recomputed_lifted,
)
from jamp._src.autocast.plan import Action
from jamp._src.autocast.residuals import recomputed, select_keeping_mask
from jamp._src.autocast.rules import (
    BOUNDED,
    FLOAT32,
    FLOAT32_DTYPE,
    KEEP,
    LOWER,
    RECOMPUTED,
    div_rule,
    narrows,
    output_is_low,
    widest,
)
from jamp._src.autocast.sums import (
    bind_summing,
    broadcast_in_float32,
    half,
    product_with_wide_gradients,
    sharded,
    summed_in_float32,
    upcast_in_backward,
)
from jamp._src.autocast.values import (
    CONST,
    TRACED,
    Casts,
    Context,
    Evaluated,
    Info,
    Value,
    aval,
    bind,
    cast,
    is_float,
    record,
    source,
)
from jamp._src.dtypes import ELIGIBLE


def half_activation(x: Value, info: Info, size: int = 2) -> bool:
    """Whether ``x``, an activation, is float16/bfloat16 (``size`` 2) or float32 too (4)."""
    return info.kind == TRACED and np.dtype(x.dtype) in ELIGIBLE and x.dtype.itemsize <= size


def kept_preferred_type(eqn: jex_core.JaxprEqn, float_in: Sequence[int]) -> np.dtype | None:
    """A dot's ``preferred_element_type`` when wider than its traced floating inputs.

    One wider than the inputs (``bf16 x bf16 -> f32``, as
    ``jax.nn.dot_product_attention`` writes its logits) was chosen on purpose
    and is kept; one equal to the inputs' dtype (what ``jnp.matmul`` fills in)
    follows the inputs to autocast's dtype. ``None`` when there is none to keep.
    """
    pet = eqn.params.get("preferred_element_type")
    if pet is None or not is_float(pet):
        return None
    traced = max(np.dtype(aval(eqn.invars[i]).dtype).itemsize for i in float_in)
    return np.dtype(pet) if np.dtype(pet).itemsize > traced else None


def lower_params(
    eqn: jex_core.JaxprEqn, float_in: Sequence[int], ctx: Context
) -> Mapping[str, object]:
    """``preferred_element_type`` in ``dtype``, unless kept (``kept_preferred_type``)."""
    params = eqn.params
    pet = params.get("preferred_element_type")
    if pet is None or not is_float(pet) or kept_preferred_type(eqn, float_in) is not None:
        return params
    return {**params, "preferred_element_type": ctx.dtype}


# Collectives over a named axis (pmap, shard_map, vmap with axis_name).
_COLLECTIVES = frozenset(
    {"psum", "pmax", "pmin", "psum_invariant", "all_gather", "all_gather_invariant",
     "ppermute", "all_to_all", "psum_scatter", "reduce_scatter", "pbroadcast"}
)  # fmt: skip


def across_devices(
    eqn: jex_core.JaxprEqn, invals: Sequence[Value], infos: Sequence[Info], out: list[Info]
) -> list[Info]:
    """A collective of statistics returns statistics: BatchNorm's mean and variance over
    ``axis_name`` (a ``pmean``) stay float32 statistics, so ``x - mean`` runs in float32 as
    it does on one device. (As an unknown primitive it returned a float32 value of no
    category, a parameter: ``x - mean`` then ran in the half dtype, and its cancellation
    made the ResNet's gradients 6x further from float32's, issue #35.)"""
    floats = [i for x, i in zip(invals, infos, strict=True) if is_float(x.dtype)]
    if eqn.primitive.name not in _COLLECTIVES or not floats:
        return out
    if not all(i.low and i.statistic for i in floats):
        return out
    return [i._replace(low=True, statistic=True) for i in out]


# What runs as traced, the user's own casts, unknown primitives


def const_kind(infos: Sequence[Info]) -> int:
    """The kind of an output computed from inputs with ``infos``, never literal."""
    return CONST if all(i.kind >= CONST for i in infos) else TRACED


def as_traced(
    eqn: jex_core.JaxprEqn, invals: Sequence[Value], infos: Sequence[Info], ctx: Context, rule: str
) -> tuple[list[Value], list[Info]]:
    vals = [
        cast(x, aval(v).dtype) if is_float(x.dtype) and is_float(aval(v).dtype) else x
        for x, v in zip(invals, eqn.invars, strict=True)
    ]
    outs = bind(eqn, vals)
    record(ctx, eqn, rule, vals, outs)
    return outs, [Info(kind=const_kind(infos))] * len(outs)


def user_cast(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> tuple[list[Value], list[Info]]:
    (x,) = invals
    new_dtype = eqn.params["new_dtype"]
    if aval(eqn.invars[0]).dtype == new_dtype and is_float(new_dtype):
        # A no-op in the traced program (at most a weak-type change): keep the
        # autocast dtype instead of undoing it.
        record(ctx, eqn, "no-op cast", [x], [x])
        return [x], [infos[0]]
    outs = bind(eqn, [x])  # the user's own cast: honoured
    record(ctx, eqn, "cast", outs, outs)
    info = infos[0]
    keeps = is_float(x.dtype) and is_float(new_dtype)
    span = info.span if keeps and not narrows(x.dtype, new_dtype) else None
    return outs, [info._replace(low=info.low and keeps, span=span, held=False)]


def unknown(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> Evaluated:
    """A primitive the table does not know: as traced, reported (a collective of
    statistics returns statistics)."""
    if ctx.recorder is not None:
        ctx.recorder.unknown.add(eqn.primitive.name)
    outs, outinfos = as_traced(eqn, invals, infos, ctx, "unknown")
    return outs, across_devices(eqn, invals, infos, outinfos)


def scatter_add(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> Evaluated:
    """segment_sum of half messages: accumulated in float32 (the traced dtype), returned in
    the half dtype, a low activation (torch lists scatter_add under promote)."""
    outs, _ = as_traced(eqn, invals, infos, ctx, "scatter-add in float32")
    with source(eqn):
        outs = [cast(outs[0], ctx.dtype)]
    return outs, [Info(low=True)]


# ---------------------------------------------------------------------------
# The table's rules
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    """One equation under a rule of the table: its inputs (``invals``, as they arrive;
    ``vals``, as cast), what the plan says of it, and its floating inputs' categories."""

    eqn: jex_core.JaxprEqn
    invals: list[Value]
    infos: list[Info]
    ctx: Context
    rule: str
    action: Action
    casts: Casts
    mask: tuple[Value, jex_core.JaxprEqn] | None  # select_n's mask: (its source, the broadcast)
    float_in: list[int]
    cats: list[str]

    @property
    def name(self) -> str:
        return self.eqn.primitive.name


@dataclasses.dataclass(frozen=True)
class Casting:
    """What a rule decided for its equation: the dtype of each floating operand, the
    parameters, whether the output is a low activation, held in float32 for float32
    consumers (``Info.held``), and whether a constant saturates (a mask fill)."""

    targets: Mapping[int, DTypeLike]
    params: Mapping[str, object]
    low: bool = False
    held: bool = False
    fill: bool = False


def lower(s: Step) -> Casting:
    """A matrix product in the low dtype; a sigmoid's logits accumulated into float32."""
    params = lower_params(s.eqn, s.float_in, s.ctx)
    held = False
    if s.action.logit:  # the matmul of a sigmoid's logits accumulates into float32
        params, held = {**params, "preferred_element_type": FLOAT32_DTYPE}, True
    return Casting({i: s.ctx.dtype for i in s.float_in}, params, low=True, held=held)


def keep(s: Step) -> Evaluated:
    """Each output is its input, as it arrives."""
    outs = bind(s.eqn, s.invals, s.eqn.params)
    record(s.ctx, s.eqn, s.rule, s.invals, outs)
    if len(outs) == len(s.infos):
        return outs, list(s.infos)
    return outs, [Info(kind=const_kind(s.infos))] * len(outs)


def float32(s: Step) -> Evaluated | Casting:
    """In float32; a unary primitive of a half activation (``RECOMPUTED``) is recomputed in
    the backward pass from its half input (``autocast.residuals``)."""
    eqn, invals, params = s.eqn, s.invals, s.eqn.params
    targets = {i: FLOAT32_DTYPE for i in s.float_in if np.dtype(invals[i].dtype) in ELIGIBLE}
    low = output_is_low(s.cats)
    if (
        s.name in RECOMPUTED
        and targets == {0: FLOAT32_DTYPE}
        and half_activation(invals[0], s.infos[0])
    ):
        with source(eqn):  # the backward pass keeps the half input (autocast.residuals)
            outs = [recomputed(lambda x: bind(eqn, [x], params)[0], invals[0])]
        record(s.ctx, eqn, s.rule, outs, outs)
        return outs, out_infos(eqn, invals, s.infos, outs, low)
    return Casting(targets, params, low=low)


def in_float32_bounded(s: Step) -> bool:
    """Whether ``s`` is a sigmoid or tanh of a half activation feeding float32."""
    infos = s.infos
    return (
        s.name in BOUNDED
        and s.action.feeds_float32
        and s.float_in == [0]
        and half_activation(s.invals[0], infos[0], 4 if infos[0].held else 2)
    )


def bounded(s: Step) -> Evaluated:
    """sigmoid feeding log(1 - p): in float32 from its half input, which the backward pass
    keeps (in the half dtype 1 - p rounds to 0 and the loss to inf); from its float32
    logits where they are computed so (``plan.sigmoid_logits``)."""
    with source(s.eqn):
        outs = [recomputed_lifted(s.eqn, s.eqn.params, s.invals[0], s.casts)]
    record(s.ctx, s.eqn, s.rule, outs, outs)
    return outs, out_infos(s.eqn, s.invals, s.infos, outs, output_is_low(s.cats), held=True)


def promote(s: Step) -> Casting:
    """The dtype flow's (``autocast.flow``); also a ``lower`` with float64 or a constant
    that does not fit the low dtype."""
    eqn, invals, infos, ctx = s.eqn, s.invals, s.infos, s.ctx
    feeds_float32 = s.action.feeds_float32
    target, fill, held = promote_target(eqn, invals, infos, s.float_in, s.cats, ctx, feeds_float32)
    if s.action.logit and target is not None:  # moving a sigmoid's float32 logits
        target, held = widest([target, FLOAT32_DTYPE]), True
    if held and s.action.lift and liftable(eqn, invals, infos, s.cats, ctx):
        # Arithmetic of half inputs feeding a float32 primitive (a matmul's output plus
        # its bias, into a norm's statistics): in the half dtype for its half consumers,
        # and in float32 from its half inputs for the float32 ones (its Lift), whose
        # backward pass keeps the half inputs, not a float32 copy.
        target, held = ctx.dtype, False
    targets = {} if target is None else {i: target for i in s.float_in}  # None: no float in
    return Casting(targets, eqn.params, output_is_low(s.cats), held, fill)


def by_rule(
    eqn: jex_core.JaxprEqn,
    invals: list[Value],
    infos: list[Info],
    ctx: Context,
    rule: str,
    action: Action,
    casts: Casts,
    mask: tuple[Value, jex_core.JaxprEqn] | None,
) -> Evaluated:
    """``eqn`` under its rule of the table (the module docstring)."""
    float_in = [i for i, x in enumerate(invals) if is_float(x.dtype)]
    eligible = bool(float_in) and all(np.dtype(invals[i].dtype) in ELIGIBLE for i in float_in)
    cats = categories(invals, infos, float_in, ctx) if float_in else []
    if eqn.primitive.name == "div" and float_in and float_in[-1] == 1:
        rule = div_rule(cats[-1])
    s = Step(eqn, invals, infos, ctx, rule, action, casts, mask, float_in, cats)
    lowered = rule == LOWER and eligible
    if lowered:
        lowered, _ = constants_allow(s.name, invals, infos, float_in, ctx.dtype)
    if lowered:
        done = lower(s)
    elif rule == KEEP:
        done = keep(s)
    elif rule == FLOAT32:
        done = float32(s)
    elif in_float32_bounded(s):
        done = bounded(s)
    else:
        done = promote(s)
    return cast_and_bind(s, done) if isinstance(done, Casting) else done


def cast_and_bind(s: Step, c: Casting) -> Evaluated:
    """``s``'s operands cast as ``c`` says, and the equation bound on them."""
    eqn, invals, infos, casts, name = s.eqn, s.invals, s.infos, s.casts, s.name
    targets, params = c.targets, c.params
    vals = list(invals)
    outs: list[Value] = []  # bound by bind_summing when `wide or up or lifts`
    # Half operands going up to float32 that have a float32 computation: used instead.
    lifts = lifts_of(vals, targets, casts)
    with source(eqn):  # the casts carry the user's source line (autocast_report)
        rest = {i: d for i, d in targets.items() if i not in lifts}
        wide = broadcast_in_float32(eqn, vals, rest, infos)
        up = upcast_in_backward(eqn, vals, targets, infos, wide) - set(lifts)
        reduced = set() if wide or up or lifts else wide_gradients(s, c)
        for i, dtype in targets.items():
            if i not in wide and i not in up and i not in lifts and i not in reduced:
                vals[i] = casts(vals[i], dtype, infos[i], saturate=c.fill)
        if wide or up or lifts:  # summed in float32, half operands kept (autocast.sums)
            shape = aval(eqn.outvars[0]).shape
            outs = bind_summing(
                lambda xs: bind(eqn, xs, params), name, vals, targets, wide, shape, up, lifts
            )
    if wide or up or lifts:
        record(s.ctx, eqn, s.rule, [vals[i] for i in targets if i not in wide] or outs, outs)
        return _lifted(s, c, outs)
    if reduced:  # a float32 operand's gradient from a float32 product (autocast.sums)
        with source(eqn):
            outs = product_with_wide_gradients(
                lambda xs: bind(eqn, xs, params), vals, targets, reduced, params
            )
        ran: list[Any] = [
            jax.ShapeDtypeStruct(np.shape(x), targets[i]) if i in reduced else x
            for i, x in enumerate(vals)
        ]  # what ran: the half casts
        record(s.ctx, eqn, s.rule, ran, outs)
        return _lifted(s, c, outs)
    if name == "broadcast_in_dim" and half_activation(vals[0], infos[0]):
        if not eqn.params["sharding"]:  # its gradient is summed in float32 (autocast.sums)
            return _broadcast(s, c, vals)
    kinds = {i.kind == TRACED for i in infos[1:]}
    if name == "select_n" and kinds == {True, False} and is_float(vals[1].dtype):
        outs = _select(s, params, vals)
    else:
        outs = bind(eqn, vals, params)
    record(s.ctx, eqn, s.rule, vals, outs)
    return _lifted(s, c, outs)


def wide_gradients(s: Step, c: Casting) -> set[int]:
    """The operands of a half ``dot_general`` whose gradients its transposed product makes in
    float32 (``Context.reduce_dtype``; by default where the program is sharded): traced
    float32 (or half) values that are not low activations (a parameter; a float32 input or
    residual stream), cast down to the half dtype here. Of a ``conv_general_dilated``, the
    kernel only (its right operand): the input's cotangent is not summed across devices."""
    if s.name not in ("dot_general", "conv_general_dilated"):
        return set()
    wanted = s.ctx.reduce_dtype
    if wanted is None:  # the default: float32 in a sharded program
        wanted = FLOAT32_DTYPE if any(sharded(x) for x in s.invals) else s.ctx.dtype
    if wanted != FLOAT32_DTYPE:
        return set()
    out: Any = c.params.get("preferred_element_type")
    if out is not None and not half(out):
        return set()
    return {
        i
        for i, dtype in c.targets.items()
        if (i == 1 or s.name == "dot_general")
        and half(dtype)
        and np.dtype(s.invals[i].dtype) in (FLOAT32_DTYPE, np.dtype(dtype))
        and s.infos[i].kind == TRACED
        and not s.infos[i].low
    }


def _lifted(s: Step, c: Casting, outs: list[Value]) -> Evaluated:
    """``outs`` with their infos, the first's float32 computation recorded (a ``Lift``)."""
    if s.action.lift:
        lift = lift_of(s.eqn, s.invals, s.infos, s.cats, outs, s.casts, s.ctx)
        s.casts.lift(outs[0], lift)
    return outs, out_infos(s.eqn, s.invals, s.infos, outs, c.low, c.held)


def _broadcast(s: Step, c: Casting, vals: list[Value]) -> Evaluated:
    """A broadcast of a half activation: its gradient summed in float32 (``autocast.sums``)."""
    p = s.eqn.params
    shape, dims = tuple(p["shape"]), tuple(p["broadcast_dimensions"])
    with source(s.eqn):
        outs: list[Value] = [summed_in_float32(vals[0], shape, dims, vals[0].dtype)]
    record(s.ctx, s.eqn, s.rule, vals, outs)
    return outs, out_infos(s.eqn, s.invals, s.infos, outs, c.low, c.held)


def _select(s: Step, params: Mapping[str, object], vals: list[Value]) -> list[Value]:
    """A select between an activation and a constant: its backward pass keeps the mask only
    (its source, where the plan found the broadcast that made it)."""
    eqn = s.eqn
    w, b = (vals[0], None) if s.mask is None else s.mask
    widen = None if b is None else (lambda w: bind(b, [w], b.params)[0])
    with source(eqn):
        return [select_keeping_mask(lambda *xs: bind(eqn, xs, params)[0], w, vals[1:], widen)]
