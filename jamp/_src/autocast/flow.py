"""autocast's promote flow: the dtype a ``promote`` primitive runs in, what its outputs are,
and the float32 computation of a half value (its ``Lift``).

``promote_target`` chooses the dtype from the inputs' categories (a low
activation, a constant, a statistic, a broadcast operand: ``categories``)
and the constants' spans (``constants_allow``); ``out_infos`` says what each
output is to its consumers (its kind, whether it is a low activation, its
span). ``lift_of`` says how a half output is computed in float32 for its float32
consumers, ``lifts_of`` and ``lifted_carry`` where that computation is used. The rule
handlers (``autocast.handlers``) call them per equation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from jax.extend import core as jex_core
from jax.typing import DTypeLike

from jamp._src.autocast.residuals import recomputed
from jamp._src.autocast.rules import (
    AFFINE,
    ARITHMETIC,
    BOUNDED,
    CONSTANT,
    FLOAT32_DTYPE,
    LOW_ACTIVATION,
    MASK_FILL,
    PARAMETER,
    REDUCTIONS,
    SPAN_PRESERVING,
    STRUCTURAL,
    Span,
    category,
    fits,
    merge_spans,
    narrows,
    norm_affine,
    runs_low,
    span_of,
    widest,
)
from jamp._src.autocast.values import (
    CONST,
    LITERAL,
    TRACED,
    Casts,
    Context,
    Info,
    Lift,
    Value,
    bind,
    is_float,
    upcast,
)
from jamp._src.dtypes import ELIGIBLE
from jamp._src.types import is_tracer


def known_span(x: Value, info: Info) -> Span | None:
    """The span of a constant's values; ``None`` when it is traced and unknown."""
    if info.span is not None:
        return info.span
    if is_tracer(x):
        return None
    return span_of(x)


def categories(
    invals: Sequence[Value], infos: Sequence[Info], float_in: Sequence[int], ctx: Context
) -> list[str]:
    biggest = max(int(np.prod(np.shape(invals[i]))) for i in float_in)
    return [
        category(
            constant=infos[i].kind >= CONST,
            low=infos[i].low,
            statistic=infos[i].statistic,
            broadcast=unbroadcast_size(invals[i], infos[i]) < biggest,
            in_low_dtype=infos[i].held or np.dtype(invals[i].dtype) == ctx.dtype,
        )
        for i in float_in
    ]


def unbroadcast_size(x: Value, info: Info) -> int:
    return int(np.prod(np.shape(x))) if info.size is None else info.size


def constants_allow(
    name: str,
    invals: Sequence[Value],
    infos: Sequence[Info],
    float_in: Sequence[int],
    dtype: DTypeLike,
) -> tuple[bool, bool]:
    """Whether the constants among the inputs may be narrowed to ``dtype``, and with saturation.

    A constant that is not narrowed, or fits (``autocast.rules.fits``),
    is fine. One that does not fit stops the narrowing (the primitive runs
    in the wider dtype) unless the primitive is a select, max, min or clamp
    and the only misfits are +-finfo(float32).max: the mask-fill idiom, which
    saturates to ``dtype``'s finite extreme.
    """
    narrowed = [i for i in float_in if infos[i].kind >= CONST and narrows(invals[i].dtype, dtype)]
    spans = [known_span(invals[i], infos[i]) for i in narrowed]
    if all(fits(s, dtype) for s in spans):
        return True, False
    if name in MASK_FILL and all(fits(s, dtype, mask_fill=True) for s in spans):
        return True, True
    return False, False


