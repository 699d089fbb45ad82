"""What autocast's backward pass keeps (jamp/_src/autocast_residuals): half values, not float32.

Softmax: the forward pass is unchanged bit for bit; the backward pass computes
softmax's rule in float32 from the probabilities the next matmul already
keeps, instead of keeping exp's float32 output as well. Unary float32
primitives of a half input (``x**3`` in gelu, ``exp``, ``log``): recomputed
from the half input in the backward pass, with unchanged values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _autocast_helpers import BF16, EPS, F32, HALF, randn
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

import jamp
from jamp._src.autocast_residuals import find_softmax, recomputed, softmax_keeping_low

B, H, T, D = 2, 2, 8, 16


def _attention_model():
    model = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=D, deterministic=True)
    x = randn(0, B, T, D)
    mask = nn.make_causal_mask(jnp.ones((B, T)))
    params = model.init(jax.random.key(0), x, mask=mask)
    return model, params, x, mask


def _probability_residuals(report):
    return [r for r in report.residuals if r.shape == (B, H, T, T)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_flax_attention_keeps_one_half_copy_of_the_probabilities(dtype):
    """The user's program: Flax causal self-attention under jamp.autocast."""
    model, params, x, mask = _attention_model()

    def loss(p, x):
        return jnp.sum(jnp.sin(model.apply(p, x, mask=mask)))

    report = jamp.autocast_report(loss, params, x, dtype=dtype)
    kept = _probability_residuals(report)
    # Before: exp's float32 output (4 bytes a probability) and the matmul's half copy.
    assert not any(np.dtype(r.dtype) == F32 for r in kept), kept
    # The half copy passes an optimization barrier, so XLA keeps it (not the float32 y).
    copies = [r for r in kept if r.source.startswith("output of optimization_barrier")]
    assert [(np.dtype(r.dtype), r.count) for r in copies] == [(np.dtype(dtype), 1)], kept
    assert report.counts["exp"] == {"float32": 1}  # still computed in float32, counted once

    # Gradients as close to float32's as before; finite under the causal mask.
    grad = jax.jit(jax.grad(jamp.autocast(loss, dtype)))(params, x)
    want = jax.jit(jax.grad(loss))(params, x)
    flat = lambda t: np.concatenate([np.ravel(g) for g in jax.tree_util.tree_leaves(t)])  # noqa: E731
    a, b = flat(grad), flat(want)
    assert np.all(np.isfinite(a))
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.9999


def _attention(q, k, v):
    return jax.nn.softmax(q @ k.T / 4.0) @ v


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_forward_is_unchanged_bit_for_bit(dtype):
    q, k, v = randn(1, T, D), randn(2, T, D), randn(3, T, D)

    def unfused(q, k, v):  # the name is a consumer other than a matmul: not fused
        return checkpoint_name(jax.nn.softmax(q @ k.T / 4.0), "p") @ v

    assert len(find_softmax(_jaxpr(_attention, q, k, v), dtype)) == 1
    assert find_softmax(_jaxpr(unfused, q, k, v), dtype) == {}
    for wrap in (lambda f: f, jax.jit):
        want = wrap(jamp.autocast(unfused, dtype))(q, k, v)
        np.testing.assert_array_equal(wrap(jamp.autocast(_attention, dtype))(q, k, v), want)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_backward_is_softmaxs_rule_on_the_half_probabilities(dtype):
    z = randn(4, 3, T, scale=3.0)
    g, g_low = randn(5, 3, T), randn(6, 3, T).astype(dtype)
    fun = softmax_keeping_low(jax.nn.softmax, (1,), dtype, F32)
    (y, y_low), pullback = jax.vjp(fun, z)
    np.testing.assert_array_equal(y, jax.nn.softmax(z))
    np.testing.assert_array_equal(y_low, jax.nn.softmax(z).astype(dtype))
    (dz,) = pullback((g, g_low))
    # NumPy: y rounded to the half dtype, the two cotangents summed in float32.
    yr = np.asarray(y_low, np.float64)
    gt = np.asarray(g, np.float64) + np.asarray(g_low, np.float64)
    want = yr * gt - yr * np.sum(yr * gt, axis=1, keepdims=True)
    assert dz.dtype == F32
    np.testing.assert_allclose(dz, want, rtol=1e-5, atol=1e-6)
    # JAX's float32 rule differs by the rounding of y only.
    (_, exact) = jax.vjp(jax.nn.softmax, z)
    (dz32,) = exact(g + g_low.astype(F32))
    np.testing.assert_allclose(dz, dz32, atol=16 * EPS[dtype] * float(jnp.max(jnp.abs(dz32))))


def _jaxpr(f, *args):
    return jax.make_jaxpr(f)(*args).jaxpr


def _in_a_loss(q, v):
    p = jax.nn.softmax(q @ q.T)
    return jnp.sum(p @ v) + jnp.sum(jnp.log(p))


