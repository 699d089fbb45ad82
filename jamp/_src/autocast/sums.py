"""Where autocast's backward pass sums: in float32, as ``jnp.sum`` does for half inputs.

The transpose of a broadcast is a ``reduce_sum``, computed in the dtype of
the broadcast value. A float32 bias or scale cast to bfloat16 and then
broadcast inside a half-precision ``add`` or ``mul`` (``lax.add`` broadcasts
a ``(1, 1, 1, C)`` or a rank-0 operand itself: Flax's ``Dense`` and ``Conv``
bias, the scale and bias of its norms, an Equinox ``Linear``'s scalar bias
under ``vmap``) therefore gets its gradient as a bfloat16 sum over ``N*H*W``
elements, each partial sum rounded to bfloat16: XLA keeps a bfloat16 reducer,
on the GPU too. Such sums cancel (the sum of ``|g|`` can be ten times
``|sum g|``), and the gradient loses a quarter of its norm.

autocast broadcasts such an operand itself, in float32, and casts the
full-size result: forward values are unchanged bit for bit (a cast commutes
with a broadcast), and the transpose is a cast of the cotangent to float32
followed by a float32 ``reduce_sum``, which XLA fuses into one reduction
kernel: no buffer is added. A half-precision value that is broadcast
(``broadcast_in_dim`` of a bfloat16 operand, or a bfloat16 operand broadcast
inside a primitive) goes up to float32 first (exact), so its gradient is
summed in float32 and rounded once. torch accumulates every reduction of half
tensors in float32 the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.typing import DTypeLike

from jamp._src.autocast.rules import FLOAT32_DTYPE
from jamp._src.autocast.values import CONST, TRACED, Info, Lift, Value, aval, routed, upcast

# Elementwise primitives whose operands lax broadcasts itself (rank 0, or size-1 axes):
# their transpose sums the cotangent of such an operand over the broadcast axes.
IMPLICIT_BROADCAST = frozenset(
    {"add", "add_any", "sub", "mul", "div", "max", "min", "rem", "atan2", "nextafter", "pow",
     "select_n", "clamp"}
)  # fmt: skip


def half(dtype: DTypeLike) -> bool:
    """Whether ``dtype`` is a floating dtype narrower than float32."""
    return bool(jnp.issubdtype(dtype, jnp.floating)) and np.dtype(dtype).itemsize < 4


def broadcast_operand(shape: Sequence[int], out_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The ``broadcast_dimensions`` that take an operand of ``shape`` to ``out_shape``, or
    ``None`` when it is not broadcast (or not in a way lax broadcasts implicitly)."""
    shape, out_shape = tuple(shape), tuple(out_shape)
    if shape == out_shape:
        return None
    if not shape:
        return ()
    pairs = zip(shape, out_shape, strict=False)
    if len(shape) == len(out_shape) and all(a in (1, b) for a, b in pairs):
        return tuple(range(len(shape)))
    return None


def summed_in_float32(
    x: Value, out_shape: Sequence[int], dims: Sequence[int], dtype: DTypeLike
) -> jax.Array:
    """``x`` broadcast to ``out_shape`` and cast to ``dtype``, broadcast in float32.

    The values are those of the plain broadcast; the transpose sums the
    cotangent in float32 (``x`` in half precision goes up to float32 first).
    """
    wide = x if not half(x.dtype) else lax.convert_element_type(x, FLOAT32_DTYPE)
    y = lax.broadcast_in_dim(wide, tuple(out_shape), tuple(dims))
    return y if y.dtype == np.dtype(dtype) else lax.convert_element_type(y, dtype)


# Elementwise primitives whose derivative reads their operands: with a broadcast operand
# made full size, they run under a checkpoint that saves the operands as they came in.
SAVES_OPERANDS = frozenset(
    {"mul", "div", "max", "min", "rem", "atan2", "nextafter", "pow", "clamp", "square",
     "integer_pow"}
)  # fmt: skip


