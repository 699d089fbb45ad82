"""Finite-check formulations over a gradient-like tree, and one-pass read floors.

Every check maps a pytree to one bool scalar (True = all finite). The
"read" entries are not checks: they are plain reductions that read every byte
once and give the floor a check is compared against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jamp

# Leaf fractions of the total element count: a few big matrices, smaller
# matrices, and bias-sized vectors (like a real gradient tree).
_FRACTIONS = (0.35, 0.25, 0.15, 0.1, 0.06, 0.04, 0.03, 0.015, 0.005)
_BIASES = (4096, 2048, 1024, 10)


def make_tree(n: int, dtype: Any, seed: int = 0) -> dict[str, jax.Array]:
    """About ``n`` elements of ``dtype`` in leaves of varied shapes (2-D and 1-D)."""
    rng = np.random.default_rng(seed)
    tree = {}
    for i, f in enumerate(_FRACTIONS):
        m = max(1, int(n * f))
        cols = 1024 if m >= 1024 * 8 else 8
        rows = max(1, m // cols)
        tree[f"w{i}"] = jnp.asarray(rng.standard_normal((rows, cols), np.float32), dtype)
    for i, b in enumerate(_BIASES):
        if b * 50 <= n:
            tree[f"b{i}"] = jnp.asarray(rng.standard_normal((b,), np.float32), dtype)
    return tree


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def _and(bools):
    return functools.reduce(jnp.logical_and, bools)


def _add(xs):
    return functools.reduce(jnp.add, xs)


def _native_sum(x):
    """A sum accumulated in x's own dtype (jnp.sum upcasts float16/bfloat16)."""
    return lax.reduce(x, np.array(0, x.dtype), lax.add, tuple(range(x.ndim)))


_EXP_MASK = {2: (np.uint16, 0x7C00, 0x7F80), 4: (np.uint32, 0x7F800000, None)}


def _exp_bits(x):
    """The exponent field of every element, as an unsigned integer array."""
    bits = x.dtype.itemsize
    uint, mask16, maskbf = _EXP_MASK[bits]
    mask = 0x7F800000 if bits == 4 else (maskbf if x.dtype == jnp.bfloat16 else mask16)
    return lax.bitcast_convert_type(x, uint) & np.array(mask, uint), np.array(mask, uint)


# --------------------------------------------------------------- the checks


def peers_all_isfinite(tree):
    """jmp / optax.apply_if_finite: all(isfinite(x)) per leaf, stacked."""
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in _leaves(tree)]).all()


def sum_times_zero_native(tree):
    """sum(x * 0) per leaf in x's dtype (NaN iff a non-finite element)."""
    return jnp.isfinite(
        _add([_native_sum(x * jnp.zeros((), x.dtype)).astype(jnp.float32) for x in _leaves(tree)])
    )


def sum_times_zero_f32(tree):
    return jnp.isfinite(_add([jnp.sum(x.astype(jnp.float32) * 0.0) for x in _leaves(tree)]))


def sum_minus_self(tree):
    return jnp.isfinite(_add([_native_sum(x - x).astype(jnp.float32) for x in _leaves(tree)]))


def _exact(tree):
    return peers_all_isfinite(tree)


def jamp_scaled_check(tree):
    """jamp's check as the training step runs it: the flag of ``unscale_and_check``.

    Under ``jit`` the unscaled output is unused, so what runs is the check of
    the unscaled values from one read of the scaled tree (``1/scale <= 1``
    fast path, exact fallback of the unscaled values under ``lax.cond``).
    """
    return jamp.unscale_and_check(jamp.dynamic_loss_scale(2.0**15), tree)[1]


def sum_native_fallback(tree):
    s = _add([_native_sum(x).astype(jnp.float32) for x in _leaves(tree)])
    return lax.cond(jnp.isfinite(s), lambda: jnp.asarray(True), lambda: _exact(tree))


def concat_sum_times_zero(tree):
    """One reduction over the concatenation of every leaf (costs a copy)."""
    flat = jnp.concatenate([x.ravel().astype(jnp.float32) for x in _leaves(tree)])
    return jnp.isfinite(jnp.sum(flat * 0.0))


def exp_bits_max(tree):
    """max of the exponent bits per leaf < all-ones exponent (integer max: no NaN trap)."""
    bad = []
    for x in _leaves(tree):
        e, mask = _exp_bits(x)
        bad.append(jnp.max(e) == mask)
    return jnp.logical_not(_add([b.astype(jnp.int32) for b in bad]) > 0)


def max_abs_isfinite(tree):
    """isfinite(max|x|): WRONG on XLA:CPU (max drops NaN on >=4096 elements); for speed only."""
    return jnp.isfinite(_add([jnp.max(jnp.abs(x)).astype(jnp.float32) for x in _leaves(tree)]))


# --------------------------------------------------------------- read floors


def read_sum_native(tree):
    return _add([_native_sum(x).astype(jnp.float32) for x in _leaves(tree)])


def read_sum_f32(tree):
    return _add([jnp.sum(x, dtype=jnp.float32) for x in _leaves(tree)])


def read_max(tree):
    return _add([jnp.max(x).astype(jnp.float32) for x in _leaves(tree)])


def read_int_max(tree):
    return _add([jnp.max(e).astype(jnp.float32) for e, _ in map(_exp_bits, _leaves(tree))])


# jamp.all_finite is now the float32 sum per leaf with an exact all(isfinite)
# fallback under lax.cond (the former "isfinite(sum f32) + exact fallback" row).
CHECKS: dict[str, Callable] = {
    "jamp.all_finite": jamp.all_finite,
    "jamp.unscale_and_check flag (scale 2^15)": jamp_scaled_check,
    "peers: all(isfinite) per leaf": peers_all_isfinite,
    "sum(x*0) native dtype": sum_times_zero_native,
    "sum(x*0) float32": sum_times_zero_f32,
    "sum(x-x) native dtype": sum_minus_self,
    "isfinite(sum native) + exact fallback": sum_native_fallback,
    "concat + sum(x*0) f32": concat_sum_times_zero,
    "max(exponent bits) integer": exp_bits_max,
    "isfinite(max|x|) [unsound on CPU]": max_abs_isfinite,
}
JAMP_CHECKS = ("jamp.all_finite", "jamp.unscale_and_check flag (scale 2^15)")
READS: dict[str, Callable] = {
    "read: sum native": read_sum_native,
    "read: sum f32": read_sum_f32,
    "read: max": read_max,
    "read: integer max of bits": read_int_max,
}


@functools.cache
def _verify_trees(dtype_name: str) -> tuple:
    """A finite tree, a finite tree whose sums overflow, and three with one NaN/inf (built once)."""
    dtype = jnp.dtype(dtype_name)
    t = make_tree(20000, dtype)
    big = jnp.finfo(dtype).max
    huge = {k: jnp.full_like(v, big) for k, v in t.items()}
    bad = []
    for x in (jnp.nan, jnp.inf, -jnp.inf):
        t2 = dict(t)
        t2["w0"] = t["w0"].at[3, 5].set(x)
        bad.append(t2)
    return t, huge, tuple(bad)


def verify(fn: Callable, dtype: Any) -> bool:
    """Does ``fn`` flag a NaN and an inf in a large leaf, and pass a finite tree of huge values?"""
    t, huge, bad = _verify_trees(jnp.dtype(dtype).name)
    ok = bool(fn(t))
    ok &= bool(fn(huge))  # finite but a sum overflows
    for t2 in bad:
        ok &= not bool(fn(t2))
    return ok
