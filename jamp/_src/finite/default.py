"""The finite check on GPUs, TPUs and every platform but the CPU.

One read of each gradient, no ``lax.cond``, exact for every input. Each
(unscaled) gradient becomes its finiteness: a bfloat16 0 where a value is
finite, a NaN where it is an inf or a NaN (for a large leaf, one per row of its
trailing axes: NaN where the row holds a non-finite value). An overflow that
unscaling creates (a scale below 1) is an inf before the test, so it is caught
too. Those zeros and NaNs are then added up: a sum of zeros and NaNs cannot
overflow, whatever its order, length or dtype, and it is 0 exactly when every
value is finite. So no exact second pass is needed, and nothing decides
through a conditional, which XLA:GPU would run as a host sync (its
conditional thunk copies the predicate to the host and waits for the stream)
in the middle of every step.

How XLA:GPU compiles it (``benchmarks/gpu_compile.py`` reads the H200
program): a large leaf (2**14 elements or more) is reduced over its trailing
axes in one kernel that reads it once and writes a byte per row (in a train
step XLA often fuses it into the kernel that makes the gradient). The rows
and the small leaves are added element by element where their shapes agree
(a model has few distinct shapes). With a handful of shapes, each shape's
sum is its own reduction, which XLA fuses with the kernels around it; with
more, the sums are joined into one vector and reduced together (the absolute
value before that last sum keeps XLA from splitting it back into a reduction
per part). Measured on the H200 compile: the 24-leaf optimizer step launches
45 kernels where jmp's launches 65, at the same bytes; the GPT step 343 where
the unscaled step launches 319 (``benchmarks/RESULTS.md``).

``exact``, ``sum32`` and ``replicated`` are shared with the CPU
branch (``finite.cpu``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jamp._src.leaves import is_sharded, unscale_leaf
from jamp._src.types import Scalar

SMALL = 2**14  # leaves below this many elements are joined as they are
ROW = 256  # a large leaf is reduced over trailing axes holding at least this many elements
FEW_SHAPES = 4  # up to this many distinct shapes, a sum per shape; beyond, one joined sum


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


def replicated(x: jax.Array) -> jax.Array:
    """``x`` replicated, if its type carries a sharding (JAX's explicit sharding mode).

    Joining parts sharded differently is a type error there; under the
    default (auto) mode XLA gathers them just the same.
    """
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec()) if is_sharded(x) else x


def _real_parts(x: jax.Array) -> list[jax.Array]:
    """``x``, or the two parts of a complex ``x``."""
    return [jnp.real(x), jnp.imag(x)] if jnp.issubdtype(x.dtype, jnp.complexfloating) else [x]


def _trailing(shape: tuple[int, ...]) -> int:
    """How many trailing axes a large leaf is reduced over (0: the whole leaf at once)."""
    for k in range(1, len(shape)):
        if math.prod(shape[-k:]) >= ROW:
            return k
    return 0


_NAN = float("nan")


def _parts(x: jax.Array) -> list[jax.Array]:
    """``x``'s finiteness as bfloat16 zeros (finite) and NaNs (not): per element for a small
    leaf, per row of its trailing axes for a large one. Only 0 and NaN are ever added, so
    bfloat16 is exact, and it halves what the join reads and writes."""
    out = []
    for z in _real_parts(x):
        bad = jnp.logical_not(jnp.isfinite(z))
        if z.size >= SMALL:
            k = _trailing(z.shape)
            bad = jnp.any(bad, axis=tuple(range(z.ndim - k, z.ndim)) if k else None)
        part = jnp.where(bad, jnp.bfloat16(_NAN), jnp.bfloat16(0))
        # Replicated before it is joined: under the explicit sharding mode parts
        # sharded differently cannot be added or flattened together.
        out.append(replicated(part))
    return out


def default_finite(*leaves: jax.Array, inv: Scalar | None = None) -> jax.Array:
    """Whether every leaf (times ``inv``, when given) is finite, from one read, exactly.

    Args:
      *leaves: floating arrays.
      inv: ``1/scale`` (a float32 scalar), or ``None`` to check the leaves as they are.
        The leaves are unscaled as [`jamp.unscale`][] does (in their own dtype),
        so an overflow that unscaling creates is found.

    Returns:
      A boolean scalar, exact for every input.
    """
    if not leaves:
        return jnp.asarray(True)
    if inv is not None:
        # With inv <= 1 a finite gradient stays finite once unscaled, so the scaled one is
        # checked: its multiply by inv is then the optimizer's alone, which XLA fuses into
        # the update, instead of one product shared by both, which it would materialise.
        by = jnp.where(inv <= 1, jnp.ones((), inv.dtype), inv)
        leaves = tuple(unscale_leaf(x, by) for x in leaves)
    # Parts of one shape are added element by element (0 + NaN is NaN): the joined
    # vector is as long as the distinct shapes, short enough for one reduction kernel.
    groups: dict[tuple[int, ...], list[jax.Array]] = {}
    for x in leaves:
        for part in _parts(x):
            groups.setdefault(part.shape, []).append(part)
    sums = [jnp.ravel(functools.reduce(jnp.add, parts)) for parts in groups.values()]
    if len(sums) <= FEW_SHAPES:
        # A sum per shape: XLA fuses each into the kernels around it.
        return jnp.isfinite(functools.reduce(jnp.add, [jnp.sum(v) for v in sums]))
    # One joined sum; abs keeps XLA from splitting it back into a sum per part.
    return jnp.isfinite(jnp.sum(jnp.abs(jnp.concatenate(sums))))
