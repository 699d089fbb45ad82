"""What autocast's backward pass keeps: half-precision values, not float32 copies.

JAX's backward pass keeps what each primitive's derivative reads. Under
autocast the float32-rule primitives (``exp``, ``log``, ``x**3`` under
float16, softmax's ``exp`` and ``div``...) compute in float32 from
half-precision activations, so by default their derivatives read float32
values, 4 bytes per element, where Flax's ``dtype=`` modules and torch keep 2.
Two rewrites keep the half-precision values instead.

**Unary float32 primitives of a half-precision input** (``recomputed``):
``f(upcast(x))`` is evaluated under a ``jax.checkpoint`` that saves nothing
of its own, so the backward pass keeps ``x`` (half precision, often kept
anyway by its other consumers) and recomputes the upcast and ``f``. The
values of both passes are unchanged, bit for bit: the float32 input is
exactly the upcast of ``x``.

**Softmax** (``find_softmax``, ``softmax_keeping_low``):
``jax.nn.softmax`` is ``e = exp(z); y = e / sum(e)`` with ``z = x -
stop_gradient(max x)``, computed in float32 (torch's autocast runs softmax in
float32 too), and JAX's rules keep ``e`` in float32 besides the
half-precision copy of ``y`` that the next matmul keeps. When every consumer
of ``y`` is a matmul (``dot_general``, a convolution) that casts it to the
half dtype anyway, as attention's ``probabilities @ values`` does (through
dropout, and a reshape that keeps the softmax's axes last: grouped KV heads),
the group is evaluated as one ``custom_vjp``:

- forward: the same float32 primitives, so ``y`` and its half-precision cast
  are bit for bit what they were, and that cast is the one the matmul uses;
- backward: softmax's own rule ``dz = y * (g - sum(g * y))`` (torch's
  softmax backward), computed in float32 from the half-precision ``y``, then
  the only copy of the probabilities the backward pass keeps.

The softmax's backward pass therefore reads probabilities rounded to the half
dtype (a relative error of at most 2**-9 in bfloat16, 2**-12 in float16
above its subnormals) where JAX's rule reads float32 ones; the gradient's
distance to float32's is what Flax's bfloat16 softmax gives. A softmax whose
output feeds anything else (a loss, a ``where``, a float32 primitive, a
``checkpoint_name``) is evaluated primitive by primitive.

**Dropout's multiplier** (``_mask_chains``): Flax multiplies the
probabilities by ``keep.astype(float32) / keep_prob``, a float32 array the
size of the scores. The fused rule takes that computation in and keeps the
boolean ``keep`` (1 byte per score, where the multiplier is 4 and Flax's
bfloat16 one 2), recomputing the same float32 multiplier where it is needed.

**Masked selects** (``select_keeping_mask``): JAX's derivative of
``select_n`` turns the zero tangent of a constant case (``jnp.where(mask,
scores, fill)``'s fill, ``jnp.zeros_like`` in NNX's dropout) into a zeros
array as large as the output, made in the forward pass and kept, and keeps
the mask as broadcast (``jnp.where`` broadcasts a causal ``(1, 1, T, T)``
mask to every batch and head). Under a checkpoint that saves nothing of its
own, the zeros and the broadcast are recomputed in the backward pass (XLA
fuses them into the select of the cotangent) and the mask is kept as it came
in. Float32 JAX and Flax's module dtype keep both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence, Set
from typing import NamedTuple, TypeAlias
from typing import cast as static_cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.typing import DTypeLike

from jamp._src.autocast.rules import FLOAT32, FLOAT32_DTYPE, LOWER, rule_of
from jamp._src.autocast.values import Value, aval, routed, upcast

# The consumers that cast their floating operands to the low dtype under LOWER.
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
_KEEPDIMS = frozenset({"broadcast_in_dim", "reshape"})


class Group(NamedTuple):
    """A softmax found in a jaxpr: its equations' indices, input, output and axes."""

    indices: tuple[int, ...]  # exp, reduce_sum, broadcast/reshape, div
    z: jax.core.Atom  # the input of exp
    y: jex_core.Var  # the output of div
    axes: tuple[int, ...]  # the summed axes
    dot: int | None = None  # the matmul contracting those axes that y reaches (fused too)
    drop: tuple[int, ...] = ()  # the dropout between them: linear in y, one use each
    p: jex_core.Var | None = None  # the operand of the dot: y, or the dropout's output
    pre: tuple[int, ...] = ()  # z = x - stop_gradient(max(x)): reduce_max ... sub
    x: jax.core.Atom | None = None  # the input of that shift (the masked scores)
    mask: tuple[int, ...] = ()  # a multiplier computed from a boolean mask: mask / keep


