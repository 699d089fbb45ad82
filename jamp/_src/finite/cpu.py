"""The finite check on CPUs: exact from one read, in few compiled kernels.

This docstring is the one description of the CPU check; the rest of the
library and the docs only state what it guarantees (exact for every input,
one read of each gradient on a clean step).

How it works. Leaves are sorted by size, dtype and shape (``kind``):

- ``"small"``: fewer than 2**14 elements, of float32, bfloat16, float16 or
  complex64. They are gathered into one vector per dtype (a complex one as its
  real and imaginary parts; unscaling multiplies each part by the same float32
  factor, so they overflow as float32 values would).
- ``"rows"``: float32 leaves of at least 2**14 elements whose last dimension
  holds 32 to 2**23 elements. Each is reduced to one float32 per row by a
  matrix-vector product with a vector of ``2**-40`` (``rows``). Finite
  float32 values times ``2**-40`` cannot overflow a row's sum of at most
  2**23 of them, whatever the order of the additions, so a row's sum is
  non-finite exactly when the row holds an inf or NaN. The weight is a power
  of two, so the products are the values, bar underflow to zero, which cannot
  hide an inf or NaN. The product runs at ``Precision.HIGHEST`` (a user's
  default matmul precision must not round the values) and contracts the last
  dimension without a reshape, so a sharded leaf stays where it is.
- ``"half"``: other float16 leaves; their non-finite flags are reduced.
- ``"other"``: the rest (bfloat16, narrow float32, complex, float64 ...),
  summed in float32 as on other platforms.

The rows and the small leaves' values form one short vector (an element per
small-leaf element or large-leaf row: kilobytes) whose flags are reduced
once; with the float16 flags this is exact. Only the "other" leaves' sum can
overflow from finite values, so the exact branch, under a ``lax.cond``, runs
only when that sum is not finite, when the leaves are not, or when unscaling
by ``inv > 1`` could overflow. It takes the largest magnitude of each large
leaf and of each dtype's small leaves (unscaling is monotone and odd, so the
largest magnitude overflows first, if any value does), and checks "other"
leaves element by element.

Why this shape. XLA:CPU splits a large sum of a computed value (a gradient)
into 32x32 ``reduce-window`` tiles that read memory across rows, several
times slower than the same sum of a parameter; the product reads each leaf
once in the library's matrix kernels on every core and compiles to no kernel
of its own. XLA:CPU compiles every kernel at a near-fixed cost (several ms
each), so the check's kernels are few: a product per large leaf, one
reduction over the vector, one per float16 or other leaf. A boolean ``all``
is reduced through tiled kernels, hence the ``uint8`` max of the flags
(``finite.default.exact``). The check waits for every gradient
(an ``optimization_barrier``): otherwise XLA:CPU starts each reduction beside
the backward pass's matrix products, which then lose a core. For float16,
``max(|x|)`` would write ``|x|`` first, so a float16 leaf's extremes are its
max and its min. Under JAX's explicit sharding mode, the short parts (rows,
small leaves) are replicated before they are joined, since joining parts
sharded differently is a type error there (under the default auto mode XLA
gathers them just the same).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jamp._src.finite.default import SMALL, exact, replicated, sum32
from jamp._src.leaves import unscale_leaf
from jamp._src.types import Scalar

ROWS_MIN_COLS = 32
ROWS_MAX_COLS = 2**23
_GATHERED = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64)
DOT_WEIGHT = 2.0**-40


def kind(x: jax.Array) -> str:
    """``"small"``, ``"rows"``, ``"half"`` or ``"other"``: how the CPU check reads ``x``."""
    if x.size < SMALL and x.dtype in _GATHERED:
        return "small"
    if x.dtype == jnp.float32 and ROWS_MIN_COLS <= x.shape[-1] <= ROWS_MAX_COLS:
        return "rows"
    return "half" if x.dtype == jnp.float16 else "other"


def rows(x: jax.Array) -> jax.Array:
    """One float32 per row of ``x``: non-finite exactly where the row holds an inf or NaN."""
    weights = jnp.full((x.shape[-1],), DOT_WEIGHT, jnp.float32)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    out = lax.dot_general(x, weights, dims, precision=lax.Precision.HIGHEST)
    return jnp.ravel(replicated(out))


def _gathered(leaves: list[jax.Array]) -> list[jax.Array]:
    """The small leaves as vectors: one per dtype, a complex one as its two parts."""
    parts = []
    for dtype in sorted({x.dtype for x in leaves}, key=str):
        v = jnp.concatenate([jnp.ravel(replicated(x)) for x in leaves if x.dtype == dtype])
        complex_ = jnp.issubdtype(dtype, jnp.complexfloating)
        parts += [jnp.real(v), jnp.imag(v)] if complex_ else [v]
    return parts


def _extremes(x: jax.Array) -> list[jax.Array]:
    """The values of ``x`` whose unscaling overflows first: ``max(|x|)``, or its max and min."""
    # initial=0: an empty vector of small leaves has nothing to overflow.
    if x.dtype != jnp.float16:
        return [jnp.max(jnp.abs(x), initial=0)]
    return [jnp.max(x, initial=0), jnp.min(x, initial=0)]


def _unscaled_max_finite(leaves: list[jax.Array], inv: jax.Array) -> jax.Array:
    """Whether unscaling the finite real ``leaves`` by ``inv`` leaves them finite."""
    ok = [jnp.isfinite(unscale_leaf(v, inv)) for x in leaves for v in _extremes(x)]
    return functools.reduce(jnp.logical_and, ok, jnp.asarray(True))


def cpu_finite(*leaves: jax.Array, inv: Scalar | None = None) -> jax.Array:
    """Whether every leaf (times ``inv``, when given) is finite, as the module docstring says.

    Args:
      *leaves: floating arrays.
      inv: ``1/scale`` (a float32 scalar), or ``None`` to check the leaves as they are.

    Returns:
      A boolean scalar, exact for every input.
    """
    leaves = lax.optimization_barrier(leaves)
    kinds = [kind(x) for x in leaves]
    small, large, half, other = (
        [x for x, k in zip(leaves, kinds, strict=True) if k == want]
        for want in ("small", "rows", "half", "other")
    )
    gathered = _gathered(small)
    parts = [rows(x) for x in large] + [v.astype(jnp.float32) for v in gathered]
    vector = [jnp.concatenate(parts)] if parts else []
    raw = exact(vector + half)
    if inv is None and not other:
        return raw
    fast = raw
    if other:
        fast = fast & jnp.isfinite(functools.reduce(jnp.add, [sum32(x) for x in other]))
    if inv is None:
        return lax.cond(fast, lambda: fast, lambda: raw & exact(other))
    fast = fast & (inv <= 1)

    def exact_branch() -> jax.Array:
        return (
            raw
            & _unscaled_max_finite(large + half + gathered, inv)
            & exact([unscale_leaf(x, inv) for x in other])
        )

    return lax.cond(fast, lambda: fast, exact_branch)
