"""The loss-scale state, its constructors, and the pure `scale`/`unscale`/`update`.

The state is an immutable pytree: the scale and the counters are device arrays,
the configuration is static metadata. Every function here is pure and
traceable; nothing reads a value back to the host.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The default bounds keep 1/scale a *normal* float32 number, so unscaling never
# multiplies by inf, 0, or a subnormal that a backend may flush to zero.
MIN_SCALE = 2.0**-126
MAX_SCALE = 2.0**126
INT32_MAX = 2**31 - 1

DYNAMIC = "dynamic"
STATIC = "static"
NONE = "none"


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """Immutable loss-scale state, a pytree.

    Dynamic leaves (JAX arrays):
      scale: float32 scalar, the current loss scale.
      growth_tracker: int32 scalar, finite steps in a row since the scale last
        changed (torch's ``_growth_tracker``).
      overflow_streak: int32 scalar, non-finite steps in a row (used by
        ``hysteresis``; saturates at ``hysteresis``).

    Static metadata (part of the tree structure, so changing it recompiles but
    changing the scale never does): ``kind`` (``"dynamic"``, ``"static"`` or
    ``"none"``), ``growth_factor``, ``backoff_factor``, ``growth_interval``,
    ``min_scale``, ``max_scale``, ``hysteresis``.

    Build one with :func:`dynamic_loss_scale`, :func:`static_loss_scale` or
    :func:`no_loss_scale`; they validate their arguments.
    """

    scale: jax.Array
    growth_tracker: jax.Array
    overflow_streak: jax.Array
    kind: str = dataclasses.field(default=DYNAMIC, metadata=dict(static=True))
    growth_factor: float = dataclasses.field(default=2.0, metadata=dict(static=True))
    backoff_factor: float = dataclasses.field(default=0.5, metadata=dict(static=True))
    growth_interval: int = dataclasses.field(default=2000, metadata=dict(static=True))
    min_scale: float = dataclasses.field(default=MIN_SCALE, metadata=dict(static=True))
    max_scale: float = dataclasses.field(default=MAX_SCALE, metadata=dict(static=True))
    hysteresis: int = dataclasses.field(default=1, metadata=dict(static=True))

    @property
    def is_dynamic(self) -> bool:
        return self.kind == DYNAMIC

    @property
    def enabled(self) -> bool:
        return self.kind != NONE


jax.tree_util.register_dataclass(
    LossScaleState,
    data_fields=["scale", "growth_tracker", "overflow_streak"],
    meta_fields=[
        "kind",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "min_scale",
        "max_scale",
        "hysteresis",
    ],
)


# --------------------------------------------------------------------------
# Validation helpers (host-side, at construction).


def is_real_number(x: Any) -> bool:
    """A Python (or NumPy) real number, not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_integer(x: Any) -> bool:
    """A Python (or NumPy) integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def saturating_increment(count: jax.Array, where: Any) -> jax.Array:
    """``count + where`` for an int32 counter, held at 2**31 - 1 instead of wrapping."""
    return jnp.where(where & (count < INT32_MAX), count + 1, count)


def _scalar_float(name: str, value: Any) -> float:
    """A Python float from a number or a concrete float32/float64 0-d array."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"Expected `{name}` to be a concrete Python number, got a traced value instead; "
            "build the loss-scale state outside `jit`."
        )
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        dtype = np.dtype(value.dtype)
        if dtype not in (np.dtype(np.float32), np.dtype(np.float64)) and not np.issubdtype(
            dtype, np.integer
        ):
            raise TypeError(
                f"Expected `{name}` to be a Python number or a float32/float64 scalar, got an "
                f"array of dtype {dtype} instead; a {dtype} scale cannot represent the range a "
                "loss scale needs. Pass a Python float."
            )
        if np.ndim(value) != 0:
            raise ValueError(
                f"Expected `{name}` to be a scalar, got an array of shape {np.shape(value)} "
                "instead."
            )
        return float(np.asarray(value))
    if not is_real_number(value):
        raise TypeError(f"Expected `{name}` to be a real number, got {value!r} instead.")
    return float(value)


