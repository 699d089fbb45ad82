"""The finite check on GPUs, TPUs and every platform but the CPU.

The check reads each gradient once: a float32 sum per leaf. A finite total
proves every element finite (an inf or NaN anywhere makes any sum inf or
NaN), and when ``1/scale <= 1`` a finite gradient stays finite once unscaled.
Only when that fails (a real overflow, a finite sum too large for float32, or
a scale below 1) does an exact element-by-element pass run, under a
``lax.cond``, so a clean step pays for one read. float16 leaves are checked
element by element on the one read instead of summed.

:func:`exact` and :func:`sum32` are shared with the CPU branch
(``finite_cpu``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jamp._src.leaves import unscale_leaf


def sum32(x: jax.Array) -> jax.Array:
    """The float32 sum of ``x``'s elements (of both parts, for a complex ``x``)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        return jnp.sum(jnp.real(x), dtype=jnp.float32) + jnp.sum(jnp.imag(x), dtype=jnp.float32)
    return jnp.sum(x, dtype=jnp.float32)


def exact(leaves: list[jax.Array]) -> jax.Array:
    """Whether every element of every leaf is finite: one pass per leaf.

    Each leaf's non-finite flags are reduced as a ``uint8`` max, which every
    backend reduces in one pass with no boolean temporary.
    """
    flags = [jnp.max(jnp.logical_not(jnp.isfinite(x)).astype(jnp.uint8), initial=0) for x in leaves]
    return functools.reduce(jnp.maximum, flags, jnp.uint8(0)) == 0


def one_read(*leaves: jax.Array) -> jax.Array:
    """Whether the one-read check finds every leaf finite.

    ``True`` proves every leaf finite; ``False`` may be a finite sum too large
    for float32, which :func:`default_finite` settles with :func:`exact`.
    """
    half = [x for x in leaves if x.dtype == jnp.float16]
    rest = [x for x in leaves if x.dtype != jnp.float16]
    fast = jnp.asarray(True)
    if rest:
        fast = jnp.isfinite(functools.reduce(jnp.add, [sum32(x) for x in rest]))
    if half:
        fast = fast & exact(half)
    return fast


def default_finite(*leaves: jax.Array, inv: Any = None) -> jax.Array:
    """Whether every leaf (times ``inv``, when given) is finite: one read, and an exact branch.

    Args:
      *leaves: floating arrays.
      inv: ``1/scale`` (a float32 scalar), or ``None`` to check the leaves as they are.

    Returns:
      A boolean scalar, exact for every input.
    """
    fast = one_read(*leaves)
    if inv is None:
        leaves_to_check = lambda: leaves  # noqa: E731
    else:
        # |g * inv| <= |g| when inv <= 1: finite g stay finite once unscaled.
        fast = fast & (inv <= 1)
        leaves_to_check = lambda: [unscale_leaf(x, inv) for x in leaves]  # noqa: E731
    # Both branches derive from the same leaves, so under shard_map they vary
    # over the same axes.
    return lax.cond(fast, lambda: fast, lambda: exact(leaves_to_check()))