def bind_summing(
    bind: Callable[[list[Value]], list[Value]],
    name: str,
    vals: Sequence[Value],
    targets: Mapping[int, DTypeLike],
    wide: Mapping[int, Sequence[int]],
    out_shape: Sequence[int],
    up: Collection[int] = (),
    lifts: Mapping[int, tuple[Lift, Sequence[Value]]] | None = None,
) -> list[Value]:
    """``bind(vals)`` with the operands in ``wide`` broadcast in float32 and cast to their
    ``targets`` dtype first (``summed_in_float32``), and those in ``lifts`` computed in
    float32 from their half inputs (``autocast.values.Lift``, with each input's float32
    cast, where its cotangent goes: ``autocast.values.routed``).

    For a primitive whose derivative reads its operands (``x * scale``), the
    broadcast is recomputed in the backward pass (a checkpoint without an
    optimization barrier), so what it keeps is ``scale`` as it came in, not a
    full-size copy; the operands in ``up`` (half precision, going up to float32)
    are kept in the half dtype the same way, and so are a lifted operand's half inputs.
    """
    lifts = lifts or {}
    n = len(vals)
    extra = [x for i in sorted(lifts) for x in (*lifts[i][0].args, *lifts[i][1])]

    def run(*xs: Value) -> list[Value]:
        ys, rest = list(xs[:n]), iter(xs[n:])
        for i, dims in wide.items():
            ys[i] = summed_in_float32(xs[i], out_shape, dims, targets[i])
        for i in up:
            ys[i] = upcast(xs[i], targets[i])
        for i in sorted(lifts):
            k = len(lifts[i][0].args)
            args, wides = [next(rest) for _ in range(k)], [next(rest) for _ in range(k)]
            ys[i] = lifts[i][0].fun(*(routed(a, w) for a, w in zip(args, wides, strict=True)))
        return bind(ys)

    if name not in SAVES_OPERANDS and not lifts:
        return run(*vals)
    policy = jax.checkpoint_policies.nothing_saveable
    return list(jax.checkpoint(run, policy=policy, prevent_cse=False)(*vals, *extra))


def broadcast_in_float32(
    eqn: jex_core.JaxprEqn,
    vals: Sequence[Value],
    targets: Mapping[int, DTypeLike],
    infos: Sequence[Info],
) -> dict[int, tuple[int, ...]]:
    """``{operand: broadcast_dimensions}``: the traced operands that ``eqn``'s primitive would
    broadcast itself in half precision (so its transpose would sum them in half precision)."""
    if eqn.primitive.name not in IMPLICIT_BROADCAST:
        return {}
    out_shape = aval(eqn.outvars[0]).shape
    wide = {}
    for i, dtype in targets.items():
        if half(dtype) and infos[i].kind == TRACED:
            dims = broadcast_operand(np.shape(vals[i]), out_shape)
            if dims is not None:
                wide[i] = dims
    return wide


def upcast_in_backward(
    eqn: jex_core.JaxprEqn,
    vals: Sequence[Value],
    targets: Mapping[int, DTypeLike],
    infos: Sequence[Info],
    wide: Mapping[int, tuple[int, ...]],
) -> set[int]:
    """The half-precision traced operands that ``eqn`` upcasts to float32 when its derivative
    reads them (``x * rsqrt(var)``, ``square(x)`` in a norm of half ``x``): the backward
    pass keeps them in the half dtype and upcasts again (``autocast.sums.bind_summing``)."""
    if eqn.primitive.name not in SAVES_OPERANDS:
        return set()
    return {
        i
        for i, dtype in targets.items()
        if i not in wide and half(vals[i].dtype) and not half(dtype) and infos[i].kind == TRACED
    }


SCATTER_ADD = frozenset({"scatter-add", "scatter_add"})


def scatters_half(eqn: jex_core.JaxprEqn, invals: Sequence[Value], infos: Sequence[Info]) -> bool:
    """A float32 scatter-add of half-precision updates (low activations) into a constant
    (``segment_sum``'s zeros) or a low activation."""
    updates = invals[2]
    return (
        np.dtype(aval(eqn.invars[0]).dtype) == FLOAT32_DTYPE
        and infos[2].kind == TRACED
        and half(updates.dtype)
        and infos[2].low
        and (infos[0].kind >= CONST or infos[0].low)
    )


