"""torch's ``(float)((double)s * factor)``, exactly, without x64.

PyTorch multiplies its float32 scale by a Python (double) factor in double
precision and rounds once to float32. For a factor exact in float32 that is a
float32 multiply; for any other factor this module forms the exact product in
16-bit limbs of uint32 arithmetic and rounds it twice, as torch does, so a
scale grown by 1.5 or backed off by 0.3 equals torch's bit for bit.
Imports only jax and numpy.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


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
