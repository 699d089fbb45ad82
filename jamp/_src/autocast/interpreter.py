"""The interpreter behind ``jamp.autocast``: a jaxpr evaluated primitive by primitive.

Each equation is re-bound with its floating inputs cast as the rule table
(``autocast.rules``) says. Every value carries a *kind*: whether it depends
on the function's arguments (``TRACED``), is known when the function is
traced (``CONST``), or comes from literals only (``LITERAL``). Under
``promote`` a literal follows the other inputs instead of widening them, as a
Python scalar does in ``jnp``; a constant is saturated when autocast narrows
it. Sub-computations (``HIGHER_ORDER``) are evaluated recursively.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TypeAlias
from typing import cast as static_cast

import jax
import jax.core
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jamp._src.autocast.flow import (
    across_devices,
    as_traced,
    categories,
    const_kind,
    constants_allow,
    known_span,
    lift_of,
    liftable,
    lifted_carry,
    lifts_of,
    lower_params,
    out_infos,
    promote_target,
    recomputed_lifted,
    user_cast,
)
from jamp._src.autocast.residuals import (
    Group,
    dropout_jaxpr,
    find_softmax,
    group_jaxpr,
    mask_broadcasts,
    recomputed,
    select_keeping_mask,
    softmax_keeping_low,
    softmax_matmul_keeping_low,
)
from jamp._src.autocast.rules import (
    AS_TRACED,
    BOUNDED,
    ELIGIBLE,
    FLOAT32,
    FLOAT32_DTYPE,
    KEEP,
    LOWER,
    RECOMPUTED,
    div_rule,
    float32_operands,
    output_is_low,
    picked,
    reaching_float32,
    rule_of,
    sigmoid_logits,
    widest,
)
from jamp._src.autocast.sums import (
    SCATTER_ADD,
    bind_summing,
    broadcast_in_float32,
    scatters_half,
    summed_in_float32,
    upcast_in_backward,
)
from jamp._src.autocast.values import (
    CONST,
    FOLD_MAX,
    LITERAL,
    MARKER,
    TRACED,
    Casts,
    Context,
    Evaluated,
    Info,
    JaxprLike,
    Value,
    aval,
    bind,
    cast,
    float0_zeros,
    is_float,
    is_inexact,
    record,
    shard_map_like,
    source,
    strong_cast,
)
from jamp._src.jaxprs import ClosedJaxpr, inline_softmax, scan_counts, shaped

# Whether a rule's operations (the float8 products') are traced under the source line and
# name stack of the equation they replace: set by `annotated_rules`, for jamp.debug.
_ANNOTATE_RULES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jamp_annotate_rules", default=False
)


@contextlib.contextmanager
def annotated_rules() -> Iterator[None]:
    """Trace the rules' operations under their equation's source line and module path,
    while in the block (``jamp.debug`` reads them)."""
    token = _ANNOTATE_RULES.set(True)
    try:
        yield
    finally:
        _ANNOTATE_RULES.reset(token)


# ---------------------------------------------------------------------------
# The interpreter
# ---------------------------------------------------------------------------


def _eval_jaxpr(
    jaxpr: jex_core.Jaxpr,
    consts: Sequence[Value],
    args: Sequence[Value],
    infos: Sequence[Info],
    ctx: Context,
    wide: Sequence[bool] = (),
) -> Evaluated:
    """Evaluates ``jaxpr`` with the rules; returns outputs and their ``Info``.

    An output marked in ``wide`` goes to float32 (a float32 loop carry): a half one
    with a ``Lift`` is returned as that float32 computation, not rounded.

    Every value carries an ``Info``: its *kind* (``TRACED``, ``CONST``
    or ``LITERAL``: whether it depends on the function's arguments, is known
    when the function is traced, or comes from literals only), whether it is
    derived from autocast's low-precision activations only, how many elements
    it had before broadcasting, and, for a constant, the span of its values.
    The dtype flow of ``promote`` (``autocast.rules.runs_low``) and the
    constant rule (``autocast.rules.fits``) decide from these.
    """
    jaxpr = inline_softmax(jaxpr)  # jax 0.12's softmax: the form its rule recognises
    env: dict[jex_core.Var, tuple[Value, Info]] = {}

    def read(v: jax.core.Atom) -> tuple[Value, Info]:
        if isinstance(v, jex_core.Literal):
            val = v.val
            if not hasattr(val, "dtype"):
                val = np.asarray(val, dtype=aval(v).dtype)
            return val, Info(kind=LITERAL)
        return env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = (x, Info(kind=TRACED if isinstance(x, jax.core.Tracer) else CONST))
    for v, x, info in zip(jaxpr.invars, args, infos, strict=True):
        env[v] = (x, info)
    to_float32 = float32_operands(jaxpr)
    reach = reaching_float32(jaxpr)
    logits, chain = sigmoid_logits(jaxpr, reach)
    to_float32 |= logits
    casts = Casts()
    softmaxes = find_softmax(jaxpr, ctx.dtype)
    done: set[int] = set()  # equations a fused softmax evaluated
    fused = {} if ctx.rule is not None else {g.dot: g for g in softmaxes.values() if g.p}
    shifts = {g.pre[0]: g for g in fused.values() if g.pre and g.drop}
    from_x: set[int] = set()  # fused softmaxes evaluated from their shift's half input
    masks = mask_broadcasts(jaxpr)
    kept_rounded = picked(jaxpr)  # values whose rounding is passed on: no Lift
    for k, eqn in enumerate(jaxpr.eqns):
        if k in done:
            continue
        sub = ctx
        if not ctx.as_traced and MARKER in str(eqn.source_info.name_stack):
            sub = dataclasses.replace(ctx, as_traced=True)
        group = shifts.get(k)
        if (
            group is not None
            and group.dot is not None
            and group.x is not None
            and not sub.as_traced
            and _upcast(*read(group.x))
        ):
            from_x.add(group.dot)  # the shift too, from the half scores
            done.update(group.pre)
            continue
        group = fused.get(k)
        if group is not None and group.y not in env:  # p @ v with its softmax (and dropout)
            v = eqn.invars[1] if eqn.invars[0] is group.p else eqn.invars[0]
            env[eqn.outvars[0]] = _softmax_matmul(jaxpr, group, read, read(v), sub, k in from_x)
            continue
        group = softmaxes.get(k)
        if group is not None and group.dot in from_x:
            done.update((*group.indices[1:], *group.drop))  # evaluated with its matmul
            continue
        read_in = [read(v) for v in eqn.invars]
        invals = [x for x, _ in read_in]
        ininfos = [i for _, i in read_in]
        group = softmaxes.get(k)
        if group is not None and group.dot in fused and _fusable(invals[0], ininfos[0], sub):
            done.update((*group.indices[1:], *group.drop))  # evaluated with its matmul
            continue
        if group is not None and not sub.as_traced and _upcast(invals[0], ininfos[0], 4):
            env[group.y] = _softmax(jaxpr, group, invals[0], ininfos[0], sub, casts)
            done.update(group.indices)
            continue
        fed = reach if eqn.primitive.name in BOUNDED else to_float32
        feeds_float32 = any(v in fed for v in eqn.outvars)
        fold = _foldable(eqn, invals, ininfos)
        b = masks.get(k)
        mask = None if b is None else (read(b.invars[0])[0], b)
        logit = any(v in chain for v in eqn.outvars)  # a float32 sigmoid's logits' matmul
        lift = not any(v in kept_rounded for v in eqn.outvars)
        with jax.ensure_compile_time_eval() if fold else contextlib.nullcontext():
            outs, outinfos = _eval_eqn(
                eqn, invals, ininfos, sub, feeds_float32, casts, mask, logit, lift
            )
        for v, x, i in zip(eqn.outvars, outs, outinfos, strict=True):
            env[v] = (x, i)
    outs = [read(v) for v in jaxpr.outvars]
    wide = [*wide, *[False] * (len(outs) - len(wide))]
    xs = [lifted_carry(x, casts) if w else x for (x, _), w in zip(outs, wide, strict=True)]
    return xs, [i for _, i in outs]


def _fusable(z: Value, info: Info, ctx: Context) -> bool:
    return not ctx.as_traced and _upcast(z, info, 4)


def _softmax_matmul(
    jaxpr: jex_core.Jaxpr,
    group: Group,
    read: Callable[[jax.core.Atom], tuple[Value, Info]],
    v_in: tuple[Value, Info],
    ctx: Context,
    from_x: bool,
) -> tuple[Value, Info]:
    """``dropout(softmax(z)) @ v`` as one custom_vjp (``softmax_matmul_keeping_low``),
    from the shift's half input ``x`` where ``from_x`` (recomputed in the backward pass)."""
    dot = jaxpr.eqns[static_cast(int, group.dot)]  # fused: the group has a dot
    start = group.x if from_x and group.x is not None else group.z  # from_x: it has an x
    (z, info), (v, v_info) = read(start), v_in
    params = lower_params(dot, [0, 1], ctx)
    with source(jaxpr.eqns[group.indices[-1]]):
        body, _, _ = _under_rules(group_jaxpr(jaxpr, group, from_x), [z], [info], ctx)
    drop_jaxpr, others = dropout_jaxpr(jaxpr, group)
    others = [read(u) for u in others]  # the mask, the keep probability (their spans known)
    o_infos = [i._replace(span=known_span(x, i)) if i.kind >= CONST else i for x, i in others]
    others = [x for x, _ in others]
    quiet = dataclasses.replace(ctx, recorder=None)

    runs = [ctx]  # the first run records; later ones (the backward pass's) do not

    def drop(y: Value, *xs: Value) -> Value:  # under the rules
        run, runs[0] = runs[0], quiet
        return eval_closed(drop_jaxpr, [y, *xs], [Info(low=True), *o_infos], run)[0][0]

    with source(dot):
        fun = softmax_matmul_keeping_low(
            lambda x: body(x)[0],
            ctx.dtype,
            z.dtype,
            lambda a, b: bind(dot, [a, b], params)[0],
            dot.invars[0] is group.p,
            dot.params["dimension_numbers"],
            drop if group.drop else None,
            from_x,
        )
        out = fun(z, Casts()(v, ctx.dtype, v_info), *others)
    record(ctx, dot, LOWER, [out], [out])
    return out, Info(low=True)