def find_softmax(jaxpr: jex_core.Jaxpr, dtype: DTypeLike) -> dict[int, Group]:
    """The softmaxes of ``jaxpr`` whose output only feeds low-precision matmuls (through
    dropout, perhaps).

    Keyed by the index of their ``exp``. Each matched value other than ``y``
    has no use outside the group, so evaluating the group at once, where the
    ``exp`` is, and skipping the other three equations changes nothing else.
    """
    if np.dtype(dtype).itemsize >= 4:
        return {}
    uses: dict[jax.core.Atom, list[int]] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal):
                uses.setdefault(v, []).append(k)
    outs = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    eqns = jaxpr.eqns

    def only(v: jax.core.Atom, n: int) -> list[int] | None:
        found = uses.get(v, [])
        return found if len(found) == n and v not in outs else None

    groups: dict[int, Group] = {}
    for k, eqn in enumerate(eqns):
        if eqn.primitive.name != "exp" or rule_of(eqn) != FLOAT32:
            continue
        e = eqn.outvars[0]
        pair = only(e, 2)
        if pair is None:
            continue
        s_k, d_k = sorted(pair, key=lambda i: eqns[i].primitive.name != "reduce_sum")
        red, div = eqns[s_k], eqns[d_k]
        if red.primitive.name != "reduce_sum" or div.primitive.name != "div":
            continue
        b_uses = only(red.outvars[0], 1)
        if b_uses is None or eqns[b_uses[0]].primitive.name not in _KEEPDIMS:
            continue
        keep = eqns[b_uses[0]]
        axes = tuple(int(a) for a in red.params["axes"])
        shape = tuple(1 if i in axes else n for i, n in enumerate(aval(e).shape))
        if tuple(aval(keep.outvars[0]).shape) != shape or only(keep.outvars[0], 1) != [d_k]:
            continue
        kept = tuple(i for i in range(len(shape)) if i not in axes)
        if keep.primitive.name == "broadcast_in_dim" and (
            tuple(keep.params["broadcast_dimensions"]) != kept
        ):
            continue
        if div.invars[0] is not e or div.invars[1] is not keep.outvars[0]:
            continue
        y = div.outvars[0]
        consumers = uses.get(y, [])
        if not consumers or y in outs:
            continue
        if _feeds_matmuls(y, eqns, uses, outs, _DROPOUT_DEPTH):
            dot, drop, p = _contracting(y, axes, eqns, uses, outs)
            pre, x = _shift(eqn.invars[0], axes, eqns, uses, outs)
            mask = _mask_chains(drop, y, eqns, uses, outs)
            indices = (k, s_k, b_uses[0], d_k)
            groups[k] = Group(indices, eqn.invars[0], y, axes, dot, drop, p, pre, x, mask)
    return groups


# Between reduce_max and the shift: max(-inf, .), the kept dimensions, stop_gradient.
_SHIFT_CHAIN = frozenset({"max", "broadcast_in_dim", "reshape", "stop_gradient"})


