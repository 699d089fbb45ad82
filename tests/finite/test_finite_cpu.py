"""What only the CPU branch of the finite check has: its leaf kinds and its rows."""

import jax
import jax.numpy as jnp
import numpy as np

from jamp._src.finite import cpu as finite_cpu


def test_cpu_leaf_kinds():
    kind = lambda shape, dtype=jnp.float32: finite_cpu.kind(jax.ShapeDtypeStruct(shape, dtype))  # noqa: E731
    assert kind((127, 128)) == kind((10,), jnp.complex64) == kind((), jnp.float16) == "small"
    assert kind((128, 128)) == kind((100_003,)) == kind((4, 2**23)) == "rows"
    assert kind((100_000, 3)) == kind((2, 2**23 + 1)) == kind((256, 256), jnp.bfloat16) == "other"
    assert kind((256, 256), jnp.complex64) == "other"
    assert kind((128, 128), jnp.float16) == "half"


def _cpu_all_finite(*leaves):
    return jax.jit(finite_cpu.cpu_finite)(*leaves)


def test_cpu_rows_at_their_longest_cannot_overflow():
    # A row of 2**23 float32 maxima: the weighted sum stays far from overflow.
    x = jnp.full((1, 2**23), np.finfo(np.float32).max)
    assert bool(_cpu_all_finite(x))
    assert not bool(_cpu_all_finite(x.at[0, -1].set(jnp.inf)))