def _upcast(x: Value, info: Info, size: int = 2) -> bool:
    """Whether ``x``, an activation, is float16/bfloat16 (``size`` 2) or float32 too (4)."""
    return info.kind == TRACED and np.dtype(x.dtype) in ELIGIBLE and x.dtype.itemsize <= size


def _softmax(
    jaxpr: jex_core.Jaxpr, group: Group, z: Value, info: Info, ctx: Context, casts: Casts
) -> tuple[Value, Info]:
    """A softmax whose backward pass keeps the low probabilities only (``autocast.residuals``)."""
    with source(jaxpr.eqns[group.indices[-1]]):
        body, _, (out,) = _under_rules(group_jaxpr(jaxpr, group), [z], [info], ctx)
        y, y_low = softmax_keeping_low(lambda x: body(x)[0], group.axes, ctx.dtype, z.dtype)(z)
    # The probabilities are a low activation: the matmuls (and dropout before them) read the
    # half copy, the one the backward pass keeps.
    return y_low, Info(low=True)


# Primitives typed by the mesh axes of shard_map: bound in the trace, never folded.
_MESH_AXIS = frozenset(
    {"pvary", "pbroadcast", "psum_invariant", "axis_index", "all_gather_invariant"}
)


def _foldable(eqn: jex_core.JaxprEqn, invals: Sequence[Value], infos: Sequence[Info]) -> bool:
    """Whether ``eqn`` computes a small constant from constants (``jnp.sqrt(d)``).

    It is then computed when ``fun`` is traced, so the constant rule sees its
    value instead of a traced constant of unknown value. Mesh-axis primitives
    (``pvary`` of a literal inside ``shard_map``) have no value outside their
    trace and are never computed then.
    """
    return (
        not eqn.effects
        and eqn.primitive.name not in HIGHER_ORDER
        and eqn.primitive.name not in _MESH_AXIS
        and all(i.kind >= CONST for i in infos)
        and not any(isinstance(x, jax.core.Tracer) for x in invals)
        and sum(int(np.prod(aval(v).shape)) for v in eqn.outvars) <= FOLD_MAX
    )


