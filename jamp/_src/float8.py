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

import dataclasses
import functools
import numbers
import typing
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from jamp._src.types import PyTree

E4M3 = np.dtype(jnp.float8_e4m3fn)  # operands (forward)
E5M2 = np.dtype(jnp.float8_e5m2)  # gradients (backward)
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
E5M2_MAX = float(jnp.finfo(E5M2).max)  # 57344
F32 = np.dtype(jnp.float32)

# The rows of a Float8State: the left operand, the right operand, the gradient
# of the output; and the largest finite value of each row's format.
LHS, RHS, GRAD = 0, 1, 2
ROW_MAX = np.array([E4M3_MAX, E4M3_MAX, E5M2_MAX], np.float32)
# A current scale is at most 2**126, so its inverse is a normal float32 number.
_SMALLEST_AMAX = ROW_MAX * np.float32(2.0**-126)

ALGOS = ("max", "most_recent")
UNMEASURED = ("one", "current")

# The largest margin that keeps the largest recorded amax a normal float8_e4m3fn number
# (448 / 2**14 >= 2**-6); past 18 it is below the smallest subnormal, and flushes to 0.
MAX_MARGIN = 14
# 3 rows of float32 per step: 768 KiB per product. TE's default is 1024.
MAX_HISTORY = 2**16


# ---------------------------------------------------------------------------
# The state and the recipe of delayed scaling
# ---------------------------------------------------------------------------


class Float8State(NamedTuple):
    """The delayed-scaling state of one float8 matrix product: immutable, a pytree.

    Row 0 is the left operand, row 1 the right operand, row 2 the gradient of
    the output (``float8_e5m2``). A product inside a ``lax.scan`` of length
    ``n`` has one state per iteration, stacked: leading dimensions ``(n,)``
    (``(n, m)`` for nested scans), as Transformer Engine stacks a scanned
    layer's state.

    Attributes:
      amax_history: float32 ``(..., 3, amax_history_len)``: the amaxes of the
        last ``amax_history_len`` steps, the most recent at index 0 (as
        Transformer Engine and ``flax.linen.fp8_ops`` roll it).
      scale: float32 ``(..., 3)``: the scales the next step quantises with
        (``float8 = x * scale``): ``finfo.max / amax / 2**margin``. A fresh
        state's is 1, as Transformer Engine's (0, "not measured yet", with
        ``DelayedScaling(unmeasured="current")``).
    """

    amax_history: jax.Array
    scale: jax.Array