def _check_bound(name: str, value: float) -> float:
    if not (math.isfinite(value) and MIN_SCALE <= value <= MAX_SCALE):
        raise ValueError(
            f"Expected `{name}` in [2**-126, 2**126] (so that 1/scale is a normal float32), "
            f"got {name}={value!r} instead."
        )
    return value


def _check_scale(name: str, value: Any, lo: float = MIN_SCALE, hi: float = MAX_SCALE) -> float:
    v = _scalar_float(name, value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"Expected `{name}` to be positive and finite, got {name}={v!r} instead.")
    f32 = float(np.float32(v)) if v <= float(np.finfo(np.float32).max) else math.inf
    if not (lo <= f32 <= hi):
        raise ValueError(
            f"Expected `{name}` within [min_scale, max_scale] = [{lo!r}, {hi!r}] after rounding "
            f"to float32, got {name}={v!r} instead."
        )
    return v


def _make_state(kind: str, scale: float, **config: Any) -> LossScaleState:
    # Strongly typed device arrays, so a jitted step never sees a weak type or
    # copies a host value on its first call.
    return LossScaleState(
        scale=jnp.asarray(scale, dtype=jnp.float32),
        growth_tracker=jnp.zeros((), dtype=jnp.int32),
        overflow_streak=jnp.zeros((), dtype=jnp.int32),
        kind=kind,
        **config,
    )


# --------------------------------------------------------------------------
# Constructors.


def dynamic_loss_scale(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    *,
    min_scale: float = MIN_SCALE,
    max_scale: float = MAX_SCALE,
    hysteresis: int = 1,
) -> LossScaleState:
    """A dynamic loss scale with ``torch.amp.GradScaler``'s update rule.

    The defaults are PyTorch's. After every step, :func:`update` applies::

        if not finite:
            overflow_streak = min(overflow_streak + 1, hysteresis)
            if overflow_streak == hysteresis:       # always, when hysteresis == 1
                scale = max(scale * backoff_factor, min_scale)
            growth_tracker = 0
        else:
            overflow_streak = 0
            growth_tracker += 1
            if growth_tracker == growth_interval:
                grown = scale * growth_factor
                if isfinite(grown):
                    scale = min(grown, max_scale)
                growth_tracker = 0

    Products are computed as torch computes them, in double precision and then
    rounded to float32, so non-power-of-two factors match torch bit for bit
    (emulated exactly in integer arithmetic; x64 is never turned on).
    Unlike torch, the scale never leaves ``[min_scale, max_scale]``, so
    ``1/scale`` is always a normal float32 and the scale cannot collapse to 0.

    Args:
      init_scale: the first scale; positive, finite, within the bounds.
      growth_factor: multiplies the scale after ``growth_interval`` finite
        steps in a row; must be > 1.
      backoff_factor: multiplies the scale on a non-finite step; in (0, 1).
      growth_interval: finite steps in a row before the scale grows; an
        integer >= 1.
      min_scale: lower bound of the scale, in [2**-126, 2**126].
      max_scale: upper bound of the scale, in [min_scale, 2**126].
      hysteresis: back off only on the ``hysteresis``-th non-finite step in a
        row (and on every one after it), as DeepSpeed does with
        ``consecutive_hysteresis=True``; a finite step starts the count over.
        (Megatron-LM and DeepSpeed's default count non-finite steps since the
        scale last grew.) Every non-finite step is still reported and
        skipped. 1 is torch's rule.

    Returns:
      A :class:`LossScaleState`.

    Raises:
      ValueError: an argument is out of range; the message names it.
      TypeError: an argument has the wrong type.

    Examples:
      >>> import jamp
      >>> state = jamp.dynamic_loss_scale(init_scale=1024.0, growth_interval=2)
      >>> float(state.scale)
      1024.0
    """
    gf = _scalar_float("growth_factor", growth_factor)
    if not (math.isfinite(gf) and gf > 1.0):
        raise ValueError(
            f"Expected `growth_factor` > 1 and finite, got growth_factor={gf!r} instead."
        )
    bf = _scalar_float("backoff_factor", backoff_factor)
    if not (0.0 < bf < 1.0):
        raise ValueError(
            f"Expected `backoff_factor` in the open interval (0, 1), got backoff_factor={bf!r} "
            "instead."
        )
    if not is_integer(growth_interval):
        raise ValueError(
            f"Expected `growth_interval` to be an integer >= 1, got "
            f"growth_interval={growth_interval!r} instead."
        )
    if not (1 <= int(growth_interval) <= INT32_MAX):
        raise ValueError(
            f"Expected `growth_interval` to be an integer in [1, 2**31 - 1], got "
            f"growth_interval={growth_interval!r} instead."
        )
    if not is_integer(hysteresis):
        raise ValueError(
            f"Expected `hysteresis` to be an integer >= 1, got hysteresis={hysteresis!r} instead."
        )
    if not (1 <= int(hysteresis) <= INT32_MAX):
        raise ValueError(
            f"Expected `hysteresis` to be an integer >= 1, got hysteresis={hysteresis!r} instead."
        )
    lo = _check_bound("min_scale", _scalar_float("min_scale", min_scale))
    hi = _check_bound("max_scale", _scalar_float("max_scale", max_scale))
    if lo > hi:
        raise ValueError(
            f"Expected `min_scale` <= `max_scale`, got min_scale={lo!r} > max_scale={hi!r} instead."
        )
    init = _check_scale("init_scale", init_scale, lo, hi)
    return _make_state(
        DYNAMIC,
        init,
        growth_factor=gf,
        backoff_factor=bf,
        growth_interval=int(growth_interval),
        min_scale=lo,
        max_scale=hi,
        hysteresis=int(hysteresis),
    )


