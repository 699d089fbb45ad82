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
half dtype anyway, as attention's ``probabilities @ values`` does, the group
is evaluated as one ``custom_vjp``:

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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jamp._src.autocast_rules import FLOAT32, FLOAT32_DTYPE, LOWER, rule_of
from jamp._src.autocast_values import upcast

# The consumers that cast their floating operands to the low dtype under LOWER.
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
_KEEPDIMS = frozenset({"broadcast_in_dim", "reshape"})


class Group(NamedTuple):
    """A softmax found in a jaxpr: its equations' indices, input, output and axes."""

    indices: tuple[int, ...]  # exp, reduce_sum, broadcast/reshape, div
    z: Any  # the input of exp
    y: Any  # the output of div
    axes: tuple[int, ...]  # the summed axes
    dot: int | None = None  # its one consumer, a matmul contracting those axes (fused too)


def find_softmax(jaxpr: Any, dtype: Any) -> dict[int, Group]:
    """The softmaxes of ``jaxpr`` whose output only feeds low-precision matmuls (through
    dropout, perhaps).

    Keyed by the index of their ``exp``. Each matched value other than ``y``
    has no use outside the group, so evaluating the group at once, where the
    ``exp`` is, and skipping the other three equations changes nothing else.
    """
    if np.dtype(dtype).itemsize >= 4:
        return {}
    uses: dict[Any, list[int]] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal):
                uses.setdefault(v, []).append(k)
    outs = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    eqns = jaxpr.eqns

    def only(v: Any, n: int) -> list[int] | None:
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
        shape = tuple(1 if i in axes else n for i, n in enumerate(e.aval.shape))
        if tuple(keep.outvars[0].aval.shape) != shape or only(keep.outvars[0], 1) != [d_k]:
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
            dot = _contracting(y, axes, eqns, uses[y])
            groups[k] = Group((k, s_k, b_uses[0], d_k), eqn.invars[0], y, axes, dot)
    return groups


def _contracting(y: Any, axes: Sequence[int], eqns: Sequence[Any], found: list) -> int | None:
    """The index of ``y``'s one consumer when it is a ``dot_general`` contracting exactly
    the softmax's axes of ``y`` (attention's probabilities @ values), else ``None``."""
    if len(found) != 1 or eqns[found[0]].primitive.name != "dot_general":
        return None
    eqn = eqns[found[0]]
    if eqn.invars[0] is eqn.invars[1]:
        return None
    (lc, rc), _ = eqn.params["dimension_numbers"]
    contract = lc if eqn.invars[0] is y else rc
    return found[0] if sorted(int(a) for a in contract) == sorted(axes) else None


# Between a softmax and its matmuls: dropout (``y * mask / keep``, ``where(keep, y / p, 0)``).
_DROPOUT = frozenset({"mul", "div", "select_n"})
_DROPOUT_DEPTH = 3


def _feeds_matmuls(v: Any, eqns: Sequence[Any], uses: dict, outs: set, depth: int) -> bool:
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


def group_jaxpr(jaxpr: Any, group: Group) -> Any:
    """The group's four equations as a jaxpr from ``z`` to ``y``."""
    eqns = [jaxpr.eqns[i] for i in group.indices]
    info = jaxpr.debug_info
    info = info and info._replace(arg_names=("z",), result_paths=("softmax",))
    return jex_core.Jaxpr([], [group.z], [group.y], eqns, debug_info=info)