def eval_closed(
    closed: JaxprLike,
    args: Sequence[Value],
    infos: Sequence[Info],
    ctx: Context,
    wide: Sequence[bool] = (),
) -> Evaluated:
    if isinstance(closed, ClosedJaxpr):
        return _eval_jaxpr(closed.jaxpr, closed.consts, args, infos, ctx, wide)
    return _eval_jaxpr(closed, (), args, infos, ctx, wide)


def _eval_eqn(
    eqn: jex_core.JaxprEqn,
    invals: list[Value],
    infos: list[Info],
    ctx: Context,
    feeds_float32: bool = False,
    casts: Casts | None = None,
    # select_n's mask: (its source, the broadcast)
    mask: tuple[Value, jex_core.JaxprEqn] | None = None,
    logit: bool = False,  # computes a float32 sigmoid's logits alone (rules.sigmoid_logits)
    lift: bool = True,  # its output may get a Lift (rules.picked)
) -> Evaluated:
    name = eqn.primitive.name
    if ctx.as_traced:
        return as_traced(eqn, invals, infos, ctx, "disabled")
    if ctx.rule is not None:
        # Under jamp.debug's tools, a float8 product carries the user's line and module
        # path; otherwise it is traced as it always was (its program stays the same).
        with source(eqn) if _ANNOTATE_RULES.get() else contextlib.nullcontext():
            done = ctx.rule(eqn, invals, infos, ctx)
        if done is not None:
            return done
    handler = HIGHER_ORDER.get(name)
    if handler is not None:
        if ctx.recorder is not None:
            ctx.recorder.add(name, "recurse", "-")
        return handler(eqn, invals, infos, ctx)
    if name == "convert_element_type":
        return user_cast(eqn, invals, infos, ctx)
    rule = rule_of(eqn)
    if rule is None:
        if ctx.recorder is not None:
            ctx.recorder.unknown.add(name)
        outs, outinfos = as_traced(eqn, invals, infos, ctx, "unknown")
        return outs, across_devices(eqn, invals, infos, outinfos)
    if name in SCATTER_ADD and scatters_half(eqn, invals, infos):
        # segment_sum of half messages: accumulated in float32 (the traced dtype), returned
        # in the half dtype, a low activation (torch lists scatter_add under promote).
        outs, _ = as_traced(eqn, invals, infos, ctx, "scatter-add in float32")
        with source(eqn):
            outs = [cast(outs[0], ctx.dtype)]
        return outs, [Info(low=True)]
    if rule == AS_TRACED:
        return as_traced(eqn, invals, infos, ctx, rule)
    casts = Casts() if casts is None else casts

    float_in = [i for i, x in enumerate(invals) if is_float(x.dtype)]
    params = eqn.params
    vals = list(invals)
    low = held = False
    eligible = bool(float_in) and all(np.dtype(invals[i].dtype) in ELIGIBLE for i in float_in)
    cats = categories(invals, infos, float_in, ctx) if float_in else []
    if name == "div" and float_in and float_in[-1] == 1:
        rule = div_rule(cats[-1])
    lowered = rule == LOWER and eligible
    if lowered:
        lowered, _ = constants_allow(name, invals, infos, float_in, ctx.dtype)
    fill = False
    if lowered:
        targets = {i: ctx.dtype for i in float_in}
        params = lower_params(eqn, float_in, ctx)
        low = True
        if logit:  # the matmul of a sigmoid's logits accumulates into float32
            params, held = {**params, "preferred_element_type": FLOAT32_DTYPE}, True
    elif rule == KEEP:  # each output is its input, as it arrives
        outs = bind(eqn, vals, params)
        record(ctx, eqn, rule, vals, outs)
        if len(outs) == len(infos):
            return outs, list(infos)
        return outs, [Info(kind=const_kind(infos))] * len(outs)
    elif rule == FLOAT32:
        targets = {i: FLOAT32_DTYPE for i in float_in if np.dtype(invals[i].dtype) in ELIGIBLE}
        low = output_is_low(cats)
        if name in RECOMPUTED and targets == {0: FLOAT32_DTYPE} and _upcast(invals[0], infos[0]):
            with source(eqn):  # the backward pass keeps the half input (autocast.residuals)
                outs = [recomputed(lambda x: bind(eqn, [x], params)[0], invals[0])]
            record(ctx, eqn, rule, outs, outs)
            return outs, out_infos(eqn, invals, infos, outs, low)
    elif (
        name in BOUNDED
        and feeds_float32
        and float_in == [0]
        and _upcast(invals[0], infos[0], 4 if infos[0].held else 2)
    ):
        # sigmoid feeding log(1 - p): in float32 from its half input, which the backward
        # pass keeps (in the half dtype 1 - p rounds to 0 and the loss to inf); from its
        # float32 logits where they are computed so (rules.sigmoid_logits).
        with source(eqn):
            outs = [recomputed_lifted(eqn, params, invals[0], casts)]
        record(ctx, eqn, rule, outs, outs)
        return outs, out_infos(eqn, invals, infos, outs, output_is_low(cats), held=True)
    else:  # promote; lower with float64 or a constant that does not fit
        target, fill, held = promote_target(eqn, invals, infos, float_in, cats, ctx, feeds_float32)
        if logit and target is not None:  # moving a sigmoid's float32 logits
            target, held = widest([target, FLOAT32_DTYPE]), True
        if held and lift and liftable(eqn, invals, infos, cats, ctx):
            # Arithmetic of half inputs feeding a float32 primitive (a matmul's output plus
            # its bias, into a norm's statistics): in the half dtype for its half consumers,
            # and in float32 from its half inputs for the float32 ones (its Lift), whose
            # backward pass keeps the half inputs, not a float32 copy.
            target, held = ctx.dtype, False
        targets = {} if target is None else {i: target for i in float_in}  # None: no float in
        low = output_is_low(cats)
    outs: list[Value] = []  # bound by bind_summing when `wide or up or lifts`
    # Half operands going up to float32 that have a float32 computation: used instead.
    lifts = lifts_of(vals, targets, casts)
    with source(eqn):  # the casts carry the user's source line (autocast_report)
        rest = {i: d for i, d in targets.items() if i not in lifts}
        wide = broadcast_in_float32(eqn, vals, rest, infos)
        up = upcast_in_backward(eqn, vals, targets, infos, wide) - set(lifts)
        for i, dtype in targets.items():
            if i not in wide and i not in up and i not in lifts:
                vals[i] = casts(vals[i], dtype, infos[i], saturate=fill)
        if wide or up or lifts:  # summed in float32, half operands kept (autocast.sums)
            shape = aval(eqn.outvars[0]).shape
            outs = bind_summing(
                lambda xs: bind(eqn, xs, params), name, vals, targets, wide, shape, up, lifts
            )
    if wide or up or lifts:
        record(ctx, eqn, rule, [vals[i] for i in targets if i not in wide] or outs, outs)
        if lift:
            casts.lift(outs[0], lift_of(eqn, invals, infos, cats, outs, casts, ctx))
        return outs, out_infos(eqn, invals, infos, outs, low, held)
    if name == "broadcast_in_dim" and _upcast(vals[0], infos[0]) and not eqn.params["sharding"]:
        with source(eqn):  # its gradient is summed in float32 (autocast.sums)
            outs = [summed_in_float32(vals[0], *_broadcast_args(eqn), vals[0].dtype)]
        record(ctx, eqn, rule, vals, outs)
        return outs, out_infos(eqn, invals, infos, outs, low, held)
    kinds = {i.kind == TRACED for i in infos[1:]}
    if name == "select_n" and kinds == {True, False} and is_float(vals[1].dtype):
        w, b = (vals[0], None) if mask is None else mask  # its backward keeps the mask only
        widen = None if b is None else (lambda w: bind(b, [w], b.params)[0])
        with source(eqn):
            outs = [select_keeping_mask(lambda *xs: bind(eqn, xs, params)[0], w, vals[1:], widen)]
    else:
        outs = bind(eqn, vals, params)
    record(ctx, eqn, rule, vals, outs)
    if lift:
        casts.lift(outs[0], lift_of(eqn, invals, infos, cats, outs, casts, ctx))
    return outs, out_infos(eqn, invals, infos, outs, low, held)


