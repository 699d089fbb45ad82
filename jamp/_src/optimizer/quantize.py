"""Block-quantised storage for optimizer state: 8-bit log codes and float8, each block of
256 values with its float32 absmax (bitsandbytes' and torchao's layout).

The codes are chosen for what they hold:

- ``"signed"`` (a first moment, ``mu``): a sign bit and 7 bits of magnitude; 127
  levels, eight per octave down to ``2**-15.75`` of the block's absmax, and zero;
- ``"positive"`` (a second moment, ``nu``: positive and spanning many decades): 255
  levels, eight per octave down to ``2**-31.75`` of the absmax, and zero. A positive
  value never rounds to zero: below the last level it is held as the last level,
  since adam divides by ``sqrt(nu)``, and a ``nu`` of zero under a nonzero ``mu``
  would be a step of ``mu / eps``;
- float8 (``e4m3fn`` or ``e5m2``): the block scaled so its absmax is the format's
  largest value, then rounded; positive fields again never round to zero. A second
  moment in ``e5m2`` is held as it is: its subnormals reach ``2**-31.8`` of the
  absmax, the positive 8-bit code's range. ``e4m3fn``'s reach only ``2**-17.8``, so
  there it is held as its square root, scaled (``"float8-root"``), which needs half
  the decades: ``2**-35.6``. Its stochastic rounding is unbiased in the square, the
  value adam reads. A block's scale is its absmax, or, for a block of tiny values,
  the least that keeps the decoding's factor a normal float32: such a block is not
  flushed to zero.

The levels are powers of two, so a code is found with one ``log2`` and decoded with
one ``exp2``: no table, no search, all elementwise after the block's absmax.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jamp._src.dtypes import E4M3
from jamp._src.optimizer.rounding import neighbour, stochastic_round, uniform

BLOCK = 256
# A leaf smaller than this stays float32: its blocks' absmax would cost more than they
# save, and these are biases and norms (bitsandbytes and torchao keep them too).
MIN_SIZE = 4096
# A leaf's block count is padded up to a multiple of the largest power of two that
# divides the leaf's first axis (at most this, and at most the block count): FSDP shards
# that axis over a mesh axis, and when the mesh axis divides the block count XLA shards
# the blocks too. Otherwise the leaf's state is replicated, a whole copy on every device
# (issue #45). Fewer padding blocks than the multiple, so under 16 KB a leaf; none where
# the count divides already (a 1024 x 1024 leaf's 4,096 blocks).
SHARD_BLOCKS = 64
_PER_OCTAVE = 8.0
# The largest level index of each log code: its smallest level is 2**(-LAST / 8).
_LAST = {"signed": 126, "positive": 254}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockQuantized:
    """A floating array stored as codes in blocks of 256, each with its float32 absmax.

    Attributes:
      codes: ``(blocks, 256)``, uint8 for the 8-bit log codes, float8 for float8.
      absmax: float32 ``(blocks,)``, each block's largest magnitude.
      shape: the array's shape (static).
      code: ``"signed"``, ``"positive"`` (8-bit log codes), or ``"float8-signed"`` /
        ``"float8-positive"`` / ``"float8-root"`` (a positive field's square root, scaled:
        ``e4m3fn``'s form of a second moment) (static).
    """

    codes: jax.Array
    absmax: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    code: str = dataclasses.field(metadata=dict(static=True))


def _blocks(x: jax.Array) -> jax.Array:
    flat = x.reshape(-1)
    pad = math.prod(padded_shape(x.shape)) - flat.size
    if pad:
        flat = jnp.concatenate([flat, jnp.zeros((pad,), flat.dtype)])
    return flat.reshape(-1, BLOCK)


def _unblock(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return blocks.reshape(-1)[: math.prod(shape)].reshape(shape)


def _log_encode(ratio: jax.Array, last: int, positive: bool, u: jax.Array | None) -> jax.Array:
    """Level indices (0 is zero, ``k >= 1`` is ``2**(-(k - 1) / 8)``) of magnitudes
    ``ratio`` in ``[0, 1]``, to nearest in value or stochastically (unbiased)."""
    z = jnp.clip(-_PER_OCTAVE * jnp.log2(ratio), 0.0, float(last))  # inf at 0: clipped
    lower = jnp.floor(z)
    big = jnp.exp2(-lower / _PER_OCTAVE)  # the level at or above ratio
    small = jnp.exp2(-(lower + 1.0) / _PER_OCTAVE)
    small_index = lower + 2.0
    # Below the last level the next one down is zero, for a signed code.
    tail = lower >= float(last)
    small = jnp.where(tail, 0.0, small)
    small_index = jnp.where(tail, 0.0, small_index)
    if positive:  # never to zero: below the last level, the last level
        small = jnp.where(tail, big, small)
        small_index = jnp.where(tail, lower + 1.0, small_index)
    p_small = jnp.clip((big - ratio) / (big - small), 0.0, 1.0)
    p_small = jnp.where(big == small, 0.0, p_small)
    take_small = (p_small > 0.5) if u is None else (u < p_small)
    index = jnp.where(take_small, small_index, lower + 1.0)
    return jnp.where(ratio > 0, index, 0.0).astype(jnp.uint8)


def _log_decode(index: jax.Array) -> jax.Array:
    k = index.astype(jnp.float32)
    return jnp.where(index > 0, jnp.exp2(-(k - 1.0) / _PER_OCTAVE), 0.0)


def quantize(x: jax.Array, code: str, dtype: DTypeLike, bits: jax.Array | None) -> BlockQuantized:
    """``x`` (float32) in blocks of 256: ``code`` is ``"signed"`` or ``"positive"``;
    ``dtype`` is ``uint8`` (the log codes) or a float8 dtype; ``bits`` (uint32, one per
    element of the padded blocks) rounds stochastically, ``None`` to nearest."""
    blocks = _blocks(x)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    safe = jnp.where(absmax > 0, absmax, 1.0)[:, None]
    positive = code == "positive"
    if jnp.dtype(dtype) == jnp.uint8:
        ratio = jnp.abs(blocks) / safe
        u = None if bits is None else uniform(bits)
        if positive:
            codes = _log_encode(ratio, _LAST[code], True, u)
        else:
            magnitude = _log_encode(ratio, _LAST[code], False, u)
            codes = magnitude | jnp.where(blocks < 0, np.uint8(0x80), np.uint8(0))
        return BlockQuantized(codes, absmax, tuple(x.shape), code)
    top = float(jnp.finfo(dtype).max)
    root = positive and jnp.dtype(dtype) == E4M3
    ratio = blocks / _base(absmax, top, root)[:, None]
    if root:  # e4m3fn's 17.8 octaves hold a second moment's square root, not the moment
        scaled = jnp.clip(jnp.sqrt(ratio) * top, 0.0, top)
        codes = scaled.astype(dtype) if bits is None else _round_square(scaled, dtype, bits)
    else:
        scaled = jnp.clip(ratio * top, -top, top)
        codes = scaled.astype(dtype) if bits is None else stochastic_round(scaled, dtype, bits)
    if positive:  # a positive value never to zero: the smallest subnormal instead
        zero = jnp.zeros((), dtype)
        codes = jnp.where((scaled > 0) & (codes == zero), neighbour(zero, jnp.array(True)), codes)
    kind = "root" if root else code
    return BlockQuantized(codes, absmax, tuple(x.shape), "float8-" + kind)


def _base(absmax: jax.Array, top: float, root: bool) -> jax.Array:
    """The value each block's codes are scaled to: its absmax, but no less than what
    keeps the decoding's per-block factor (``base / top``, ``base / top**2`` for a root)
    a normal float32. XLA folds that factor out of the elementwise decode under ``jit``,
    and a subnormal factor is flushed to zero on XLA:CPU, zeroing a block of tiny values.
    A value float32 holds as a normal number still gets a normal code (at least 1)."""
    return jnp.maximum(absmax, np.float32(2.0**-126 * top ** (2 if root else 1)))


def _round_square(s: jax.Array, dtype: DTypeLike, bits: jax.Array) -> jax.Array:
    """``s >= 0`` (float32) into ``dtype`` up or down at random, unbiased in ``s**2``: a
    root stored for a second moment rounds so that the moment, its square, is right on
    average (rounding the root unbiased would bias the square up by its variance, and
    adam's ``nu`` would drift up by it every step)."""
    y = s.astype(dtype)
    low = y.astype(jnp.float32)
    other = neighbour(y, s > low)
    high = other.astype(jnp.float32)
    # NaN (s held exactly, or at the format's largest) keeps y, as stochastic_round does.
    fraction = jnp.abs(s * s - low * low) / jnp.abs(high * high - low * low)
    return jnp.where(uniform(bits) < fraction, other, y)


def dequantize(q: BlockQuantized) -> jax.Array:
    """The float32 array ``q`` holds."""
    if q.code in _LAST:
        magnitude = q.codes & np.uint8(0x7F) if q.code == "signed" else q.codes
        values = _log_decode(magnitude)
        if q.code == "signed":
            values = jnp.where(q.codes >= np.uint8(0x80), -values, values)
        blocks = values * q.absmax[:, None]
    else:
        top = float(jnp.finfo(q.codes.dtype).max)
        root = q.code == "float8-root"
        fraction = q.codes.astype(jnp.float32) / top
        if root:
            fraction = fraction * fraction
        blocks = fraction * _base(q.absmax, top, root)[:, None]
    return _unblock(blocks, q.shape)


def padded_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The blocks' shape for an array of ``shape``: its elements in blocks of 256, the
    block count padded to a multiple of ``_shard_multiple``."""
    blocks = -(-math.prod(shape) // BLOCK)
    multiple = _shard_multiple(shape, blocks)
    return (-(-blocks // multiple) * multiple, BLOCK)


def _shard_multiple(shape: tuple[int, ...], blocks: int) -> int:
    """The largest power of two dividing ``shape[0]``, at most ``SHARD_BLOCKS`` and
    ``blocks``."""
    if not shape or shape[0] == 0 or blocks == 0:
        return 1
    top = 1 << (min(blocks, SHARD_BLOCKS).bit_length() - 1)
    return min(shape[0] & -shape[0], top)