def _short(n: int) -> str:
    """An integer as written, or its number of digits when it is too long to read."""
    text = str(int(n))
    return text if len(text) <= 20 else f"<an integer of {len(text.lstrip('-'))} digits>"


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Transformer Engine's delayed-scaling recipe (``DelayedScaling`` in TE).

    After every step, each tensor's amax is rolled into its history (most
    recent at index 0, the oldest dropped) and the next scale is
    ``finfo(float8).max / amax / 2**margin``, where ``amax`` is the largest
    value of the history (``"max"``) or the newest (``"most_recent"``). A
    scale is kept from the step before when ``amax`` is 0 or not finite, or
    when the new scale would not be a finite float32 number (an amax below
    ``finfo.max * 2**-128``; TE has no such guard).

    ``unmeasured`` says what a tensor without a measured scale is quantised
    with: a fresh state's ([`jamp.float8.init`][]), and one whose next
    state came back zero (a product that the backward pass did not reach,
    such as one under ``stop_gradient``: its cotangent is zero):

    * ``"one"`` (TE's recipe, the default): scale 1, as Transformer Engine
      and Flax start. The quantisation never waits for this step's amax, so
      XLA can compute the amax in the same pass that quantises: the reason
      delayed scaling is faster than current scaling. On the first step a
      tensor above 448 saturates and one below ``2**-9`` flushes to zero,
      and a zero output has amax 0, so the next layer flushes on the next
      step, and so on down the network (``benchmarks/RESULTS.md``).
    * ``"current"``: a fresh state has scales of 0, "not measured yet", and
      a tensor whose scale is not positive and finite is quantised with its
      current scale: the first step is current scaling. The quantisation then
      depends on this step's amax on every step, so each operand is read
      twice, as under current scaling.

    Args:
      amax_history_len: how many steps of amaxes to keep (TE: 1024).
      margin: the scale is divided by ``2**margin``, leaving that many powers
        of two of headroom above the recorded amax (TE: 0).
      amax_compute_algo: ``"max"`` (TE's default) or ``"most_recent"``.
      unmeasured: ``"one"`` (TE's) or ``"current"``, see above.

    Raises:
      TypeError: ``amax_history_len`` or ``margin`` is not an integer, or
        ``amax_compute_algo`` or ``unmeasured`` not a string.
      ValueError: ``amax_history_len`` outside ``[1, 2**16]`` (a longer
        history is 12 bytes a step for every product: 2**28 steps would be
        3 GiB each), ``margin`` outside ``[0, 14]`` (a larger one maps even
        the largest value below float8_e4m3fn's smallest normal number,
        ``2**-6``, so the products lose their precision, and past 18 are all
        zero) or an unknown ``amax_compute_algo`` or ``unmeasured``.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> recipe = jamp.float8.DelayedScaling(amax_history_len=16, margin=1)
      >>> recipe
      DelayedScaling(amax_history_len=16, margin=1, amax_compute_algo='max', unmeasured='one')
      >>> f = jamp.autocast(lambda w, x: x @ w, "float8", recipe=recipe)
      >>> state = jamp.float8.init(f, jnp.ones((4, 4)), jnp.ones((2, 4)))
      >>> f(state, jnp.ones((4, 4)), jnp.ones((2, 4))).shape  # the state comes first
      (2, 4)
    """

    amax_history_len: int = 1024
    margin: int = 0
    amax_compute_algo: str = "max"
    unmeasured: str = "one"

    def __post_init__(self) -> None:
        for name in ("amax_history_len", "margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"Expected an int for `{name}`, got {value!r} instead.")
        if self.amax_history_len < 1:
            raise ValueError(
                f"Expected `amax_history_len` >= 1, got {self.amax_history_len} instead."
            )
        if self.amax_history_len > MAX_HISTORY:
            raise ValueError(
                f"Expected `amax_history_len` <= 2**16 = {MAX_HISTORY}, got "
                f"amax_history_len={_short(self.amax_history_len)} instead: the history holds 12 "
                "bytes per step for every float8 product (Transformer Engine's default is 1024)."
            )
        if self.margin < 0:
            raise ValueError(f"Expected `margin` >= 0, got {self.margin} instead.")
        if self.margin > MAX_MARGIN:
            raise ValueError(
                f"Expected `margin` in [0, {MAX_MARGIN}], got margin={_short(self.margin)} "
                f"instead: the scale divides by 2**margin, and past {MAX_MARGIN} even the largest "
                "recorded value quantises below float8_e4m3fn's smallest normal number "
                "(2**-6), so the products lose their precision (past 18 they are all zero). "
                "Transformer Engine's default is 0."
            )
        for name, allowed in (("amax_compute_algo", ALGOS), ("unmeasured", UNMEASURED)):
            value, choices = getattr(self, name), " or ".join(repr(a) for a in allowed)
            if not isinstance(value, str):
                raise TypeError(
                    f"Expected a string for `{name}` ({choices}), got {value!r} instead."
                )
            if value not in allowed:
                raise ValueError(f"Expected {choices} for `{name}`, got {value!r} instead.")


def _concrete(x: object) -> bool:
    """Whether ``x`` holds values this process can read (not a tracer, not another host's)."""
    if isinstance(x, jax.core.Tracer):
        return False
    return getattr(x, "is_fully_addressable", True)


# Relative tolerance of a restored scale against the one its history gives (the recipe
# computes it in float32; a state from another backend may round differently).
_TOLERANCE = 2.0**-8


def _scales_from(amax: np.ndarray, margin: int, history: bool = False) -> np.ndarray:
    """The recipe's scale for each row's ``amax`` (``(..., 3)``, or a history ``(..., 3,
    steps)``), as ``next_state`` computes it in float32; inf where it would not be a
    finite float32 number."""
    row_max = ROW_MAX[:, None] if history else ROW_MAX
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        new = (row_max / amax.astype(np.float32)) / np.float32(2.0**margin)
    return np.where(np.isfinite(new), new, np.inf)


def _matches(scale: np.ndarray, want: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.isfinite(want) & (np.abs(scale / want - 1.0) <= _TOLERANCE)


def check_values(state: Float8State, where: str, recipe: DelayedScaling | None = None) -> None:
    """A ``ValueError`` naming ``where`` unless ``state`` (a [`jamp.float8.Float8State`][]) holds
    values the recipe can have produced: the scale the next product quantises with.

    An amax history with a negative entry, or a scale that is negative or not
    finite, never comes from the recipe. A row whose history is finite and
    measured (an amax > 0) must hold the scale the recipe computes from it,
    ``finfo.max / amax / 2**margin``, for ``recipe``'s ``amax_compute_algo`` and
    ``margin`` (with ``recipe=None``, for either algorithm and some margin in
    ``[0, 14]``); a row never measured holds 1 (a fresh state) or 0 ("not
    measured yet"). A restored scale of ``1e30`` for a tensor of amax 10 would
    saturate every value and make the product 0.0: finite, so loss scaling
    would apply the step. Traced values (under ``jit``) cannot be read: there
    ``traced_check`` makes the products and their gradients NaN instead, where a
    row's history determines its scale and the scale is another.
    """
    history, scale = state.amax_history, state.scale
    if not (_concrete(history) and _concrete(scale)):
        return
    fix = (
        "start from a fresh state (jamp.float8.init) or restore the checkpoint the run saved; "
        "a state saved by another recipe (a changed margin or amax_compute_algo) does not carry "
        "over"
    )
    for name, x in (("amax_history", history), ("scale", scale)):
        if not hasattr(x, "dtype") or np.dtype(x.dtype) != F32:
            raise TypeError(
                f"Expected {where}.{name} to be a float32 array, got "
                f"{type(x).__name__}{'' if not hasattr(x, 'dtype') else ' of ' + str(x.dtype)} "
                f"instead; {fix}."
            )
    h, s = np.asarray(history), np.asarray(scale)
    if h.ndim < 2 or h.shape[-2] != 3 or s.shape != h.shape[:-1]:
        raise ValueError(
            f"Expected {where} to hold an amax_history of shape (..., 3, amax_history_len) and "
            f"a scale of shape (..., 3), got {h.shape} and {s.shape} instead; {fix}."
        )
    if np.any(h < 0) or np.any(np.isneginf(h)):
        raise ValueError(
            f"Expected {where}.amax_history to hold amaxes (largest magnitudes, >= 0), found "
            f"a negative one ({float(h[h < 0].min())!r}) instead; {fix}."
        )
    if not (np.all(np.isfinite(s)) and np.all(s >= 0)):
        bad = s[~(np.isfinite(s) & (s >= 0))]
        raise ValueError(
            f"Expected {where}.scale to be finite and >= 0 (0: not measured yet), got "
            f"{float(bad.flat[0])!r} instead; {fix}."
        )
    algos = ALGOS if recipe is None else (recipe.amax_compute_algo,)
    margins = range(MAX_MARGIN + 1) if recipe is None else (recipe.margin,)
    finite = np.all(np.isfinite(h), axis=-1)  # a non-finite amax freezes a row's scale
    ok = (s == 0) | ~finite
    for algo in algos:
        amax = np.max(h, axis=-1) if algo == "max" else h[..., 0]
        measured = finite & (amax > 0)
        for m in margins:
            want = _scales_from(amax, m)
            # A scale past float32 is not taken: the row keeps an earlier one.
            ok |= measured & (_matches(s, want) | np.isinf(want))
            if algo == "most_recent":  # an amax of 0 keeps the scale of an earlier one
                earlier = _matches(s[..., None], _scales_from(h, m, history=True)) & (h > 0)
                ok |= finite & (amax == 0) & np.any(earlier, axis=-1)
        ok |= finite & (amax == 0) & (s == 1)  # never measured: a fresh state's 1
    if not np.all(ok):
        idx = tuple(int(i) for i in np.argwhere(~ok)[0])
        row = ("the left operand", "the right operand", "the output's gradient")[idx[-1]]
        amaxes = h[idx]
        expected = (
            f"the amax history of that row has max {float(np.max(amaxes)):.4g}, most recent "
            f"{float(amaxes[0]):.4g}"
            if np.any(amaxes > 0)
            else "that row was never measured (its history is all zero), so its scale is 1 or 0"
        )
        which = (
            "any margin in [0, 14]"
            if recipe is None
            else f"margin={recipe.margin}, amax_compute_algo={recipe.amax_compute_algo!r}"
        )
        raise ValueError(
            f"Expected {where}.scale{list(idx)} (the scale of {row}) to be the one its amax "
            f"history gives, finfo.max / amax / 2**margin with {which}, got "
            f"{float(s[idx])!r} instead: {expected}. Quantised with it, the product would be "
            f"wrong (saturated or flushed to zero) while still finite; {fix}."
        )


def kept_max(amax_history: jax.Array) -> jax.Array:
    """The largest amax of the history that ``next_state`` keeps (``(..., 3)``): every
    entry but the one it overwrites (index ``1 % amax_history_len``, rolled to 0); -inf
    for a history of 1. The largest of the next history is ``max(new amax, this)``, and
    of this one ``max(this, that entry)``: one pass over the history serves both
    (``traced_check`` in the forward pass, ``next_state`` in the backward)."""
    n = amax_history.shape[-1]
    kept = np.arange(n) != 1 % n
    return jnp.max(jnp.where(kept, amax_history, np.float32(-np.inf)), axis=-1)


def traced_check(
    amax_history: jax.Array,
    scale: jax.Array,
    recipe: DelayedScaling,
    kept: jax.Array | None = None,
) -> jax.Array:
    """``1.0`` if ``scale`` (``(3,)``) is one the recipe can have computed from
    ``amax_history`` (``(3, amax_history_len)``), else NaN: ``check_values`` for the values
    it cannot read (under ``jit``), as a float32 scalar that multiplies the products'
    inverse scales, so a corrupted state gives non-finite outputs and gradients, which loss
    scaling skips, instead of finite wrong ones (a scale of ``1e30`` saturates every value;
    the product was 0.0).

    A row is checked only where the recipe itself leaves no choice: its amax (the
    history's max, or its newest entry for ``"most_recent"``) is positive and finite and
    gives a finite scale, so ``next_state`` wrote ``finfo.max / amax / 2**margin`` there,
    from this very history. Its scale must then be that one, for any margin in
    ``[0, 14]`` and the amax of the recipe's algorithm (with ``"max"``, the newest amax
    too), within ``_TOLERANCE``: a state saved with another margin, or computed on
    another backend, passes; ``1e30`` does not. Or it may be 0 ("not measured yet",
    which ``_usable`` replaces). Every other row holds a scale the
    recipe kept from an earlier step (a history never measured, all zero: a fresh state's
    1 or 0, or a scale whose amaxes have all rolled out of the history; an amax that is
    inf or NaN; one so small its scale is not a finite float32), which its history cannot
    vouch for: only its value is checked, finite and >= 0. So a state the recipe produced
    is never touched, and its products are bit for bit what they were (they are
    multiplied by exactly 1). Scalar work: a few operations on 3 scalars. The history's
    largest amax (``"max"``) comes from ``kept``, the pass over the history that
    ``next_state`` needs anyway (``kept_max``), made once in the forward pass and kept
    for the backward; the quantisation does not depend on any of it.
    """
    n = amax_history.shape[-1]
    newest = amax_history[..., 0]
    if recipe.amax_compute_algo == "max":
        kept = kept_max(amax_history) if kept is None else kept
        amax = jnp.maximum(kept, amax_history[..., 1 % n])  # the history's largest
        candidates = (amax, newest)
    else:
        amax, candidates = newest, (newest,)
    # The checks make no inf or NaN from a finite state (a zero history divides nothing):
    # jamp.debug.locate_nonfinite would name them, and they are masked anyway.
    one = np.float32(1.0)
    positive = amax > 0
    want = (ROW_MAX / jnp.where(positive, amax, one)) / np.float32(2.0**recipe.margin)
    determined = positive & jnp.isfinite(amax) & jnp.isfinite(want)
    log_scale = jnp.log2(jnp.where(scale > 0, scale, one))

    def given_by(a: jax.Array) -> jax.Array:
        """Whether ``scale == finfo.max / a / 2**m`` for some margin ``m`` in [0, 14], in
        the log domain (no quotient overflows)."""
        log_ratio = jnp.log2(ROW_MAX) - jnp.log2(jnp.where(a > 0, a, one)) - log_scale
        m = jnp.round(log_ratio)
        close = jnp.abs(jnp.exp2(log_ratio - m) - 1) <= _TOLERANCE
        return (a > 0) & (scale > 0) & (m >= 0) & (m <= MAX_MARGIN) & close

    given = functools.reduce(jnp.logical_or, [given_by(a) for a in candidates])
    ok = jnp.isfinite(scale) & (scale >= 0) & (~determined | (scale == 0) | given)
    return jnp.where(jnp.all(ok), np.float32(1), np.float32(np.nan))


def init_state(
    recipe: DelayedScaling, stack: Sequence[int] = (), scale: float | None = None
) -> Float8State:
    """A fresh state: an empty history and scales of 1 (``unmeasured="one"``, TE's start)
    or 0 ("not measured yet", ``unmeasured="current"``), unless ``scale`` is given."""
    if scale is None:
        scale = 1.0 if recipe.unmeasured == "one" else 0.0
    stack = tuple(stack)
    return Float8State(
        amax_history=jnp.zeros((*stack, 3, recipe.amax_history_len), F32),
        scale=jnp.full((*stack, 3), scale, F32),
    )


def next_state(
    state: Float8State,
    amaxes: jax.Array,
    recipe: DelayedScaling,
    kept: jax.Array | None = None,
) -> Float8State:
    """Transformer Engine's update: roll ``amaxes`` (shape ``(3,)``) in, compute the scales.

    ``kept``: ``kept_max(state.amax_history)``, when the caller has it already."""
    history = jnp.roll(state.amax_history, -1, axis=-1).at[..., 0].set(amaxes)
    if recipe.amax_compute_algo == "max":  # the max of the new history, from one pass
        kept = kept_max(state.amax_history) if kept is None else kept
        amax = jnp.maximum(amaxes, kept)
    else:
        amax = history[..., 0]
    # A row never measured keeps its scale; it divides nothing (no inf is made, for
    # jamp.debug.locate_nonfinite to name).
    positive = amax > 0
    new = (ROW_MAX / jnp.where(positive, amax, np.float32(1.0))) / np.float32(2.0**recipe.margin)
    keep = positive & jnp.isfinite(amax) & jnp.isfinite(new)
    return Float8State(history, jnp.where(keep, new, state.scale))


# ---------------------------------------------------------------------------
# Quantisation
# ---------------------------------------------------------------------------


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
    """
    big = np.float32(jnp.finfo(dtype).max)
    y = x.astype(F32) * scale
    return (lax.clamp(-big, y, big) + (y - y)).astype(dtype)


def _usable(scale: jax.Array, x_amax: jax.Array, row: int, recipe: DelayedScaling) -> jax.Array:
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


# How the float8 GEMMs accumulate (docs/float8.md, "Accumulation"). The two gradient
# products (dgrad, wgrad) ask for float32 accumulation without fast accumulation on CUDA
# GPUs: the ``ANY_F8_ANY_F8_F32`` algorithm, which XLA:GPU runs as a cuBLASLt float8 GEMM
# with CUBLASLT_MATMUL_DESC_FAST_ACCUM off (its Triton GEMM emitter refuses the algorithm,
# and accumulates a float8 dot without one imprecisely). Transformer Engine and torchao
# accumulate their gradient GEMMs the same way. The forward product keeps ``DEFAULT``,
# which both XLA:GPU paths run with fast accumulation, as TE and torchao run theirs. Other
# platforms keep ``DEFAULT``: the CPU refuses float8 algorithms (it upcasts the operands
# and accumulates in float32).
GRADIENT_ALGORITHM = lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
BF16 = np.dtype(jnp.bfloat16)


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


def _forward(spec: Spec, lhs, rhs, s_lhs, s_rhs, checked=None):
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
    return _transposed(spec, operands, q_g, inv_g)


def _transposed(spec: Spec, operands, q_g, inv_g):
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
    return _current_fwd(lhs, rhs, spec)[0]


def _current_fwd(lhs, rhs, spec):
    return _forward(spec, lhs, rhs, current_scale(amax(lhs), LHS), current_scale(amax(rhs), RHS))


def _current_bwd(spec, res, g):
    return _backward(spec, res, g, current_scale(amax(g), GRAD))


current_dot.defvjp(_current_fwd, _current_bwd)


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
    return _delayed_fwd(lhs, rhs, amax_history, scale, spec)[0]


def _state_check(amax_history, scale, recipe):
    """``(kept_max(amax_history) or None, traced_check(...))``: the history's pass that
    ``next_state`` reuses, and 1 or NaN (a corrupted state) for the inverse scales."""
    kept = kept_max(amax_history) if recipe.amax_compute_algo == "max" else None
    return kept, traced_check(amax_history, scale, recipe, kept)


def _delayed_fwd(lhs, rhs, amax_history, scale, spec):
    a_lhs, a_rhs = amax(lhs), amax(rhs)  # recorded; quantised with the state's scales
    s_lhs = _usable(scale[LHS], a_lhs, LHS, spec.recipe)
    s_rhs = _usable(scale[RHS], a_rhs, RHS, spec.recipe)
    kept, checked = _state_check(amax_history, scale, spec.recipe)
    out, operands = _forward(spec, lhs, rhs, s_lhs, s_rhs, checked)
    return out, (operands, a_lhs, a_rhs, amax_history, scale, kept)


def _delayed_bwd(spec, res, g):
    operands, a_lhs, a_rhs, amax_history, scale, kept = res
    a_g = amax(g)
    d_lhs, d_rhs = _backward(spec, operands, g, _usable(scale[GRAD], a_g, GRAD, spec.recipe))
    amaxes = jnp.stack([a_lhs, a_rhs, a_g])
    new = next_state(Float8State(amax_history, scale), amaxes, spec.recipe, kept)
    return d_lhs, d_rhs, new.amax_history, new.scale


delayed_dot.defvjp(_delayed_fwd, _delayed_bwd)


# ---------------------------------------------------------------------------
# Telemetry: what float8 made of each tensor, returned as a cotangent
# ---------------------------------------------------------------------------


class Telemetry(NamedTuple):
    """What float8 made of the tensors of one matrix product in one step: immutable, a pytree.

    Each field is float32 ``(..., 3)``, with the rows of a
    [`Float8State`][jamp.float8.Float8State]: row 0 the left operand (``x``
    in ``x @ w``), row 1 the right operand (``w``), row 2 the gradient of the
    output (quantised to ``float8_e5m2``); a product inside a ``lax.scan`` of
    length ``n`` has leading axes ``(n,)``. A product returns its telemetry
    as the *cotangent* of a telemetry argument (whose values it ignores):
    ``jax.grad`` with respect to that argument returns it, as arrays, with
    the gradients ([`jamp.float8.telemetry_init`][], ``docs/float8.md``).

    Attributes:
      amax: the tensor's largest magnitude (NaN if it holds a NaN). The
        gradient's is the gradient the product received: times the loss
        scale, under loss scaling.
      scale: the scale it was quantised with (``float8 = x * scale``): its
        current scale, ``finfo.max / amax``, or under delayed scaling the
        state's (1 for a fresh state, the current scale for a row not yet
        measured with ``unmeasured="current"``).
      underflow: the fraction of its elements that are not zero and
        quantise to zero (flushed: a scaled magnitude of at most half the
        format's smallest subnormal, ``2**-10`` for ``float8_e4m3fn``,
        ``2**-17`` for ``float8_e5m2``).
      saturated: the fraction of its elements that are finite and whose
        scaled magnitude is beyond the format's range, so that quantisation
        clamped them to its largest finite value (448, 57344): above 464 for
        ``float8_e4m3fn`` and from 61440 for ``float8_e5m2``, the values that
        would not round to that largest value. Current scaling maps the amax
        to it, so it saturates nothing finite; delayed scaling saturates
        what grew past the history's amax.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> f = jamp.autocast(lambda w, x: jnp.sum(x @ w), "float8", telemetry=True)
      >>> w, x = jnp.full((4, 4), 0.5), jnp.array([[1.0, 2.0, 1e-6, 0.0]])
      >>> zeros = jamp.float8.telemetry_init(f, w, x)
      >>> stats = jax.grad(f)(zeros, w, x)["0:dot_general"]
      >>> stats.amax  # x, w, the gradient of the output
      Array([2. , 0.5, 1. ], dtype=float32)
      >>> stats.underflow  # 1e-6 * 224 is below 2**-10: flushed, 1 of the 4 values of x
      Array([0.25, 0.  , 0.  ], dtype=float32)
    """

    amax: jax.Array
    scale: jax.Array
    underflow: jax.Array
    saturated: jax.Array


# Each row's largest scaled magnitude that quantises to zero (half the smallest subnormal:
# round to nearest, ties to even) and its largest one that does not round past the largest
# finite value: float8_e4m3fn rounds 464 to 448 and more to NaN, float8_e5m2 rounds 61440
# to inf. Quantisation clamps, so the values above it are those the clamp changed.
_FLUSHES_AT_MOST = np.array([2.0**-10, 2.0**-10, 2.0**-17], np.float32)
_SATURATES_ABOVE = np.array(
    [464.0, 464.0, np.nextafter(np.float32(61440.0), np.float32(0.0))], np.float32
)
_ZERO = np.float32(0.0)

# The statistics are full reductions of the flattened tensor (``_flat``: a view in the
# tensor's own layout, whatever layout its other uses get), each a single variadic
# ``reduce``: XLA:GPU fuses one such reduction into a pass that reads the tensor anyway
# (its amax, or its quantisation), where two sibling reductions, or one over the 2-D
# tensor, get passes of their own (``tests/test_float8_telemetry.py`` measures the bytes).


def _flat(x):
    """``x`` as a vector; ``x`` itself when an explicit sharding of an axis past the first
    makes the vector no view of it (a reshape would gather it): the reductions of both
    are the same."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return x if any(axis is not None for axis in spec[1:]) else x.reshape(-1)


def _reduce(operands, combine):
    """One variadic reduction of ``operands`` (float32, of one shape) over all their axes,
    each combined by ``combine`` (``lax.max`` or ``lax.add``)."""
    return lax.reduce(
        operands,
        [_ZERO] * len(operands),
        lambda a, b: [f(u, v) for f, u, v in zip(combine, a, b, strict=True)],
        tuple(range(operands[0].ndim)),
    )


def _count(mask):
    return mask.astype(F32)


def _clamped(magnitude, scale, row):
    """Which of the values of ``magnitude`` (``|x|``, float32) ``scale`` saturates."""
    return lax.is_finite(magnitude) & (magnitude * scale > _SATURATES_ABOVE[row])


def _before(x, row, recipe, state_scale):
    """The scale ``x`` is quantised with, and what ``_after`` needs to report on ``x``.

    With a scale that does not wait for the amax (delayed scaling, ``unmeasured="one"``)
    nothing: ``_after`` reads ``x`` once, for the amax and both counts, in a pass XLA
    fuses into the quantising pass. Otherwise (current scaling, ``unmeasured="current"``)
    the pass before quantisation is the amax's, which counts ``x``'s zeros too and, under
    delayed scaling, the values the state's scale saturates.
    """
    if recipe is not None and recipe.unmeasured == "one":
        unread = typing.cast(jax.Array, _ZERO)  # "one" reads no amax
        return _usable(state_scale, unread, row, recipe), None
    flat = _flat(x)
    magnitude = jnp.abs(flat).astype(F32)
    counted = [magnitude, _count(flat == 0)]
    if recipe is not None:
        counted.append(_count(_clamped(magnitude, state_scale, row)))
    x_amax, *counts = _reduce(counted, [lax.max, *[lax.add] * (len(counted) - 1)])
    if recipe is None:
        return current_scale(x_amax, row), (x_amax, *counts, _ZERO)
    return _usable(state_scale, x_amax, row, recipe), (x_amax, *counts)


def _after(x, q, scale, row, pending, state_scale):
    """``(amax, scale, underflow, saturated)`` of ``x``, quantised to ``q`` with ``scale``."""
    n = np.float32(max(x.size, 1))
    if pending is None:  # the scale did not wait: one pass, counted from the scaled values
        if x.size == 0:
            return _ZERO, scale, _ZERO, _ZERO
        magnitude = jnp.abs(_flat(x)).astype(F32)
        flushed = (magnitude != 0) & (magnitude * scale <= _FLUSHES_AT_MOST[row])
        x_amax, n_flushed, n_clamped = _reduce(
            [magnitude, _count(flushed), _count(_clamped(magnitude, scale, row))],
            [lax.max, lax.add, lax.add],
        )
        return x_amax, scale, n_flushed / n, n_clamped / n
    x_amax, zeros, clamped = pending
    # The flushed values are the zeros of q that were not zeros of x: q is read where XLA
    # can fuse the count into the pass that quantises x, else once more (a byte a value).
    # A NaN scale (a NaN amax) quantises every value to NaN: nothing is flushed.
    (q_zeros,) = _reduce([_count(_flat(q) == 0)], [lax.add])
    flushed = jnp.maximum(q_zeros - zeros, _ZERO)
    # The current scale maps the amax to at most finfo.max * (1 + 2**-22), so it saturates
    # nothing; the state's scale, when it was used, saturates what was counted.
    if state_scale is not None:
        clamped = jnp.where(jnp.isfinite(state_scale) & (state_scale > 0), clamped, _ZERO)
    return x_amax, scale, flushed / n, clamped / n


def _stacked(*rows) -> Telemetry:
    """The Telemetry of three rows of ``(amax, scale, underflow, saturated)``."""
    return Telemetry(*(jnp.stack(field) for field in zip(*rows, strict=True)))


def _telemetry_fwd(spec: Spec, lhs, rhs, scale=None, checked=None):
    """The product of ``lhs`` and ``rhs`` and its residuals, the operands' rows of
    telemetry among them; ``scale`` is the state's, under delayed scaling, and ``checked``
    its ``traced_check``."""
    s_lhs, p_lhs = _before(lhs, LHS, spec.recipe, None if scale is None else scale[LHS])
    s_rhs, p_rhs = _before(rhs, RHS, spec.recipe, None if scale is None else scale[RHS])
    out, operands = _forward(spec, lhs, rhs, s_lhs, s_rhs, checked)
    q_lhs, q_rhs = operands[:2]
    seen = (
        _after(lhs, q_lhs, s_lhs, LHS, p_lhs, None if scale is None else scale[LHS]),
        _after(rhs, q_rhs, s_rhs, RHS, p_rhs, None if scale is None else scale[RHS]),
    )
    return out, (operands, seen)


def _telemetry_bwd(spec: Spec, operands, seen, g, scale=None):
    """The operands' gradients and the product's Telemetry."""
    s_grad = None if scale is None else scale[GRAD]
    s_g, p_g = _before(g, GRAD, spec.recipe, s_grad)
    q_g = quantize(g, s_g, E5M2)  # as _backward does
    d_lhs, d_rhs = _transposed(spec, operands, q_g, 1 / s_g)
    return d_lhs, d_rhs, _stacked(*seen, _after(g, q_g, s_g, GRAD, p_g, s_grad))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def current_dot_telemetry(
    lhs: jax.Array, rhs: jax.Array, telemetry: Telemetry, spec: Spec
) -> jax.Array:
    """``current_dot``, whose cotangent of ``telemetry`` (values ignored) is this step's
    [`Telemetry`][jamp.float8.Telemetry], whatever the cotangent of the output is."""
    return _current_fwd(lhs, rhs, spec)[0]


def _current_telemetry_fwd(lhs, rhs, telemetry, spec):
    return _telemetry_fwd(spec, lhs, rhs)


def _current_telemetry_bwd(spec, res, g):
    operands, seen = res
    return _telemetry_bwd(spec, operands, seen, g)


current_dot_telemetry.defvjp(_current_telemetry_fwd, _current_telemetry_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def delayed_dot_telemetry(
    lhs: jax.Array,
    rhs: jax.Array,
    amax_history: jax.Array,
    scale: jax.Array,
    telemetry: Telemetry,
    spec: Spec,
) -> jax.Array:
    """``delayed_dot``, whose cotangent of ``telemetry`` (values ignored) is this step's
    [`Telemetry`][jamp.float8.Telemetry]; that of the state is the next state."""
    return _delayed_fwd(lhs, rhs, amax_history, scale, spec)[0]


def _delayed_telemetry_fwd(lhs, rhs, amax_history, scale, telemetry, spec):
    kept, checked = _state_check(amax_history, scale, spec.recipe)  # as delayed_dot's
    out, (operands, seen) = _telemetry_fwd(spec, lhs, rhs, scale, checked)
    return out, (operands, seen, amax_history, scale, kept)


def _delayed_telemetry_bwd(spec, res, g):
    operands, seen, amax_history, scale, kept = res
    d_lhs, d_rhs, stats = _telemetry_bwd(spec, operands, seen, g, scale)
    new = next_state(Float8State(amax_history, scale), stats.amax, spec.recipe, kept)
    return d_lhs, d_rhs, new.amax_history, new.scale, stats


delayed_dot_telemetry.defvjp(_delayed_telemetry_fwd, _delayed_telemetry_bwd)


_ROWS = ("lhs", "rhs", "grad")


def telemetry_metrics(telemetry: Mapping[str, Telemetry]) -> dict[str, jax.Array]:
    """The telemetry of a step as a flat dict of device scalars, ready for any logger.

    ``telemetry`` is what ``jax.grad`` returned for the telemetry argument of
    an autocast function made with ``telemetry=True`` (a dict of
    [`jamp.float8.Telemetry`][]). Each key is ``"<product>/<tensor>/<field>"``:
    the product's key (``"0:MLP.Dense_0"``), the tensor (``lhs``, ``rhs`` or
    ``grad``: ``x``, ``w`` and the output's gradient of ``x @ w``) and the
    field (``amax``, ``scale``, ``underflow``, ``saturated``). A product in a
    ``lax.scan`` has one entry per iteration, its index after its key:
    ``"1:scan.dot_general[3]/lhs/amax"``. Nothing is read back to the host:
    convert with ``float()`` (or ``jax.device_get``) when you log.

    Raises:
      TypeError: ``telemetry`` is not a dict of ``Telemetry``.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> stats = {"0:dot_general": jamp.float8.Telemetry(*[jnp.zeros(3)] * 4)}
      >>> metrics = jamp.float8.telemetry_metrics(stats)
      >>> len(metrics), sorted(metrics)[:2]
      (12, ['0:dot_general/grad/amax', '0:dot_general/grad/saturated'])
    """
    fix = (
        "pass what jax.grad returned for the telemetry argument of jamp.autocast(f, 'float8', "
        "telemetry=True)"
    )
    if not isinstance(telemetry, Mapping):
        raise TypeError(
            f"Expected a dict of jamp.float8.Telemetry, got {type(telemetry).__name__} "
            f"instead; {fix}."
        )
    out: dict[str, jax.Array] = {}
    for key, entry in telemetry.items():
        if not isinstance(entry, Telemetry):
            raise TypeError(
                f"Expected a jamp.float8.Telemetry for entry {key!r}, got "
                f"{type(entry).__name__} instead; {fix}."
            )
        stack = np.shape(entry.amax)[:-1]
        for index in np.ndindex(*stack):
            name = key if not stack else f"{key}[{','.join(map(str, index))}]"
            for row, tensor in enumerate(_ROWS):
                for field, values in zip(entry._fields, entry, strict=True):
                    out[f"{name}/{tensor}/{field}"] = values[(*index, row)]
    return out


def refuse_in(tree: PyTree, what: str) -> None:
    """A ``TypeError`` when ``tree`` holds a [`jamp.float8.Float8State`][] or a
    [`jamp.float8.Telemetry`][]: neither is a parameter."""
    found = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, (Float8State, Telemetry))
    )[0]
    for path, leaf in found:
        if isinstance(leaf, Float8State):
            raise TypeError(
                f"Expected no jamp.float8.Float8State in {what}, found one at "
                f"{jax.tree_util.keystr(path)}: the float8 state is not a parameter. An "
                "optimizer would apply a learning-rate update to it and loss scaling would "
                "unscale it. Keep it out of the parameters: pass it to the delayed-scaling "
                "function as its own argument and take the next state from jax.grad with "
                "respect to that argument (docs/float8.md)."
            )
        if isinstance(leaf, Telemetry):
            raise TypeError(
                f"Expected no jamp.float8.Telemetry in {what}, found one at "
                f"{jax.tree_util.keystr(path)}: float8 telemetry is not a parameter. An "
                "optimizer would apply a learning-rate update to it and loss scaling would "
                "unscale it. Keep it out of the parameters: pass it to the telemetry function "
                "as its own argument and take the step's telemetry from jax.grad with respect "
                "to that argument (docs/float8.md)."
            )