def _shift(
    z: jax.core.Atom,
    axes: Sequence[int],
    eqns: Sequence[jex_core.JaxprEqn],
    uses: Mapping[jax.core.Atom, list[int]],
    outs: Set[jex_core.Var],
) -> tuple[tuple[int, ...], jax.core.Atom | None]:
    """``(indices, x)`` when ``z = x - stop_gradient(max(x))`` over ``axes`` (jax.nn.softmax's
    shift), every intermediate used once and ``x`` by the shift only; else ``((), None)``."""
    made: dict[jax.core.Atom, int] = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    k = made.get(z)
    if k is None or len(uses.get(z, [])) != 1 or eqns[k].primitive.name != "sub":
        return (), None
    x, c = eqns[k].invars
    found = [k]
    while not isinstance(c, jex_core.Literal) and c in made:
        e = eqns[made[c]]
        if len(uses.get(c, [])) != 1 or c in outs:
            return (), None
        found.append(made[c])
        if e.primitive.name == "reduce_max":
            ok = e.invars[0] is x and sorted(int(a) for a in e.params["axes"]) == sorted(axes)
            xs = uses.get(x, [])
            ok = ok and x not in outs and sorted(xs) == sorted((made[c], k))
            return (tuple(sorted(found)), x) if ok else ((), None)
        if e.primitive.name not in _SHIFT_CHAIN:
            return (), None
        (c, *rest) = [u for u in e.invars if not isinstance(u, jex_core.Literal)] or [None]
        if rest or (e.primitive.name == "max" and len(e.invars) != 2):
            return (), None
    return (), None


def _contracting(
    y: jex_core.Var,
    axes: Sequence[int],
    eqns: Sequence[jex_core.JaxprEqn],
    uses: Mapping[jax.core.Atom, list[int]],
    outs: Set[jex_core.Var],
) -> tuple[int | None, tuple[int, ...], jex_core.Var | None]:
    """``(dot, dropout, p)``: the index of the ``dot_general`` contracting exactly the
    softmax's axes of ``y`` (attention's probabilities @ values) that ``y`` reaches alone or
    through dropout linear in ``y`` (``_linear_dropout``) and reshapes that keep those axes
    last (``_keeps_last``: grouped KV heads), the indices of both, and the dot's operand;
    ``(None, (), None)`` when there is none."""
    v, drop = y, []
    for _ in range(_DROPOUT_DEPTH + 2):
        found = uses.get(v, [])
        if len(found) != 1 or v in outs:
            break
        eqn = eqns[found[0]]
        if eqn.primitive.name == "dot_general" and eqn.invars[0] is not eqn.invars[1]:
            (lc, rc), _ = eqn.params["dimension_numbers"]
            contract = lc if eqn.invars[0] is v else rc
            if sorted(int(a) for a in contract) == sorted(axes):
                return found[0], tuple(drop), v
            break
        if _keeps_last(eqn, v, axes):
            n = aval(eqn.outvars[0]).ndim
            axes = tuple(range(n - len(axes), n))
        elif not _linear_dropout(eqn, v, eqns):
            break
        drop.append(found[0])
        v = eqn.outvars[0]
    return None, (), None


def _keeps_last(eqn: jex_core.JaxprEqn, v: jex_core.Var, axes: Sequence[int]) -> bool:
    """Whether ``eqn`` reshapes ``v`` keeping the softmax's ``axes``, its last ones, last and
    whole: ``(B, T, N, S) -> (B, T, K, G, S)``, Gemma's probabilities for grouped KV heads.
    A row of the softmax is then a row of the reshaped value."""
    if eqn.primitive.name != "reshape" or eqn.params.get("dimensions") is not None:
        return False
    old, new, k = tuple(aval(v).shape), tuple(aval(eqn.outvars[0]).shape), len(axes)
    last = tuple(range(len(old) - k, len(old)))
    return 0 < k < len(new) and tuple(sorted(axes)) == last and new[-k:] == old[-k:]


