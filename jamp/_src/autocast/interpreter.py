"""The interpreter behind ``jamp.autocast``: a jaxpr evaluated primitive by primitive.

Each equation is re-bound with its floating inputs cast as the rule table
(``autocast.rules``) says. Every value carries a *kind*: whether it depends
on the function's arguments (``TRACED``), is known when the function is
traced (``CONST``), or comes from literals only (``LITERAL``). Under
``promote`` a literal follows the other inputs instead of widening them, as a
Python scalar does in ``jnp``; a constant is saturated when autocast narrows
it. Before it evaluates a jaxpr, the interpreter makes its plan
(``autocast.plan``); then ``eval_eqn`` hands each equation to its handler
(``autocast.handlers``; a sub-computation's in ``autocast.higher_order``, evaluated
recursively). A softmax whose probabilities a matmul reads is evaluated here, with that
matmul, as one custom_vjp (``autocast.residuals``). ``README.md`` tells the whole story.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import cast as static_cast

import jax
import jax.core
import numpy as np
from jax.extend import core as jex_core

from jamp._src.autocast.flow import known_span, lifted_carry
from jamp._src.autocast.folding import FOLDING
from jamp._src.autocast.handlers import (
    as_traced,
    by_rule,
    half_activation,
    lower_params,
    scatter_add,
    unknown,
    user_cast,
)
from jamp._src.autocast.higher_order import HIGHER_ORDER, under_rules
from jamp._src.autocast.plan import PLAIN, Action, Plan, make_plan
from jamp._src.autocast.residuals import (
    Group,
    dropout_jaxpr,
    group_jaxpr,
    softmax_keeping_low,
    softmax_matmul_keeping_low,
)
from jamp._src.autocast.rules import AS_TRACED, LOWER, rule_of
from jamp._src.autocast.sums import SCATTER_ADD, scatters_half
from jamp._src.autocast.values import (
    CONST,
    FOLD_MAX,
    LITERAL,
    TRACED,
    Casts,
    Context,
    Evaluated,
    Info,
    JaxprLike,
    Value,
    aval,
    bind,
    record,
    source,
)
from jamp._src.jaxprs import ClosedJaxpr, inline_softmax
from jamp._src.types import is_tracer

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

Read = Callable[[jax.core.Atom], tuple[Value, Info]]


def eval_closed(
    closed: JaxprLike,
    args: Sequence[Value],
    infos: Sequence[Info],
    ctx: Context,
    wide: Sequence[bool] = (),
) -> Evaluated:
    """Evaluates ``closed`` with the rules; returns outputs and their ``Info``.

    An output marked in ``wide`` goes to float32 (a float32 loop carry): a half one
    with a ``Lift`` is returned as that float32 computation, not rounded.
    """
    if isinstance(closed, ClosedJaxpr):
        return _eval_jaxpr(closed.jaxpr, closed.consts, args, infos, ctx, wide)
    return _eval_jaxpr(closed, (), args, infos, ctx, wide)


def _eval_jaxpr(
    jaxpr: jex_core.Jaxpr,
    consts: Sequence[Value],
    args: Sequence[Value],
    infos: Sequence[Info],
    ctx: Context,
    wide: Sequence[bool] = (),
) -> Evaluated:
    """``jaxpr`` evaluated equation by equation, as its plan says (``eval_closed``)."""
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
        env[v] = (x, Info(kind=TRACED if is_tracer(x) else CONST))
    for v, x, info in zip(jaxpr.invars, args, infos, strict=True):
        env[v] = (x, info)
    plan = make_plan(jaxpr, ctx.dtype, fuse=ctx.rule is None)
    casts = Casts()
    done: set[int] = set()  # equations a fused softmax evaluated
    from_x: set[int] = set()  # fused softmaxes evaluated from their shift's half input
    for k, eqn in enumerate(jaxpr.eqns):
        if k in done:
            continue
        action = plan.action(k)
        sub = dataclasses.replace(ctx, as_traced=True) if action.disabled else ctx
        fused = _softmax_step(jaxpr, plan, k, read, env, sub, casts, done, from_x)
        if fused:
            continue
        read_in = [read(v) for v in eqn.invars]
        invals = [x for x, _ in read_in]
        ininfos = [i for _, i in read_in]
        fold = _foldable(eqn, invals, ininfos)
        mask = None if action.mask is None else (read(action.mask.invars[0])[0], action.mask)
        with _folding() if fold else contextlib.nullcontext():
            outs, outinfos = eval_eqn(eqn, invals, ininfos, sub, action, casts, mask)
        for v, x, i in zip(eqn.outvars, outs, outinfos, strict=True):
            env[v] = (x, i)
    outs = [read(v) for v in jaxpr.outvars]
    wide = [*wide, *[False] * (len(outs) - len(wide))]
    xs = [lifted_carry(x, casts) if w else x for (x, _), w in zip(outs, wide, strict=True)]
    return xs, [i for _, i in outs]


def eval_eqn(
    eqn: jex_core.JaxprEqn,
    invals: list[Value],
    infos: list[Info],
    ctx: Context,
    action: Action = PLAIN,
    casts: Casts | None = None,
    mask: tuple[Value, jex_core.JaxprEqn] | None = None,  # select_n's: its source, its broadcast
) -> Evaluated:
    """One equation, handed to its handler (``autocast/README.md``: the handlers' order)."""
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
        return handler(eqn, invals, infos, ctx, eval_closed)
    if name == "convert_element_type":
        return user_cast(eqn, invals, infos, ctx)
    rule = rule_of(eqn)
    if rule is None:
        return unknown(eqn, invals, infos, ctx)
    if name in SCATTER_ADD and scatters_half(eqn, invals, infos):
        return scatter_add(eqn, invals, infos, ctx)
    if rule == AS_TRACED:
        return as_traced(eqn, invals, infos, ctx, rule)
    casts = Casts() if casts is None else casts
    return by_rule(eqn, invals, infos, ctx, rule, action, casts, mask)


@contextlib.contextmanager
def _folding() -> Iterator[None]:
    """Computes an equation of constants now (jax's eager evaluation, or NumPy's where
    exact: ``folding``), not in the traced program."""
    token = FOLDING.set(True)
    try:
        with jax.ensure_compile_time_eval():
            yield
    finally:
        FOLDING.reset(token)


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
        and not any(is_tracer(x) for x in invals)
        and sum(int(np.prod(aval(v).shape)) for v in eqn.outvars) <= FOLD_MAX
    )


