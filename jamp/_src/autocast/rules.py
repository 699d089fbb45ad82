"""The rule table of ``jamp.autocast``: which dtype each primitive runs in.

``autocast(fun)`` traces ``fun`` to a jaxpr and evaluates that jaxpr with an
interpreter that decides, primitive by primitive, in which dtype it runs. The
decision comes from one table, ``RULES``, the JAX analogue of
torch.autocast's op lists, and, for ``promote``, from what each input is
(``category``, ``runs_low``):

================  ==========================================================
rule              what happens to the floating inputs of the primitive
================  ==========================================================
``lower``         cast to the low-precision ``dtype`` (float16/bfloat16); the
                  output stays in that dtype (``preferred_element_type`` too,
                  unless the program asked for one wider than the traced
                  inputs, e.g. ``bf16 x bf16 -> f32``). Matrix products and
                  convolutions. Their outputs are *low activations*.
``float32``       cast to float32 (float64 is left alone); the output is
                  float32. exp, log, pow, rsqrt, sums, window sums,
                  cumulative sums, divisions (not by a constant or a
                  parameter: that is a scale, ``promote``), ... so softmax,
                  log-softmax, logsumexp, norm statistics, variance, pooling
                  and losses compute in float32; also FFTs, linear algebra,
                  ``complex`` and ``conj``, which accept only float32/float64.
``promote``       every elementwise or structural primitive on no other list.
                  It runs in the low dtype when a low activation is among its
                  inputs and neither a float32 *statistic* (a reduction of low
                  activations: a norm's mean or variance) nor a *full-size*
                  float32 value that does not come from low activations (a
                  residual stream, an input batch) is: broadcast parameters
                  (a bias, a scale, a gate), constants and float32 values
                  computed from low activations follow the activation down,
                  as torch casts a Linear's bias with its matmul. Where a
                  float32 value computed from low activations meets a
                  broadcast parameter (the scale and bias that end a norm of
                  low activations) it runs in float32, as Flax's norms do,
                  and its result is a low activation held in float32 that the
                  next primitive reads in the low dtype (``norm_affine``). A
                  sigmoid or tanh feeding a float32 primitive other than a sum
                  (``log(1 - p)``) runs in float32. Otherwise it runs in the widest
                  floating input dtype, literals following the others as in
                  ``jnp``. An ``add``/``sub``/``mul``/``square`` whose result
                  feeds a ``float32`` primitive runs in float32 (so ``x -
                  max(x)`` in softmax is computed as in float32); of half
                  activations and parameters only (a matmul's output plus its
                  bias into a norm's statistics), it runs in the low dtype and
                  its float32 consumers compute it in float32 from those
                  (below). The logits of a float32 sigmoid (``log(sigmoid(z))``)
                  are float32: their matmul accumulates into float32, their
                  bias is added in float32 (``sigmoid_logits``).
``keep``          left as they arrive (data movement with independent inputs,
                  ``checkpoint_name``, debug printing).
``as traced``     cast back to the dtypes they had when ``fun`` was traced
                  (float32 for a float32 model): primitives whose meaning
                  depends on the dtype, e.g. ``bitcast_convert_type``, and
                  every primitive the table does not know.
================  ==========================================================

So activation functions, dropout and data movement run in their input's
dtype; a float32 residual stream stays float32 (``x + attention(x)``), and
norms of it compute and return float32, which the next matmul casts down.

Integer, boolean, complex and key inputs are never touched. A constant (a
value known when ``fun`` is traced; small computations on constants are done
then, so ``jnp.sqrt(d)`` is one) is narrowed only if every value fits the low
dtype (``fits``: no overflow, no flush below its smallest normal);
otherwise the primitive runs in the wider dtype, so no constant silently
changes a value. The one exception is the mask fill: a select, max, min or
clamp against ``+-finfo(float32).max`` saturates it to the low dtype's finite
extreme, so a ``jnp.finfo(jnp.float32).min`` fill stays finite. Values that
depend on the arguments are cast as they are, so their overflow reaches loss
scaling. Sub-computations (``jit``, ``closed_call``, ``custom_jvp_call``,
``custom_vjp_call``, ``scan``, ``while``, ``cond``, ``remat``) are
interpreted recursively with the same rules; loop carries and the outputs of
``cond`` keep the dtypes they were traced with, so every branch and iteration
agrees. ``convert_element_type`` written by the user (``x.astype(...)``) is
honoured; a no-op conversion in the traced program stays a no-op.

A half value that goes up to float32 (a float32 consumer, a float32 loop
carry) is not rounded where autocast can compute it in float32 instead, from
the half values it was computed from (``autocast.values.Lift``): a sigmoid or
tanh from its half input, a product of such gates from theirs. A GRU's update
gate ``z`` (spacing ``2**-8`` near 1 in bfloat16) meets its float32 carry in
``z * h`` so, and an LSTM's ``f * c + i * g`` and ``o * tanh(c)``; a carry is
state, kept float32 between iterations. The backward pass recomputes these
from the half inputs it keeps, so what it saves does not grow. A sum's float32
computation (a bias added to a matmul's output) is used inside another one or
by a float32 sigmoid only: on its own it would re-read the matmul's output at
each float32 consumer to save one rounding.

``jamp.autocast(fun, "float8")`` adds one rule in front of the table:

================  ==========================================================
``float8``        ``dot_general`` of float16, bfloat16 or float32 operands
                  (``FLOAT8_PRIMITIVES``): operands quantised to
                  ``float8_e4m3fn`` with a per-tensor scale, accumulated in
                  float32, the output rescaled and cast to the autocast
                  dtype (bfloat16, or the policy's float16), so the rest of
                  the program runs as under ``autocast(fun, bfloat16)``; the
                  gradient of the output is quantised to ``float8_e5m2``
                  (``jamp/_src/float8/``, ``autocast.float8.py``).
                  Convolutions and ``ragged_dot_general`` stay ``lower``.
================  ==========================================================

Regions that must not be autocast are marked with ``autocast(fun, enabled=False)``
(a ``jax.named_scope`` the interpreter recognises); inside them every
primitive runs as traced. An inner ``autocast`` inside an outer one marks its
region the same way, so the innermost setting wins, as with nested
``torch.autocast``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.typing import ArrayLike, DTypeLike

from jamp._src.dtypes import FLOAT32 as FLOAT32_DTYPE
from jamp._src.types import is_tracer

LOWER = "lower"
FLOAT8 = "float8"  # float8 mode only: see FLOAT8_PRIMITIVES
FLOAT32 = "float32"
PROMOTE = "promote"
KEEP = "keep"
AS_TRACED = "as traced"

# ---------------------------------------------------------------------------
# The table: primitive names grouped by rule, each group with the torch ops it
# mirrors. Sub-computations are handled structurally (see
# autocast.higher_order.HIGHER_ORDER); they are not in the table.
# ---------------------------------------------------------------------------

# fmt: off
_LOWER_PRECISION = (
    # torch: matmul, mm, bmm, baddbmm, addmm, addbmm, linear, einsum, conv*,
    # scaled_dot_product_attention, ... all lower to these two in JAX.
    "dot_general",
    "conv_general_dilated",
    "ragged_dot_general",
)

# float8 mode: these run with float8 operands (autocast.float8). XLA has no float8
# convolution jamp can rely on, so conv_general_dilated stays in the autocast dtype.
FLOAT8_PRIMITIVES = frozenset({"dot_general"})

_FLOAT32 = (
    # torch: exp, expm1, log, log1p, log2, log10, pow, reciprocal, rsqrt, ...
    "exp", "exp2", "log", "log1p", "expm1", "pow", "sqrt", "rsqrt", "cbrt", "reciprocal",
    # torch: acos, asin, cosh, sinh, tan (and the inverse hyperbolics).
    "tan", "acos", "asin", "cosh", "sinh", "acosh", "asinh", "atanh",
    # torch: erfinv; special functions (softplus is exp and log1p).
    "erf_inv", "lgamma", "digamma", "polygamma",
    "igamma", "igammac", "igamma_grad_a", "random_gamma_grad", "zeta",
    "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta",
    # torch: sum, prod, cumsum, cumprod, logsumexp (dtype= overloads) ... and
    # avg_pool's window sums (torch accumulates those in float32 too).
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "reduce_window_sum",
    # ... and the divisions of softmax, layer_norm, group_norm, mean, mse_loss
    # (a division by a constant or a parameter is a scale: see div_rule).
    "div",
    # integer_pow: float32 for exponents < 0 or > 2, promote for 0, 1, 2 (see rule_of).
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
    "square", "sin", "cos", "atan", "atan2", "floor", "ceil", "round",
    # Activation functions run in their input's dtype (torch: sigmoid, tanh,
    # gelu, silu are on no list); their outputs are bounded.
    "tanh", "logistic", "erf", "erfc",
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
    # jax 0.12's "hijax" primitives (jnp.searchsorted, ldexp, frexp, nonzero): a
    # HiPrim whose parameters hold the avals it was traced for.
    "call_hi_primitive",
    # scatter carries an update jaxpr typed for the traced dtype (torch lists
    # scatter_add and index_put under "promote"; here they run as traced, except a
    # scatter-add of half updates: in float32, its result low (autocast.sums)).
    "scatter", "scatter-add", "scatter_add", "scatter-sub", "scatter_sub",
    "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
    "scatter_max",
)

# The unary elementwise float32-rule primitives: from a half-precision input
# they are recomputed in the backward pass (autocast.residuals.recomputed).
RECOMPUTED = frozenset(
    {
        "exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt", "cbrt", "reciprocal",
        "tan", "acos", "asin", "cosh", "sinh", "acosh", "asinh", "atanh",
        "erf_inv", "lgamma", "digamma", "bessel_i0e", "bessel_i1e", "integer_pow",
    }
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
reported as unknown by [`autocast_report`][jamp.debug.autocast_report]."""