# From a boolean mask to dropout's multiplier: ``keep.astype(float32) / keep_prob``.
_MASK_CHAIN = frozenset({"convert_element_type", "mul", "div", "broadcast_in_dim", "reshape"})


def _mask_chains(
    drop: Sequence[int],
    y: jex_core.Var,
    eqns: Sequence[jex_core.JaxprEqn],
    uses: Mapping[jax.core.Atom, list[int]],
    outs: Set[jex_core.Var],
) -> tuple[int, ...]:
    """The equations computing a dropout multiplier from a non-floating mask, in order:
    Flax's ``keep.astype(dtype) / keep_prob``. Each value on the way has one use and the
    chain reads literals besides the mask, so the fused rule can keep the mask (1 byte
    per element) and recompute the float32 multiplier (4 bytes) where it is needed."""
    made: dict[jex_core.Var, int] = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    inside = {eqns[i].outvars[0] for i in drop}
    found: list[int] = []
    for i in drop:
        for u in eqns[i].invars:
            if isinstance(u, jex_core.Literal) or u is y or u in inside:
                continue
            chain, v = [], u
            while jnp.issubdtype(aval(v).dtype, jnp.floating):
                k = made.get(v)
                if k is None or len(uses.get(v, [])) != 1 or v in outs:
                    chain = []
                    break
                e = eqns[k]
                ins = [w for w in e.invars if not isinstance(w, jex_core.Literal)]
                if (
                    e.primitive.name not in _MASK_CHAIN
                    or len(ins) != 1
                    or (e.primitive.name == "div" and e.invars[0] is not ins[0])
                ):
                    chain = []
                    break
                chain.append(k)
                v = ins[0]
            found.extend(chain)
    return tuple(sorted(set(found)))


def _linear_dropout(
    eqn: jex_core.JaxprEqn, v: jex_core.Var, eqns: Sequence[jex_core.JaxprEqn]
) -> bool:
    """Whether ``eqn`` is dropout linear in ``v``: ``v * m``, ``v / c`` or ``where(keep, v,
    0)``, elementwise (``v`` keeps its shape and dtype), ``v`` used once. Linear, the
    row sums of the softmax's backward pass are the output's (``sum(g_o * o)``)."""
    name, ins, out, here = eqn.primitive.name, eqn.invars, aval(eqn.outvars[0]), aval(v)
    if sum(u is v for u in ins) != 1 or (out.shape, out.dtype) != (here.shape, here.dtype):
        return False
    if name == "mul":
        return True
    if name == "div":
        return ins[0] is v
    if name != "select_n" or len(ins) != 3 or ins[0] is v:
        return False
    return _is_zero(ins[1] if ins[2] is v else ins[2], eqns)


def _is_zero(u: jax.core.Atom, eqns: Sequence[jex_core.JaxprEqn]) -> bool:
    """Whether ``u`` is a literal zero or a broadcast of one (``jnp.zeros_like``)."""
    if isinstance(u, jex_core.Literal):
        return not np.any(np.asarray(u.val))
    for eqn in eqns:
        if eqn.outvars and eqn.outvars[0] is u:
            return eqn.primitive.name == "broadcast_in_dim" and _is_zero(eqn.invars[0], eqns)
    return False


