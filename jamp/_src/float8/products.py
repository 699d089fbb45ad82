"""Float8 matrix products with per-tensor scaling, as pure functions.

A float8 matrix product quantises each operand to ``float8_e4m3fn`` (max
448, 3 mantissa bits) with a *per-tensor* scale that maps the tensor's
largest magnitude (its *amax*) to the format's largest finite value, so a
tensor of values near ``1e-6`` uses float8's full range as a tensor near
``1e3`` does. It multiplies the quantised operands with float32 accumulation
(``preferred_element_type=float32``) and multiplies the product by the
inverse scales. The backward pass quantises the incoming gradient to
``float8_e5m2`` (max 57344, 2 mantissa bits, more range) with its own scale
and computes both transposed products with float8 operands: a
``jax.custom_vjp``. This is the pattern XLA's GPU compiler rewrites into one
cuBLASLt float8 GEMM (``__cublas$lt$matmul$f8``): float8 operands, a float32
``dot_general``, and a multiply by a broadcast scalar.

Two ways to choose the scales, both Transformer Engine's:

*current scaling* (``current_dot``)
    ``scale = finfo(float8).max / amax`` of the tensor itself, computed in the
    same step. Stateless and exact to the tensor, at the cost of one more
    pass over the tensor before it is quantised.
*delayed scaling* (``delayed_dot``, recipe [`DelayedScaling`][jamp.float8.DelayedScaling])
    the scale of step ``t`` comes from the amaxes of earlier steps, kept in an
    immutable [`Float8State`][jamp.float8.Float8State] (an amax history and a scale per operand
    and for the gradient). Nothing waits for the amax of step ``t``, so XLA
    may compute it in the pass that quantises; it is recorded, and the next
    state is computed in the backward pass and returned as the *cotangent of
    the state argument*: ``jax.grad`` with respect to the state returns the
    next state.

Quantisation saturates finite values at the format's largest finite value
and turns infinities and NaN into NaN, so an overflow still reaches loss
scaling's finite check.

The forward product accumulates as XLA's ``DEFAULT`` does for float8 (fast
accumulation); the two gradient products ask for float32 accumulation without
it on CUDA GPUs (``GRADIENT_ALGORITHM``), as Transformer Engine and torchao do.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from jamp._src.dtypes import BFLOAT16 as BF16
from jamp._src.float8.recipe import (
    E4M3,
    E5M2,
    F32,
    GRAD,
    LHS,
    RHS,
    ROW_MAX,
    DelayedScaling,
    Float8State,
    kept_max,
    next_state,
    traced_check,
)
from jamp._src.jaxprs import SCOPE_QUANTIZE

# A current scale is at most 2**126, so its inverse is a normal float32 number.
_SMALLEST_AMAX = ROW_MAX * np.float32(2.0**-126)

# ---------------------------------------------------------------------------
# Quantisation
# ---------------------------------------------------------------------------

# Each quantisation's operations run under the named scope ``jaxprs.SCOPE_QUANTIZE``
# (``jax.named_scope``): the multiply by the scale, the clip and the cast to float8.
# ``jamp.debug``'s ``precision_report`` finds a quantisation, its scale and its scaled
# tensor by it. A scope changes the operations' metadata only (their name stack), never
# the program.


def amax(x: jax.Array) -> jax.Array:
    """The largest magnitude of ``x`` as a float32 scalar (NaN if ``x`` holds a NaN)."""
    if x.size == 0:
        return jnp.zeros((), F32)
    return jnp.max(jnp.abs(x)).astype(F32)


def current_scale(amax: jax.Array, row: int) -> jax.Array:
    """``finfo.max / amax`` for ``row``'s format, at most ``2**126`` (an ``amax`` of 0).

    A non-finite ``amax`` gives a scale of 0 or NaN, so the product of a
    tensor holding inf or NaN is not finite either.
    """
    return ROW_MAX[row] / jnp.maximum(amax, _SMALLEST_AMAX[row])


def quantize(x: jax.Array, scale: jax.Array, dtype: DTypeLike) -> jax.Array:
    """``clip(x * scale, +-finfo(dtype).max)`` in ``dtype``; a value whose scaled value is
    not finite (inf, NaN, or a finite value the scale takes past float32) becomes NaN.

    ``y - y`` is 0 for a finite ``y`` and NaN otherwise, so the saturating cast is one
    elementwise pass. A ``select`` on ``is_finite(x)`` (the form before) made XLA:GPU
    write the predicate of a weight in a pass of its own when it quantised the weight into
    the transposed layout its GEMM reads: 20 MiB more per 1024x4096 weight and step
    (``tests/test_gpu_compile.py``).

    The operations run under the named scope ``SCOPE_QUANTIZE``.
    """
    big = np.float32(jnp.finfo(dtype).max)
    with jax.named_scope(SCOPE_QUANTIZE):
        y = x.astype(F32) * scale
        return (lax.clamp(-big, y, big) + (y - y)).astype(dtype)


def usable(scale: jax.Array, x_amax: jax.Array, row: int, recipe: DelayedScaling) -> jax.Array:
    """The state's scale where it is positive and finite; else 1 (``unmeasured="one"``: no
    dependency on the tensor, so XLA may fuse its amax into the quantising pass) or the
    current scale of the tensor whose amax is ``x_amax`` (``"current"``)."""
    ok = jnp.isfinite(scale) & (scale > 0)
    other = np.float32(1.0) if recipe.unmeasured == "one" else current_scale(x_amax, row)
    return jnp.where(ok, scale, other)


# ---------------------------------------------------------------------------
# The products and their transposes
# ---------------------------------------------------------------------------


class Spec(NamedTuple):
    """What a float8 product needs besides its arrays (static, hashable)."""

    dimension_numbers: lax.DotDimensionNumbers
    out_dtype: np.dtype  # the dtype of the output (the autocast dtype, or a wider pet)
    lhs_dtype: np.dtype  # the dtypes the gradients come back in
    rhs_dtype: np.dtype
    out_sharding: NamedSharding | None = None  # dot_general's, as its equation holds it
    recipe: DelayedScaling | None = None


# How the float8 GEMMs accumulate (docs/float8-design.md, "Accumulation"). The two gradient
# products (dgrad, wgrad) ask for float32 accumulation without fast accumulation on CUDA
# GPUs: the ``ANY_F8_ANY_F8_F32`` algorithm, which XLA:GPU runs as a cuBLASLt float8 GEMM
# with CUBLASLT_MATMUL_DESC_FAST_ACCUM off (its Triton GEMM emitter refuses the algorithm,
# and accumulates a float8 dot without one imprecisely). Transformer Engine and torchao
# accumulate their gradient GEMMs the same way. The forward product keeps ``DEFAULT``,
# which both XLA:GPU paths run with fast accumulation, as TE and torchao run theirs. Other
# platforms keep ``DEFAULT``: the CPU refuses float8 algorithms (it upcasts the operands
# and accumulates in float32).
GRADIENT_ALGORITHM = lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32


def _gradient_dot(lhs, rhs, dimension_numbers, out_sharding, out_type):
    """``dot_general`` of two float8 operands, accumulated in float32, as float32: on CUDA
    GPUs with ``GRADIENT_ALGORITHM``, rounded to ``out_type`` (float32, or bfloat16 for a
    bfloat16 gradient) by the cuBLASLt GEMM itself (a float32 product would be written,
    read back and cast: 10 bytes a value where bfloat16 is 2); elsewhere with ``DEFAULT``,
    not rounded. Chosen at lowering."""

    def cuda(a, b):
        return lax.dot_general(
            a, b, dimension_numbers, precision=GRADIENT_ALGORITHM,
            preferred_element_type=out_type, out_sharding=out_sharding,
        ).astype(F32)  # fmt: skip

    def default(a, b):
        return lax.dot_general(
            a, b, dimension_numbers, preferred_element_type=F32, out_sharding=out_sharding
        )

    return lax.platform_dependent(lhs, rhs, cuda=cuda, default=default)


def _scaled_dot(q_lhs, q_rhs, dimension_numbers, inv, out_sharding=None):
    """``dot_general(q_lhs, q_rhs) * inv`` in float32: what XLA rewrites to one FP8 GEMM
    (fast accumulation, ``DEFAULT``)."""
    out = lax.dot_general(
        q_lhs, q_rhs, dimension_numbers, preferred_element_type=F32, out_sharding=out_sharding
    )
    return out * inv


def _operand_grad(g, other, own, dimension_numbers, wrt_lhs: bool, inv, dtype):
    """The gradient of one operand (``own``) of ``dot_general``: ``g`` times the other.

    ``g`` has the output's axes (batch, the left operand's free axes, the
    right operand's free axes); it is contracted with ``other`` over the
    other operand's free axes and batched over the batch axes. The result's
    axes (batch, this operand's free axes, its contracting axes in the order
    of the other operand's) are then permuted to this operand's layout. The
    scale multiplies the product before the permutation, next to the dot. On
    an explicit mesh the product is sharded as ``own`` is (as JAX's own
    transpose of ``dot_general`` does), since a contraction over a sharded
    axis would otherwise have no sharding.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lhs_nd, rhs_nd = (own.ndim, other.ndim) if wrt_lhs else (other.ndim, own.ndim)
    own_c, oth_c, own_b, oth_b = (lc, rc, lb, rb) if wrt_lhs else (rc, lc, rb, lb)
    own_free = [i for i in range(own.ndim) if i not in own_c and i not in own_b]
    oth_free = [i for i in range(other.ndim) if i not in oth_c and i not in oth_b]
    nb = len(lb)
    n_lhs_free = lhs_nd - len(lc) - nb
    g_oth = range(nb + n_lhs_free, g.ndim) if wrt_lhs else range(nb, nb + n_lhs_free)
    dims = ((tuple(g_oth), tuple(oth_free)), (tuple(range(nb)), tuple(oth_b)))
    order = [*own_b, *own_free, *(own_c[i] for i in np.argsort(oth_c))]
    # On a GPU a bfloat16 gradient's product is rounded to bfloat16 before it is scaled: a
    # relative error of at most 2**-8, next to the 2**-3 of the float8_e5m2 gradient it is
    # made of. float16 keeps a float32 product: unscaled, it may exceed float16's range.
    out_type = BF16 if np.dtype(dtype) == BF16 else F32
    y = _gradient_dot(g, other, dims, _sharding_as(own, order), out_type)
    return lax.transpose(y * inv, tuple(int(i) for i in np.argsort(order)))


def _sharding_as(own: jax.Array, order: Sequence[int]) -> NamedSharding | None:
    """``own``'s sharding with its axes in ``order``; replicated on the current mesh when
    ``own`` has none (JAX's transpose of ``dot_general`` does the same); ``None`` when
    there is no mesh (the compiler decides)."""
    sharding = jax.typeof(own).sharding
    if sharding.mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
        return None if mesh.empty else NamedSharding(mesh, P(*([None] * own.ndim)))
    spec = (*sharding.spec, *([None] * (own.ndim - len(sharding.spec))))
    return sharding.update(spec=P(*(spec[o] for o in order)))


def forward(spec: Spec, lhs, rhs, s_lhs, s_rhs, checked=None):
    """The product of the operands quantised with ``s_lhs``, ``s_rhs``; and what the
    backward pass needs of them (``_backward``). ``checked`` (``traced_check``'s 1 or
    NaN) multiplies the inverse scales, so the product and both gradients, never the
    quantisation."""
    q_lhs, q_rhs = quantize(lhs, s_lhs, E4M3), quantize(rhs, s_rhs, E4M3)
    inv_lhs, inv_rhs = 1 / s_lhs, 1 / s_rhs
    if checked is not None:
        inv_lhs, inv_rhs = inv_lhs * checked, inv_rhs * checked
    out = _scaled_dot(q_lhs, q_rhs, spec.dimension_numbers, inv_lhs * inv_rhs, spec.out_sharding)
    return out.astype(spec.out_dtype), (q_lhs, q_rhs, inv_lhs, inv_rhs)


def _backward(spec: Spec, operands, g, s_g):
    """The operands' gradients from ``g`` quantised to float8_e5m2 with ``s_g``."""
    q_g, inv_g = quantize(g, s_g, E5M2), 1 / s_g
    return transposed(spec, operands, q_g, inv_g)


def transposed(spec: Spec, operands, q_g, inv_g):
    """The operands' gradients from the quantised gradient ``q_g`` (inverse scale ``inv_g``)."""
    q_lhs, q_rhs, inv_lhs, inv_rhs = operands
    dn = spec.dimension_numbers
    d_lhs = _operand_grad(q_g, q_rhs, q_lhs, dn, True, inv_g * inv_rhs, spec.lhs_dtype)
    d_rhs = _operand_grad(q_g, q_lhs, q_rhs, dn, False, inv_g * inv_lhs, spec.rhs_dtype)
    return d_lhs.astype(spec.lhs_dtype), d_rhs.astype(spec.rhs_dtype)


# Current scaling --------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def current_dot(lhs: jax.Array, rhs: jax.Array, spec: Spec) -> jax.Array:
    """``dot_general`` in float8 with current per-tensor scaling (see the module docstring)."""
    return current_fwd(lhs, rhs, spec)[0]


def current_fwd(lhs, rhs, spec):
    return forward(spec, lhs, rhs, current_scale(amax(lhs), LHS), current_scale(amax(rhs), RHS))


def _current_bwd(spec, res, g):
    return _backward(spec, res, g, current_scale(amax(g), GRAD))


current_dot.defvjp(current_fwd, _current_bwd)


# Delayed scaling ------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def delayed_dot(
    lhs: jax.Array, rhs: jax.Array, amax_history: jax.Array, scale: jax.Array, spec: Spec
) -> jax.Array:
    """``dot_general`` in float8 with delayed scaling: the state's scales, amaxes recorded.

    The cotangent of ``(amax_history, scale)`` is the next state
    (``next_state`` with this step's three amaxes), whatever the
    cotangent of the output is.
    """
    return delayed_fwd(lhs, rhs, amax_history, scale, spec)[0]


