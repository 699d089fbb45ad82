"""autocast's sub-computations: the primitives that hold jaxprs, each evaluated under the
rules and bound again (``HIGHER_ORDER``).

A call (``jit``, ``closed_call``) is inlined; ``checkpoint`` and ``shard_map`` are bound
again by ``jax.checkpoint`` and ``jax.shard_map`` around their body under the rules; loops
(``scan``, ``while``) and ``cond`` keep the dtypes their carries and outputs were traced
with, so every iteration and branch agrees (a float32 carry is not rounded: its new value's
float32 computation is used, ``flow.lifted_carry``); a custom_jvp's or custom_vjp's body
and rules are traced and evaluated under the rules too. What each keeps of its outputs'
infos is whether they are low activations (``_traced``).

Each handler takes the interpreter's evaluation of a jaxpr (``run``, an ``Evaluate``) as
an argument, so this module does not import the interpreter that dispatches to it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TypeAlias
from typing import cast as static_cast

import jax
import jax.core
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jamp._src.autocast.rules import FLOAT32_DTYPE
from jamp._src.autocast.values import (
    LITERAL,
    TRACED,
    Context,
    Evaluate,
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
    shard_map_like,
    strong_cast,
)
from jamp._src.jaxprs import CALLS, CUSTOM_RULES, REMATS, body_of, scan_counts, shaped

Handler: TypeAlias = Callable[
    [jex_core.JaxprEqn, list[Value], list[Info], Context, Evaluate], Evaluated
]
"""A sub-computation's handler: ``(eqn, invals, infos, ctx, run)`` to its outputs and infos."""


def call(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context, run: Evaluate
) -> Evaluated:
    """A call (``jit``, ``closed_call``): its body under the rules, inlined."""
    return run(static_cast(JaxprLike, body_of(eqn)), invals, infos, ctx)


def remat(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context, run: Evaluate
) -> Evaluated:
    params = eqn.params
    out_infos: list[Info] = []

    def body(*xs: Value) -> list[Value]:
        outs, out_infos[:] = run(params["jaxpr"], xs, infos, ctx)
        return outs

    fn = jax.checkpoint(
        body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
    )
    outs = fn(*invals)
    return list(outs), [_traced(i) for i in out_infos]


def shard_map(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context, run: Evaluate
) -> Evaluated:
    """``shard_map``'s body under the rules, bound again by ``jax.shard_map`` on the same
    mesh, specs and manual axes (``autocast(shard_map(f))`` is ``shard_map(autocast(f))``).
    The inputs' broadcast sizes are the global ones: inside, each is a shard."""
    p = eqn.params
    out_infos: list[Info] = []
    local = [i._replace(size=None) for i in infos]

    def body(*xs: Value) -> tuple[Value, ...]:
        outs, out_infos[:] = run(p["jaxpr"], xs, local, ctx)
        return tuple(outs)

    return list(shard_map_like(p, body)(*invals)), [_traced(i) for i in out_infos]


def scan_with(
    eqn: jex_core.JaxprEqn,
    invals: list[Value],
    infos: list[Info],
    ctx: Context,
    run: Evaluate,
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
        outs, out_infos = run(p["jaxpr"], [*consts, *carry, *x], body_infos, inner, wide)
        y_infos[:] = [_traced(i) for i in out_infos[n_carry:]]
        new_carry = [strong_cast(o, d) for o, d in zip(outs[:n_carry], carry_dtypes, strict=True)]
        return new_carry, outs[n_carry:]

    length, reverse, unroll = p["length"], p["reverse"], p.get("unroll", 1)
    carry, ys = lax.scan(body, init, [*xs, *extra], length=length, reverse=reverse, unroll=unroll)
    return [*carry, *ys], [*([Info()] * n_carry), *y_infos]


def _traced(info: Info) -> Info:
    """What a sub-computation's output keeps of its info: whether it is low."""
    return Info(low=info.low, statistic=info.statistic)


def while_loop(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context, run: Evaluate
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
        return run(p["cond_jaxpr"], [*cond_consts, *carry], cond_infos, ctx)[0][0]

    wide = [np.dtype(d) == FLOAT32_DTYPE for d in carry_dtypes]

    def body_fun(carry: list[jax.Array]) -> list[jax.Array]:
        outs, _ = run(p["body_jaxpr"], [*body_consts, *carry], body_infos, ctx, wide)
        return [strong_cast(o, d) for o, d in zip(outs, carry_dtypes, strict=True)]

    outs = lax.while_loop(cond_fun, body_fun, init)
    return list(outs), [Info()] * len(outs)


def cond(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context, run: Evaluate
) -> Evaluated:
    index, ops = invals[0], invals[1:]
    out_dtypes = [aval(v).dtype for v in eqn.outvars]

    def branch(closed: JaxprLike, *xs: Value) -> list[jax.Array]:
        outs, _ = run(closed, xs, infos[1:], ctx)
        return [strong_cast(o, d) for o, d in zip(outs, out_dtypes, strict=True)]

    fns = [functools.partial(branch, b) for b in eqn.params["branches"]]
    outs = lax.switch(index, fns, *ops)
    return list(outs), [Info()] * len(outs)


def under_rules(
    run: Evaluate, jaxpr: JaxprLike, invals: Sequence[Value], infos: Sequence[Info], ctx: Context
) -> tuple[Callable[..., tuple[Value, ...]], list[np.dtype], list[Info]]:
    """``jaxpr`` evaluated under the rules and traced once (a custom rule's body, a fused
    softmax): a function computing that trace, its output dtypes and infos."""
    out_infos: list[Info] = []

    def primal(*xs: Value) -> list[Value]:
        outs, out_infos[:] = run(jaxpr, xs, infos, ctx)
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


def custom_jvp(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context, run: Evaluate
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
    primal, out_dtypes, out_infos = under_rules(run, eqn.params["call_jaxpr"], invals, infos, ctx)
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
        outs, _ = run(traced, args, [*infos, *tangent_infos], ctx)
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


def custom_vjp(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context, run: Evaluate
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
    primal, out_dtypes, out_infos = under_rules(run, eqn.params["call_jaxpr"], invals, infos, ctx)
    fun = jax.custom_vjp(primal)

    def original_vjp(*primals: jax.Array) -> tuple[list[Value], _Pullback]:
        return jax.vjp(lambda *xs: bind(eqn, xs), *primals)

    def fwd(*xs: jax.Array) -> tuple[tuple[Value, ...], _Pullback]:
        traced, shapes = jax.make_jaxpr(original_vjp, return_shape=True)(*_like(xs, in_avals))
        leaves, tree = jax.tree_util.tree_flatten(shapes)
        outs, _ = run(traced, xs, infos, ctx)
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
        outs, _ = run(traced, args, [Info()] * len(args), ctx)
        it = iter(outs)
        return tuple(
            cast(next(it), in_dtypes[i]) if i in diff_in else float0_zeros(a)
            for i, a in enumerate(in_avals)
        )

    fun.defvjp(fwd, bwd)
    outs = fun(*invals)
    return list(outs), out_infos


HIGHER_ORDER: dict[str, Handler] = {
    **{name: call for name in CALLS if name not in CUSTOM_RULES},
    **{name: remat for name in REMATS},
    "shard_map": shard_map,
    "scan": scan_with,
    "while": while_loop,
    "cond": cond,
    "custom_jvp_call": custom_jvp,
    "custom_vjp_call": custom_vjp,
}
