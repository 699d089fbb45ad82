"""Rounding float32 into a narrower float: to nearest, stochastically, and split exactly.

Three pieces, elementwise, so XLA fuses each into the optimizer's pass:

- ``step_key`` and ``random_bits``, a counter-based hash of ``(seed, step,
  leaf, element)``: the bits are made inside the kernel that uses them, from the
  element's global index (an ``iota``), so they do not depend on how the array is
  sharded;
- ``stochastic_round``, unbiased rounding into any narrower float (bfloat16,
  float16, float8): ``E[round(x)] == x``;
- ``split`` / ``merge``, a float32 master held exactly as its bfloat16
  rounding plus the 16 low bits (Transformer Engine's "parameter remainders").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

# Domains of the random streams: the parameters' write-back and the stored moments draw
# from different streams even under the same seed.
PARAMETERS, MOMENTS = 1, 2

_U32 = np.uint32
_GOLDEN = _U32(0x9E3779B9)


def _mix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection of uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * _U32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _U32(0xC2B2AE35)
    return h ^ (h >> 16)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major index in the whole array, as uint32 (wraps past 2**32)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, d) * _U32(stride % 2**32)
        stride *= shape[d]
    return index


def step_key(seed: int, domain: int, count: jax.Array) -> jax.Array:
    """The uint32 key of one step's random stream: ``seed``, ``domain`` and ``count``
    (the step) mixed. One scalar for all leaves: each leaf adds its own constant in
    the kernel that draws the bits (XLA fuses an add of a scalar there, not a mix),
    so a step spends one small kernel on its key, not one per leaf."""
    salt = _U32((seed * 0x632BE5AB + domain * 0x6C8E9CF5) % 2**32)
    return _mix(_mix(jnp.asarray(count, jnp.uint32) * _GOLDEN + salt) ^ salt)


def random_bits(key: jax.Array, leaf: int, shape: tuple[int, ...]) -> jax.Array:
    """uint32 bits for every element of a leaf, from the step's ``key``, the leaf's index
    and each element's global index.

    A counter-based generator: two murmur3 finalisers over the element's index and
    the key plus the leaf's constant. The same arguments give the same bits on any
    device and under any sharding; a new step's key gives fresh bits.
    """
    base = key + _U32((leaf * 0x2545F491) % 2**32)
    return _mix(_mix(_flat_index(shape) * _GOLDEN + base) ^ (base >> 7) ^ _U32(0x5BD1E995))


def uniform(bits: jax.Array) -> jax.Array:
    """float32 in ``[0, 1)`` from uint32 bits, on a grid of ``2**-24`` (exactly)."""
    return (bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def neighbour(y: jax.Array, away_from_zero: jax.Array) -> jax.Array:
    """The next value of ``y``'s format, one step away from zero or toward it (an IEEE
    format's bits are sign and magnitude: one more is the next larger magnitude)."""
    uint = _UINT[jnp.dtype(y.dtype).itemsize]
    bits = lax.bitcast_convert_type(y, uint)
    one = jnp.ones((), uint)
    return lax.bitcast_convert_type(jnp.where(away_from_zero, bits + one, bits - one), y.dtype)


def stochastic_round(x: jax.Array, dtype: DTypeLike, bits: jax.Array) -> jax.Array:
    """``x`` (float32) rounded into ``dtype`` up or down at random, unbiased.

    It takes the neighbour of ``x``'s nearest rounding on the other side of ``x``
    with probability ``|x - nearest| / |neighbour - nearest|``, so that
    ``E[round(x)] == x`` (to ``2**-24`` in the probability). A value the format
    holds comes back as it is; a value past the format's largest finite one
    rounds as a cast does; NaN and infinities pass through.
    """
    y = x.astype(dtype)
    back = y.astype(jnp.float32)
    other = neighbour(y, jnp.abs(x) > jnp.abs(back))
    # Exact in float32: both are neighbours of x in a narrower format.
    fraction = jnp.abs(x - back) / jnp.abs(other.astype(jnp.float32) - back)
    # A NaN fraction (x held exactly at zero, or past the largest value) keeps y.
    return jnp.where(uniform(bits) < fraction, other, y)


def round_to(x: jax.Array, dtype: DTypeLike, bits: jax.Array | None) -> jax.Array:
    """``x`` into ``dtype``: stochastically with ``bits``, to nearest without."""
    return x.astype(dtype) if bits is None else stochastic_round(x, dtype, bits)


_SIGN = _U32(0x80000000)
_HALF = _U32(0x8000)
_NAN_HIGH = _U32(0x7FC0)