def dropout_jaxpr(jaxpr: jex_core.Jaxpr, group: Group) -> tuple[jex_core.Jaxpr, list[jex_core.Var]]:
    """The group's dropout as a jaxpr from ``(y, *others)`` to the dot's operand, and the
    ``others``: the variables it reads besides ``y`` (a broadcast zero and a multiplier
    computed from a mask, ``group.mask``, are computed in it; the mask is an other)."""
    eqns: list[jex_core.JaxprEqn] = []
    others: list[jex_core.Var] = []
    made = {jaxpr.eqns[i].outvars[0] for i in (*group.mask, *group.drop)}
    for i in (*group.mask, *group.drop):
        eqn = jaxpr.eqns[i]
        for u in eqn.invars:
            if isinstance(u, jex_core.Literal) or u is group.y or u in made or u in others:
                continue
            zero = next((e for e in jaxpr.eqns if e.outvars and e.outvars[0] is u), None)
            if eqn.primitive.name == "select_n" and zero is not None and _is_zero(u, [zero]):
                eqns.append(zero)
                made.add(u)
            else:
                others.append(u)
        eqns.append(eqn)
    info = jaxpr.debug_info
    info = info and info._replace(arg_names=("y",) * (1 + len(others)), result_paths=("p",))
    p = static_cast(jex_core.Var, group.p)  # a group with a dropout has a dot, and its operand
    return jex_core.Jaxpr([], [group.y, *others], [p], eqns, debug_info=info), others


# Between a softmax and its matmuls: dropout (``y * mask / keep``, ``where(keep, y / p, 0)``).
_DROPOUT = frozenset({"mul", "div", "select_n"})
_DROPOUT_DEPTH = 3


def _feeds_matmuls(
    v: jex_core.Var,
    eqns: Sequence[jex_core.JaxprEqn],
    uses: Mapping[jax.core.Atom, list[int]],
    outs: Set[jex_core.Var],
    depth: int,
) -> bool:
    """Whether every use of ``v`` is a low-precision matmul, or dropout on the way to one.

    Dropout is a ``mul`` by, a ``div`` of ``v`` by, or a ``select_n`` of ``v`` against
    values that do not depend on ``v`` (a mask, the keep probability, zero).
    """
    found = uses.get(v, [])
    if not found or v in outs:
        return False
    for c in found:
        eqn = eqns[c]
        name = eqn.primitive.name
        if name in _MATMULS and rule_of(eqn) == LOWER:
            continue
        others = [u for u in eqn.invars if u is not v]
        if name == "reshape" and depth and _feeds_matmuls(eqn.outvars[0], eqns, uses, outs, depth):
            continue  # checked by _contracting (_keeps_last)
        if (
            depth
            and name in _DROPOUT
            and len(others) == len(eqn.invars) - 1
            and not (name == "div" and eqn.invars[0] is not v)
            and not (name == "select_n" and eqn.invars[0] is v)
            and _feeds_matmuls(eqn.outvars[0], eqns, uses, outs, depth - 1)
        ):
            continue
        return False
    return True


def group_jaxpr(jaxpr: jex_core.Jaxpr, group: Group, from_x: bool = False) -> jex_core.Jaxpr:
    """The group's four equations as a jaxpr from ``z`` to ``y``; from ``x`` (the shift
    too) where ``from_x``."""
    indices = (*group.pre, *group.indices) if from_x else group.indices
    eqns = [jaxpr.eqns[i] for i in indices]
    info = jaxpr.debug_info
    info = info and info._replace(arg_names=("z",), result_paths=("softmax",))
    start = group.x if from_x else group.z
    # a group is evaluated from a traced value (``handlers.half_activation``): a variable, and
    # ``from_x`` only where the group has a shift, so an ``x``
    start = static_cast(jex_core.Var, start)
    return jex_core.Jaxpr([], [start], [group.y], eqns, debug_info=info)


