"""Leaf rules: which leaves are floating, their dtypes and multiplies (via jamp.scale/unscale)."""

import _golden
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jamp

FLOAT_DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
EAGER_AND_JIT = [pytest.param(lambda f: f, id="eager"), pytest.param(jax.jit, id="jit")]


def test_passthrough_leaves():
    s = jamp.static_loss_scale(8.0)
    f0 = np.zeros((2,), dtype=jax.dtypes.float0)
    tree = {"none": None, "b": jnp.array([True]), "i": jnp.int8(3), "f0": f0, "py": 3}
    for fn in (jamp.scale, jamp.unscale):
        out = fn(s, tree)
        assert out["none"] is None and out["py"] == 3
        assert out["f0"] is f0
        assert out["b"].dtype == jnp.bool_ and out["i"].dtype == jnp.int8


def test_numpy_scalars_keep_their_dtype_python_floats_become_float32():
    state = jamp.dynamic_loss_scale(4.0)
    with jax.enable_x64(True):
        for fn in (jamp.scale, jamp.unscale):
            assert fn(state, np.float64(1.5)).dtype == jnp.float64
            assert fn(state, np.complex128(1.5)).dtype == jnp.complex128
            assert fn(state, 1.5).dtype == jnp.float32  # a Python float: float32, as in torch
            assert fn(state, np.float32(1.5)).dtype == jnp.float32
        assert float(jamp.scale(state, np.float64(1.5))) == 6.0


@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_scale_keeps_dtype_and_scalar_half_loss_is_float32(wrap, dtype):
    s = jamp.static_loss_scale(1024.0)
    tree = {"vec": jnp.ones((3,), dtype), "loss": jnp.asarray(2.0, dtype), "i": jnp.arange(3)}
    out = wrap(jamp.scale)(s, tree)
    assert out["vec"].dtype == dtype
    assert out["loss"].dtype == (jnp.float32 if dtype != jnp.float32 else jnp.float32)
    assert float(out["loss"]) == 2048.0
    assert out["i"].dtype == tree["i"].dtype and np.array_equal(out["i"], tree["i"])


def test_scalar_half_loss_cannot_overflow():
    # 60000 * 2**16 overflows float16; the float32 result does not.
    s = jamp.dynamic_loss_scale()
    out = jamp.scale(s, jnp.asarray(60000.0, jnp.float16))
    assert out.dtype == jnp.float32 and float(out) == 60000.0 * 65536


def test_scale_half_vector_rounds_once():
    # torch: round_to_dtype(float32(x) * scale), from api_facts.json.
    facts = _golden.load("api_facts.json")["facts"]
    for key in ["scale(bfloat16 1-dim, scale=3000.3)", "scale(bfloat16 1-dim, scale=65536)"]:
        fact = facts[key]
        value = 3000.3 if "3000.3" in key else 65536.0
        x = _golden.array(fact["input"])
        got = jamp.scale(jamp.static_loss_scale(value), jnp.asarray(x))
        assert _golden.bits_equal(np.asarray(got), _golden.array(fact["output"])), key


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    ndim=st.integers(0, 3),
    scale=st.floats(2.0**-126, 2.0**126),
)
def test_dtype_preserved_property(dtype, ndim, scale):
    x = jnp.ones((2,) * ndim, dtype)
    state = jamp.static_loss_scale(scale)
    out = jamp.unscale(state, x)
    assert out.dtype == dtype and out.shape == x.shape
    out = jamp.scale(state, x)
    assert out.shape == x.shape
    assert out.dtype == (jnp.float32 if ndim == 0 else dtype)