def promote_target(
    eqn: jex_core.JaxprEqn,
    invals: Sequence[Value],
    infos: Sequence[Info],
    float_in: Sequence[int],
    cats: Sequence[str],
    ctx: Context,
    feeds_float32: bool,
) -> tuple[np.dtype | None, bool, bool]:
    """The dtype a ``promote`` primitive runs in; whether a mask fill saturates; whether held.

    The widest floating input dtype (literals follow the others), or the low
    dtype when ``autocast.rules.runs_low`` says so; float32 for
    arithmetic feeding a float32-rule primitive; and no narrowing past a
    constant that does not fit (``constants_allow``).
    """
    name = eqn.primitive.name
    if not float_in:
        return None, False, False
    strong = [i for i in float_in if infos[i].kind != LITERAL] or float_in
    target = widest([invals[i].dtype for i in strong])
    eligible = all(np.dtype(invals[i].dtype) in ELIGIBLE for i in float_in)
    held = False
    if eligible and runs_low(cats):
        target = ctx.dtype
        if name in AFFINE and norm_affine(cats, [invals[i].dtype for i in float_in], ctx.dtype):
            target, held = FLOAT32_DTYPE, True  # a norm's scale and bias: float32, as Flax
    if feeds_float32 and name in ARITHMETIC and target != widest([target, FLOAT32_DTYPE]):
        # The operand of exp/log/sum...: computed in float32 from its
        # half-precision inputs, as torch upcasts softmax's input before
        # subtracting the max (see the module docstring). To its other
        # consumers it is still a low activation (held in float32).
        held = target == ctx.dtype
        target = widest([target, FLOAT32_DTYPE])
    allowed, fill = constants_allow(name, invals, infos, float_in, target)
    if not allowed:  # a constant that does not fit: no narrowing
        target = widest([invals[i].dtype for i in float_in])
    return target, fill, held


def out_infos(
    eqn: jex_core.JaxprEqn,
    invals: Sequence[Value],
    infos: Sequence[Info],
    outs: Sequence[Value],
    low: bool,
    held: bool = False,
) -> list[Info]:
    kind = min((i.kind for i in infos), default=CONST)
    name = eqn.primitive.name
    size = None
    if name in STRUCTURAL and invals:
        size = unbroadcast_size(invals[0], infos[0])
    span = None
    if kind >= CONST and name in SPAN_PRESERVING and all(is_float(x.dtype) for x in outs):
        spans = [known_span(x, i) for x, i in zip(invals, infos, strict=True) if is_float(x.dtype)]
        if spans and all(s is not None for s in spans):
            span = merge_spans([s for s in spans if s is not None])  # none is None here
    lows = [i for x, i in zip(invals, infos, strict=True) if is_float(x.dtype) and i.low]
    statistic = low and (name in REDUCTIONS or bool(lows) and all(i.statistic for i in lows))
    return [
        Info(kind, low and is_float(x.dtype), size, span, held and low, statistic) for x in outs
    ]


# What a lift is recorded for: the activations, and the arithmetic between activations,
# parameters and constants (a gate, a gated sum, a bias added to a matmul's output).
LIFTED = BOUNDED | AFFINE | frozenset({"square", "integer_pow"})
# A sum's lift (a bias added to a matmul's output) is not a loop carry's new value
# (lifted_carry). Every float32 consumer of the sum reads it, as the lifts of the
# arithmetic computed from it do: a value and everything computed from it in one
# expression see the same rounding (issue #42: a LayerNorm's E[x**2] from the lift and its
# E[x] from the rounded sum, whose difference cancelled what the two roundings differ by).
SUMS = frozenset({"add", "sub"})


def _parts(
    eqn: jex_core.JaxprEqn,
    invals: Sequence[Value],
    infos: Sequence[Info],
    cats: Sequence[str],
    ctx: Context,
) -> list[Lift] | None:
    """Each floating input of ``eqn`` as a ``Lift``: a half activation as itself, a parameter
    or a constant closed over; ``None`` when ``eqn`` is not ``LIFTED`` or an input is
    neither (a float32 activation, a statistic)."""
    if eqn.primitive.name not in LIFTED or len(cats) != len(invals):
        return None
    parts: list[Lift] = []
    for x, info, c in zip(invals, infos, cats, strict=True):
        if c == LOW_ACTIVATION and np.dtype(x.dtype) == ctx.dtype and info.kind == TRACED:
            parts.append(Lift((x,), lambda a: a))
        elif c in (PARAMETER, CONSTANT):
            parts.append(Lift((), lambda x=x: upcast(x, FLOAT32_DTYPE)))
        else:
            return None
    return parts if any(p.args for p in parts) else None