def split(master: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A float32 ``master`` as ``(high, low)``: bfloat16 and int16, exactly.

    ``high`` is ``master`` rounded to nearest bfloat16 with ties away from zero;
    ``low`` is the rest, ``master``'s bits minus ``high``'s (shifted up 16), which
    lies in ``[-2**15, 2**15)`` and so fits int16 with no exception. Ties to even,
    as a cast rounds, cannot be held in 16 bits: an even bfloat16 has 65,537 float32
    values that round to it (both ties). Ties away from zero give each bfloat16
    exactly 65,536. ``merge(*split(m))`` is ``m``, bit for bit, for every float32
    but NaN (which stays a NaN).
    """
    bits = lax.bitcast_convert_type(master, jnp.uint32)
    sign = bits & _SIGN
    magnitude = bits & ~_SIGN
    high = (magnitude + _HALF) >> 16  # at most 0x8000, from a NaN only
    nan = magnitude > _U32(0x7F800000)
    high = jnp.where(nan, _NAN_HIGH, high)
    low = jnp.where(nan, _U32(0), magnitude - (high << 16))  # wraps to the negative ones
    param = lax.bitcast_convert_type(((sign >> 16) | high).astype(jnp.uint16), jnp.bfloat16)
    return param, lax.bitcast_convert_type(low, jnp.int32).astype(jnp.int16)


def merge(high: jax.Array, low: jax.Array) -> jax.Array:
    """The float32 master from its bfloat16 ``high`` part and int16 ``low`` part."""
    bits = lax.bitcast_convert_type(high, jnp.uint16).astype(jnp.uint32)
    sign = (bits & _U32(0x8000)) << 16
    magnitude = ((bits & _U32(0x7FFF)) << 16) + lax.bitcast_convert_type(
        low.astype(jnp.int32), jnp.uint32
    )
    return lax.bitcast_convert_type(sign | magnitude, jnp.float32)


def reach(param: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The update that moves ``param`` to ``target`` (both of one narrow dtype) through
    ``param + update``, as ``optax.apply_updates`` adds it, and what that add gives.

    The difference is taken in float32 and rounded to the parameter's dtype; it is
    exact, and the add lands on ``target``, unless the step is larger than where it
    lands (a parameter that crosses zero or lands near it): then no update of that
    dtype reaches ``target`` (from 256, bfloat16 updates reach only whole numbers
    near 1, not 1.0078125), and the add gives the nearest value it can. A parameter that
    stays gets ``-0.0``: ``p + -0.0`` is ``p`` for every ``p``, where the difference,
    ``+0.0``, would turn a ``-0.0`` parameter into ``0.0``.
    """
    update = (target.astype(jnp.float32) - param.astype(jnp.float32)).astype(param.dtype)
    update = jnp.where(same_bits(param, target), jnp.array(-0.0, param.dtype), update)
    return update, param + update


def same_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    """Whether ``a`` and ``b`` (one dtype) are the same value bit for bit (``-0.0`` is
    not ``0.0``; a NaN is itself)."""
    uint = _UINT[jnp.dtype(a.dtype).itemsize]
    return lax.bitcast_convert_type(a, uint) == lax.bitcast_convert_type(b, uint)


# The elements of a leaf whose fingerprint the state keeps: XLA reads them in a kernel of
# their own, and 256 of them cost nothing beside the step.
SAMPLE = 256


def checksum(x: jax.Array) -> jax.Array:
    """A uint32 fingerprint of ``SAMPLE`` elements of ``x`` (a floating array) spread
    evenly over it (all of them, in a smaller array): each element's bits mixed with its
    place, summed modulo ``2**32``. An integer sum does not depend on its order, so it is
    the same under any sharding or fusion. A zero counts as ``+0.0`` whatever its sign:
    an add of ``0.0`` turns ``-0.0`` into ``+0.0`` and changes no value it is used as.

    A sample, not the whole array: a fingerprint of every element is a reduction that
    XLA does not fuse into the optimizer's pass, and it costs a second read of the
    parameters (on the H200 compile of adamw's step, 26 bytes a parameter became 36).
    """
    with jax.named_scope("fingerprint"):  # named in the compiled program's kernels
        flat = x.reshape(-1)
        stride = max(1, flat.size // SAMPLE)
        sample = flat[::stride][:SAMPLE]
        uint = _UINT[jnp.dtype(x.dtype).itemsize]
        bits = lax.bitcast_convert_type(sample, uint).astype(jnp.uint32)
        bits = jnp.where(sample == jnp.zeros((), x.dtype), _U32(0), bits)
        place = _mix(lax.iota(jnp.uint32, sample.size) + _U32(0x68E31DA4))
        return jnp.sum(_mix(bits * _GOLDEN + place), dtype=jnp.uint32)
