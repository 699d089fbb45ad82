"""The rule table of ``jamp.autocast``: which dtype each primitive runs in.

``autocast(fun)`` traces ``fun`` to a jaxpr and evaluates that jaxpr with an
interpreter that decides, primitive by primitive, in which dtype it runs. The
decision comes from one table, :data:`RULES`, the JAX analogue of
torch.autocast's CUDA op lists:

================  ==========================================================
rule              what happens to the floating inputs of the primitive
================  ==========================================================
``lower``         cast to the low-precision ``dtype`` (float16/bfloat16); the
                  output stays in that dtype (``preferred_element_type`` too,
                  unless the program asked for one wider than the traced
                  inputs, e.g. ``bf16 x bf16 -> f32``). Matrix products and
                  convolutions.
``float32``       cast to float32 (float64 is left alone). exp, log, pow,
                  rsqrt, sums, window sums, cumulative sums, division, ...
                  so softmax, log-softmax, logsumexp, norms, variance,
                  pooling and losses run in float32; also FFTs, linear
                  algebra, ``complex`` and ``conj``, which accept only
                  float32/float64.
``promote``       cast to the widest floating dtype among the inputs (torch's
                  "promote" list). Python scalars and constants (literals)
                  follow the other inputs instead of widening them, as they
                  do in ``jnp``. An ``add``/``sub``/``mul``/``square`` whose
                  result feeds a ``float32`` primitive runs in float32 (so
                  ``x - max(x)`` in softmax is computed as in float32).
``keep``          left as they arrive (data movement with independent inputs,
                  ``checkpoint_name``, debug printing).
``as traced``     cast back to the dtypes they had when ``fun`` was traced
                  (float32 for a float32 model): primitives whose meaning
                  depends on the dtype, e.g. ``bitcast_convert_type``, and
                  every primitive the table does not know.
================  ==========================================================

Integer, boolean, complex and key inputs are never touched. A constant (a
value known when ``fun`` is traced) that autocast narrows is first saturated
to the finite range of the narrower dtype, so a ``jnp.finfo(jnp.float32).min``
mask fill stays finite; values that depend on the arguments are cast as they
are, so their overflow still reaches loss scaling. Sub-computations
(``jit``, ``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``, ``scan``,
``while``, ``cond``, ``remat``) are interpreted recursively with the same rules;
loop carries and the outputs of ``cond`` keep the dtypes they were traced with,
so every branch and iteration agrees. ``convert_element_type`` written by the
user (``x.astype(...)``) is honoured; a no-op conversion in the traced program
stays a no-op.

Regions that must not be autocast are marked with :func:`autocast_disabled`
(a ``jax.named_scope`` the interpreter recognises); inside them every
primitive runs as traced. An inner ``autocast`` inside an outer one marks its
region the same way, so the innermost setting wins, as with nested
``torch.autocast``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

LOWER = "lower"
FLOAT32 = "float32"
PROMOTE = "promote"
KEEP = "keep"
AS_TRACED = "as traced"

# ---------------------------------------------------------------------------
# The table: primitive names grouped by rule, each group with the torch ops it
# mirrors. Sub-computations are handled structurally (see
# autocast_interpreter.HIGHER_ORDER); they are not in the table.
# ---------------------------------------------------------------------------

# fmt: off
_LOWER_PRECISION = (
    # torch: matmul, mm, bmm, baddbmm, addmm, addbmm, linear, einsum, conv*,
    # scaled_dot_product_attention, ... all lower to these two in JAX.
    "dot_general",
    "conv_general_dilated",
    "ragged_dot_general",
)

_FLOAT32 = (
    # torch: exp, expm1, log, log1p, log2, log10, pow, reciprocal, rsqrt, ...
    "exp", "exp2", "log", "log1p", "expm1", "pow", "sqrt", "rsqrt", "cbrt", "reciprocal",
    # torch: acos, asin, cosh, sinh, tan (and the inverse hyperbolics).
    "tan", "acos", "asin", "cosh", "sinh", "acosh", "asinh", "atanh",
    # torch: softplus, erfinv; sigmoid-like and special functions.
    "logistic", "erf", "erfc", "erf_inv", "lgamma", "digamma", "polygamma",
    "igamma", "igammac", "igamma_grad_a", "random_gamma_grad", "zeta",
    "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta",
    # torch: sum, prod, cumsum, cumprod, logsumexp (dtype= overloads) ... and
    # avg_pool's window sums (torch accumulates those in float32 too).
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_window_sum",
    # ... and the divisions of softmax, layer_norm, group_norm, mean, mse_loss.
    "div",
    # integer_pow: float32 for exponents < 0 or > 2, promote for 0, 1, 2
    # (see _integer_pow_rule).
    "integer_pow",
    # torch: fft_*, linalg_* (qr, svd, eigh, cholesky, solve, ...), geqrf,
    # triangular_solve. These primitives accept float32/float64 (or complex)
    # only, as do complex and conj (a complex number is built from float32).
    "fft", "complex", "conj",
    "cholesky", "cholesky_update", "eig", "eigh", "hessenberg", "householder_product",
    "lu", "lu_pivots_to_permutation", "qr", "geqrf", "geqp3", "ormqr", "schur", "svd",
    "symmetric_product", "triangular_solve", "tridiagonal", "tridiagonal_solve",
)

_PROMOTE = (
    # torch's promote list (addcmul, addcdiv, atan2, cross, dot, ...; its
    # index_put/scatter_add are "as traced" below) and every elementwise or
    # structural op on no list.
    "add", "add_any", "sub", "mul", "neg", "abs", "sign", "max", "min", "rem",
    "square", "tanh", "sin", "cos", "atan", "atan2", "floor", "ceil", "round",
    "is_finite", "nextafter", "clamp", "select_n", "reduce_precision",
    "eq", "ne", "lt", "le", "gt", "ge", "eq_to", "lt_to", "le_to",
    "and", "or", "not", "xor",
    "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "clz", "real", "imag",
    "reduce_max", "reduce_min", "reduce_and", "reduce_or", "reduce_xor",
    "argmax", "argmin", "cummax", "cummin",
    "reduce_window_max", "reduce_window_min", "select_and_gather_add",
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev",
    "slice", "dynamic_slice", "dynamic_update_slice", "gather", "concatenate",
    "stack", "unstack", "tile", "roll",
    "pad", "split", "sort", "top_k", "iota", "copy", "copy_p", "stop_gradient",
    "zeros_like", "sharding_constraint", "mesh_cast",
    "random_bits", "random_seed", "random_wrap", "random_unwrap", "random_split",
    "random_fold_in", "threefry2x32",
)

_KEEP = (
    # Independent inputs passed through: never mix their dtypes.
    "device_put", "optimization_barrier", "pvary",
    # checkpoint_name tags a value for a remat policy: the saved residual keeps
    # the dtype autocast computed it in. Debug printing shows what is computed.
    "name", "debug_print", "debug_callback", "platform_index",
)

_AS_TRACED = (
    # The dtype is part of the meaning, or the primitive carries a jaxpr or
    # result types fixed for the traced dtypes.
    "bitcast_convert_type", "reduce", "reduce_window", "select_and_scatter",
    "select_and_scatter_add", "rng_bit_generator", "rng_uniform",
    "custom_linear_solve", "pure_callback", "io_callback", "ffi_call",
    # scatter carries an update jaxpr typed for the traced dtype (torch lists
    # scatter_add and index_put under "promote"; here they run as traced).
    "scatter", "scatter-add", "scatter_add", "scatter-sub", "scatter_sub",
    "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
    "scatter_max",
)

# fmt: on

RULES: Mapping[str, str] = types.MappingProxyType(
    {
        **{name: PROMOTE for name in _PROMOTE},
        **{name: KEEP for name in _KEEP},
        **{name: AS_TRACED for name in _AS_TRACED},
        **{name: FLOAT32 for name in _FLOAT32},
        **{name: LOWER for name in _LOWER_PRECISION},
    }
)
"""Primitive name -> rule. Primitives not in the table run as traced and are
reported as unknown by :func:`autocast_report`."""

_INTEGER_POW_MAX_LOW = 2  # x**0, x**1, x**2 promote; larger or negative: float32

# float64 is never cast (as in torch); these are the dtypes autocast may change.
ELIGIBLE = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))
FLOAT32_DTYPE = np.dtype(jnp.float32)


# Promote-rule arithmetic that rounds. When its result feeds a float32-rule
# primitive (x - max(x) feeding exp in softmax), it runs in float32.
ARITHMETIC = frozenset({"add", "add_any", "sub", "mul", "square", "integer_pow"})


def rule_of(eqn: Any) -> str | None:
    """The rule of ``eqn``'s primitive, or ``None`` for a primitive the table does not know.

    ``integer_pow`` depends on its exponent: ``x**0``, ``x**1`` and ``x**2``
    promote, larger or negative exponents run in float32.
    """
    name = eqn.primitive.name
    if name == "integer_pow":
        y = eqn.params["y"]
        return PROMOTE if 0 <= y <= _INTEGER_POW_MAX_LOW else FLOAT32
    return RULES.get(name)
