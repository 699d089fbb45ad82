"""What autocast's backward pass keeps (jamp/_src/autocast/residuals.py): half values, not float32.

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
from jamp._src.autocast.residuals import find_softmax, recomputed, softmax_keeping_low
from jamp._src.jaxprs import inline_softmax

B, H, T, D = 2, 2, 8, 16


def _attention_model():
    model = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=D, deterministic=True)
    x = randn(0, B, T, D)
    mask = nn.make_causal_mask(jnp.ones((B, T)))
    params = jax.jit(model.init)(jax.random.key(0), x, mask=mask)  # one compile, not one per op
    return model, params, x, mask


def _probability_residuals(report):
    return [r for r in report.residuals if r.shape == (B, H, T, T)]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_flax_attention_keeps_one_half_copy_of_the_probabilities(dtype):
    """The user's program: Flax causal self-attention under jamp.autocast."""
    model, params, x, mask = _attention_model()

    def loss(p, x):
        return jnp.sum(jnp.sin(model.apply(p, x, mask=mask)))

    report = jamp.debug.autocast_report(loss, params, x, dtype=dtype)
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
    return inline_softmax(jax.make_jaxpr(f)(*args).jaxpr)  # jax 0.12: softmax is a custom_jvp


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
    report = jamp.debug.autocast_report(f, q, v, dtype=dtype)
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
    params = jax.jit(model.init)(jax.random.key(0), x)

    def loss(p, x):
        return jnp.sum(jnp.sin(model.apply(p, x)))

    report = jamp.debug.autocast_report(loss, params, x, dtype=dtype)
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


# --------------------------------------------------------------------------
# masks: dropout's multiplier and a select's mask and fill (lm1b, wmt, NNX)


def _flax_residuals(loss, *args):
    """(dtype, shape) -> bytes that ``loss``'s backward pass keeps, arguments excluded."""
    out = {}
    for shape, dtype in _saved(loss, *args):
        out[(dtype, shape)] = out.get((dtype, shape), 0) + int(np.prod(shape)) * dtype.itemsize
    return out


@pytest.mark.parametrize("broadcast_dropout", [False, True])
def test_flax_attention_dropout_keeps_its_mask_not_a_float32_multiplier(broadcast_dropout):
    """The user's program: lm1b's and wmt's attention (Flax, causal, dropout 0.1 on the
    probabilities, ``broadcast_dropout=False``), trained. Flax's dropout multiplies by
    ``keep.astype(float32) / 0.9``; before, autocast kept that multiplier, 4 bytes per score,
    besides a bool and a zeros array as large as the scores for the causal mask's
    ``jnp.where``: 1.02x the residuals of the model at ``dtype=bfloat16`` (lm1b, wmt)."""

    def model(dtype=None):
        return nn.MultiHeadDotProductAttention(
            num_heads=H, qkv_features=D, dropout_rate=0.1, deterministic=False, dtype=dtype,
            broadcast_dropout=broadcast_dropout,
        )  # fmt: skip

    t = 12  # not the head size: the shapes of the scores and of p @ v differ
    x, mask = randn(0, B, t, D), nn.make_causal_mask(jnp.ones((B, t)))
    params = jax.jit(model().init)(jax.random.key(0), x, mask=mask)

    def loss_of(m):
        def loss(p, x):
            out = m.apply(p, x, mask=mask, rngs={"dropout": jax.random.key(3)})
            return jnp.sum(jnp.sin(out.astype(F32)))

        return loss

    ours = jamp.autocast(loss_of(model()), BF16)
    kept = _flax_residuals(ours, params, x)
    with jax.numpy_dtype_promotion("standard"):
        flax = _flax_residuals(loss_of(model(BF16)), params, x)
    scores = (B, H, t, t)
    assert (F32, scores) not in kept, kept  # no float32 multiplier, no float32 probabilities
    assert kept.get((np.dtype(bool), scores), 0) == (0 if broadcast_dropout else B * H * t * t)
    assert kept.get((np.dtype(BF16), scores)) == 2 * B * H * t * t  # the scores, once
    assert sum(kept.values()) < sum(flax.values()), (kept, flax)
    # Values: the multiplier is recomputed from the mask in the backward pass; the
    # gradients are float32's within bfloat16's rounding (the key bias's is zero in exact
    # arithmetic, a softmax being shift-invariant: the whole tree is compared).
    # Jitted only: the eager and jitted values of this rule are compared bit for bit in
    # test_dropout_multiplier_from_its_mask_changes_no_value.
    flat = lambda t: np.concatenate([np.ravel(g) for g in jax.tree.leaves(t)])  # noqa: E731
    a = flat(jax.jit(jax.grad(ours))(params, x))
    b = flat(jax.jit(jax.grad(loss_of(model())))(params, x))
    assert np.all(np.isfinite(a)) and a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.9999


