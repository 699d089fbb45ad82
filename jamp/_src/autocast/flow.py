"""autocast's dtype flow: the dtype a ``promote`` primitive runs in and what its outputs are.

``promote_target`` chooses the dtype from the inputs' categories (a low
activation, a constant, a statistic, a broadcast operand: ``categories``)
and the constants' spans (``constants_allow``); ``out_infos`` says what each
output is to its consumers (its kind, whether it is a low activation, its
span). The interpreter (``autocast.interpreter``) calls them per equation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.core
import numpy as np
from jax.extend import core as jex_core
from jax.typing import DTypeLike

from jamp._src.autocast.rules import (
    AFFINE,
    ARITHMETIC,
    ELIGIBLE,
    FLOAT32_DTYPE,
    MASK_FILL,
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
from jamp._src.autocast.values import CONST, LITERAL, Context, Info, Value, is_float


def known_span(x: Value, info: Info) -> Span | None:
    """The span of a constant's values; ``None`` when it is traced and unknown."""
    if info.span is not None:
        return info.span
    if isinstance(x, jax.core.Tracer):
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