def test_only_a_softmax_feeding_matmuls_alone_is_fused():
    q, v = randn(1, T, D), randn(3, T, D)
    fused = _jaxpr(lambda q, v: jax.nn.softmax(q @ q.T) @ v, q, v)
    assert len(find_softmax(fused, BF16)) == 1
    assert find_softmax(fused, F32) == {}  # nothing to save under float32
    unfused = {
        "returned": lambda q, v: (jax.nn.softmax(q @ q.T) @ v, jax.nn.softmax(q @ q.T)),
        "in a loss": lambda q, v: _in_a_loss(q, v),
        "masked": lambda q, v: jax.nn.softmax(q @ q.T, where=q @ q.T > 0) @ v,
        "exp used twice": lambda q, v: (jnp.exp(q) / jnp.sum(jnp.exp(q), -1, keepdims=True)) @ v.T,
    }
    for name, f in unfused.items():
        jaxpr = _jaxpr(f, q, v)
        if name == "returned":
            assert len(find_softmax(jaxpr, BF16)) == 1  # the one feeding the matmul only
        else:
            assert find_softmax(jaxpr, BF16) == {}, name


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_softmax_that_feeds_a_loss_returns_float32_and_keeps_its_rule(dtype):
    # log(softmax) in the loss: the probabilities stay float32 (torch returns float32).
    q, v = randn(1, T, D), randn(3, T, D)

    f = _in_a_loss
    report = jamp.autocast_report(f, q, v, dtype=dtype)
    assert any(r.shape == (T, T) and np.dtype(r.dtype) == F32 for r in report.residuals)
    got = jax.grad(jamp.autocast(f, dtype))(q, v)
    want = jax.grad(f)(q, v)
    np.testing.assert_allclose(got, want, rtol=0, atol=64 * EPS[dtype] * float(jnp.abs(want).max()))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_attention_under_scan_remat_and_jit(dtype):
    """Layers of attention in a scan, each rematerialised: gradients as float32's."""
    wq, wk, wv = randn(1, 3, D, D, scale=D**-0.5), randn(2, 3, D, D, scale=D**-0.5), None
    wv = randn(3, 3, D, D, scale=D**-0.5)
    x = randn(4, T, D)

    @jax.checkpoint
    def layer(h, w):
        q, k, v = h @ w[0], h @ w[1], h @ w[2]
        return h + jax.nn.softmax(q @ k.T / 4.0) @ v, None

    def loss(ws, x):
        h, _ = jax.lax.scan(layer, x, jnp.stack(ws, 1))
        return jnp.sum(jnp.sin(h))

    got = jax.jit(jax.grad(jamp.autocast(loss, dtype)))((wq, wk, wv), x)
    want = jax.jit(jax.grad(loss))((wq, wk, wv), x)
    for a, b in zip(got, want, strict=True):
        a, b = np.ravel(a), np.ravel(b)
        assert np.all(np.isfinite(a)) and a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


# --------------------------------------------------------------------------
# unary float32 primitives of a half-precision input


def _saved(f, *args):
    from jax._src.ad_checkpoint import saved_residuals

    return [(aval.shape, np.dtype(aval.dtype)) for aval, src in saved_residuals(f, *args)
            if not src.startswith("from the argument")]  # fmt: skip


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_recomputed_keeps_the_half_input_and_changes_no_value(dtype):
    x = randn(0, 4, 8).astype(dtype)
    for fun in (jnp.exp, jnp.log1p, lambda v: v**3, jax.lax.rsqrt):
        x_in = jnp.abs(x) + 0.5 if fun is not jnp.exp else x
        plain = lambda v, fun=fun: jnp.sum(fun(v.astype(F32)))  # noqa: E731
        kept = lambda v, fun=fun: jnp.sum(recomputed(fun, v))  # noqa: E731
        assert all(d != F32 or s != x.shape for s, d in _saved(kept, x_in))
        assert any(d == F32 and s == x.shape for s, d in _saved(plain, x_in))  # what it saves
        np.testing.assert_array_equal(kept(x_in), plain(x_in))
        np.testing.assert_array_equal(jax.grad(kept)(x_in), jax.grad(plain)(x_in))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_flax_mlp_with_gelu_keeps_no_float32_hidden_activation(dtype):
    """The user's program: Dense, gelu (tanh form, x**3 in float32), Dense, under autocast."""

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(x)))

    model, x = MLP(), randn(0, B, T, D)
    params = model.init(jax.random.key(0), x)

    def loss(p, x):
        return jnp.sum(jnp.sin(model.apply(p, x)))

    report = jamp.autocast_report(loss, params, x, dtype=dtype)
    hidden = [r for r in report.residuals if r.shape == (B, T, 4 * D)]
    assert hidden and all(np.dtype(r.dtype) == np.dtype(dtype) for r in hidden), hidden
    assert report.counts["integer_pow"] == {"float32": 1}
    grad = jax.jit(jax.grad(jamp.autocast(loss, dtype)))(params, x)
    want = jax.jit(jax.grad(loss))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(want), strict=True):
        a, b = np.ravel(a), np.ravel(b)
        assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_exp_of_a_half_activation_is_bit_for_bit_the_upcast_computation(dtype):
    x, w, w2 = randn(0, 4, 8), randn(1, 8, 8, scale=0.3), randn(2, 8, 3, scale=0.3)

    def f(x, w, w2):
        return jnp.sum(jnp.exp(x @ w) @ w2)

    def by_hand(x, w, w2):
        h = jnp.matmul(x.astype(dtype), w.astype(dtype), preferred_element_type=dtype)
        e = jnp.exp(h.astype(F32)).astype(dtype)
        out = jnp.matmul(e, w2.astype(dtype), preferred_element_type=dtype)
        return jnp.sum(out.astype(F32))

    assert not any(d == F32 and s == (4, 8) for s, d in _saved(jamp.autocast(f, dtype), x, w, w2))
    got = jax.grad(jamp.autocast(f, dtype), argnums=(0, 1, 2))(x, w, w2)
    want = jax.grad(by_hand, argnums=(0, 1, 2))(x, w, w2)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