def test_dropout_multiplier_from_its_mask_changes_no_value():
    """The fused rule recomputes ``keep / 0.9`` from the mask: the forward values and the
    gradients are those of the multiplier kept (made visible, here as a second output)."""
    q, k, v = randn(1, B, T, D), randn(2, B, T, D), randn(3, B, T, D)
    keep = jax.random.bernoulli(jax.random.key(0), 0.9, (B, T, T))

    def attention(q, k, v, keep):
        p = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / 4.0)
        multiplier = keep.astype(F32) / 0.9
        return jnp.einsum("bts,bsd->btd", p * multiplier, v), multiplier

    def fused(q, k, v):
        return jnp.sum(jnp.sin(attention(q, k, v, keep)[0]))

    def unfused(q, k, v):  # the multiplier is an output too: the mask chain is not taken
        out, multiplier = attention(q, k, v, keep)
        return jnp.sum(jnp.sin(out)), multiplier

    for wrap in (lambda f: f, jax.jit):
        got = jamp.autocast(wrap(jax.value_and_grad(fused, argnums=(0, 1, 2))), BF16)(q, k, v)
        want = jamp.autocast(
            wrap(jax.value_and_grad(lambda *xs: unfused(*xs)[0], argnums=(0, 1, 2))), BF16
        )(q, k, v)
        np.testing.assert_array_equal(got[0], want[0])
        for x, y in zip(got[1], want[1], strict=True):
            np.testing.assert_array_equal(x, y)
    saved = _saved(jamp.autocast(fused, BF16), q, k, v)
    assert ((B, T, T), np.dtype(bool)) in saved and ((B, T, T), F32) not in saved, saved


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_masked_select_keeps_the_small_mask_only(dtype):
    """``jnp.where(causal_mask, scores, fill)`` and NNX's dropout ``select(keep, x / 0.9,
    zeros_like(x))`` between matmuls: JAX's derivative of a select keeps a zeros array as
    large as the output for the constant case, and the broadcast mask; under autocast both
    are recomputed in the backward pass (float32 JAX keeps them: 4 + 1 bytes per score)."""
    from flax import nnx

    s, w = randn(0, B, H, T, T), randn(1, T, T, scale=T**-0.5)
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]

    def masked(w, s):
        return jnp.sum(jnp.tanh(jnp.where(causal, s @ w, jnp.finfo(F32).min)) @ w)

    drop = nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=1))

    def dropped(w, s):
        return jnp.sum(drop(jnp.tanh(s @ w), rngs=nnx.Rngs(dropout=2).dropout()) @ w)

    low = np.dtype(dtype)

    # Of the scores' size: what float32 JAX keeps, in the low dtype, but the select's
    # zeros (recomputed) and with s @ w's input cast in place of the argument: tanh's
    # output and derivative factor (jax 0.12 keeps the factor alone where the matmul reads
    # the dropped values), the dropped values, and the dropout's own mask.
    def floats_float32_keeps(f):
        return sum(shape == s.shape and d == F32 for shape, d in _saved(f, w, s))

    want = {
        masked: [low] * floats_float32_keeps(masked),
        dropped: sorted([np.dtype(bool)] + [low] * floats_float32_keeps(dropped), key=str),
    }
    assert len(want[masked]) == 3 and len(want[dropped]) in (4, 5)  # jax 0.12, 0.10
    for f, kept in want.items():
        ours = jamp.autocast(f, dtype)
        saved = _saved(ours, w, s)
        assert sorted((d for shape, d in saved if shape == s.shape), key=str) == kept, saved
        assert (causal.shape, np.dtype(bool)) in saved or f is dropped, saved
        assert any(shape == s.shape and d == np.dtype(bool) for shape, d in _saved(f, w, s))
        for wrap in (lambda g: g, jax.jit):
            a, b = wrap(jax.grad(ours))(w, s), wrap(jax.grad(f))(w, s)
            a, b = np.ravel(a), np.ravel(b)
            assert np.all(np.isfinite(a)) and a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


