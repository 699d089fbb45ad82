"""mul_as_torch: float32 times a Python float, rounded as torch's double arithmetic rounds it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp._src import torch_rounding


@pytest.mark.parametrize(
    "factor", [1.1, 0.3, 1.0001, 0.9999, 1 + 2.0**-24, 1 + 2.0**-23 + 2.0**-30, 0.7, 3.3]
)
def test_double_rounding_emulation_matches_torch_arithmetic(factor):
    rng = np.random.default_rng(0)
    # Random float32 bit patterns over the whole normal range, plus edge mantissas.
    bits = rng.integers(0x00800000, 0x7F000000, size=20000, dtype=np.uint32)
    edges = np.array([0x3F800000, 0x3FFFFFFF, 0x3F7FFFFF, 0x00800000, 0x7E7FFFFF], np.uint32)
    s = np.concatenate([bits, edges]).view(np.float32)
    with np.errstate(over="ignore"):
        expected = (s.astype(np.float64) * factor).astype(np.float32)  # torch's arithmetic
    got = np.asarray(
        jax.jit(jax.vmap(lambda v: torch_rounding.mul_as_torch(v, factor)))(jnp.asarray(s))
    )
    normal = np.abs(expected) >= np.finfo(np.float32).tiny
    np.testing.assert_array_equal(got[normal].view(np.uint32), expected[normal].view(np.uint32))
    assert np.all(got[~normal & np.isfinite(expected)] == 0)
    assert np.all(np.isinf(got[np.isinf(expected)]))