# ---------------------------------------------------------------- float32 weight gradients
#
# A float32 parameter read by a half product (``x @ w`` under autocast: ``w`` cast to
# bfloat16) gets its gradient from the transposed product, which would run in bfloat16 and
# round it, then go up to float32 (the transpose of the cast). Under FSDP or data
# parallelism that product's output is what XLA sums across devices (a reduce-scatter or an
# all-reduce of the per-device partial gradients), so the sum runs in bfloat16: 8
# significant bits for N devices' partial sums. ``product_with_wide_gradients`` computes the
# transposed product for such an operand with ``preferred_element_type=float32``: the same
# half operands, accumulated into and returned in float32, the sum across devices in float32
# (PyTorch FSDP2's ``MixedPrecisionPolicy(reduce_dtype=float32)``). Forward values are the
# same bit for bit. A convolution's kernel gets the same: its gradient is the transposed
# convolution of the half input and output cotangent, accumulated into float32; the
# input's cotangent is jax's own.


def sharded(x: Value) -> bool:
    """Whether ``x`` is a value of a program over several devices: its abstract value's
    sharding is on a mesh of more than one device (``jit`` of sharded arguments, with or
    without ``jax.set_mesh``), or it is traced under such a mesh (``shard_map``)."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and mesh.size > 1:
        return True
    return jax.sharding.get_abstract_mesh().size > 1


def _ranges_like(*xs: Sequence[int]) -> list[tuple[int, ...]]:
    out, start = [], 0
    for x in xs:
        out.append(tuple(range(start, start + len(x))))
        start += len(x)
    return out


def _remaining(n: int, *removed: Sequence[int]) -> list[int]:
    gone = {int(i) for r in removed for i in r}
    return [i for i in range(n) if i not in gone]


def transposed_product(
    g: Value, y: Value, x_ndim: int, dimension_numbers: tuple, precision: Any,
    dtype: DTypeLike | None, swap_ans: bool = False, like: Value | None = None,
) -> jax.Array:  # fmt: skip
    """The cotangent of the left operand (``x_ndim`` dimensions) of ``dot_general(x, y,
    dimension_numbers)`` for its output's cotangent ``g``, the product accumulated into
    ``dtype`` (jax's own transpose of ``dot_general``, with its preferred type chosen),
    sharded as ``like`` (the operand) is on a mesh with explicit axes."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(np.ndim(y), y_contract, y_batch)
    if swap_ans:
        ans_batch, ans_y, _ = _ranges_like(x_batch, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    x_contract_by_y = [int(i) for i in np.take(x_contract, np.argsort(y_contract))]
    out_axes = [int(a) for a in np.argsort([*x_batch, *x_kept, *x_contract_by_y])]
    prod = lax.dot_general(g, y, dims, precision=precision, preferred_element_type=dtype,
                           out_sharding=_explicit(like, out_axes))  # fmt: skip
    return lax.transpose(prod, tuple(out_axes))


def _explicit(like: Value | None, out_axes: Sequence[int]) -> Any:
    """The sharding of the product that ``out_axes`` transposes into ``like``'s layout,
    where ``like`` is on a mesh with explicit axes (jax asks for it when the contracted
    axes are sharded); ``None`` otherwise."""
    if like is None:
        return None
    sharding: Any = getattr(jax.typeof(like), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    explicit = jax.sharding.AxisType.Explicit
    if mesh is None or explicit not in tuple(getattr(mesh, "axis_types", ())):
        return None
    given = tuple(sharding.spec)
    spec = given + (None,) * (np.ndim(like) - len(given))
    pre: list[object] = [None] * len(spec)
    for j, a in enumerate(out_axes):
        pre[int(a)] = spec[j]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*pre))


def _conv_kernel_cotangent(
    g: Value, ys: Sequence[Value], params: Mapping, dtype: DTypeLike
) -> jax.Array:
    """The cotangent of a ``conv_general_dilated``'s kernel (its right operand) for its
    output's cotangent ``g``: jax's own transposed convolution of the same half operands,
    accumulated into and returned in ``dtype``, sharded as the kernel (depthwise and
    grouped convolutions included: jax's rule turns the feature groups into batch groups).

    jax's rule is private (``tests/test_implementation_pins.py`` pins its signature). No
    public route gives half operands with a float32 output: the ``vjp`` of a convolution
    with ``preferred_element_type=float32`` has a float32 cotangent, and its transpose
    casts the input up to it (a float32 convolution)."""
    from jax._src.lax.convolution import _conv_general_dilated_transpose_rhs

    lhs, rhs = ys
    if np.size(g) == 0:
        return jnp.zeros(np.shape(rhs), dtype)

    class Kernel:  # what jax's rule reads of the undefined kernel: its abstract value
        aval = jax.typeof(rhs).update(dtype=np.dtype(dtype))

    keys = ("window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers",
            "feature_group_count", "batch_group_count", "precision")  # fmt: skip
    out: Any = _conv_general_dilated_transpose_rhs(  # not jax's Zero: g is not empty
        g, lhs, Kernel, **{k: params[k] for k in keys}, preferred_element_type=dtype,
        out_sharding=params.get("out_sharding"),
    )  # fmt: skip
    return out


def _cotangent(i: int, g: Value, ys: Sequence[Value], params: Mapping, dtype: DTypeLike):
    if "window_strides" in params:  # a convolution: only its kernel is in ``wide``
        return _conv_kernel_cotangent(g, ys, params, dtype)
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    precision = params.get("precision")
    if i == 0:
        dims = ((lc, rc), (lb, rb))
        return transposed_product(g, ys[1], np.ndim(ys[0]), dims, precision, dtype, like=ys[0])
    swapped = ((rc, lc), (rb, lb))
    return transposed_product(
        g, ys[0], np.ndim(ys[1]), swapped, precision, dtype, swap_ans=True, like=ys[1]
    )


def product_with_wide_gradients(
    bind: Callable[[list[Value]], list[Value]],
    vals: Sequence[Value],
    targets: Mapping[int, DTypeLike],
    wide: Collection[int],
    params: Mapping[str, object],
) -> list[Value]:
    """``bind`` (a ``dot_general``, or a ``conv_general_dilated`` with its kernel in
    ``wide``) on ``vals`` cast to ``targets``, the operands in ``wide``
    (float32 values cast down) getting their cotangents from a product accumulated into, and
    returned in, float32; the other operands' cotangents are jax's own."""

    dtypes = [x.dtype for x in vals]

    def cast(xs: Sequence[Value]) -> list[Value]:
        return [lax.convert_element_type(x, targets[i]) if i in wide and x.dtype != targets[i]
                else x for i, x in enumerate(xs)]  # fmt: skip

    @jax.custom_vjp
    def product(*xs: Value) -> Value:
        return bind(cast(xs))[0]

    def fwd(*xs: Value) -> tuple[Value, list[Value]]:
        ys = cast(xs)
        return bind(ys)[0], ys

    def bwd(ys: list[Value], g: Value) -> tuple:
        rest = [i for i in range(len(ys)) if i not in wide]

        def narrow(*zs: Value) -> Value:
            full = list(ys)
            for i, z in zip(rest, zs, strict=True):
                full[i] = z
            return bind(full)[0]

        cts: list[Value | None] = [None] * len(ys)
        if rest:
            _, vjp = jax.vjp(narrow, *[ys[i] for i in rest])
            for i, ct in zip(rest, vjp(g), strict=True):
                cts[i] = ct
        for i in wide:  # float32, and a half operand's rounded once, after the sum
            cts[i] = _cotangent(i, g, ys, params, FLOAT32_DTYPE).astype(dtypes[i])
        return tuple(cts)

    product.defvjp(fwd, bwd)
    return [product(*vals)]