def state_check(amax_history, scale, recipe):
    """``(kept_max(amax_history) or None, traced_check(...))``: the history's pass that
    ``next_state`` reuses, and 1 or NaN (a corrupted state) for the inverse scales."""
    kept = kept_max(amax_history) if recipe.amax_compute_algo == "max" else None
    return kept, traced_check(amax_history, scale, recipe, kept)


def delayed_fwd(lhs, rhs, amax_history, scale, spec):
    a_lhs, a_rhs = amax(lhs), amax(rhs)  # recorded; quantised with the state's scales
    s_lhs = usable(scale[LHS], a_lhs, LHS, spec.recipe)
    s_rhs = usable(scale[RHS], a_rhs, RHS, spec.recipe)
    kept, checked = state_check(amax_history, scale, spec.recipe)
    out, operands = forward(spec, lhs, rhs, s_lhs, s_rhs, checked)
    return out, (operands, a_lhs, a_rhs, amax_history, scale, kept)


def _delayed_bwd(spec, res, g):
    operands, a_lhs, a_rhs, amax_history, scale, kept = res
    a_g = amax(g)
    d_lhs, d_rhs = _backward(spec, operands, g, usable(scale[GRAD], a_g, GRAD, spec.recipe))
    amaxes = jnp.stack([a_lhs, a_rhs, a_g])
    new = next_state(Float8State(amax_history, scale), amaxes, spec.recipe, kept)
    return d_lhs, d_rhs, new.amax_history, new.scale


delayed_dot.defvjp(delayed_fwd, _delayed_bwd)
