"""What only the default branch (GPUs, TPUs) has: one read, exact, with no conditional.

Its exactness over every kind of leaf is tested beside the CPU branch in
test_finite.py; its jaxpr (no conditional, a reduction per large leaf) is pinned in
test_implementation_pins.py; its compiled form on an H200 in test_gpu_compile.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp._src.finite import default as finite_default

# Each shape takes a different path: small, reduced over its last axis, over its two
# last axes, whole (trailing axes too short), 1-D, and a 4-D convolution kernel.
SHAPES = [(128, 128), (3, 40, 1024), (100_003,), (784, 2048), (5000,), (9000, 4, 4), (3, 3, 64, 96)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_one_read_finds_every_inf_and_nan(shape, bad, wrap):
    # An inf or NaN, first, middle or last, beside a finite leaf, is found.
    n = int(np.prod(shape))
    check = wrap(finite_default.default_finite)
    for where in (0, n // 2 + 1, n - 1):
        x = np.ones(shape, np.float32)
        x.reshape(-1)[where] = bad
        assert not bool(check(jnp.ones(7), jnp.asarray(x)))
    assert bool(check(jnp.ones(7), jnp.ones(shape)))


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_a_finite_tree_whose_sum_overflows_is_finite(wrap):
    # The float32 sum of these overflows; the sum of their zeros cannot.
    x = jnp.full((100_000,), 3e38, jnp.float32)
    h = jnp.full((1000,), 60000.0, jnp.float16)
    b = jnp.full((64, 512), 3e38, jnp.bfloat16)
    check = wrap(finite_default.default_finite)
    assert bool(check(x, h, b))
    assert not bool(check(x, h.at[7].set(jnp.inf), b))


def test_unscaling_that_overflows_is_caught():
    # A scale below 1: the unscaled value, not the scaled one, is checked.
    inv = jnp.float32(4.0)
    for x in (jnp.full((300, 300), 1e38, jnp.float32), jnp.full((10,), 30000.0, jnp.float16)):
        assert bool(finite_default.default_finite(x))
        assert not bool(finite_default.default_finite(x, inv=inv))
        assert bool(finite_default.default_finite(x, inv=jnp.float32(1.0)))


def test_complex_and_empty_leaves():
    z = jnp.ones((200, 300), jnp.complex64)
    assert bool(finite_default.default_finite(z, jnp.zeros((0, 5))))
    assert not bool(finite_default.default_finite(z.at[3, 4].set(1j * jnp.inf)))
    assert not bool(finite_default.default_finite(z.at[3, 4].set(complex(np.nan, 0))))
    assert bool(finite_default.default_finite())


def test_many_shapes_are_joined_and_checked_exactly():
    # More distinct shapes than FEW_SHAPES: their sums are joined (the joined form is
    # pinned in test_implementation_pins.py); a NaN in the last one is found.
    leaves = [jnp.ones((n,)) for n in range(10, 10 + finite_default.FEW_SHAPES + 3)]
    assert bool(finite_default.default_finite(*leaves))
    assert not bool(finite_default.default_finite(*leaves[:-1], leaves[-1].at[3].set(jnp.nan)))