@pytest.mark.parametrize("dtype", [BF16], ids=str)  # float16 takes the same path
def test_grouped_kv_heads_attention_with_dropout_is_fused(dtype):
    """The user's program: Gemma's attention (flax examples/gemma, grouped KV heads): the
    probabilities, after NNX-style dropout, are reshaped to ``(B, T, K, G, S)`` for the
    product with the values. The fused rule takes the reshape in; before, the softmax ran
    primitive by primitive and kept its float32 ``exp`` (4 bytes per score). Its values are
    those of the same attention with the KV heads repeated (no reshape), fused as before."""
    k_heads, groups, hd = 2, 2, 8
    n = k_heads * groups
    q, k, v = randn(1, B, T, n, hd), randn(2, B, T, k_heads, hd), randn(3, B, T, k_heads, hd)
    causal = jnp.tril(jnp.ones((T, T), bool))[None, :, None, :]
    keep = jax.random.bernoulli(jax.random.key(0), 0.9, (B, T, n, T))

    def probabilities(logits, name=None):
        probs = jax.nn.softmax(jnp.where(causal, logits, -2.3819763e38), axis=-1)
        probs = probs if name is None else checkpoint_name(probs, name)  # unfused
        return jax.lax.select(keep, probs / 0.9, jnp.zeros_like(probs))

    def grouped(q, k, v, name=None):
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(B, T, k_heads, groups, hd), k)
        probs = probabilities(logits.reshape(B, T, n, T), name)
        out = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(B, T, k_heads, groups, T), v)
        return jnp.sum(jnp.sin(out.reshape(B, T, n, hd)))

    def repeated(q, k, v):
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        probs = probabilities(jnp.einsum("BTNH,BSNH->BTNS", q, k))
        return jnp.sum(jnp.sin(jnp.einsum("BTNS,BSNH->BTNH", probs, v)))

    def unfused(q, k, v):
        return grouped(q, k, v, "p")

    for f in (grouped, repeated):
        assert [g.dot is not None for g in find_softmax(_jaxpr(f, q, k, v), dtype).values()] == [
            True
        ]
    assert find_softmax(_jaxpr(unfused, q, k, v), dtype) == {}
    ours = jamp.autocast(grouped, dtype)
    assert ((B, T, n, T), F32) not in _saved(ours, q, k, v)
    assert ((B, T, n, T), F32) in _saved(jamp.autocast(unfused, dtype), q, k, v)
    eager = jamp.autocast(repeated, dtype)(q, k, v)
    np.testing.assert_allclose(ours(q, k, v), eager, rtol=1e-6)  # eagerly: the values
    np.testing.assert_allclose(jax.jit(ours)(q, k, v), eager, rtol=1e-6)
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    same = jax.jit(jax.grad(jamp.autocast(repeated, dtype), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(grouped, argnums=(0, 1, 2)))(q, k, v)
    for a, b, c in zip(got, same, want, strict=True):
        a, b, c = np.ravel(a), np.ravel(b), np.ravel(c)
        assert a @ c / np.linalg.norm(a) / np.linalg.norm(c) > 0.9999
        np.testing.assert_allclose(a, b, rtol=0, atol=4 * EPS[dtype] * np.abs(c).max())