# ---------------------------------------------------------------------------
# Softmaxes (autocast.residuals): their own backward passes
# ---------------------------------------------------------------------------


def _softmax_step(
    jaxpr: jex_core.Jaxpr,
    plan: Plan,
    k: int,
    read: Read,
    env: dict[jex_core.Var, tuple[Value, Info]],
    ctx: Context,
    casts: Casts,
    done: set[int],
    from_x: set[int],
) -> bool:
    """Equation ``k`` as part of a softmax the plan found: evaluated (its values in ``env``,
    the equations it covers in ``done``) or left to its matmul; ``False`` when it is not
    one, or is left to the rules."""
    eqn = jaxpr.eqns[k]
    group = plan.shifts.get(k)
    if (
        group is not None
        and group.dot is not None
        and group.x is not None
        and not ctx.as_traced
        and half_activation(*read(group.x))
    ):
        from_x.add(group.dot)  # the shift too, from the half scores
        done.update(group.pre)
        return True
    group = plan.fused.get(k)
    if group is not None and group.y not in env:  # p @ v with its softmax (and dropout)
        v = eqn.invars[1] if eqn.invars[0] is group.p else eqn.invars[0]
        env[eqn.outvars[0]] = _softmax_matmul(jaxpr, group, read, read(v), ctx, k in from_x)
        return True
    group = plan.softmaxes.get(k)
    if group is None:
        return False
    if group.dot in from_x:
        done.update((*group.indices[1:], *group.drop))  # evaluated with its matmul
        return True
    z, info = read(eqn.invars[0])
    if group.dot in plan.fused and not ctx.as_traced and half_activation(z, info, 4):
        done.update((*group.indices[1:], *group.drop))  # evaluated with its matmul
        return True
    if not ctx.as_traced and half_activation(z, info, 4):
        env[group.y] = _softmax(jaxpr, group, z, info, ctx)
        done.update(group.indices)
        return True
    return False


def _softmax_matmul(
    jaxpr: jex_core.Jaxpr,
    group: Group,
    read: Read,
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
        body, _, _ = under_rules(eval_closed, group_jaxpr(jaxpr, group, from_x), [z], [info], ctx)
    drop_jaxpr, others = dropout_jaxpr(jaxpr, group)
    others = [read(u) for u in others]  # the mask, the keep probability (their spans known)
    o_infos = [i._replace(span=known_span(x, i)) if i.kind >= CONST else i for x, i in others]
    others = [x for x, _ in others]
    quiet = dataclasses.replace(ctx, recorder=None)

    def drop(first: bool, y: Value, *xs: Value) -> Value:  # under the rules
        # The primal's trace records (autocast_report); the passes traced after it do not.
        run = ctx if first else quiet
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


def _softmax(
    jaxpr: jex_core.Jaxpr, group: Group, z: Value, info: Info, ctx: Context
) -> tuple[Value, Info]:
    """A softmax whose backward pass keeps the low probabilities only (``autocast.residuals``)."""
    with source(jaxpr.eqns[group.indices[-1]]):
        body, _, (_,) = under_rules(eval_closed, group_jaxpr(jaxpr, group), [z], [info], ctx)
        _, y_low = softmax_keeping_low(lambda x: body(x)[0], group.axes, ctx.dtype, z.dtype)(z)
    # The probabilities are a low activation: the matmuls (and dropout before them) read the
    # half copy, the one the backward pass keeps.
    return y_low, Info(low=True)
