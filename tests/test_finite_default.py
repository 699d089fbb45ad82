"""What only the default branch (GPUs, TPUs) has: its one read, which the exact pass backs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp._src import finite_default


@pytest.mark.parametrize("shape", [(128, 128), (3, 40, 1024), (100_003,), (784, 2048), (5000,)])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_one_read_finds_every_inf_and_nan(shape, bad):
    # True proves every leaf finite: an inf or NaN, first, middle or last, never reads True.
    n = int(np.prod(shape))
    for where in (0, n // 2 + 1, n - 1):
        x = np.ones(shape, np.float32)
        x.reshape(-1)[where] = bad
        assert not bool(finite_default.one_read(jnp.asarray(x)))  # the other platforms' form


def test_one_read_leaves_a_finite_sum_too_large_to_the_exact_pass():
    # The float32 sum of these overflows: the one read cannot tell, the exact pass can.
    # float16 leaves are checked element by element on the one read, never summed.
    x = jnp.full((1000,), 3e38, jnp.float32)
    h = jnp.full((1000,), 60000.0, jnp.float16)
    assert not bool(finite_default.one_read(x))
    assert bool(finite_default.exact([x]))
    assert bool(jax.jit(finite_default.default_finite)(x))
    assert bool(finite_default.one_read(h))
    assert not bool(finite_default.one_read(h.at[7].set(jnp.inf)))