def softmax_keeping_low(
    body: Callable[[jax.Array], Value], axes: Sequence[int], low: DTypeLike, z_dtype: DTypeLike
) -> Callable[[Value], tuple[Value, jax.Array]]:
    """``z -> (y, y in low)``, ``y = body(z)``, whose backward pass keeps only ``y in low``.

    ``body`` computes the float32 softmax. The cotangents of both outputs
    are summed in float32 and run through softmax's rule; ``z``'s cotangent
    comes back in ``z_dtype``.
    """
    low, z_dtype, axes = np.dtype(low), np.dtype(z_dtype), tuple(axes)

    def primal(z: jax.Array) -> tuple[Value, jax.Array]:
        y = body(z)
        # The barrier makes the rounding explicit: XLA's excess precision would otherwise
        # read the float32 y (and keep exp's float32 output) where y_low is read.
        return y, lax.optimization_barrier(lax.convert_element_type(y, low))

    fun = jax.custom_vjp(primal)

    def fwd(z: jax.Array) -> tuple[tuple[Value, jax.Array], jax.Array]:
        y, y_low = primal(z)
        return (y, y_low), y_low

    def bwd(y_low: jax.Array, cts: tuple[jax.Array, jax.Array]) -> tuple[jax.Array]:
        g, g_low = (lax.convert_element_type(c, FLOAT32_DTYPE) for c in cts)
        y = lax.convert_element_type(y_low, FLOAT32_DTYPE)
        g = g + g_low
        dz = y * (g - jnp.sum(g * y, axis=axes, keepdims=True))
        return (lax.convert_element_type(dz, z_dtype),)

    fun.defvjp(fwd, bwd)
    return fun


def recomputed(
    fun: Callable[..., Value], *xs: Value, wides: Sequence[Value] | None = None
) -> Value:
    """``fun(*xs upcast to float32)``; the backward pass keeps ``xs`` and recomputes the rest.

    With ``wides`` (each ``x`` upcast once, outside), the cotangent of each ``x`` is
    sent to its wide copy (``autocast.values.routed``), where the float32 uses add up.
    """
    n = len(xs)

    def upcast_then(*args: Value) -> Value:
        if wides is None:
            return fun(*(upcast(x, FLOAT32_DTYPE) for x in args))
        return fun(*(routed(x, w) for x, w in zip(args[:n], args[n:], strict=True)))

    # prevent_cse=False: no optimization barrier around the recomputation, which would make
    # XLA write x and the float32 cotangent to memory (the recomputation is x's own value).
    return jax.checkpoint(
        upcast_then, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
    )(*xs, *(wides or ()))


def select_keeping_mask(
    select: Callable[..., Value],
    which: Value,
    cases: Sequence[Value],
    widen: Callable[[Value], Value] | None = None,
) -> Value:
    """``select(which, *cases)``, ``which`` the mask (or ``widen(which)``, the broadcast of a
    smaller one), whose backward pass keeps the mask as it came in and nothing else.

    JAX's derivative of ``select_n`` makes the zero tangent of a constant case (a fill
    value, ``jnp.zeros_like``) a zeros array of the output's size in the forward pass, and
    the transpose reads it and the broadcast mask: residuals of 2 or 4 and 1 bytes per
    element (an attention mask's fill: per score). Under a checkpoint that saves nothing
    of its own, both are recomputed in the backward pass, where XLA fuses them into the
    select of the cotangent. The values are those of ``select``.
    """

    def fun(w: Value, *cs: Value) -> Value:
        return select(w if widen is None else widen(w), *cs)

    policy = jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint(fun, policy=policy, prevent_cse=False)(which, *cases)


# What the fused rule's backward pass keeps: the probabilities (or the scores), the values,
# the output and the dropout's other operands.
_Kept: TypeAlias = tuple[jax.Array, jax.Array, Value, tuple[jax.Array, ...]]