def _broadcast_args(eqn: jex_core.JaxprEqn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    p = eqn.params
    return tuple(p["shape"]), tuple(p["broadcast_dimensions"])


# ---------------------------------------------------------------------------
# Sub-computations
# ---------------------------------------------------------------------------


def _call(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> Evaluated:
    params = eqn.params
    closed = params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"]
    return eval_closed(closed, invals, infos, ctx)


def _remat(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> Evaluated:
    params = eqn.params
    out_infos: list[Info] = []

    def body(*xs: Value) -> list[Value]:
        outs, out_infos[:] = eval_closed(params["jaxpr"], xs, infos, ctx)
        return outs

    fn = jax.checkpoint(
        body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
    )
    outs = fn(*invals)
    return list(outs), [_traced(i) for i in out_infos]


def _shard_map(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> Evaluated:
    """``shard_map``'s body under the rules, bound again by ``jax.shard_map`` on the same
    mesh, specs and manual axes (``autocast(shard_map(f))`` is ``shard_map(autocast(f))``).
    The inputs' broadcast sizes are the global ones: inside, each is a shard."""
    p = eqn.params
    out_infos: list[Info] = []
    local = [i._replace(size=None) for i in infos]

    def body(*xs: Value) -> tuple[Value, ...]:
        outs, out_infos[:] = eval_closed(p["jaxpr"], xs, local, ctx)
        return tuple(outs)

    return list(shard_map_like(p, body)(*invals)), [_traced(i) for i in out_infos]


def scan_with(
    eqn: jex_core.JaxprEqn,
    invals: list[Value],
    infos: list[Info],
    ctx: Context,
    extra: Sequence[Value] = (),
    body_ctx: Callable[[Context, list[Value]], Context] | None = None,
) -> Evaluated:
    """A ``scan`` under the rules; ``extra`` arrays are scanned over too (one slice per
    iteration), and ``body_ctx(ctx, slices)`` is the context the body runs in."""
    p = eqn.params
    n_consts, n_carry = scan_counts(p)
    consts = invals[:n_consts]
    carry_dtypes = [aval(v).dtype for v in eqn.invars[n_consts : n_consts + n_carry]]
    init = [
        strong_cast(x, d)
        for x, d in zip(invals[n_consts : n_consts + n_carry], carry_dtypes, strict=True)
    ]
    xs = invals[n_consts + n_carry :]
    x_infos = [i._replace(size=None) for i in infos[n_consts + n_carry :]]  # slices
    body_infos = [*infos[:n_consts], *([Info()] * n_carry), *x_infos]
    y_infos: list[Info] = []
    wide = [np.dtype(d) == FLOAT32_DTYPE for d in carry_dtypes]  # a float32 carry: not rounded

    def body(carry: list[jax.Array], x: list[Value]) -> tuple[list[jax.Array], list[Value]]:
        x, slices = x[: len(xs)], x[len(xs) :]
        inner = ctx if body_ctx is None else body_ctx(ctx, slices)
        outs, out_infos = eval_closed(p["jaxpr"], [*consts, *carry, *x], body_infos, inner, wide)
        y_infos[:] = [_traced(i) for i in out_infos[n_carry:]]
        new_carry = [strong_cast(o, d) for o, d in zip(outs[:n_carry], carry_dtypes, strict=True)]
        return new_carry, outs[n_carry:]

    length, reverse, unroll = p["length"], p["reverse"], p.get("unroll", 1)
    carry, ys = lax.scan(body, init, [*xs, *extra], length=length, reverse=reverse, unroll=unroll)
    return [*carry, *ys], [*([Info()] * n_carry), *y_infos]


def _traced(info: Info) -> Info:
    """What a sub-computation's output keeps of its info: whether it is low."""
    return Info(low=info.low, statistic=info.statistic)


def _while(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> Evaluated:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:nc], invals[nc : nc + nb]
    carry_dtypes = [aval(v).dtype for v in eqn.invars[nc + nb :]]
    init = [strong_cast(x, d) for x, d in zip(invals[nc + nb :], carry_dtypes, strict=True)]
    n_carry = len(init)
    cond_infos = [*infos[:nc], *([Info()] * n_carry)]
    body_infos = [*infos[nc : nc + nb], *([Info()] * n_carry)]

    def cond_fun(carry: list[jax.Array]) -> Value:
        return eval_closed(p["cond_jaxpr"], [*cond_consts, *carry], cond_infos, ctx)[0][0]

    wide = [np.dtype(d) == FLOAT32_DTYPE for d in carry_dtypes]

    def body_fun(carry: list[jax.Array]) -> list[jax.Array]:
        outs, _ = eval_closed(p["body_jaxpr"], [*body_consts, *carry], body_infos, ctx, wide)
        return [strong_cast(o, d) for o, d in zip(outs, carry_dtypes, strict=True)]

    outs = lax.while_loop(cond_fun, body_fun, init)
    return list(outs), [Info()] * len(outs)


def _cond(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> Evaluated:
    index, ops = invals[0], invals[1:]
    out_dtypes = [aval(v).dtype for v in eqn.outvars]

    def branch(closed: JaxprLike, *xs: Value) -> list[jax.Array]:
        outs, _ = eval_closed(closed, xs, infos[1:], ctx)
        return [strong_cast(o, d) for o, d in zip(outs, out_dtypes, strict=True)]

    fns = [functools.partial(branch, b) for b in eqn.params["branches"]]
    outs = lax.switch(index, fns, *ops)
    return list(outs), [Info()] * len(outs)


def _under_rules(
    jaxpr: JaxprLike, invals: Sequence[Value], infos: Sequence[Info], ctx: Context
) -> tuple[Callable[..., tuple[Value, ...]], list[np.dtype], list[Info]]:
    """``jaxpr`` evaluated under the rules and traced once (a custom rule's body, a fused
    softmax): a function computing that trace, its output dtypes and infos."""
    out_infos: list[Info] = []

    def primal(*xs: Value) -> list[Value]:
        outs, out_infos[:] = eval_closed(jaxpr, xs, infos, ctx)
        return outs

    traced = jax.make_jaxpr(primal)(*invals)
    body = jex_core.jaxpr_as_fun(traced)
    dtypes = [a.dtype for a in shaped(traced.out_avals)]
    return (lambda *xs: tuple(body(*xs))), dtypes, [_traced(i) for i in out_infos]


def _like(values: Sequence[Value], avals: Sequence[jax.core.ShapedArray]) -> list[Value]:
    """``values`` in the traced dtypes of ``avals``, to trace a rule on: unlike shape structs,
    they keep the sharding and the varying mesh axes (``shard_map``'s check_vma) of the
    values the rule is applied to."""
    pairs = zip(values, avals, strict=True)
    return [cast(x, a.dtype) if is_float(a.dtype) else x for x, a in pairs]


def _custom_jvp(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> Evaluated:
    """custom_jvp: the body and the jvp rule both evaluated with the rules.

    The primal runs the body under the rules. The jvp rule is JAX's jvp of the
    original call (so the user's rule is used), traced and then evaluated
    under the rules too; primal and tangent outputs are cast to the dtypes of
    the autocast primal so the two agree.
    """
    in_avals = [aval(v) for v in eqn.invars]
    out_avals = [aval(v) for v in eqn.outvars]
    diff_in = [i for i, a in enumerate(in_avals) if is_inexact(a.dtype)]
    diff_out = [j for j, a in enumerate(out_avals) if is_inexact(a.dtype)]
    diff_avals = [in_avals[i] for i in diff_in]
    n, m = len(in_avals), len(out_avals)
    primal, out_dtypes, out_infos = _under_rules(eqn.params["call_jaxpr"], invals, infos, ctx)
    fun = jax.custom_jvp(primal)

    def original_jvp(*args: jax.Array) -> list[jax.Array]:
        primals, diff_tangents = args[:n], iter(args[n:])
        tangents = [
            next(diff_tangents) if i in diff_in else float0_zeros(a) for i, a in enumerate(in_avals)
        ]
        p_out, t_out = jax.jvp(lambda *xs: bind(eqn, xs), tuple(primals), tuple(tangents))
        return [*p_out, *(t_out[j] for j in diff_out)]

    @fun.defjvp
    def fun_jvp(primals: tuple, tangents: tuple) -> tuple[tuple, tuple]:
        traced = jax.make_jaxpr(original_jvp)(
            *_like(primals, in_avals), *_like([tangents[i] for i in diff_in], diff_avals)
        )
        args = [*primals, *(tangents[i] for i in diff_in)]
        # A tangent is never a constant; a literal's (zero) tangent follows.
        tangent_infos = [
            infos[i] if infos[i].kind == LITERAL else infos[i]._replace(kind=TRACED, span=None)
            for i in diff_in
        ]
        outs, _ = eval_closed(traced, args, [*infos, *tangent_infos], ctx)
        p_out = tuple(cast(x, d) for x, d in zip(outs[:m], out_dtypes, strict=True))
        t_iter = iter(outs[m:])
        t_out = tuple(
            cast(next(t_iter), out_dtypes[j]) if j in diff_out else float0_zeros(a)
            for j, a in enumerate(out_avals)
        )
        return p_out, t_out

    outs = fun(*invals)
    return list(outs), out_infos


# jax.vjp's pullback of a custom_vjp's call: the cotangents of its inputs from its outputs'.
_Pullback: TypeAlias = Callable[[list[jax.Array]], tuple[jax.Array, ...]]


def _custom_vjp(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> Evaluated:
    """custom_vjp: body, forward and backward passes all evaluated with the rules.

    The forward pass is ``jax.vjp`` of the original call (so the user's ``fwd``
    and ``bwd`` are used), traced and evaluated under the rules; the residuals
    are cast back to their traced dtypes so the backward pass, traced and
    evaluated under the rules as well, type-checks. Cotangents come back in
    the dtypes of the inputs.
    """
    in_avals = [aval(v) for v in eqn.invars]
    out_avals = [aval(v) for v in eqn.outvars]
    diff_in = [i for i, a in enumerate(in_avals) if is_inexact(a.dtype)]
    diff_out = [j for j, a in enumerate(out_avals) if is_inexact(a.dtype)]
    in_dtypes = [x.dtype for x in invals]
    primal, out_dtypes, out_infos = _under_rules(eqn.params["call_jaxpr"], invals, infos, ctx)
    fun = jax.custom_vjp(primal)

    def original_vjp(*primals: jax.Array) -> tuple[list[Value], _Pullback]:
        return jax.vjp(lambda *xs: bind(eqn, xs), *primals)

    def fwd(*xs: jax.Array) -> tuple[tuple[Value, ...], _Pullback]:
        traced, shapes = jax.make_jaxpr(original_vjp, return_shape=True)(*_like(xs, in_avals))
        leaves, tree = jax.tree_util.tree_flatten(shapes)
        outs, _ = eval_closed(traced, xs, infos, ctx)
        outs = [cast(x, s.dtype) for x, s in zip(outs, leaves, strict=True)]
        p_out, pullback = jax.tree_util.tree_unflatten(tree, outs)
        return tuple(cast(x, d) for x, d in zip(p_out, out_dtypes, strict=True)), pullback

    def bwd(pullback: _Pullback, cts: tuple[jax.Array, ...]) -> tuple[Value, ...]:
        res, res_tree = jax.tree_util.tree_flatten(pullback)
        n_res = len(res)

        def original_bwd(*args: jax.Array) -> list[jax.Array]:
            residuals, diff_cts = args[:n_res], iter(args[n_res:])
            cts_full = [
                next(diff_cts) if j in diff_out else float0_zeros(a)
                for j, a in enumerate(out_avals)
            ]
            in_cts = jax.tree_util.tree_unflatten(res_tree, residuals)(cts_full)
            return [in_cts[i] for i in diff_in]

        traced = jax.make_jaxpr(original_bwd)(
            *res, *_like([cts[j] for j in diff_out], [out_avals[j] for j in diff_out])
        )
        args = [*res, *(cts[j] for j in diff_out)]
        outs, _ = eval_closed(traced, args, [Info()] * len(args), ctx)
        it = iter(outs)
        return tuple(
            cast(next(it), in_dtypes[i]) if i in diff_in else float0_zeros(a)
            for i, a in enumerate(in_avals)
        )

    fun.defvjp(fwd, bwd)
    outs = fun(*invals)
    return list(outs), out_infos


HIGHER_ORDER: dict[
    str, Callable[[jex_core.JaxprEqn, list[Value], list[Info], Context], Evaluated]
] = {
    "pjit": _call,
    "jit": _call,
    "closed_call": _call,
    "core_call": _call,
    "remat": _remat,
    "shard_map": _shard_map,
    "remat2": _remat,
    "checkpoint": _remat,
    "scan": scan_with,
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "custom_vjp_call_jaxpr": _custom_vjp,
}