def static_loss_scale(scale: float) -> LossScaleState:
    """A loss scale that never changes.

    Args:
      scale: positive and finite, within [2**-126, 2**126].

    Returns:
      A :class:`LossScaleState` whose :func:`update` returns it unchanged.

    Examples:
      >>> import jamp
      >>> float(jamp.static_loss_scale(128.0).scale)
      128.0
    """
    s = _check_scale("scale", scale)
    return _make_state(STATIC, s)


def no_loss_scale() -> LossScaleState:
    """A disabled loss scale: ``scale``/``unscale`` are the identity, scale 1.

    Examples:
      >>> import jamp
      >>> state = jamp.no_loss_scale()
      >>> jamp.scale(state, 3.0)
      3.0
    """
    return _make_state(NONE, 1.0)


# --------------------------------------------------------------------------
# Leaf handling shared by scale, unscale and the finite checks.


def _is_float_dtype(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact) and dtype != jax.dtypes.float0


def leaf_kind(path: Any, leaf: Any, fn: str) -> str:
    """Classify a leaf: ``"float"`` (scaled), ``"pass"`` (returned as is).

    Raises a TypeError naming the path for anything that is not an array.
    """
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or hasattr(leaf, "__jax_array__"):
        dtype = leaf.dtype
        return "float" if _is_float_dtype(dtype) else "pass"
    if isinstance(leaf, bool) or isinstance(leaf, numbers.Integral):
        return "pass"
    if isinstance(leaf, (float, complex)):
        return "float"
    raise TypeError(
        f"`jamp.{fn}` expected a pytree of arrays, got a leaf of type "
        f"{type(leaf).__name__} at path {jax.tree_util.keystr(path) or '<root>'} "
        f"({leaf!r:.60}) instead."
    )