def softmax_keeping_low(
    body: Callable[[Any], Any], axes: Sequence[int], low: Any, z_dtype: Any
) -> Callable[[Any], tuple[Any, Any]]:
    """``z -> (y, y in low)``, ``y = body(z)``, whose backward pass keeps only ``y in low``.

    ``body`` computes the float32 softmax. The cotangents of both outputs
    are summed in float32 and run through softmax's rule; ``z``'s cotangent
    comes back in ``z_dtype``.
    """
    low, z_dtype, axes = np.dtype(low), np.dtype(z_dtype), tuple(axes)

    def primal(z: Any) -> tuple[Any, Any]:
        y = body(z)
        # The barrier makes the rounding explicit: XLA's excess precision would otherwise
        # read the float32 y (and keep exp's float32 output) where y_low is read.
        return y, lax.optimization_barrier(lax.convert_element_type(y, low))

    fun = jax.custom_vjp(primal)

    def fwd(z: Any) -> tuple[tuple[Any, Any], Any]:
        y, y_low = primal(z)
        return (y, y_low), y_low

    def bwd(y_low: Any, cts: tuple[Any, Any]) -> tuple[Any]:
        g, g_low = (lax.convert_element_type(c, FLOAT32_DTYPE) for c in cts)
        y = lax.convert_element_type(y_low, FLOAT32_DTYPE)
        g = g + g_low
        dz = y * (g - jnp.sum(g * y, axis=axes, keepdims=True))
        return (lax.convert_element_type(dz, z_dtype),)

    fun.defvjp(fwd, bwd)
    return fun


def recomputed(fun: Callable[[Any], Any], x: Any) -> Any:
    """``fun(x upcast to float32)``; the backward pass keeps ``x`` and recomputes the rest."""

    def upcast_then(x: Any) -> Any:
        return fun(upcast(x, FLOAT32_DTYPE))

    # prevent_cse=False: no optimization barrier around the recomputation, which would make
    # XLA write x and the float32 cotangent to memory (the recomputation is x's own value).
    return jax.checkpoint(
        upcast_then, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False
    )(x)


def softmax_matmul_keeping_low(
    body: Callable[[Any], Any],
    low: Any,
    z_dtype: Any,
    matmul: Callable[[Any, Any], Any],
    y_is_lhs: bool,
    dimension_numbers: Any,
) -> Callable[[Any, Any], Any]:
    """``(z, v) -> matmul(softmax(z) in low, v)``: attention's softmax and the product with
    the values, whose backward pass keeps the low probabilities, ``v`` and the output.

    The softmax's backward pass needs ``sum(g_p * p)`` over each row; it is computed as
    ``sum(g_o * o)`` over the value dimension instead (FlashAttention's identity: both
    are ``g_o . (p @ v)``), from the output and its cotangent, which are a fraction of the
    size of the probabilities. The gradient ``p * (g_p - that)`` is then one elementwise
    pass over ``p`` and ``g_p``, which XLA fuses with the product's transpose.
    """
    low, z_dtype = np.dtype(low), np.dtype(z_dtype)
    (lc, rc), (lb, rb) = dimension_numbers

    def probabilities(z: Any) -> Any:
        return lax.optimization_barrier(lax.convert_element_type(body(z), low))

    def product(y_low: Any, v: Any) -> Any:
        return matmul(y_low, v) if y_is_lhs else matmul(v, y_low)

    @jax.custom_vjp
    def fun(z: Any, v: Any) -> Any:
        return product(probabilities(z), v)

    def fwd(z: Any, v: Any) -> tuple[Any, Any]:
        y_low = probabilities(z)
        out = product(y_low, v)
        return out, (y_low, v, out)

    def bwd(res: Any, g: Any) -> tuple[Any, Any]:
        y_low, v, out = res
        g_y, g_v = jax.vjp(product, y_low, v)[1](g)
        contract, batch = (lc, lb) if y_is_lhs else (rc, rb)
        free = [i for i in range(y_low.ndim) if i not in batch and i not in contract]
        n_v_free = out.ndim - len(batch) - len(free)
        start = len(batch) + len(free) if y_is_lhs else len(batch)
        v_free = tuple(range(start, start + n_v_free))
        row = jnp.sum(_f32(g) * _f32(out), axis=v_free)  # (batch..., free...) of y
        target = [*batch, *free]
        order = sorted(range(len(target)), key=lambda j: target[j])
        keep = tuple(1 if i in contract else n for i, n in enumerate(y_low.shape))
        row = lax.broadcast_in_dim(lax.transpose(row, order), keep, tuple(sorted(target)))
        y = _f32(y_low)
        dz = y * (_f32(g_y) - row)
        return lax.convert_element_type(dz, z_dtype), g_v

    fun.defvjp(fwd, bwd)
    return fun


def _f32(x: Any) -> Any:
    return lax.convert_element_type(x, FLOAT32_DTYPE)