_INTEGER_POW_MAX_LOW = 2  # x**0, x**1, x**2 promote (rule_of)

# Promote-rule arithmetic that rounds. When its result feeds a float32-rule
# primitive (x - max(x) feeding exp in softmax), it runs in float32.
ARITHMETIC = frozenset({"add", "add_any", "sub", "mul", "square", "integer_pow"})

# Bounded activations: rounded to the half dtype they reach 0 or 1 exactly. Feeding a
# float32 primitive, directly or through ARITHMETIC (log(1 - sigmoid(z))), they run in
# float32 from their half input (recomputed in the backward pass, like exp).
BOUNDED = frozenset({"logistic", "tanh", "erf", "erfc"})


def widest(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The widest of some floating dtypes; float16 with bfloat16 is float32."""
    distinct = list(dict.fromkeys(np.dtype(d) for d in dtypes))
    if len(distinct) == 1:
        return distinct[0]
    size = max(d.itemsize for d in distinct)
    top = [d for d in distinct if d.itemsize == size]
    if len(top) == 1:
        return top[0]
    return FLOAT32_DTYPE if size < 4 else np.dtype(jnp.float64)


def narrows(src: DTypeLike, dst: DTypeLike) -> bool:
    """Whether casting floating ``src`` to ``dst`` can overflow to inf."""
    floats = jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)
    return bool(floats) and bool(jnp.finfo(dst).max < jnp.finfo(src).max)


def saturated(
    x: jax.Array | np.ndarray | np.number | np.bool_, dtype: DTypeLike
) -> jax.Array | np.ndarray | np.number | np.bool_:
    """``x`` with its finite values clipped to ``dtype``'s finite range.

    Infinities and NaN are kept. A concrete value (a literal, a constant
    array) is checked and clipped at trace time, and returned as it is when
    nothing needs clipping; a traced one gets a clamp that XLA folds.
    """
    big: np.ndarray = np.asarray(jnp.finfo(dtype).max, dtype=x.dtype)  # exact in the wider dtype
    if not is_tracer(x):
        a = np.asarray(x)
        over = np.isfinite(a) & (np.abs(a) > big)
        if not over.any():
            return x
        return np.where(over, np.sign(a) * big, a).astype(a.dtype)
    return lax.select(lax.is_finite(x), lax.clamp(-big, x, big), x)


def rule_of(eqn: jex_core.JaxprEqn) -> str | None:
    """The rule of ``eqn``'s primitive, or ``None`` for a primitive the table does not know.

    ``integer_pow`` depends on its exponent: ``x**0``, ``x**1`` and ``x**2``
    promote; larger or negative exponents run in float32. That includes
    ``x**3`` of gelu's tanh approximation, under both half dtypes: its
    derivative ``3 x**2`` overflows float16 from ``|x| = 148`` (and ``0 * inf``
    would make the gradient NaN), and computed from the half input in float32
    and recomputed in the backward pass (``autocast.residuals``) it keeps
    nothing but that input, which gelu keeps anyway. ``div`` is ``float32``
    here; dividing by a constant or a parameter promotes (``div_rule``).
    """
    name = eqn.primitive.name
    if name == "integer_pow":
        return PROMOTE if 0 <= eqn.params["y"] <= _INTEGER_POW_MAX_LOW else FLOAT32
    return RULES.get(name)


# ---------------------------------------------------------------------------
# The dtype flow of ``promote``: what a floating input of an elementwise or
# structural primitive is, and the dtype the primitive runs in.
# ---------------------------------------------------------------------------

LOW_ACTIVATION = "low activation"  # in the low dtype, computed by autocast from activations
DERIVED = "derived"  # float32, computed by float32 primitives from low activations only
STATISTIC = "statistic"  # a reduction of low activations: a mean, a variance, a max
PARAMETER = "parameter"  # not derived from low activations, broadcast: bias, scale, gate
FULL = "full"  # not derived from low activations, full size: a float32 residual stream
CONSTANT = "constant"  # known when fun is traced: literals and constant arrays


def category(
    *, constant: bool, low: bool, statistic: bool, broadcast: bool, in_low_dtype: bool
) -> str:
    """The category of one floating input of a ``promote`` primitive.

    ``low``: derived from low-precision activations only (parameters and
    constants do not count); ``statistic``: and reduced (a mean, a variance,
    a max, a softmax normaliser, and what is computed from those alone);
    ``broadcast``: fewer elements before broadcasting than the largest input;
    ``in_low_dtype``: a low activation (its dtype is autocast's low dtype, or
    it is held in float32 for float32 consumers).
    """
    if constant:
        return CONSTANT
    if low:
        if statistic:
            return STATISTIC
        return LOW_ACTIVATION if in_low_dtype else DERIVED
    return PARAMETER if broadcast else FULL


# Reductions: what they compute from low activations is a statistic.
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod"})


def runs_low(categories: Sequence[str]) -> bool:
    """Whether a ``promote`` primitive runs in the low dtype (else: the widest input dtype).

    Never when a float32 statistic (a norm's mean or variance) or a full-size
    value that does not come from low activations (a float32 residual
    stream) is among its inputs. Otherwise it does when a low activation is
    among them: parameters, constants and float32 values derived from low
    activations (``x**3`` inside ``gelu``) follow it down, as torch casts a
    Linear's bias with its matmul. And it does when a float32 value derived
    from low activations meets a broadcast parameter: the affine transform
    that ends a norm (``* scale + bias``), so a norm of low activations
    returns them to the low dtype.
    """
    kinds = set(categories)
    if kinds & {STATISTIC, FULL}:
        return False
    return LOW_ACTIVATION in kinds or {DERIVED, PARAMETER} <= kinds


AFFINE = frozenset({"add", "sub", "mul"})


def norm_affine(categories: Sequence[str], dtypes: Sequence[DTypeLike], low: DTypeLike) -> bool:
    """Whether a ``promote`` primitive that runs low is a norm's scale or bias: float32
    derived from low activations (or a low activation held in float32) meeting a broadcast
    parameter, with no low activation in the low dtype."""
    kinds = set(categories)
    if PARAMETER not in kinds or not kinds <= {DERIVED, PARAMETER, CONSTANT, LOW_ACTIVATION}:
        return False
    if not kinds & {DERIVED, LOW_ACTIVATION}:
        return False
    return all(
        np.dtype(d) != np.dtype(low)
        for c, d in zip(categories, dtypes, strict=True)
        if c == LOW_ACTIVATION
    )


def div_rule(divisor: str) -> str:
    """``x / c`` by a constant or a parameter is a scale (dropout's ``x / keep``,
    attention's ``q / sqrt(d)``): it promotes. Any other division (softmax's,
    a norm's, a mean's) runs in float32."""
    return PROMOTE if divisor in (CONSTANT, PARAMETER) else FLOAT32


def output_is_low(categories: Sequence[str]) -> bool:
    """Whether an output is derived from low activations only (see ``category``)."""
    kinds = set(categories)
    return bool(kinds & {LOW_ACTIVATION, DERIVED, STATISTIC}) and FULL not in kinds


# Primitives that move values without computing new ones: their output's
# broadcast size is their input's, and a constant keeps its span of values.
STRUCTURAL = frozenset(
    {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "copy", "copy_p",
     "convert_element_type", "sharding_constraint", "rev"}
)  # fmt: skip
SPAN_PRESERVING = STRUCTURAL | frozenset(
    {"slice", "dynamic_slice", "gather", "concatenate", "pad", "select_n", "neg", "abs",
     "max", "min", "reduce_max", "reduce_min", "stop_gradient", "clamp"}
)  # fmt: skip
# The mask-fill idiom: a select (jnp.where) or a max/min against a constant
# holding +-finfo(float32).max; narrowed, the fill saturates to the low
# dtype's finite extreme instead of running the primitive in float32.
MASK_FILL = frozenset({"select_n", "max", "min", "clamp"})
_F32_MAX = float(np.finfo(np.float32).max)


class Span(NamedTuple):
    """The finite magnitudes of a constant: what decides whether it fits a dtype."""

    big: float  # the largest finite magnitude, +-finfo(float32).max excepted (0 if none)
    small: float  # the smallest nonzero finite magnitude (inf if none)
    fill: bool  # whether +-finfo(float32).max occurs: the mask-fill idiom


def span_of(value: ArrayLike) -> Span:
    a = np.abs(np.asarray(value).astype(np.float64)).ravel()
    a = a[np.isfinite(a)]
    fill = a == _F32_MAX
    rest = a[~fill]
    nonzero = rest[rest > 0]
    return Span(
        big=float(rest.max()) if rest.size else 0.0,
        small=float(nonzero.min()) if nonzero.size else float("inf"),
        fill=bool(fill.any()),
    )


def merge_spans(spans: Sequence[Span]) -> Span:
    return Span(
        big=max(s.big for s in spans),
        small=min(s.small for s in spans),
        fill=any(s.fill for s in spans),
    )


def fits(span: Span | None, dtype: DTypeLike, *, mask_fill: bool = False) -> bool:
    """Whether a constant with ``span`` keeps its value, to rounding, in ``dtype``.

    A value that would overflow to inf or flush below ``dtype``'s smallest
    normal number does not fit; an unknown span (``None``) does not either.
    With ``mask_fill``, +-finfo(float32).max is allowed: it saturates.
    """
    if span is None:
        return False
    info = jnp.finfo(dtype)
    return (
        span.big <= float(info.max)
        and span.small >= float(info.smallest_normal)
        and (mask_fill or not span.fill)
    )
