"""Op-level mixed precision as a function transformation: ``jamp.autocast``.

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

import collections
import contextlib
import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jamp._src.policy import Policy, get_policy
from jamp._src.policy import _parse as _parse_dtype

try:  # Keeps user name scopes and tracebacks on the re-emitted equations.
    from jax._src import source_info_util as _source_info_util
except ImportError:  # pragma: no cover - depends on the jax version
    _source_info_util = None

__all__ = ["RULES", "AutocastReport", "autocast", "autocast_disabled", "autocast_report"]

LOWER = "lower"
FLOAT32 = "float32"
PROMOTE = "promote"
KEEP = "keep"
AS_TRACED = "as traced"

# ---------------------------------------------------------------------------
# The table: primitive names grouped by rule, each group with the torch ops it
# mirrors. Sub-computations are handled structurally (see
# _HIGHER_ORDER below); they are not in the table.
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
_ELIGIBLE = frozenset(np.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))
_FLOAT32_DTYPE = np.dtype(jnp.float32)
_DEFAULT = np.dtype(jnp.bfloat16)  # autocast's dtype when neither dtype nor policy is given

# The name scope that marks a region the interpreter evaluates as traced.
_SCOPE_DISABLED = "jamp_autocast_disabled"
_SCOPE_AUTOCAST = "jamp_autocast"
_MARKER = "jamp_autocast"  # a substring of both

# Where a value comes from (see _eval_jaxpr). Ordered: an output has the
# smallest kind of its inputs.
_TRACED = 0  # depends on the function's arguments: activations, parameters
_CONST = 1  # known when the function is traced: a concrete constant, or computed from those
_LITERAL = 2  # computed from literals only (Python scalars): also follows under promote

# Promote-rule arithmetic that rounds. When its result feeds a float32-rule
# primitive (x - max(x) feeding exp in softmax), it runs in float32.
_ARITHMETIC = frozenset({"add", "add_any", "sub", "mul", "square", "integer_pow"})


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AutocastReport:
    """Which primitives an autocast function ran, under which rule, in which dtype.

    Attributes:
      dtype: the low-precision dtype of the autocast.
      rows: ``(primitive, rule, dtype, count)`` tuples, sorted. ``dtype`` is
        the floating dtype the primitive computed in (its widest floating
        input after casting, else its first output's dtype).
      unknown: the primitives the table does not know; they ran as traced.
    """

    dtype: np.dtype
    rows: tuple[tuple[str, str, str, int], ...]
    unknown: tuple[str, ...]

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """``{primitive: {dtype: count}}``."""
        out: dict[str, dict[str, int]] = {}
        for prim, _, dtype, count in self.rows:
            out.setdefault(prim, {})
            out[prim][dtype] = out[prim].get(dtype, 0) + count
        return out

    def __str__(self) -> str:
        header = ("primitive", "rule", "dtype", "count")
        body = [(p, r, d, str(c)) for p, r, d, c in self.rows]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(4)]

        def line(row: Sequence[str]) -> str:
            return "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()

        lines = [f"autocast report (low precision: {np.dtype(self.dtype).name})", line(header)]
        lines.append(line(["-" * w for w in widths]))
        lines.extend(line(row) for row in body)
        if self.unknown:
            lines.append(
                "unknown primitives (ran as traced, float32 for a float32 program): "
                + ", ".join(self.unknown)
            )
        return "\n".join(lines)


class _Recorder:
    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.unknown: set[str] = set()

    def add(self, prim: str, rule: str, dtype: str) -> None:
        self.counts[(prim, rule, dtype)] += 1


@dataclasses.dataclass(frozen=True)
class _Context:
    dtype: np.dtype
    recorder: _Recorder | None
    as_traced: bool = False


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _is_inexact(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _cast(x: Any, dtype: Any) -> Any:
    return x if x.dtype == dtype else lax.convert_element_type(x, dtype)


def _narrows(src: Any, dst: Any) -> bool:
    """Whether casting floating ``src`` to ``dst`` can overflow to inf."""
    return _is_float(src) and _is_float(dst) and jnp.finfo(dst).max < jnp.finfo(src).max


def _saturate(x: Any, dtype: Any) -> Any:
    """``x`` with its finite values clipped to ``dtype``'s finite range.

    Infinities and NaN are kept. A concrete value (a literal, a constant
    array) is checked and clipped at trace time, and returned as it is when
    nothing needs clipping; a traced one gets a clamp that XLA folds.
    """
    big = np.asarray(jnp.finfo(dtype).max, dtype=x.dtype)  # exact in the wider dtype
    if not isinstance(x, jax.core.Tracer):
        a = np.asarray(x)
        over = np.isfinite(a) & (np.abs(a) > big)
        if not over.any():
            return x
        return np.where(over, np.sign(a) * big, a).astype(a.dtype)
    return lax.select(lax.is_finite(x), lax.clamp(-big, x, big), x)


def _cast_input(x: Any, dtype: Any, kind: int) -> Any:
    """The cast autocast inserts before a primitive.

    A constant (``kind`` at least ``_CONST``) cast to a narrower dtype is
    saturated first, so a finite fill such as ``jnp.finfo(jnp.float32).min``
    stays finite (the most negative bfloat16/float16) instead of becoming
    -inf; values that depend on the function's arguments are cast as they
    are, so their overflow still reaches loss scaling.
    """
    if x.dtype == dtype:
        return x
    if kind >= _CONST and _narrows(x.dtype, dtype):
        x = _saturate(x, dtype)
    return lax.convert_element_type(x, dtype)


def _strong_cast(x: Any, dtype: Any) -> Any:
    """A cast that also drops weak typing (loop carries must type-check)."""
    return lax.convert_element_type(x, dtype)


def _widest(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The widest of some floating dtypes; float16 with bfloat16 is float32."""
    distinct = list(dict.fromkeys(np.dtype(d) for d in dtypes))
    if len(distinct) == 1:
        return distinct[0]
    size = max(d.itemsize for d in distinct)
    top = [d for d in distinct if d.itemsize == size]
    if len(top) == 1:
        return top[0]
    return _FLOAT32_DTYPE if size < 4 else np.dtype(jnp.float64)


def _source(eqn: Any) -> contextlib.AbstractContextManager:
    stack = contextlib.ExitStack()
    if _source_info_util is not None:
        name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
        stack.enter_context(
            _source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
        )
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is not None:
        stack.enter_context(manager)
    return stack


def _bind(eqn: Any, vals: Sequence[Any], params: Mapping[str, Any] | None = None) -> list:
    """Binds ``eqn``'s primitive on ``vals`` (as ``jax.core.eval_jaxpr`` does)."""
    bind_params = eqn.primitive.get_bind_params(dict(eqn.params if params is None else params))
    subfuns: Sequence[Any] = ()
    if isinstance(bind_params, tuple):  # older jax: (subfuns, params)
        subfuns, bind_params = bind_params
    with _source(eqn):
        out = eqn.primitive.bind(*subfuns, *vals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _sds(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _float0_zeros(aval: Any) -> np.ndarray:
    return np.zeros(aval.shape, dtype=jax.dtypes.float0)


def _ran_in(vals: Sequence[Any], outs: Sequence[Any]) -> str:
    floats = [np.dtype(x.dtype) for x in vals if _is_float(x.dtype)]
    if floats:
        return _widest(floats).name
    for x in outs:
        return str(x.dtype)
    return "-"


def _record(ctx: _Context, eqn: Any, rule: str, vals: Sequence[Any], outs: Sequence[Any]) -> None:
    if ctx.recorder is not None:
        ctx.recorder.add(eqn.primitive.name, rule, _ran_in(vals, outs))


# ---------------------------------------------------------------------------
# The interpreter
# ---------------------------------------------------------------------------


def _eval_jaxpr(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], kinds: Sequence[int], ctx: _Context
) -> tuple[list, list]:
    """Evaluates ``jaxpr`` with the rules; returns outputs and their kinds.

    Every value carries a *kind* (``_TRACED``, ``_CONST`` or ``_LITERAL``):
    whether it depends on the function's arguments, is known when the
    function is traced, or comes from literals only (Python scalars baked into
    the jaxpr). Under ``promote`` a literal value follows the other inputs
    instead of widening them, as a Python scalar does in ``jnp``; a constant
    is saturated when autocast narrows it (see :func:`_cast_input`).
    """
    env: dict[Any, tuple[Any, int]] = {}

    def read(v: Any) -> tuple[Any, int]:
        if isinstance(v, jex_core.Literal):
            val = v.val
            if not hasattr(val, "dtype"):
                val = np.asarray(val, dtype=v.aval.dtype)
            return val, _LITERAL
        return env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = (x, _TRACED if isinstance(x, jax.core.Tracer) else _CONST)
    for v, x, k in zip(jaxpr.invars, args, kinds, strict=True):
        env[v] = (x, int(k))
    to_float32 = _float32_operands(jaxpr)
    for eqn in jaxpr.eqns:
        read_in = [read(v) for v in eqn.invars]
        invals = [x for x, _ in read_in]
        inkinds = [k for _, k in read_in]
        sub = ctx
        if not ctx.as_traced and _MARKER in str(eqn.source_info.name_stack):
            sub = dataclasses.replace(ctx, as_traced=True)
        feeds_float32 = any(v in to_float32 for v in eqn.outvars)
        outs, outkinds = _eval_eqn(eqn, invals, inkinds, sub, feeds_float32)
        for v, x, k in zip(eqn.outvars, outs, outkinds, strict=True):
            env[v] = (x, k)
    outs = [read(v) for v in jaxpr.outvars]
    return [x for x, _ in outs], [k for _, k in outs]


def _eval_closed(
    closed: Any, args: Sequence[Any], kinds: Sequence[int], ctx: _Context
) -> tuple[list, list]:
    if isinstance(closed, jex_core.ClosedJaxpr):
        return _eval_jaxpr(closed.jaxpr, closed.consts, args, kinds, ctx)
    return _eval_jaxpr(closed, (), args, kinds, ctx)


def _rule_of(eqn: Any) -> str | None:
    name = eqn.primitive.name
    if name == "integer_pow":
        return _integer_pow_rule(eqn)
    return RULES.get(name)


def _float32_operands(jaxpr: Any) -> set:
    """The variables of ``jaxpr`` that some float32-rule primitive consumes."""
    found = set()
    for eqn in jaxpr.eqns:
        if _rule_of(eqn) == FLOAT32:
            found.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    return found


def _const_kind(kinds: Sequence[int]) -> int:
    """The kind of an output computed from inputs of ``kinds``, never literal."""
    return _CONST if all(k >= _CONST for k in kinds) else _TRACED


def _as_traced(
    eqn: Any, invals: Sequence[Any], kinds: Sequence[int], ctx: _Context, rule: str
) -> tuple[list, list]:
    vals = [
        _cast(x, v.aval.dtype) if _is_float(x.dtype) and _is_float(v.aval.dtype) else x
        for x, v in zip(invals, eqn.invars, strict=True)
    ]
    outs = _bind(eqn, vals)
    _record(ctx, eqn, rule, vals, outs)
    return outs, [_const_kind(kinds)] * len(outs)


def _integer_pow_rule(eqn: Any) -> str:
    y = eqn.params["y"]
    return PROMOTE if 0 <= y <= _INTEGER_POW_MAX_LOW else FLOAT32


def _lower_params(eqn: Any, float_in: Sequence[int], ctx: _Context) -> Mapping[str, Any]:
    """``preferred_element_type`` in ``dtype``, unless the program asked for a wider one.

    A ``preferred_element_type`` wider than the dot's traced floating inputs
    (``bf16 x bf16 -> f32``, as ``jax.nn.dot_product_attention`` writes its
    logits) was chosen on purpose and is kept; one equal to the inputs'
    dtype (what ``jnp.matmul`` fills in) follows the inputs to ``dtype``.
    """
    params = eqn.params
    pet = params.get("preferred_element_type")
    if pet is None or not _is_float(pet):
        return params
    traced = max(np.dtype(eqn.invars[i].aval.dtype).itemsize for i in float_in)
    if np.dtype(pet).itemsize > traced:
        return params
    return {**params, "preferred_element_type": ctx.dtype}


def _eval_eqn(
    eqn: Any, invals: list, kinds: list, ctx: _Context, feeds_float32: bool = False
) -> tuple[list, list]:
    name = eqn.primitive.name
    if ctx.as_traced:
        return _as_traced(eqn, invals, kinds, ctx, "disabled")
    handler = _HIGHER_ORDER.get(name)
    if handler is not None:
        if ctx.recorder is not None:
            ctx.recorder.add(name, "recurse", "-")
        return handler(eqn, invals, kinds, ctx)
    if name == "convert_element_type":
        return _convert_element_type(eqn, invals, kinds, ctx)
    rule = _rule_of(eqn)
    if rule is None:
        if ctx.recorder is not None:
            ctx.recorder.unknown.add(name)
        return _as_traced(eqn, invals, kinds, ctx, "unknown")
    if rule == AS_TRACED:
        return _as_traced(eqn, invals, kinds, ctx, rule)

    float_in = [i for i, x in enumerate(invals) if _is_float(x.dtype)]
    params = eqn.params
    vals = list(invals)
    if rule == LOWER and float_in and all(np.dtype(invals[i].dtype) in _ELIGIBLE for i in float_in):
        for i in float_in:
            vals[i] = _cast_input(vals[i], ctx.dtype, kinds[i])
        params = _lower_params(eqn, float_in, ctx)
    elif rule == FLOAT32:
        for i in float_in:
            if np.dtype(vals[i].dtype) in _ELIGIBLE:
                vals[i] = _cast(vals[i], _FLOAT32_DTYPE)
    elif rule in (PROMOTE, LOWER) and float_in:  # LOWER with float64: promote
        strong = [i for i in float_in if kinds[i] != _LITERAL] or float_in
        target = _widest([invals[i].dtype for i in strong])
        if feeds_float32 and name in _ARITHMETIC:
            # The operand of exp/log/sum/div...: computed in float32 from its
            # half-precision inputs, as torch upcasts softmax's input before
            # subtracting the max (see the module docstring).
            target = _widest([target, _FLOAT32_DTYPE])
        for i in float_in:
            vals[i] = _cast_input(vals[i], target, kinds[i])
    outs = _bind(eqn, vals, params)
    _record(ctx, eqn, rule, vals, outs)
    kind = min(kinds) if kinds else _CONST
    return outs, [kind] * len(outs)


def _convert_element_type(eqn: Any, invals: list, kinds: list, ctx: _Context):
    (x,) = invals
    new_dtype = eqn.params["new_dtype"]
    if eqn.invars[0].aval.dtype == new_dtype and _is_float(new_dtype):
        # A no-op in the traced program (at most a weak-type change): keep the
        # autocast dtype instead of undoing it.
        _record(ctx, eqn, "no-op cast", [x], [x])
        return [x], [kinds[0]]
    outs = _bind(eqn, [x])  # the user's own cast: honoured
    _record(ctx, eqn, "cast", outs, outs)
    return outs, [kinds[0]]


# ---------------------------------------------------------------------------
# Sub-computations
# ---------------------------------------------------------------------------


def _call(eqn: Any, invals: list, kinds: list, ctx: _Context):
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return _eval_closed(closed, invals, kinds, ctx)


def _remat(eqn: Any, invals: list, kinds: list, ctx: _Context):
    params = eqn.params

    def body(*xs: Any) -> list:
        return _eval_closed(params["jaxpr"], xs, kinds, ctx)[0]

    fn = jax.checkpoint(
        body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
    )
    outs = fn(*invals)
    return list(outs), [_TRACED] * len(outs)


def _scan(eqn: Any, invals: list, kinds: list, ctx: _Context):
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts = invals[:n_consts]
    carry_dtypes = [v.aval.dtype for v in eqn.invars[n_consts : n_consts + n_carry]]
    init = [
        _strong_cast(x, d)
        for x, d in zip(invals[n_consts : n_consts + n_carry], carry_dtypes, strict=True)
    ]
    xs = invals[n_consts + n_carry :]
    body_kinds = [*kinds[:n_consts], *([_TRACED] * n_carry), *kinds[n_consts + n_carry :]]

    def body(carry: list, x: list) -> tuple[list, list]:
        outs, _ = _eval_closed(p["jaxpr"], [*consts, *carry, *x], body_kinds, ctx)
        new_carry = [_strong_cast(o, d) for o, d in zip(outs[:n_carry], carry_dtypes, strict=True)]
        return new_carry, outs[n_carry:]

    carry, ys = lax.scan(
        body, init, xs, length=p["length"], reverse=p["reverse"], unroll=p.get("unroll", 1)
    )
    outs = [*carry, *ys]
    return outs, [_TRACED] * len(outs)


def _while(eqn: Any, invals: list, kinds: list, ctx: _Context):
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:nc], invals[nc : nc + nb]
    carry_dtypes = [v.aval.dtype for v in eqn.invars[nc + nb :]]
    init = [_strong_cast(x, d) for x, d in zip(invals[nc + nb :], carry_dtypes, strict=True)]
    n_carry = len(init)
    cond_kinds = [*kinds[:nc], *([_TRACED] * n_carry)]
    body_kinds = [*kinds[nc : nc + nb], *([_TRACED] * n_carry)]

    def cond_fun(carry: list) -> Any:
        return _eval_closed(p["cond_jaxpr"], [*cond_consts, *carry], cond_kinds, ctx)[0][0]

    def body_fun(carry: list) -> list:
        outs, _ = _eval_closed(p["body_jaxpr"], [*body_consts, *carry], body_kinds, ctx)
        return [_strong_cast(o, d) for o, d in zip(outs, carry_dtypes, strict=True)]

    outs = lax.while_loop(cond_fun, body_fun, init)
    return list(outs), [_TRACED] * len(outs)


def _cond(eqn: Any, invals: list, kinds: list, ctx: _Context):
    index, ops = invals[0], invals[1:]
    out_dtypes = [v.aval.dtype for v in eqn.outvars]

    def branch(closed: Any, *xs: Any) -> list:
        outs, _ = _eval_closed(closed, xs, kinds[1:], ctx)
        return [_strong_cast(o, d) for o, d in zip(outs, out_dtypes, strict=True)]

    fns = [functools.partial(branch, b) for b in eqn.params["branches"]]
    outs = lax.switch(index, fns, *ops)
    return list(outs), [_TRACED] * len(outs)


def _custom_primal(eqn: Any, invals: list, kinds: list, ctx: _Context):
    """The body under the rules, as a closed jaxpr, plus its output dtypes."""

    def primal(*xs: Any) -> list:
        return _eval_closed(eqn.params["call_jaxpr"], xs, kinds, ctx)[0]

    traced = jax.make_jaxpr(primal)(*invals)
    body = jex_core.jaxpr_as_fun(traced)
    return (lambda *xs: tuple(body(*xs))), [a.dtype for a in traced.out_avals]


def _custom_jvp(eqn: Any, invals: list, kinds: list, ctx: _Context):
    """custom_jvp: the body and the jvp rule both evaluated with the rules.

    The primal runs the body under the rules. The jvp rule is JAX's jvp of the
    original call (so the user's rule is used), traced and then evaluated
    under the rules too; primal and tangent outputs are cast to the dtypes of
    the autocast primal so the two agree.
    """
    in_avals = [v.aval for v in eqn.invars]
    out_avals = [v.aval for v in eqn.outvars]
    diff_in = [i for i, a in enumerate(in_avals) if _is_inexact(a.dtype)]
    diff_out = [j for j, a in enumerate(out_avals) if _is_inexact(a.dtype)]
    n, m = len(in_avals), len(out_avals)
    primal, out_dtypes = _custom_primal(eqn, invals, kinds, ctx)
    fun = jax.custom_jvp(primal)

    def original_jvp(*args: Any) -> list:
        primals, diff_tangents = args[:n], iter(args[n:])
        tangents = [
            next(diff_tangents) if i in diff_in else _float0_zeros(a)
            for i, a in enumerate(in_avals)
        ]
        p_out, t_out = jax.jvp(lambda *xs: _bind(eqn, xs), tuple(primals), tuple(tangents))
        return [*p_out, *(t_out[j] for j in diff_out)]

    @fun.defjvp
    def fun_jvp(primals: tuple, tangents: tuple) -> tuple[tuple, tuple]:
        traced = jax.make_jaxpr(original_jvp)(
            *map(_sds, in_avals), *(_sds(in_avals[i]) for i in diff_in)
        )
        args = [*primals, *(tangents[i] for i in diff_in)]
        # A tangent is never a constant; a literal's (zero) tangent follows.
        tangent_kinds = [kinds[i] if kinds[i] == _LITERAL else _TRACED for i in diff_in]
        outs, _ = _eval_closed(traced, args, [*kinds, *tangent_kinds], ctx)
        p_out = tuple(_cast(x, d) for x, d in zip(outs[:m], out_dtypes, strict=True))
        t_iter = iter(outs[m:])
        t_out = tuple(
            _cast(next(t_iter), out_dtypes[j]) if j in diff_out else _float0_zeros(a)
            for j, a in enumerate(out_avals)
        )
        return p_out, t_out

    outs = fun(*invals)
    return list(outs), [_TRACED] * len(outs)


def _custom_vjp(eqn: Any, invals: list, kinds: list, ctx: _Context):
    """custom_vjp: body, forward and backward passes all evaluated with the rules.

    The forward pass is ``jax.vjp`` of the original call (so the user's ``fwd``
    and ``bwd`` are used), traced and evaluated under the rules; the residuals
    are cast back to their traced dtypes so the backward pass, traced and
    evaluated under the rules as well, type-checks. Cotangents come back in
    the dtypes of the inputs.
    """
    in_avals = [v.aval for v in eqn.invars]
    out_avals = [v.aval for v in eqn.outvars]
    diff_in = [i for i, a in enumerate(in_avals) if _is_inexact(a.dtype)]
    diff_out = [j for j, a in enumerate(out_avals) if _is_inexact(a.dtype)]
    in_dtypes = [x.dtype for x in invals]
    primal, out_dtypes = _custom_primal(eqn, invals, kinds, ctx)
    fun = jax.custom_vjp(primal)

    def original_vjp(*primals: Any) -> tuple:
        return jax.vjp(lambda *xs: _bind(eqn, xs), *primals)

    def fwd(*xs: Any) -> tuple[tuple, Any]:
        traced, shapes = jax.make_jaxpr(original_vjp, return_shape=True)(*map(_sds, in_avals))
        leaves, tree = jax.tree_util.tree_flatten(shapes)
        outs, _ = _eval_closed(traced, xs, kinds, ctx)
        outs = [_cast(x, s.dtype) for x, s in zip(outs, leaves, strict=True)]
        p_out, pullback = jax.tree_util.tree_unflatten(tree, outs)
        return tuple(_cast(x, d) for x, d in zip(p_out, out_dtypes, strict=True)), pullback

    def bwd(pullback: Any, cts: tuple) -> tuple:
        res, res_tree = jax.tree_util.tree_flatten(pullback)
        n_res = len(res)

        def original_bwd(*args: Any) -> list:
            residuals, diff_cts = args[:n_res], iter(args[n_res:])
            cts_full = [
                next(diff_cts) if j in diff_out else _float0_zeros(a)
                for j, a in enumerate(out_avals)
            ]
            in_cts = jax.tree_util.tree_unflatten(res_tree, residuals)(cts_full)
            return [in_cts[i] for i in diff_in]

        traced = jax.make_jaxpr(original_bwd)(
            *(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in res),
            *(_sds(out_avals[j]) for j in diff_out),
        )
        args = [*res, *(cts[j] for j in diff_out)]
        outs, _ = _eval_closed(traced, args, [_TRACED] * len(args), ctx)
        it = iter(outs)
        return tuple(
            _cast(next(it), in_dtypes[i]) if i in diff_in else _float0_zeros(a)
            for i, a in enumerate(in_avals)
        )

    fun.defvjp(fwd, bwd)
    outs = fun(*invals)
    return list(outs), [_TRACED] * len(outs)


_HIGHER_ORDER: dict[str, Callable[..., tuple[list, list]]] = {
    "pjit": _call,
    "jit": _call,
    "closed_call": _call,
    "core_call": _call,
    "remat": _remat,
    "remat2": _remat,
    "checkpoint": _remat,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "custom_vjp_call_jaxpr": _custom_vjp,
}


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _split_static(args: tuple, kwargs: dict) -> tuple[list, Callable[[Sequence[Any]], tuple]]:
    """Array leaves (traced) and a function rebuilding ``(args, kwargs)`` from them.

    Non-array leaves (Python numbers, booleans, strings, ...) stay static, so
    ``fun`` can branch on them as it would without autocast.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    mask = [_is_array(leaf) for leaf in leaves]

    def rebuild(dynamic: Sequence[Any]) -> tuple:
        it = iter(dynamic)
        full = [next(it) if is_dyn else leaf for leaf, is_dyn in zip(leaves, mask, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, full)

    return [leaf for leaf, is_dyn in zip(leaves, mask, strict=True) if is_dyn], rebuild


def _check_fun(fun: Any, name: str) -> None:
    if not callable(fun):
        raise TypeError(
            f"Expected a callable for `fun` of jamp.{name}, got {fun!r} "
            f"(type {type(fun).__name__}) instead."
        )


_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _low_dtype(value: Any, what: str) -> np.dtype:
    dtype = _parse_dtype(value, what)
    if dtype not in _HALF:
        raise ValueError(
            f"Expected float16 or bfloat16 for {what} of jamp.autocast (its low-precision "
            f"dtype), got {dtype.name} instead. To run a function as written, use "
            "enabled=False or call it directly."
        )
    return dtype


def _resolve(dtype: Any, policy: Any) -> tuple[np.dtype, Policy | None]:
    """The low-precision dtype and the policy; ``dtype=None`` means "not given"."""
    if policy is None:
        return (_DEFAULT if dtype is None else _low_dtype(dtype, "`dtype`")), None
    if not isinstance(policy, (Policy, str)):
        raise TypeError(
            "Expected a jamp.Policy or a policy string such as 'p=f32,c=bf16,o=f32' for "
            f"`policy`, got {policy!r} (type {type(policy).__name__}) instead."
        )
    low = None if dtype is None else _low_dtype(dtype, "`dtype`")
    policy = get_policy(policy)
    compute = _low_dtype(policy.compute_dtype, "the compute dtype of `policy`")
    if low is not None and low != compute:
        raise ValueError(
            f"Expected `dtype` to be left out or to equal the policy's compute dtype "
            f"{compute.name}, got {low.name} instead: with a policy, its compute_dtype is "
            "the low-precision dtype."
        )
    return compute, policy


def _autocast(fun: Callable, low: np.dtype, policy: Policy | None, recorder: _Recorder | None):
    ctx = _Context(dtype=low, recorder=recorder)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        dynamic, rebuild = _split_static(args, kwargs)

        def flat_fun(*xs: Any) -> Any:
            a, k = rebuild(xs)
            return fun(*a, **k)

        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dynamic)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
        with jax.named_scope(_SCOPE_AUTOCAST):
            outs, _ = _eval_closed(closed, dynamic, [_TRACED] * len(dynamic), ctx)
            final = []
            for x, shape in zip(outs, out_leaves, strict=True):
                target = shape.dtype
                if policy is not None and _is_float(target):
                    target = policy.output_dtype
                final.append(_cast(x, target))
        return jax.tree_util.tree_unflatten(out_tree, final)

    return wrapped


def autocast(
    fun: Callable,
    dtype: Any = None,
    *,
    policy: Policy | str | None = None,
    enabled: bool = True,
) -> Callable:
    """Runs ``fun`` with matrix products in ``dtype`` and sensitive ops in float32.

    ``autocast`` is a function transformation, the JAX analogue of
    ``torch.autocast``. It traces ``fun`` to a jaxpr and evaluates it with an
    interpreter that applies one table of rules (``RULES`` in
    ``jamp/_src/autocast.py``, explained in ``docs/autocast.md``):

    * ``dot_general`` and ``conv_general_dilated`` (every matmul, einsum,
      Dense and Conv layer) run in ``dtype``, output included (a
      ``preferred_element_type`` wider than the traced inputs is kept);
    * exp, log, pow, rsqrt, sums (window sums too), cumulative sums,
      divisions, FFTs and linear algebra run in float32, and so does the
      add/sub/mul producing their operand (``x - max(x)`` in softmax), so
      softmax, log-softmax, logsumexp, layer/group norm, mean, variance and
      losses are computed in float32 from their (possibly ``dtype``) inputs;
    * every other floating primitive runs in the widest floating dtype of its
      inputs; integers are never touched; constants that autocast narrows
      (a ``jnp.finfo(jnp.float32).min`` mask fill) saturate to ``dtype``'s
      finite range instead of becoming infinite;
    * primitives the table does not know run as traced (float32 for a float32
      program); :func:`autocast_report` lists them.

    The rules apply inside ``jit``, ``scan``, ``while_loop``, ``cond``,
    ``checkpoint``, ``custom_jvp`` and ``custom_vjp`` too. Loop carries and
    ``cond`` outputs keep their traced dtypes; the outputs of the returned
    function have the dtypes ``fun`` would have returned (or
    ``policy.output_dtype`` for floating outputs). It composes with ``jit``,
    ``grad``, ``vmap`` and Flax ``apply``; gradients with respect to float32
    parameters are float32, since every cast is differentiable.

    Array arguments (``jax.Array`` and NumPy arrays, anywhere in pytrees and
    keyword arguments) are traced; other leaves (Python numbers, booleans,
    strings) are passed to ``fun`` unchanged, so ``fun`` may branch on them.

    Args:
      fun: the function to transform.
      dtype: the low-precision dtype: ``jnp.bfloat16`` (the default) or
        ``jnp.float16``; the short names of :func:`jamp.get_policy`
        (``"bf16"``, ``"f16"``, ``"half"``) work too. Left out (``None``) it
        is bfloat16, or the policy's compute dtype.
      policy: optional :class:`jamp.Policy` or policy string. Its
        ``compute_dtype`` (float16 or bfloat16) is the low-precision dtype
        (``dtype`` must then be left out or agree) and its ``output_dtype``
        the dtype of the floating outputs.
      enabled: ``False`` returns ``autocast_disabled(fun)``: ``fun`` runs as
        written, even inside another autocast function.

    Returns:
      A function with the signature of ``fun``.

    Raises:
      TypeError: ``fun`` is not callable, ``dtype`` is not a dtype or not a
        floating one (``jnp.int32``, ``"int32"``), or ``policy`` is neither a
        ``Policy`` nor a string.
      ValueError: ``dtype`` (or the policy's compute dtype) is a floating
        dtype other than float16 and bfloat16 (``jnp.float32``,
        ``jnp.float8_e4m3fn``) or a name that is no dtype (``"fp8"``); an
        invalid policy string; or ``dtype`` disagrees with ``policy``.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> def f(x, w):
      ...   return jax.nn.log_softmax(x @ w)
      >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
      >>> jamp.autocast(f)(x, w).dtype  # the dtype f returns
      dtype('float32')
      >>> jaxpr = jax.make_jaxpr(jamp.autocast(f))(x, w)
      >>> [(e.primitive.name, str(e.outvars[0].aval.dtype)) for e in jaxpr.eqns
      ...  if e.primitive.name in ("dot_general", "exp", "log")]
      [('dot_general', 'bfloat16'), ('exp', 'float32'), ('log', 'float32')]
    """
    _check_fun(fun, "autocast")
    low, policy = _resolve(dtype, policy)
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"Expected a bool for `enabled`, got {enabled!r} instead.")
    if not enabled:
        return autocast_disabled(fun)
    return _autocast(fun, low, policy, None)


def autocast_disabled(fun: Callable) -> Callable:
    """Marks ``fun`` as a region that an enclosing :func:`autocast` leaves alone.

    Inside the region every primitive runs in the dtypes it was traced with
    (float32 for a float32 function): arguments arriving in low precision are
    cast back first. This is ``torch.autocast(enabled=False)`` nested inside an
    autocast region. Outside any autocast the function is unchanged. The
    marker is a ``jax.named_scope``, so the region may contain anything,
    including ``jit``, loops and custom derivatives, and works as a decorator.

    Args:
      fun: the function to exclude from autocasting.

    Returns:
      A function with the signature of ``fun``.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> @jamp.autocast_disabled
      ... def gram(x):
      ...   return x @ x.T  # stays float32 under autocast
      >>> f = jamp.autocast(lambda x: gram(x) + x @ x.T)
      >>> dots = [e for e in jax.make_jaxpr(f)(jnp.ones((2, 2))).eqns
      ...         if e.primitive.name == "dot_general"]
      >>> [str(e.outvars[0].aval.dtype) for e in dots]
      ['float32', 'bfloat16']
    """
    _check_fun(fun, "autocast_disabled")

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(_SCOPE_DISABLED):
            return fun(*args, **kwargs)

    return wrapped


def _check_report_keywords(fun: Callable, args: tuple, kwargs: dict, **own: Any) -> None:
    """A clear error when ``fun`` needs a ``dtype``/``policy`` the report took."""
    try:
        signature = inspect.signature(fun)
        bound = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature, or a call error fun will report
        return
    for name, value in own.items():
        param = signature.parameters.get(name)
        if (
            value is not None
            and param is not None
            and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
            and param.default is param.empty
            and name not in bound
        ):
            raise TypeError(
                f"Expected the argument `{name}` of `fun` to be given, got only "
                f"autocast_report's own `{name}=` (the autocast {name}) instead. Bind "
                f"fun's argument first: jamp.autocast_report(functools.partial(fun, "
                f"{name}=...), *args, {name}=...)."
            )


def autocast_report(
    fun: Callable,
    *args: Any,
    dtype: Any = None,
    policy: Policy | str | None = None,
    **kwargs: Any,
) -> AutocastReport:
    """Traces ``autocast(fun)`` on the arguments and reports what ran in which dtype.

    Nothing is executed: the function is traced once. The report counts, per
    primitive, the rule applied and the dtype it computed in, and lists the
    primitives the table does not know (they ran as traced). It is the tool to
    reach for when numerics look wrong under autocast.

    ``dtype=`` and ``policy=`` always belong to the report, never to ``fun``.
    To pass ``fun`` keyword arguments with those names, bind them first:
    ``autocast_report(functools.partial(fun, dtype=jnp.int32), x,
    dtype=jnp.float16)``. When ``fun`` requires such an argument and only the
    report's keyword is given, a ``TypeError`` says so.

    Args:
      fun: the function, as it would be passed to :func:`autocast`.
      *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      dtype: the low-precision dtype, as in :func:`autocast`.
      policy: optional policy, as in :func:`autocast`.
      **kwargs: its other keyword arguments.

    Returns:
      An :class:`AutocastReport`; ``print`` it for a table.

    Raises:
      TypeError: as :func:`autocast`, or ``fun`` requires an argument named
        ``dtype`` or ``policy`` that only the report's own keyword supplies.
      ValueError: as :func:`autocast`.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> report = jamp.autocast_report(
      ...     lambda x: jax.nn.softmax(x @ x), jnp.ones((2, 2)), dtype=jnp.float16)
      >>> report.counts["dot_general"], report.counts["exp"]
      ({'float16': 1}, {'float32': 1})
    """
    _check_fun(fun, "autocast_report")
    _check_report_keywords(fun, args, kwargs, dtype=dtype, policy=policy)
    low, policy = _resolve(dtype, policy)
    recorder = _Recorder()
    wrapped = _autocast(fun, low, policy, recorder)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    mask = [_is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves]

    def flat(*xs: Any) -> Any:
        it = iter(xs)
        a, k = jax.tree_util.tree_unflatten(
            treedef,
            [next(it) if is_dyn else leaf for leaf, is_dyn in zip(leaves, mask, strict=True)],
        )
        return wrapped(*a, **k)

    jax.make_jaxpr(flat)(*(leaf for leaf, is_dyn in zip(leaves, mask, strict=True) if is_dyn))
    rows = tuple(
        (prim, rule, dt, count) for (prim, rule, dt), count in sorted(recorder.counts.items())
    )
    return AutocastReport(dtype=low, rows=rows, unknown=tuple(sorted(recorder.unknown)))