def softmax_matmul_keeping_low(
    body: Callable[[jax.Array], Value],
    low: DTypeLike,
    z_dtype: DTypeLike,
    matmul: Callable[[Value, Value], Value],
    y_is_lhs: bool,
    dimension_numbers: lax.DotDimensionNumbers,
    drop: Callable[..., Value] | None = None,
    recompute: bool = False,
) -> Callable[..., Value]:
    """``(z, v, *others) -> matmul(drop(softmax(z) in low, *others), v)``: attention's
    softmax, its dropout and the product with the values, whose backward pass keeps the low
    probabilities (or, where ``recompute``, the low scores ``z`` they are recomputed from),
    ``v``, the output and the dropout's ``others`` (its mask). ``drop(first, y, *others)``
    is told whether it is the primal's call (``first``) or a pass traced after it.

    The softmax's backward pass needs ``sum(g_p * p)`` over each row; it is computed as
    ``sum(g_o * o)`` over the value dimension instead (FlashAttention's identity: both
    are ``g_o . (p @ v)``, with dropout too, which is linear in ``p``), from the output and
    its cotangent, which are a fraction of the size of the probabilities. The gradient
    ``p * (g_p - that)`` is then one elementwise pass over ``p`` and ``g_p``, which XLA
    fuses with the product's transpose; the dropped probabilities are recomputed there.

    With ``recompute`` (``z`` is the half-precision input of softmax's shift, ``body``
    computes the shift too), nothing the size of the probabilities is written but what the
    matmul reads, as in a softmax of the module dtype: the forward pass computes the
    probabilities and their dropout in one kernel from ``z`` (which the score matmul wrote
    anyway), the backward pass recomputes them in its own. The rounding to ``low`` stays
    explicit (``reduce_precision``), so both passes see the same probabilities.
    """
    low, z_dtype = np.dtype(low), np.dtype(z_dtype)
    (lc, rc), (lb, rb) = dimension_numbers
    drop = drop or (lambda first, y: y)  # first: the primal's trace (autocast_report's)

    def probabilities(z: jax.Array) -> jax.Array:
        y = lax.convert_element_type(body(z), low)
        return y if recompute else lax.optimization_barrier(y)

    def product(p: Value, v: Value) -> Value:
        p = p if p.dtype == low else lax.convert_element_type(p, low)
        return matmul(p, v) if y_is_lhs else matmul(v, p)

    @jax.custom_vjp
    def fun(z: jax.Array, v: jax.Array, *others: jax.Array) -> Value:
        return product(drop(True, probabilities(z), *others), v)

    def fwd(z: jax.Array, v: jax.Array, *others: jax.Array) -> tuple[Value, _Kept]:
        y_low = probabilities(z)
        out = product(drop(False, y_low, *others), v)
        return out, (z if recompute else y_low, v, out, others)

    def bwd(res: _Kept, g: jax.Array) -> tuple[Value, ...]:
        kept, v, out, others = res
        y_low = probabilities(kept) if recompute else kept
        p, drop_vjp = jax.vjp(functools.partial(drop, False), y_low, *others)
        g_p, g_v = jax.vjp(product, p, v)[1](g)
        g_y, *g_others = drop_vjp(g_p)
        contract, batch = (lc, lb) if y_is_lhs else (rc, rb)
        free = [i for i in range(p.ndim) if i not in batch and i not in contract]
        n_v_free = out.ndim - len(batch) - len(free)
        start = len(batch) + len(free) if y_is_lhs else len(batch)
        v_free = tuple(range(start, start + n_v_free))
        row = jnp.sum(_f32(g) * _f32(out), axis=v_free)  # (batch..., free...) of y
        target = [*batch, *free]
        order = sorted(range(len(target)), key=lambda j: target[j])
        keep = tuple(1 if i in contract else n for i, n in enumerate(p.shape))
        row = lax.broadcast_in_dim(lax.transpose(row, order), keep, tuple(sorted(target)))
        if p.shape != y_low.shape:  # reshaped for grouped heads, the softmax's axes last
            k = len(contract)
            row = lax.reshape(row, (*y_low.shape[: y_low.ndim - k], *(1,) * k))
        y = upcast(y_low, FLOAT32_DTYPE) if recompute else _f32(y_low)
        dz = y * (_f32(g_y) - row)
        return (lax.convert_element_type(dz, z_dtype), g_v, *g_others)

    fun.defvjp(fwd, bwd)
    return fun


def _f32(x: Value) -> jax.Array:
    return lax.convert_element_type(x, FLOAT32_DTYPE)