def _is_half(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def as_array(x: Any) -> jax.Array:
    """A leaf as an array: a Python float as float32 (complex as complex64), as
    in PyTorch; a NumPy scalar (``np.float64(1.5)``) keeps its dtype."""
    if isinstance(x, (float, complex)) and not isinstance(x, np.generic):
        x = jnp.asarray(x, dtype=jnp.float32 if isinstance(x, float) else jnp.complex64)
    return jnp.asarray(x)


def _scale_leaf(x: Any, s: jax.Array) -> Any:
    x = as_array(x)
    if _is_half(x.dtype):
        prod = x.astype(jnp.float32) * s
        # A 0-d half loss comes back float32 (torch's promotion of a 0-d
        # tensor against the float32 scale), so the scaled loss cannot overflow.
        return prod if x.ndim == 0 else prod.astype(x.dtype)
    return x * s.astype(x.dtype)


def _unscale_leaf(x: Any, inv: jax.Array) -> Any:
    x = as_array(x)
    if _is_half(x.dtype):
        # torch: round_to_dtype(float(x) * inv_scale): float32 arithmetic, one rounding.
        return (x.astype(jnp.float32) * inv).astype(x.dtype)
    return x * inv.astype(x.dtype)


def map_floating(fn: Any, tree: Any, name: str) -> Any:
    """Apply ``fn`` to every floating leaf; pass the others through."""

    def visit(path: Any, leaf: Any) -> Any:
        if leaf_kind(path, leaf, name) == "float":
            return fn(leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(visit, tree)


def _check_state(state: Any, fn: str) -> None:
    if not isinstance(state, LossScaleState):
        raise TypeError(
            f"`jamp.{fn}` expected `state` to be a LossScaleState (from "
            f"jamp.dynamic_loss_scale, static_loss_scale or no_loss_scale), got "
            f"{type(state).__name__} instead."
        )


# --------------------------------------------------------------------------
# Pure functions.


def scale(state: LossScaleState, tree: Any) -> Any:
    """Multiply every floating leaf of ``tree`` by the loss scale.

    Each array leaf keeps its dtype, except that a 0-d float16/bfloat16 leaf
    (a loss) comes back float32, as in torch, so the scaled loss itself cannot
    overflow. Integer, boolean and ``float0`` leaves and ``None`` pass through.
    With a disabled state (:func:`no_loss_scale`) ``tree`` is returned as is.

    Args:
      state: a :class:`LossScaleState`.
      tree: a loss, or any pytree of losses/outputs.

    Returns:
      The scaled tree.

    Raises:
      TypeError: a leaf is not an array; the message names its path.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> state = jamp.static_loss_scale(4.0)
      >>> jamp.scale(state, {"a": jnp.float32(1.5), "n": jnp.int32(3)})
      {'a': Array(6., dtype=float32), 'n': Array(3, dtype=int32)}
    """
    _check_state(state, "scale")
    if not state.enabled:
        map_floating(lambda x: x, tree, "scale")  # validate leaves all the same
        return tree
    return map_floating(lambda x: _scale_leaf(x, state.scale), tree, "scale")


def inverse_scale(state: LossScaleState) -> jax.Array:
    """``1/scale`` in float32, correctly rounded (torch's ``inv_scale``)."""
    return jnp.float32(1.0) / state.scale


def unscale(state: LossScaleState, tree: Any) -> Any:
    """Multiply every floating leaf of ``tree`` by ``1/scale``, keeping dtypes.

    ``1/scale`` is computed once in float32 (torch's ``inv_scale``);
    float16/bfloat16 leaves are multiplied in float32 and rounded back once,
    exactly as torch's unscale kernel does.

    Args:
      state: a :class:`LossScaleState`.
      tree: any pytree, usually gradients.

    Returns:
      The unscaled tree, every leaf in its own dtype.

    Raises:
      TypeError: a leaf is not an array; the message names its path.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> state = jamp.static_loss_scale(4.0)
      >>> jamp.unscale(state, jnp.array([8.0, 2.0], jnp.bfloat16))
      Array([2, 0.5], dtype=bfloat16)
    """
    _check_state(state, "unscale")
    if not state.enabled:
        map_floating(lambda x: x, tree, "unscale")
        return tree
    inv = inverse_scale(state)
    return map_floating(lambda x: _unscale_leaf(x, inv), tree, "unscale")


# --------------------------------------------------------------------------
# The update rule.


def _split_double(f: float) -> tuple[int, int]:
    """``f = mantissa * 2**exp`` with a 53-bit mantissa in [2**52, 2**53)."""
    m, e = math.frexp(f)  # f = m * 2**e, 0.5 <= m < 1
    mant = int(m * 2.0**53)
    return mant, e - 53


def _limb_bit(limbs: list, pos: int) -> jax.Array:
    return (limbs[pos // 16] >> (pos % 16)) & jnp.uint32(1)


def _limbs_nonzero_below(limbs: list, pos: int) -> jax.Array:
    """Whether any bit strictly below bit ``pos`` is set."""
    acc = jnp.uint32(0)
    for k in range(pos // 16):
        acc = acc | limbs[k]
    if pos % 16:
        acc = acc | (limbs[pos // 16] & jnp.uint32((1 << (pos % 16)) - 1))
    return acc != 0


def _shift_round_even(limbs: list, n: int) -> list:
    """``round_half_even(value / 2**n)`` for a value held in 16-bit limbs."""
    u32 = jnp.uint32
    out = []
    for i in range(len(limbs)):
        pos = 16 * i + n
        k, off = divmod(pos, 16)
        if k >= len(limbs):
            out.append(u32(0))
            continue
        v = limbs[k] >> off
        if off and k + 1 < len(limbs):
            v = v | ((limbs[k + 1] << (16 - off)) & u32(0xFFFF))
        out.append(v & u32(0xFFFF))
    half = _limb_bit(limbs, n - 1) == 1
    odd = (out[0] & u32(1)) == 1
    carry = (half & (_limbs_nonzero_below(limbs, n - 1) | odd)).astype(u32)
    for i in range(len(out)):
        v = out[i] + carry
        out[i], carry = v & u32(0xFFFF), v >> 16
    return out


def mul_as_torch(s: jax.Array, factor: float) -> jax.Array:
    """torch's ``(float)((double)s * factor)`` for a positive normal float32 ``s``.

    When ``factor`` is exact in float32 this is a float32 multiply: the double
    product of two float32 numbers is exact, so both equal one rounding of the
    exact product. Otherwise the exact product of the 24-bit and 53-bit
    mantissas is formed in 16-bit limbs of uint32 arithmetic, rounded to 53
    bits (the double product) and then to 24 bits (the cast), each to nearest
    even, so the result equals torch's bit for bit with no x64 anywhere.
    Results below the float32 normal range come back as 0 and results that
    overflow as +inf; callers clamp to ``[min_scale, max_scale]`` anyway.
    """
    if float(np.float32(factor)) == factor:
        return s * jnp.float32(factor)
    big, fexp = _split_double(factor)
    u32 = jnp.uint32
    bits = jax.lax.bitcast_convert_type(s, u32)
    sexp = ((bits >> 23) & u32(0xFF)).astype(jnp.int32) - 127
    mant = (bits & u32(0x7FFFFF)) | u32(0x800000)  # 24 bits
    a = [mant & u32(0xFFFF), mant >> 16]  # 16-bit limbs of the float32 mantissa
    b = [(big >> (16 * k)) & 0xFFFF for k in range(4)]  # static limbs of the double's
    cols = [u32(0)] * 6
    for i, ai in enumerate(a):
        for j, bj in enumerate(b):
            if bj:
                pp = ai * u32(bj)  # < 2**32
                cols[i + j] = cols[i + j] + (pp & u32(0xFFFF))
                cols[i + j + 1] = cols[i + j + 1] + (pp >> 16)
    for k in range(5):
        cols[k + 1] = cols[k + 1] + (cols[k] >> 16)
        cols[k] = cols[k] & u32(0xFFFF)
    # The exact product lies in [2**75, 2**77); ``top`` says whether bit 76 is set.
    top = cols[4] >= u32(1 << 12)
    results = []
    for drop in (23, 24):  # bits below the 53-bit double mantissa
        q = _shift_round_even(cols, drop)  # the double product, 53 (or 54 after carry) bits
        m = _shift_round_even(q, 29)  # the float32 mantissa, 24 (or 25 after carry) bits
        results.append(m[0] | (m[1] << 16))
    m24 = jnp.where(top, results[1], results[0])
    carry = m24 >= u32(1 << 24)
    m24 = jnp.where(carry, m24 >> 1, m24)
    # s = mant * 2**(sexp - 23) and factor = big * 2**fexp, so the product is
    # 1.m * 2**(sexp + fexp + 52 + top), one more after a rounding carry.
    exp = sexp + jnp.int32(fexp + 52) + top.astype(jnp.int32) + carry.astype(jnp.int32)
    biased = exp + 127
    out_bits = (biased.astype(u32) << 23) | (m24 & u32(0x7FFFFF))
    out = jax.lax.bitcast_convert_type(out_bits, jnp.float32)
    out = jnp.where(biased >= 255, jnp.float32(jnp.inf), out)
    return jnp.where(biased <= 0, jnp.float32(0.0), out)


def check_bool_scalar(value: Any, name: str, source: str) -> jax.Array:
    """``value`` as a boolean scalar array, or a TypeError/ValueError naming ``name``."""
    if isinstance(value, bool):
        return jnp.asarray(value)
    dtype = getattr(value, "dtype", None)
    shape = getattr(value, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(
            f"Expected `{name}` to be a boolean scalar array ({source}), got "
            f"{type(value).__name__} instead."
        )
    if dtype != jnp.bool_:
        raise TypeError(
            f"Expected `{name}` to be a boolean scalar, got dtype {dtype} instead; pass the "
            f"flag {source}."
        )
    if tuple(shape) != ():
        raise ValueError(
            f"Expected `{name}` to be a scalar (shape ()), got shape {tuple(shape)} instead; "
            "reduce it over the whole tree with jamp.all_finite."
        )
    return value


def update(state: LossScaleState, finite: Any) -> LossScaleState:
    """The loss-scale state after a step whose gradients were ``finite``.

    Applies the rule documented in :func:`dynamic_loss_scale`. A static or
    disabled state is returned unchanged.

    Args:
      state: a :class:`LossScaleState`.
      finite: a boolean scalar, ``True`` when the step's gradients were all
        finite (from :func:`jamp.all_finite` or :func:`jamp.unscale_and_check`).

    Returns:
      The new state, with the same static configuration.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> state = jamp.dynamic_loss_scale(init_scale=8.0, growth_interval=1)
      >>> float(jamp.update(state, jnp.bool_(True)).scale)
      16.0
      >>> float(jamp.update(state, jnp.bool_(False)).scale)
      4.0
    """
    _check_state(state, "update")
    finite = check_bool_scalar(finite, "finite", "from jamp.all_finite / jamp.unscale_and_check")
    if not state.is_dynamic:
        return state
    s, tracker, streak = state.scale, state.growth_tracker, state.overflow_streak
    lo, hi = jnp.float32(state.min_scale), jnp.float32(state.max_scale)

    # Non-finite branch.
    streak_bad = jnp.minimum(streak + 1, jnp.int32(state.hysteresis))
    backed_off = jnp.maximum(mul_as_torch(s, state.backoff_factor), lo)
    s_bad = jnp.where(streak_bad >= state.hysteresis, backed_off, s)

    # Finite branch.
    k = saturating_increment(tracker, True)  # never wraps
    grow = k == jnp.int32(state.growth_interval)
    grown = mul_as_torch(s, state.growth_factor)
    grown = jnp.where(jnp.isfinite(grown), jnp.minimum(grown, hi), s)
    s_good = jnp.where(grow, grown, s)
    tracker_good = jnp.where(grow, jnp.int32(0), k)

    return dataclasses.replace(
        state,
        scale=jnp.where(finite, s_good, s_bad),
        growth_tracker=jnp.where(finite, tracker_good, jnp.int32(0)),
        overflow_streak=jnp.where(finite, jnp.int32(0), streak_bad),
    )


def backoff(state: LossScaleState) -> LossScaleState:
    """The state after an unconditional backoff (used to retry at a lower scale).

    Unlike ``update(state, False)`` this ignores ``hysteresis``: retrying at the
    same scale would overflow again. A static or disabled state is returned
    unchanged.
    """
    _check_state(state, "backoff")
    if not state.is_dynamic:
        return state
    lo = jnp.float32(state.min_scale)
    return dataclasses.replace(
        state,
        scale=jnp.maximum(mul_as_torch(state.scale, state.backoff_factor), lo),
        growth_tracker=jnp.zeros((), jnp.int32),
        overflow_streak=jnp.zeros((), jnp.int32),
    )