def liftable(
    eqn: jex_core.JaxprEqn,
    invals: Sequence[Value],
    infos: Sequence[Info],
    cats: Sequence[str],
    ctx: Context,
) -> bool:
    """Whether ``eqn``, run in the half dtype, gets a ``Lift`` (``lift_of``)."""
    return _parts(eqn, invals, infos, cats, ctx) is not None


def lift_of(
    eqn: jex_core.JaxprEqn,
    invals: Sequence[Value],
    infos: Sequence[Info],
    cats: Sequence[str],
    outs: Sequence[Value],
    casts: Casts,
    ctx: Context,
) -> Lift | None:
    """How ``eqn``'s half output is computed in float32 for a float32 consumer, or ``None``.

    A sigmoid or tanh rounded to the half dtype and then upcast loses what a
    float32 consumer would have kept: a GRU's update gate ``z`` near 1 (where
    the half dtype's spacing is 2**-8) in ``z * h`` with a float32 carry ``h``;
    a logit added to its bias and rounded before a float32 loss. So
    ``eqn`` (a ``LIFTED`` primitive that ran in the half dtype, its floating
    inputs half activations, parameters and constants: ``invals`` before their
    cast, with their categories ``cats``) records how to compute it in float32
    instead: from its half activations, each upcast exactly, or from theirs when
    they have a lift themselves and that reads no more half arrays than ``eqn``
    does, so what the backward pass keeps (the half arrays) never grows.
    """
    if eqn.primitive.name not in LIFTED or len(outs) != 1:
        return None
    if not is_float(outs[0].dtype) or np.dtype(outs[0].dtype) != ctx.dtype:
        return None
    parts = _parts(eqn, invals, infos, cats, ctx)
    if parts is None:
        return None
    inner = [(casts.lifted(p.args[0]) if p.args else None) or p for p in parts]
    if sum(len(p.args) for p in inner) <= sum(len(p.args) for p in parts):
        parts = inner
    sizes = [len(p.args) for p in parts]
    params = eqn.params

    def fun(*args: Value) -> Value:
        it = iter(args)
        xs = [p.fun(*(next(it) for _ in range(k))) for p, k in zip(parts, sizes, strict=True)]
        return bind(eqn, xs, params)[0]

    return Lift(tuple(a for p in parts for a in p.args), fun, eqn.primitive.name)


def lifts_of(
    vals: Sequence[Value], targets: Mapping[int, DTypeLike], casts: Casts
) -> dict[int, tuple[Lift, tuple[Value, ...]]]:
    """The operands going up to float32 that have a ``Lift``, each with its half inputs'
    float32 casts (where their cotangents go). A value gets a lift only where no consumer
    passes its rounded elements on (``rules.picked``): every float32 consumer of it then
    reads the same float32 computation."""
    out = {}
    for i, dtype in targets.items():
        lift = casts.lifted(vals[i]) if np.dtype(dtype) == FLOAT32_DTYPE else None
        if lift is not None:
            out[i] = (lift, casts.wides(lift))
    return out


def lifted_carry(x: Value, casts: Casts) -> Value:
    """A float32 loop carry's new value: ``x``'s float32 computation if it has a ``Lift``
    (a carry is state: not rounded to the half dtype between iterations), else ``x``."""
    lift = casts.lifted(x)
    if lift is None or lift.name in SUMS:
        return x
    return recomputed(lift.fun, *lift.args, wides=casts.wides(lift))


def recomputed_lifted(
    eqn: jex_core.JaxprEqn, params: Mapping[str, object], x: Value, casts: Casts
) -> Value:
    """A float32 unary primitive of ``x``, recomputed in the backward pass from ``x``, or
    from ``x``'s half inputs when ``x`` has a float32 computation (a ``Lift``, a sum's
    included: a sigmoid loss's logits plus their bias)."""
    lift = casts.lifted(x)
    if lift is None:
        return recomputed(lambda x: bind(eqn, [x], params)[0], x)
    fun = lift.fun
    return recomputed(
        lambda *xs: bind(eqn, [fun(*xs)], params)[0], *lift.args, wides=casts.wides(lift)
    )
