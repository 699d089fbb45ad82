"""jamp.autocast (enabled=False too), jamp.debug.autocast_report, and the interpreter via them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _autocast_helpers import (
    BF16,
    EPS,
    F16,
    F32,
    HALF,
    assert_close_tree,
    eqns_named,
    in_dtypes,
    is_scale,
    randn,
    rel_err,
    tree_dtypes,
    walk,
)
from _bad_input import assert_clear_error
from flax import linen as nn
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jex_core
from jax.interpreters import mlir

import jamp
from jamp._src.jaxprs import scan_counts

SENSITIVE = {
    "exp", "exp2", "log", "log1p", "expm1", "pow", "rsqrt", "sqrt",
    "erf_inv", "lgamma", "digamma", "reduce_sum", "reduce_prod", "cumsum", "cumprod",
    "cumlogsumexp",
}  # fmt: skip
# x**3 (gelu's tanh approximation) runs in float32 from its half input, recomputed in the
# backward pass (test_autocast_residuals.py).
POW_MAX_LOW = {F16: 2, BF16: 2}


# --------------------------------------------------------------------------
# helpers


def assert_autocast_jaxpr(jaxpr, dtype, min_dots=1):
    """Matmuls/convs in ``dtype``; no precision-sensitive primitive with half inputs."""
    dots = eqns_named(jaxpr, "dot_general", "conv_general_dilated")
    assert len(dots) >= min_dots
    for eqn in dots:
        assert in_dtypes(eqn) == [dtype, dtype], eqn
        assert jnp.dtype(eqn.outvars[0].aval.dtype) == dtype, eqn
    for eqn in walk(jaxpr):
        if eqn.primitive.name in SENSITIVE or (
            eqn.primitive.name == "integer_pow" and eqn.params["y"] > POW_MAX_LOW[dtype]
        ):
            assert not set(in_dtypes(eqn)) & set(HALF), eqn
        if eqn.primitive.name == "div" and set(in_dtypes(eqn)) & set(HALF):
            assert is_scale(eqn), eqn  # only a scale runs in low precision


def init_params(model, *x):
    """Flax parameters with the shapes of ``model.init``, filled cheaply and deterministically."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), *x)

    def fill(path, s):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return jnp.ones(s.shape, s.dtype)
        if "bias" in name:
            return jnp.zeros(s.shape, s.dtype)
        return randn(len(name), *s.shape, scale=float(np.prod(s.shape[:-1])) ** -0.5)

    return jax.tree_util.tree_map_with_path(fill, shapes)


# --------------------------------------------------------------------------
# a function with every kind of sub-computation


@jax.custom_vjp
def attention_core(q, k):
    return jax.nn.softmax(q @ k.T, axis=-1)


def _attention_fwd(q, k):
    p = attention_core(q, k)
    return p, (q, k, p)


def _attention_bwd(res, g):
    q, k, p = res
    ds = p * (g - jnp.sum(g * p, axis=-1, keepdims=True))
    return ds @ k, ds.T @ q


attention_core.defvjp(_attention_fwd, _attention_bwd)


@jax.custom_jvp
def matmul_tanh(x, w):
    return jnp.tanh(x @ w)


@matmul_tanh.defjvp
def _matmul_tanh_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    y = matmul_tanh(x, w)
    return y, (1 - y * y) * (dx @ w + x @ dw)


def everything(x, w, n, while_loop=True):
    y = jax.nn.relu(x @ w)
    y = jax.jit(lambda a: jax.nn.gelu(a @ w))(y)

    def step(c, xs):
        c = jnp.tanh(c @ w + xs)
        return c, jnp.sum(c)

    c, ys = lax.scan(step, jnp.zeros((w.shape[0],), x.dtype), y)
    y = lax.cond(jnp.sum(c) > 0, lambda a: a @ w, lambda a: a - 1.0, y)
    y = jax.checkpoint(lambda a: jnp.sin(a @ w))(y)
    y = matmul_tanh(y, w)
    if while_loop:  # reverse mode cannot differentiate a while loop
        _, y = lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, s[1] @ w), (0, y))
    else:
        y = lax.fori_loop(0, 2, lambda i, s: s @ w, y)  # a scan
    y = attention_core(y, x)
    lse = jax.nn.logsumexp(y, axis=-1)
    return {"lse": lse, "ys": ys, "n": n + 1, "norm": jnp.linalg.norm(y) + jnp.var(y)}


def _inputs():
    x = randn(0, 4, 4)
    w = randn(1, 4, 4, scale=0.5)
    return x, w, jnp.int32(3)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_every_dot_in_half_precision_in_every_sub_computation(dtype):
    x, w, n = _inputs()
    jaxpr = jax.make_jaxpr(jamp.autocast(everything, dtype))(x, w, n)
    assert_autocast_jaxpr(jaxpr, dtype, min_dots=8)
    names = {e.primitive.name for e in walk(jaxpr)}
    assert {"scan", "cond", "while", "custom_vjp_call", "custom_jvp_call"} <= names
    assert any(e.primitive.name.startswith("remat") or e.primitive.name == "checkpoint"
               for e in walk(jaxpr))  # fmt: skip


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_outputs_keep_the_original_dtypes_and_values(dtype):
    x, w, n = _inputs()
    want = jax.jit(everything)(x, w, n)
    for f in (jax.jit(jamp.autocast(everything, dtype)),):
        got = f(x, w, n)
        assert tree_dtypes(got) == tree_dtypes(want)
        assert int(got["n"]) == 4
        assert_close_tree(got, want, 60 * EPS[dtype])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_gradients_through_custom_jvp_vjp_scan_cond_remat(dtype):
    x, w, n = _inputs()

    def loss_no_loop(x, w):
        out = everything(x, w, n, while_loop=False)
        return jnp.sum(out["lse"]) + jnp.sum(out["ys"]) + out["norm"]

    want = jax.jit(jax.grad(loss_no_loop, argnums=(0, 1)))(x, w)
    grad = jax.jit(jax.grad(jamp.autocast(loss_no_loop, dtype), argnums=(0, 1)))
    got = grad(x, w)
    assert tree_dtypes(got) == (F32, F32)
    assert_close_tree(got, want, 80 * EPS[dtype])
    # The backward pass of autocast(grad(f)) is autocast too.
    jaxpr = jax.make_jaxpr(jamp.autocast(jax.grad(loss_no_loop, argnums=(0, 1)), dtype))(x, w)
    assert_autocast_jaxpr(jaxpr, dtype, min_dots=16)
    got = jax.jit(jamp.autocast(jax.grad(loss_no_loop, argnums=(0, 1)), dtype))(x, w)
    assert_close_tree(got, want, 80 * EPS[dtype])


def test_custom_vjp_forward_and_backward_passes_are_autocast():
    x, w, _ = _inputs()
    f = jamp.autocast(lambda q, k: jnp.sum(attention_core(q, k) ** 3), F16)
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w)
    # Primal (in the custom_vjp body), forward and the user's backward (ds @ k, ds.T @ q).
    assert_autocast_jaxpr(jaxpr, F16, min_dots=3)
    got = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(lambda q, k: jnp.sum(attention_core(q, k) ** 3), argnums=(0, 1)))(x, w)
    assert_close_tree(got, want, 40 * EPS[F16])


@pytest.mark.parametrize(
    "fn",
    [jax.nn.relu, jax.nn.gelu, jax.nn.softmax, jax.nn.log_softmax, jax.nn.logsumexp,
     jax.nn.silu, jax.nn.sigmoid, jax.nn.softplus],
    ids=lambda f: f.__name__,
)  # fmt: skip
def test_jax_nn_functions_under_grad(fn):
    x, w, _ = _inputs()

    def loss(x, w):
        return jnp.sum(fn(x @ w) * jnp.cos(x))

    want_v, want_g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    got_v, got_g = jax.jit(jax.value_and_grad(jamp.autocast(loss, F16), argnums=(0, 1)))(x, w)
    assert got_v.dtype == F32 and tree_dtypes(got_g) == (F32, F32)
    assert abs(float(got_v) - float(want_v)) < 30 * EPS[F16] * (1 + abs(float(want_v)))
    assert_close_tree(got_g, want_g, 30 * EPS[F16])


# --------------------------------------------------------------------------
# numerics against float32 on small models


def compare_with_float32(fn, params, *args, dtype, tol, min_dots):
    """Jaxpr checks, then outputs and parameter gradients of autocast(fn) vs fn.

    One compiled value-and-grad per side keeps the test fast.
    """
    f = jamp.autocast(fn, dtype)
    assert_autocast_jaxpr(jax.make_jaxpr(f)(params, *args), dtype, min_dots=min_dots)

    def run(g):
        def loss(p):
            out = g(p, *args)
            leaves = jax.tree_util.tree_leaves(out)
            return sum(jnp.sum(jnp.sin(leaf)) for leaf in leaves), out

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (_, got), got_g = run(f)
    (_, want), want_g = run(fn)
    assert tree_dtypes(got) == tree_dtypes(want)
    assert tree_dtypes(got_g) == tree_dtypes(params)  # float32 grads for float32 params
    assert_close_tree(got, want, tol)
    assert_close_tree(got_g, want_g, 2 * tol)
    return f


def attention_block(params, x):
    q, k, v = (x @ params[name] for name in ("wq", "wk", "wv"))
    logits = q @ k.T / jnp.sqrt(jnp.float32(q.shape[-1]))
    h = jax.nn.softmax(logits, axis=-1) @ v
    h = x + h @ params["wo"]
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.var(h, axis=-1, keepdims=True)
    return (h - mean) * lax.rsqrt(var + 1e-5)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_attention_block_matches_float32(dtype):
    names = ("wq", "wk", "wv", "wo")
    params = {name: randn(i, 16, 16, scale=0.25) for i, name in enumerate(names)}
    x = randn(4, 8, 16)
    compare_with_float32(attention_block, params, x, dtype=dtype, tol=20 * EPS[dtype], min_dots=6)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.LayerNorm()(x)
        x = nn.relu(x)
        x = nn.Conv(8, (3, 3), strides=(2, 2))(x)
        x = nn.gelu(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(4)(x)


def test_cnn_with_layer_norm_matches_float32():
    model = CNN()
    x = randn(2, 2, 8, 8, 3)
    params = init_params(model, x)
    f = compare_with_float32(model.apply, params, x, dtype=F16, tol=30 * EPS[F16], min_dots=3)
    assert len(eqns_named(jax.make_jaxpr(f)(params, x), "conv_general_dilated")) == 2


def rnn(params, xs):
    def cell(h, x):
        h = jnp.tanh(h @ params["wh"] + x @ params["wx"] + params["b"][None, :])
        return h, h @ params["wy"]

    h, ys = lax.scan(cell, jnp.zeros((xs.shape[1], 8)), xs)
    return h, ys


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_scan_rnn_matches_float32_and_keeps_carry_dtype(dtype):
    params = {
        "wh": randn(0, 8, 8, scale=1 / 3),
        "wx": randn(1, 5, 8, scale=1 / 3),
        "wy": randn(2, 8, 2, scale=1 / 3),
        "b": jnp.zeros(8),
    }
    xs = randn(3, 6, 3, 5)
    f = compare_with_float32(rnn, params, xs, dtype=dtype, tol=30 * EPS[dtype], min_dots=3)
    (scan,) = eqns_named(jax.make_jaxpr(f)(params, xs), "scan")
    carry, _ = scan_counts(scan.params)
    assert jnp.dtype(scan.invars[carry].aval.dtype) == F32  # the carry keeps its dtype
    assert jnp.dtype(scan.outvars[0].aval.dtype) == F32


def test_large_logits_through_log_softmax_stay_finite_in_float16():
    x = jnp.full((4, 8), 10.0)
    w = jnp.tile(jnp.linspace(-375.0, 375.0, 64), (8, 1))  # logits in +-30000, near f16 max
    labels = jnp.arange(4)

    def loss(x, w):
        logits = x @ w
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.mean(ce), jax.nn.log_softmax(logits), jax.nn.logsumexp(logits, axis=-1)

    jaxpr = jax.make_jaxpr(jamp.autocast(loss, jnp.float16))(x, w)
    assert_autocast_jaxpr(jaxpr, F16)
    got = jax.jit(jamp.autocast(loss, jnp.float16))(x, w)
    want = jax.jit(loss)(x, w)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(got))
    assert_close_tree(got, want, 1e-2)
    grads = jax.jit(jax.grad(lambda x, w: jamp.autocast(loss, jnp.float16)(x, w)[0], argnums=1))(
        x, w
    )
    assert bool(jnp.all(jnp.isfinite(grads))) and grads.dtype == F32


def test_cross_entropy_mean_and_variance_run_in_float32():
    def f(x, w, labels):
        logits = x @ w
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.mean(ce), jnp.var(logits), jnp.mean(jnp.square(logits - 1.0))

    x, w = jnp.ones((4, 3)), jnp.ones((3, 5))
    jaxpr = jax.make_jaxpr(jamp.autocast(f, F16))(x, w, jnp.arange(4))
    assert_autocast_jaxpr(jaxpr, F16)
    sums = eqns_named(jaxpr, "reduce_sum", "div", "exp", "log")
    assert sums and all(in_dtypes(e) and set(in_dtypes(e)) == {F32} for e in sums)


# --------------------------------------------------------------------------
# masks, pooling, attention logits, softmax, float32-only primitives


def _padded_attention():
    model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
    x = randn(7, 2, 5, 16)
    pad = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    mask = nn.make_attention_mask(pad, pad)  # the padding queries' rows are fully masked
    return model, init_params(model, x), x, mask


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_padding_mask_in_flax_attention_stays_finite_and_matches_float32(dtype):
    # Flax fills masked logits with jnp.finfo(float32).min; cast to a half dtype
    # that literal used to become -inf, and fully masked rows NaN.
    model, params, x, mask = _padded_attention()

    def loss(p, x):
        out = model.apply(p, x, mask=mask)
        return jnp.sum(jnp.sin(out)), out

    f = jamp.autocast(loss, dtype)
    assert_autocast_jaxpr(jax.make_jaxpr(f)(params, x), dtype, min_dots=6)
    (_, got), got_g = jax.jit(jax.value_and_grad(f, has_aux=True))(params, x)
    (_, want), want_g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x)
    leaves = jax.tree_util.tree_leaves((got, got_g))
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in leaves)
    assert_close_tree(got, want, 20 * EPS[dtype])
    # Relative to the whole gradient: the key bias's is zero in exact arithmetic.
    flat = lambda t: jnp.concatenate([g.ravel() for g in jax.tree_util.tree_leaves(t)])  # noqa: E731
    assert rel_err(flat(got_g), flat(want_g)) < 40 * EPS[dtype]


def test_fully_masked_row_in_dot_product_attention_float16():
    q = randn(8, 1, 4, 2, 8)
    keep_q, keep_k = jnp.array([True, True, False, False]), jnp.array([True, True, True, False])
    mask = jnp.broadcast_to(keep_q[:, None] & keep_k[None, :], (1, 2, 4, 4))  # queries 2, 3

    def loss(q):
        out = jax.nn.dot_product_attention(q, q, q, mask=mask)
        return jnp.sum(jnp.sin(out)), out

    (_, got), got_g = jax.jit(jax.value_and_grad(jamp.autocast(loss, F16), has_aux=True))(q)
    (_, want), want_g = jax.jit(jax.value_and_grad(loss, has_aux=True))(q)
    assert bool(jnp.all(jnp.isfinite(got))) and bool(jnp.all(jnp.isfinite(got_g)))
    assert_close_tree((got, got_g), (want, want_g), 20 * EPS[F16])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_constants_saturate_while_infinities_and_activations_overflow(dtype):
    mask = jnp.array([[True, True, False], [False, False, False]])
    overflow = {F16: 1e5, BF16: 3.4e38}[dtype]  # finite in float32, not in dtype

    def f(x, w, big):
        s = x @ w
        filled = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(jnp.float32).min))
        minus_inf = jax.nn.softmax(jnp.where(mask[:1], s[:1], -jnp.inf))
        return filled, minus_inf, x @ big

    x, w = jnp.ones((2, 3)), jnp.eye(3)
    big = jnp.array([[overflow], [0.0], [0.0]])
    want = jax.jit(f)(x, w, big)
    assert bool(jnp.all(jnp.isfinite(want[2])))
    # Under jit the fill is a traced constant; eagerly, a concrete one.
    for g in (jax.jit(jamp.autocast(f, dtype)), jamp.autocast(f, dtype)):
        filled, minus_inf, activation = g(x, w, big)
        np.testing.assert_allclose(filled, want[0], rtol=4 * EPS[dtype])  # [1/2, 1/2, 0], 1/3
        assert float(minus_inf[0, 2]) == 0.0  # an infinite fill stays infinite
        assert bool(jnp.all(jnp.isinf(activation)))  # what loss scaling must see


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_window_sums_and_cumulative_sums_accumulate_in_float32(dtype):
    img = 1.0 + jnp.asarray(np.random.default_rng(0).uniform(size=(1, 64, 64, 2)), jnp.float32)
    kernel = jnp.eye(2)[None, None]

    def pools(img, kernel):
        y = lax.conv_general_dilated(
            img, kernel, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        mean = nn.pooling.pool(y, 0.0, lax.add, (64, 64), (64, 64), "VALID") / 4096.0
        return mean, jnp.cumsum(y.reshape(-1, 2), axis=0)[-1]  # fmt: skip

    f = jamp.autocast(pools, dtype)
    jaxpr = jax.make_jaxpr(f)(img, kernel)
    assert_autocast_jaxpr(jaxpr, dtype)
    for eqn in eqns_named(jaxpr, "reduce_window_sum", "cumsum"):
        assert in_dtypes(eqn) == [F32]
    # Only the rounding of the conv output to dtype remains: the mean of 4096
    # values of about 1.5 is 1.5 to a few dtype roundings, not 0.5 or 0.125.
    assert_close_tree(jax.jit(f)(img, kernel), jax.jit(pools)(img, kernel), 2 * EPS[dtype])


def test_a_wider_preferred_element_type_is_kept():
    a, b = randn(0, 16, 256), randn(1, 256, 8)

    def explicit(a, b):  # bf16 x bf16 -> f32, on purpose
        return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)  # fmt: skip

    f = jamp.autocast(explicit)
    assert _dot_dtypes(f, a, b) == [F32]
    np.testing.assert_array_equal(jax.jit(f)(a, b), jax.jit(explicit)(a, b))
    # jnp's own preferred_element_type (the inputs' dtype) still follows autocast.
    assert _dot_dtypes(jamp.autocast(jnp.matmul), a, b) == [BF16]

    # jax.nn.dot_product_attention on bfloat16 inputs: float32 logits, as without
    # autocast. (JAX's own dtype logic there needs standard promotion.)
    q, k, v = (randn(i, 1, 8, 2, 16).astype(jnp.bfloat16) for i in range(3))
    dpa = jax.nn.dot_product_attention
    with jax.numpy_dtype_promotion("standard"):
        assert _dot_dtypes(jamp.autocast(dpa), q, k, v) == [F32, BF16]
        assert _dot_dtypes(dpa, q, k, v) == [F32, BF16]
        got, want = jax.jit(jamp.autocast(dpa))(q, k, v), jax.jit(dpa)(q, k, v)
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=2 * EPS[BF16])


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_softmax_family_computes_in_float32_from_its_half_inputs(dtype):
    # torch's recipe: the low-precision logits upcast, then max, x - max, exp,
    # sum and log in float32. reduce_max is exact in any dtype; x - max is not.
    # Eager, op by op: under jit XLA may keep the logits in excess precision.
    x, w = randn(0, 4, 16), randn(1, 16, 256, scale=3.0)
    logits = jnp.matmul(x.astype(dtype), w.astype(dtype)).astype(jnp.float32)
    for fn in (jax.nn.softmax, jax.nn.log_softmax, jax.nn.logsumexp):
        got = jamp.autocast(lambda x, w: fn(x @ w), dtype)(x, w)  # noqa: B023
        want = fn(logits)
        assert got.dtype == F32
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=fn.__name__)
        jaxpr = jax.make_jaxpr(jamp.autocast(lambda x, w: fn(x @ w), dtype))(x, w)  # noqa: B023
        assert all(in_dtypes(e) == [F32, F32] for e in eqns_named(jaxpr, "sub"))


def test_stack_and_checkpoint_name_keep_the_autocast_dtype():
    w, x = randn(0, 8, 8, scale=0.3), randn(1, 4, 8)

    def f(w, x):
        h = checkpoint_name(x @ w, "proj")  # a tag for the remat policy below
        return jnp.sum(jnp.stack([h, jnp.tanh(h)]) @ w)

    g = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("proj"))
    jaxpr = jax.make_jaxpr(jamp.autocast(g))(w, x)
    for eqn in eqns_named(jaxpr, "name", "stack", "tanh"):
        assert set(in_dtypes(eqn)) == {BF16}, eqn
    # The saved residual is the bfloat16 activation, not a float32 copy.
    _, pullback = jax.vjp(jamp.autocast(g), w, x)
    saved = sorted(str(r.dtype) for r in jax.tree_util.tree_leaves(pullback) if r.shape == (4, 8))
    assert saved == ["bfloat16", "float32"]  # the named residual, and the argument x
    got, want = jax.jit(jax.grad(jamp.autocast(g)))(w, x), jax.jit(jax.grad(g))(w, x)
    assert_close_tree(got, want, 20 * EPS[BF16])


# --------------------------------------------------------------------------
# the dtype flow: parameters follow low activations, norms and softmax in
# float32, a float32 residual stream stays float32, constants never change


def tagged_dtypes(f, *args, dtype):
    """``{tag: dtype}`` of the values ``f`` tags with ``checkpoint_name``, under autocast."""
    jaxpr = jax.make_jaxpr(jamp.autocast(f, dtype))(*args)
    return {e.params["name"]: jnp.dtype(e.invars[0].aval.dtype) for e in eqns_named(jaxpr, "name")}


def last(v, like):
    """``v`` along the last axis of ``like`` (explicit broadcasting: rank promotion raises)."""
    return v.reshape((1,) * (like.ndim - 1) + (-1,))


def layer_norm(x, g, b):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    n = (x - mean) * lax.rsqrt(var + 1e-5)
    return n * last(g, n) + last(b, n)


def gpt_block(p, x, key):
    """A pre-norm transformer block on a float32 residual stream ``x``, each op class tagged."""
    tag = checkpoint_name
    h = tag(layer_norm(x, p["ln1_g"], p["ln1_b"]), "layer norm of the stream")
    q, k, v = (tag(h @ p[n] + last(p[n + "_b"], h), f"{n} + bias") for n in ("wq", "wk", "wv"))
    s = tag(q @ k.T / jnp.sqrt(jnp.float32(q.shape[-1])), "logits / sqrt(d)")
    s = tag(jnp.where(jnp.tril(jnp.ones(s.shape, bool)), s, jnp.finfo(jnp.float32).min), "mask")
    probs = tag(jax.nn.softmax(s), "softmax")
    x = tag(x + (probs @ v) @ p["wo"] + last(p["wo_b"], x), "stream + attention")
    h = layer_norm(x, p["ln2_g"], p["ln2_b"])
    h = tag(jax.nn.gelu(tag(h @ p["w1"] + last(p["w1_b"], h), "fc + bias")), "gelu")
    h = tag(jax.nn.silu(h) * last(p["gate"], h), "silu * gate")
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    h = tag(jnp.where(keep, h / 0.9, 0.0), "dropout")
    return tag(x + h @ p["w2"] + last(p["w2_b"], x), "stream + mlp")


def gpt_params(d=16):
    names = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, 4 * d),
             "w2": (4 * d, d)}  # fmt: skip
    p = {}
    for i, (n, (rows, cols)) in enumerate(names.items()):
        p[n], p[f"{n}_b"] = randn(i, rows, cols, scale=rows**-0.5), randn(10 + i, cols, scale=0.1)
    p.update(ln1_g=jnp.ones(d), ln1_b=jnp.zeros(d), ln2_g=jnp.ones(d), ln2_b=jnp.zeros(d))
    p["gate"] = 1.0 + randn(30, 4 * d, scale=0.1)
    return p


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_dtype_of_each_op_class_in_a_transformer_block(dtype):
    p, x, key = gpt_params(), randn(40, 8, 16), jax.random.key(0)
    got = tagged_dtypes(gpt_block, p, x, key, dtype=dtype)
    assert got == {
        "layer norm of the stream": F32,  # the stream is float32: the norm too, output included
        "wq + bias": dtype, "wk + bias": dtype, "wv + bias": dtype,  # the bias follows the matmul
        "logits / sqrt(d)": dtype,  # a scale by a constant
        "mask": dtype,  # jnp.finfo(float32).min saturates: the mask-fill idiom
        "softmax": F32,  # computed in float32, returned in float32 (torch)
        "stream + attention": F32,  # a float32 residual stream stays float32
        "fc + bias": dtype,
        "gelu": dtype,  # activation functions run in their input's dtype
        "silu * gate": dtype,  # logistic too; a learned gate follows the activation
        "dropout": dtype,
        "stream + mlp": F32,
    }  # fmt: skip
    jaxpr = jax.make_jaxpr(jamp.autocast(gpt_block, dtype))(p, x, key)
    assert_autocast_jaxpr(jaxpr, dtype, min_dots=7)
    for prim in ("rsqrt", "exp", "reduce_sum"):  # layer norm and softmax compute in float32
        assert {d for e in eqns_named(jaxpr, prim) for d in in_dtypes(e)} == {F32}, prim
    # x - mean, its square and the normalisation of the stream, and x - max(x): float32.
    assert all(F32 in in_dtypes(e) for e in eqns_named(jaxpr, "sub"))

    def loss(block):
        return jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(block(p, x, key)))))

    want, got = loss(gpt_block)(p), loss(jamp.autocast(gpt_block, dtype))(p)
    flat = lambda t: np.concatenate([np.ravel(g) for g in jax.tree_util.tree_leaves(t)])  # noqa: E731
    a, b = flat(got), flat(want)
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


def conv_group_norm_relu(p, x):
    tag = checkpoint_name
    y = lax.conv_general_dilated(x, p["kernel"], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip
    y = tag(y + last(p["conv_b"], y), "conv + bias")
    g = y.reshape(*y.shape[:3], 2, y.shape[3] // 2)
    mean = jnp.mean(g, axis=(1, 2, 4), keepdims=True)
    var = jnp.var(g, axis=(1, 2, 4), keepdims=True)
    n = tag((g - mean) * lax.rsqrt(var + 1e-5), "normalised").reshape(y.shape)
    n = tag(n * last(p["gamma"], n) + last(p["beta"], n), "group norm")  # ends the norm
    return tag(jax.nn.relu(n), "relu")


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_dtype_of_each_op_class_in_a_conv_block(dtype):
    p = {"kernel": randn(0, 3, 3, 3, 4, scale=0.3), "conv_b": randn(1, 4, scale=0.1),
         "gamma": 1.0 + randn(2, 4, scale=0.1), "beta": randn(3, 4, scale=0.1)}  # fmt: skip
    x = randn(4, 2, 6, 6, 3)
    got = tagged_dtypes(conv_group_norm_relu, p, x, dtype=dtype)
    # A norm of low activations computes in float32, its scale and bias too (as Flax's
    # norms and torch's kernels do), and its output returns to the low dtype at the next
    # activation, so the activation after it is low again.
    assert got == {"conv + bias": dtype, "normalised": F32, "group norm": F32, "relu": dtype}
    jaxpr = jax.make_jaxpr(jamp.autocast(conv_group_norm_relu, dtype))(p, x)
    assert_autocast_jaxpr(jaxpr, dtype)
    assert {d for e in eqns_named(jaxpr, "rsqrt", "reduce_sum") for d in in_dtypes(e)} == {F32}
    compare_with_float32(conv_group_norm_relu, p, x, dtype=dtype, tol=8 * EPS[dtype], min_dots=1)


def test_flax_dense_conv_and_attention_run_bias_and_activations_in_low_precision():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, img, seq):
            y = nn.relu(nn.GroupNorm(num_groups=2)(nn.Conv(4, (3, 3))(img)))
            attention = nn.MultiHeadDotProductAttention(num_heads=2, deterministic=True)
            h = attention(nn.LayerNorm()(seq))
            return jnp.sum(y), jnp.sum(nn.Dense(8)(nn.gelu(nn.Dense(32)(seq + h))))

    img, seq = randn(0, 2, 6, 6, 3), randn(1, 2, 5, 16)
    params = init_params(Net(), img, seq)
    report = jamp.debug.autocast_report(Net().apply, params, img, seq, dtype=BF16)
    counts = report.counts
    assert counts["tanh"] == {"bfloat16": 1}  # gelu
    assert counts["exp"] == {"float32": 1} and set(counts["rsqrt"]) == {"float32"}
    assert counts["add"]["bfloat16"] >= 6  # conv, q, k, v, out, Dense biases ...
    assert counts["add"]["float32"] >= 1  # ... and the float32 stream + attention
    # What the backward pass keeps: the gelu's and the relu's residuals in low precision;
    # float32 only inside the norms (GroupNorm's x - mean).
    for shape in ((2, 5, 32), (2, 6, 6, 4)):
        kept = [r for r in report.residuals if r.shape == shape and np.dtype(r.dtype) != bool]
        assert kept and all(np.dtype(r.dtype) == BF16 or "normalization.py" in r.source
                            for r in kept), shape  # fmt: skip
    assert report.residual_bytes["bfloat16"] > 0 and "float32" in report.residual_bytes


def test_float32_residual_stream_and_low_branches():
    w = randn(0, 8, 8, scale=0.3)

    def f(x, w):
        h = x @ w
        return (
            checkpoint_name(x + h, "f32 stream + low branch"),  # float32
            checkpoint_name(h + jnp.tanh(h), "low + low"),  # low
            checkpoint_name(h + x[:1], "low + f32 vector"),  # a broadcast value follows: low
            checkpoint_name(h * jnp.exp(h), "low * float32 derived from low"),  # low
            checkpoint_name(h - jnp.mean(h), "low - float32 statistic"),  # float32
        )

    got = tagged_dtypes(f, randn(1, 4, 8), w, dtype=F16)
    assert got == {
        "f32 stream + low branch": F32, "low + low": F16, "low + f32 vector": F16,
        "low * float32 derived from low": F16, "low - float32 statistic": F32,
    }  # fmt: skip


def test_outputs_of_sub_computations_stay_low_activations():
    w, b = randn(0, 8, 8, scale=0.3), randn(1, 8, scale=0.1)

    def f(x, w, b):
        h = jax.nn.relu(x @ w)  # a custom_jvp
        _, ys = lax.scan(lambda c, xi: (c, xi @ w), 0.0, x[None])  # per-step outputs
        g = jax.checkpoint(lambda h: jnp.tanh(h @ w))(h)
        tag = checkpoint_name
        return (tag(h + b[None], "relu + bias"), tag(ys[0] + b[None], "scan output + bias"),
                tag(g * b[None], "remat output * scale"))  # fmt: skip

    got = tagged_dtypes(f, randn(2, 4, 8), w, b, dtype=BF16)
    assert got == {"relu + bias": BF16, "scan output + bias": BF16, "remat output * scale": BF16}


def test_casts_are_cached_per_value():
    x, w = randn(0, 4, 8), randn(1, 8, 8)

    def qkv(x, w):
        return x @ w, x @ (2.0 * w), x @ (3.0 * w), (x @ w) @ w

    jaxpr = jax.make_jaxpr(jamp.autocast(qkv))(x, w)
    casts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"
             and e.invars[0] is jaxpr.jaxpr.invars[0]]  # fmt: skip
    assert len(casts) == 1  # x cast once for the four matmuls that read it


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_constant_that_does_not_fit_runs_the_op_in_float32(dtype):
    x, w = randn(0, 4, 8, scale=0.01), jnp.eye(8)  # x @ w is about 1e-2
    big = {F16: 1e5, BF16: 3.4e38}[dtype]  # finite in float32, not in dtype

    def scaled_max(x, w):
        return jnp.max(jnp.abs((x @ w) * big))

    want = jax.jit(scaled_max)(x, w)
    for g in (jamp.autocast(scaled_max, dtype), jax.jit(jamp.autocast(scaled_max, dtype))):
        got = g(x, w)
        assert bool(jnp.isfinite(got)) and abs(float(got) / float(want) - 1) < 4 * EPS[dtype]
    (mul,) = eqns_named(jax.make_jaxpr(jamp.autocast(scaled_max, dtype))(x, w), "mul")
    assert in_dtypes(mul) == [F32, F32]
    # A constant that fits follows the activation; one that flushes to zero does not.
    (mul,) = eqns_named(jax.make_jaxpr(jamp.autocast(lambda x, w: (x @ w) * 3.0, dtype))(x, w),
                        "mul")  # fmt: skip
    assert in_dtypes(mul) == [dtype, dtype]
    tiny = jamp.autocast(lambda x, w: (x @ w) * 1e-9, F16)
    assert bool(jnp.all((tiny(x, w) != 0) == (x @ w != 0)))
    # A constant array (a closure) is checked value by value.
    table = jnp.ones((1, 8)).at[0, 3].set(big)
    (mul,) = eqns_named(jax.make_jaxpr(jamp.autocast(lambda x, w: (x @ w) * table, dtype))(x, w),
                        "mul")  # fmt: skip
    assert in_dtypes(mul) == [F32, F32]
    # Values that depend on the arguments are never adjusted: their overflow reaches loss scaling.
    out = jamp.autocast(lambda x, w, s: (x @ w) * s, dtype)(x, w, jnp.float32(big))
    assert bool(jnp.any(jnp.isinf(out)))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_only_the_mask_fill_idiom_saturates(dtype):
    mask = jnp.array([[True, True, False, False], [True, False, False, False],
                      [False, False, False, False], [True, True, True, True]])  # fmt: skip
    lo, hi = jnp.finfo(jnp.float32).min, jnp.finfo(jnp.float32).max
    x = randn(0, 4, 8)

    def fills(x):
        s, tag = x @ x.T, checkpoint_name
        return (tag(jnp.where(mask, s, lo), "where"), tag(jnp.maximum(s, lo), "maximum"),
                tag(jnp.clip(s, lo, hi), "clip"), tag(jnp.where(mask, s, -1e9), "-1e9"),
                tag(jnp.minimum(s, jnp.float32(-1e6)), "-1e6"))  # fmt: skip

    # finfo(float32).min/max: saturated, low precision; other big fills run in float32 (f16).
    other = F32 if dtype == F16 else dtype
    assert tagged_dtypes(fills, x, dtype=dtype) == {
        "where": dtype,
        "maximum": dtype,
        "clip": dtype,
        "-1e9": other,
        "-1e6": other,
    }
    want = jax.jit(fills)(x)
    for got in (jamp.autocast(fills, dtype)(x), jax.jit(jamp.autocast(fills, dtype))(x)):
        for g, w in zip(got[:3], want[:3], strict=True):
            assert bool(jnp.all(jnp.isfinite(g)))  # the fill is the low dtype's finite extreme
            kept = np.asarray(w) > -1e30
            np.testing.assert_allclose(np.where(kept, g, 0), np.where(kept, w, 0),
                                       rtol=4 * EPS[dtype], atol=1e-2)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got[3]) < -9e8, np.asarray(want[3]) < -9e8)


def test_masked_attention_in_float16_has_no_nan_in_outputs_or_gradients():
    q = randn(0, 2, 6, 8)
    keep = jnp.array([True, True, True, False, False, False])
    mask = keep[:, None] & keep[None, :] & jnp.tril(jnp.ones((6, 6), bool))  # rows 3-5: all masked

    def attention(q, w):
        s = jnp.einsum("btd,bsd->bts", q @ w, q) / jnp.sqrt(jnp.float32(8))
        s = jnp.where(mask, s, jnp.finfo(jnp.float32).min)
        return jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1), q)

    def loss(q, w):
        out = attention(q, w)
        return jnp.sum(out**2), out

    w = randn(1, 8, 8, scale=0.3)
    for f in (jamp.autocast(loss, F16), jax.jit(jamp.autocast(loss, F16))):
        (value, out), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(q, w)
        assert all(bool(jnp.all(jnp.isfinite(t))) for t in (value, out, *grads))
    (_, want), want_g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(q, w)
    assert_close_tree((out, grads), (want, want_g), 30 * EPS[F16])
    np.testing.assert_allclose(out[:, 3:], jnp.broadcast_to(jnp.mean(q, 1, keepdims=True),
                                                            (2, 3, 8)), rtol=1e-2)  # fmt: skip


def test_gelu_cube_in_float16_runs_in_float32_so_large_inputs_keep_a_finite_gradient():
    def f(x, w):
        return jnp.sum(jax.nn.gelu(x @ w))

    x, w = jnp.array([[150.0, -160.0, 1.0]]), jnp.eye(3)
    for dtype in HALF:
        grads = jax.grad(jamp.autocast(f, dtype), argnums=(0, 1))(x, w)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads), dtype
    for dtype in HALF:  # 3 x**2 overflows float16 from |x| = 148
        (cube,) = eqns_named(jax.make_jaxpr(jamp.autocast(f, dtype))(x, w), "integer_pow")
        assert in_dtypes(cube) == [F32]


def test_report_lists_the_dtype_of_every_saved_residual():
    def mlp(p, x):
        return jnp.sum(jax.nn.gelu(x @ p["w"] + p["b"][None]) @ p["v"])

    p = {"w": randn(0, 8, 32), "b": jnp.zeros(32), "v": randn(1, 32, 4)}
    x = randn(2, 16, 8)
    report = jamp.debug.autocast_report(mlp, p, x, dtype=BF16)
    hidden = [r for r in report.residuals if r.shape == (16, 32)]
    assert hidden and all(np.dtype(r.dtype) == BF16 for r in hidden)  # the gelu in bfloat16
    assert all(r.nbytes == r.count * np.prod(r.shape) * np.dtype(r.dtype).itemsize
               for r in report.residuals)  # fmt: skip
    assert sum(report.residual_bytes.values()) == sum(r.nbytes for r in report.residuals)
    assert not any(r.source.startswith("from the argument") for r in report.residuals)
    text = str(report)
    assert "saved for the backward pass (arguments excluded): bfloat16" in text
    assert "(16, 32)" in text and "test_autocast.py" in text  # the user's source line
    # A function autocast cannot differentiate (a primitive without a derivative) says so.
    opaque = jamp.debug.autocast_report(lambda x: UNKNOWN.bind(x @ x.T), x)
    assert opaque.residuals == () and opaque.residuals_note
    assert "saved for the backward pass: not computed" in str(opaque)


# --------------------------------------------------------------------------
# training with loss scaling


def test_flax_cnn_trains_in_float16_like_float32():
    model = CNN()
    x = randn(5, 8, 8, 8, 3)
    y = randn(6, 8, 4)
    params0 = init_params(model, x)

    def loss(apply, p):
        return jnp.mean((apply(p, x) - y) ** 2)

    def train(apply, tx, scaled):
        @jax.jit
        def step(p, state):
            if scaled:
                ls = jamp.get_loss_scale(state)
                value, grads = jax.value_and_grad(lambda p: jamp.scale(ls, loss(apply, p)))(p)
            else:
                value, grads = jax.value_and_grad(lambda p: loss(apply, p))(p)
            updates, state = tx.update(grads, state, p)
            return optax.apply_updates(p, updates), state, grads

        p, state = params0, tx.init(params0)
        for _ in range(8):
            p, state, grads = step(p, state)
            assert tree_dtypes(grads) == tree_dtypes(params0)
        return float(loss(model.apply, p)), state

    # (optax.adam's bias correction does not trace under strict dtype promotion.)
    want, _ = train(model.apply, optax.sgd(0.05, momentum=0.9), scaled=False)
    got, state = train(
        jamp.autocast(model.apply, jnp.float16),
        jamp.loss_scaling(optax.sgd(0.05, momentum=0.9)),
        scaled=True,
    )
    start = float(loss(model.apply, params0))
    assert want < 0.9 * start
    assert abs(got - want) < 0.05 * start
    assert float(jamp.get_loss_scale(state).scale) > 0


# --------------------------------------------------------------------------
# composition: jit, vmap, kwargs, closures, Flax NNX


def test_jit_vmap_and_kwargs():
    def f(x, *, w, scale=2.0, activate=True):
        y = x @ w * scale
        return {"y": jax.nn.relu(y) if activate else y, "s": jnp.sum(y)}

    x, w = jnp.ones((3, 4)), jnp.ones((4, 2))
    g = jamp.autocast(f, jnp.float16)
    assert f.__name__ == g.__name__
    for h in (g, jax.jit(functools.partial(g, activate=False))):
        out = h(x, w=w, scale=3.0)
        assert tree_dtypes(out) == {"y": F32, "s": F32}
        np.testing.assert_allclose(out["y"], f(x, w=w, scale=3.0)["y"])
    batched = jax.vmap(lambda xi: g(xi, w=w), in_axes=0)(jnp.ones((5, 3, 4)))
    assert batched["y"].shape == (5, 3, 2) and batched["y"].dtype == F32
    jaxpr = jax.make_jaxpr(jax.vmap(lambda xi: g(xi, w=w)))(jnp.ones((5, 3, 4)))
    assert_autocast_jaxpr(jaxpr, F16)


def test_gradients_wrt_closed_over_float32_parameters():
    x, w, _ = _inputs()

    def loss(w):
        return jnp.sum(jamp.autocast(lambda x: jnp.tanh(x @ w), jnp.bfloat16)(x) ** 2)

    g = jax.grad(loss)(w)
    assert g.dtype == F32
    assert_close_tree(g, jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w), 20 * EPS[BF16])


def test_integer_inputs_and_outputs_are_untouched():
    def f(x, idx):
        return jnp.take(x @ x, idx, axis=0), idx * 2, jnp.argmax(x, axis=-1)

    x, idx = jnp.eye(3), jnp.array([2, 0], jnp.int32)
    out = jamp.autocast(f)(x, idx)
    assert tree_dtypes(out) == tree_dtypes(f(x, idx))
    np.testing.assert_array_equal(out[1], idx * 2)


def test_scatter_sort_and_explicit_casts():
    def f(x, idx):
        y = x @ x
        y = y.at[idx].add(y[:2])  # scatter-add carries a typed update jaxpr: runs as traced
        return jnp.sort(y, axis=-1), jnp.argsort(y[0]), y.astype(jnp.bfloat16)

    x, idx = jnp.eye(3) * 2.0, jnp.array([2, 0], jnp.int32)
    g = jamp.autocast(f, jnp.float16)
    out = jax.jit(g)(x, idx)
    assert tree_dtypes(out) == tree_dtypes(f(x, idx))  # the explicit bfloat16 cast is kept
    assert_close_tree(out, f(x, idx), 1e-3)
    (scatter,) = eqns_named(jax.make_jaxpr(g)(x, idx), "scatter-add")
    assert set(in_dtypes(scatter)) == {F32}


def test_float16_program_and_python_scalars_do_not_widen():
    def f(x):
        return jnp.tanh(x * 0.5 + 1.0) * 3.0

    jaxpr = jax.make_jaxpr(jamp.autocast(f, jnp.float16))(jnp.ones(3, jnp.float16))
    assert all(jnp.dtype(e.outvars[0].aval.dtype) == F16 for e in jaxpr.eqns)


def test_nnx_module():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.LayerNorm(8, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.gelu(self.norm(self.l1(x))))

    model = nnx.jit(lambda: MLP(nnx.Rngs(0)))()
    x = randn(6, 3, 4)
    f = jamp.autocast(lambda m, x: m(x), jnp.bfloat16)
    out = jax.jit(f)(model, x)
    assert out.dtype == F32
    assert_close_tree(out, jax.jit(lambda m, x: m(x))(model, x), 20 * EPS[BF16])
    assert_autocast_jaxpr(jax.make_jaxpr(jamp.autocast(model))(x), BF16, min_dots=2)

    @nnx.jit
    def loss_and_grad(model, x):
        return nnx.value_and_grad(lambda m: jnp.sum(f(m, x) ** 2))(model)

    value, grads = loss_and_grad(model, x)
    assert value.dtype == F32
    assert grads.l1.kernel[...].dtype == F32


def test_nnx_state_updates_need_split_and_merge():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    x = randn(0, 8, 3) + 1.0
    ref = Net(nnx.Rngs(0))
    nnx.jit(lambda m, x: m(x))(ref, x)
    assert np.any(ref.bn.mean[...])
    # A module passed straight in is read, not written back (as with jax.jit).
    direct = Net(nnx.Rngs(0))
    jax.jit(jamp.autocast(lambda m, x: m(x)))(direct, x)
    assert not np.any(direct.bn.mean[...])

    @nnx.jit
    def forward(model, x):  # the pattern docs/autocast.md gives
        graphdef, state = nnx.split(model)

        def pure(state, x):
            module = nnx.merge(graphdef, state)
            return module(x), nnx.state(module)

        y, state = jamp.autocast(pure)(state, x)
        nnx.update(model, state)
        return y

    model = Net(nnx.Rngs(0))
    assert forward(model, x).dtype == F32
    assert_close_tree(model.bn.mean[...], ref.bn.mean[...], 20 * EPS[BF16])
    assert_close_tree(model.bn.var[...], ref.bn.var[...], 20 * EPS[BF16])


# --------------------------------------------------------------------------
# policy, disabled regions, nesting


def test_policy_sets_compute_and_output_dtypes():
    def f(x, w):
        return x @ w, jnp.int32(7), jnp.exp(x)

    x = jnp.ones((2, 2))
    g = jamp.autocast(f, policy="p=f32,c=f16,o=bf16")
    out = g(x, x)
    assert tree_dtypes(out) == (BF16, jnp.dtype(jnp.int32), BF16)
    assert_autocast_jaxpr(jax.make_jaxpr(g)(x, x), F16)
    policy = jamp.Policy(jnp.float32, jnp.float16, jnp.float32)
    assert tree_dtypes(jamp.autocast(f, jnp.float16, policy=policy)(x, x))[0] == F32


def test_disabled_region_and_enabled_false_run_as_traced():
    @jamp.autocast(enabled=False)
    def sensitive(a, w):
        return jnp.tanh(a @ w)

    def f(x, w):
        return sensitive(x @ w, w) + jamp.autocast(jnp.matmul, enabled=False)(x, w)

    x = jnp.ones((2, 2))
    jaxpr = jax.make_jaxpr(jamp.autocast(f, jnp.float16))(x, x)
    dots = [jnp.dtype(e.outvars[0].aval.dtype) for e in eqns_named(jaxpr, "dot_general")]
    assert dots == [F16, F32, F32]
    tanh = eqns_named(jaxpr, "tanh")[0]
    assert in_dtypes(tanh) == [F32]
    assert sensitive.__name__ == "sensitive"
    # Outside any autocast the region is the plain function.
    np.testing.assert_array_equal(sensitive(x, x), jnp.tanh(x @ x))
    plain = jax.make_jaxpr(jamp.autocast(f, enabled=False))(x, x)
    assert {jnp.dtype(e.outvars[0].aval.dtype) for e in eqns_named(plain, "dot_general")} == {F32}


def test_nested_autocast_innermost_wins():
    inner = jamp.autocast(lambda a: a @ a, jnp.float16)

    def f(x):
        return inner(x) + x @ x

    jaxpr = jax.make_jaxpr(jamp.autocast(f, jnp.bfloat16))(jnp.ones((2, 2)))
    dots = [jnp.dtype(e.outvars[0].aval.dtype) for e in eqns_named(jaxpr, "dot_general")]
    assert dots == [F16, BF16]


# --------------------------------------------------------------------------
# report and errors


def _unknown_primitive():
    """A primitive autocast's table cannot know, as a third-party library defines one."""
    prim = jex_core.Primitive("jamp_test_sin")
    prim.def_impl(jnp.sin)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(jnp.sin, multiple_results=False))
    return prim


UNKNOWN = _unknown_primitive()


def test_report_counts_dtypes_and_unknown_primitives():
    def f(x):
        y = jax.nn.softmax(x @ x)
        return UNKNOWN.bind(y @ x), jnp.cumsum(y), jnp.abs(jnp.fft.rfft(y))

    report = jamp.debug.autocast_report(f, jnp.ones((4, 4)), dtype=jnp.float16)
    assert report.counts["dot_general"] == {"float16": 2}
    assert report.counts["exp"] == {"float32": 1}
    assert report.counts["cumsum"] == {"float32": 1}
    assert report.counts["fft"] == {"float32": 1}
    assert report.unknown == ("jamp_test_sin",)
    text = str(report)
    assert "dot_general" in text and "float16" in text and "unknown" in text
    assert "jamp_test_sin" in text
    # The unknown primitive ran as traced (float32) and the function still works.
    jaxpr = jax.make_jaxpr(jamp.autocast(f, jnp.float16))(jnp.ones((4, 4)))
    assert in_dtypes(eqns_named(jaxpr, "jamp_test_sin")[0]) == [F32]
    out = jamp.autocast(f, jnp.float16)(jnp.ones((4, 4)))
    assert tree_dtypes(out) == tree_dtypes(f(jnp.ones((4, 4))))
    shaped = jamp.debug.autocast_report(f, jax.ShapeDtypeStruct((4, 4), jnp.float32))
    assert shaped.counts["dot_general"] == {"bfloat16": 2}


def test_report_keywords_belong_to_the_report():
    def f(x, dtype=jnp.float32):
        return (x @ x).astype(dtype)

    x = jnp.ones((2, 2))
    # dtype= is the autocast dtype; f keeps its default.
    report = jamp.debug.autocast_report(f, x, dtype=jnp.float16)
    assert report.dtype == F16 and report.counts["dot_general"] == {"float16": 1}
    # f's own dtype argument: bound with functools.partial.
    bound = jamp.debug.autocast_report(functools.partial(f, dtype=jnp.int32), x, dtype=jnp.float16)
    assert bound.counts["convert_element_type"] == {"int32": 1}
    assert bound.counts["dot_general"] == {"float16": 1}

    def needs_dtype(x, *, dtype, policy):
        return (x @ x).astype(dtype) * len(policy)

    with pytest.raises(TypeError, match=r"argument `dtype` of `fun`.*functools.partial"):
        jamp.debug.autocast_report(needs_dtype, x, dtype=jnp.float16, policy="p")
    with pytest.raises(TypeError, match=r"argument `policy` of `fun`.*functools.partial"):
        jamp.debug.autocast_report(needs_dtype, x, policy="mixed_float16")
    ok = jamp.debug.autocast_report(
        functools.partial(needs_dtype, dtype=jnp.float32, policy="p"), x, dtype="f16"
    )
    assert ok.counts["dot_general"] == {"float16": 1}


def _dot_dtypes(fn, *args):
    return [
        jnp.dtype(e.outvars[0].aval.dtype)
        for e in eqns_named(jax.make_jaxpr(fn)(*args), "dot_general")
    ]


def test_dtype_default_and_policy_agreement():
    x = jnp.ones((2, 2))
    f = jnp.matmul
    assert _dot_dtypes(jamp.autocast(f), x, x) == [BF16]
    assert _dot_dtypes(jamp.autocast(f, None), x, x) == [BF16]
    assert _dot_dtypes(jamp.autocast(f, dtype=jnp.bfloat16), x, x) == [BF16]
    assert _dot_dtypes(jamp.autocast(f, "half"), x, x) == [jamp.compat.half_dtype()]
    assert _dot_dtypes(jamp.autocast(f, policy="mixed_float16"), x, x) == [F16]
    assert _dot_dtypes(jamp.autocast(f, "f16", policy="mixed_float16"), x, x) == [F16]
    # An explicit bfloat16 is not mistaken for the default.
    with pytest.raises(ValueError, match=r"policy's compute dtype float16, got bfloat16"):
        jamp.autocast(f, jnp.bfloat16, policy="mixed_float16")
    with pytest.raises(ValueError, match=r"policy's compute dtype float16, got bfloat16"):
        jamp.debug.autocast_report(f, x, x, dtype=jnp.bfloat16, policy="mixed_float16")


# Every invalid argument of autocast and autocast_report: id -> (call, exception,
# match). A tuple of patterns: each must match (two tables checked that call).
BAD_INPUT = {
    "autocast dtype=int32": (
        lambda: jamp.autocast(jnp.sin, dtype=jnp.int32),
        TypeError,
        (
            r"floating dtype for `dtype`.*int32",
            r"Expected a floating dtype for `dtype`.*got int32 instead",
        ),
    ),
    "autocast dtype=int8": (
        lambda: jamp.autocast(jnp.sin, dtype=np.int8),
        TypeError,
        r"floating dtype for `dtype`.*int8",
    ),
    "autocast dtype='int32'": (
        lambda: jamp.autocast(jnp.sin, dtype="int32"),
        TypeError,
        r"`dtype`.*int32",
    ),
    "autocast dtype=bool": (lambda: jamp.autocast(jnp.sin, dtype=jnp.bool_), TypeError, r"`dtype`"),
    "autocast dtype='foo'": (
        lambda: jamp.autocast(jnp.sin, "foo"),
        ValueError,
        r"Expected a dtype name for `dtype`.*got 'foo'",
    ),
    "autocast fun=3": (
        lambda: jamp.autocast(3),
        TypeError,
        (r"`fun`", r"Expected a callable for `fun`"),
    ),
    # issue #35: an explicit None is no function, and a decorator is not called on arrays
    "autocast(None, jnp.bfloat16)": (
        lambda: jamp.autocast(None, jnp.bfloat16),
        TypeError,
        (r"^Expected a callable for `fun` of jamp\.autocast, got None", r"@jamp\.autocast\("),
    ),
    "autocast(fun=None)": (
        lambda: jamp.autocast(fun=None, dtype=jnp.float16),
        TypeError,
        r"^Expected a callable for `fun` of jamp\.autocast, got None",
    ),
    "autocast(dtype=...)(x, y): the decorator given the arrays": (
        lambda: jamp.autocast(dtype=jnp.bfloat16)(jnp.ones(2), jnp.ones(2)),
        TypeError,
        (r"^Expected one function for `fun`.*got 2 arguments", r"jamp\.autocast\(fn, dtype="),
    ),
    "autocast(enabled=False)(x, y): the decorator given the arrays": (
        lambda: jamp.autocast(enabled=False)(jnp.ones(2), jnp.ones(2)),
        TypeError,
        (r"^Expected one function for `fun`", r"jamp\.autocast\(fn, enabled=False\)"),
    ),
    "autocast()(): the decorator given nothing": (
        lambda: jamp.autocast()(),
        TypeError,
        r"^Expected one function for `fun`.*got 0 arguments",
    ),
    "autocast policy='mixed'": (
        lambda: jamp.autocast(jnp.sin, policy="mixed"),
        ValueError,
        r"Expected a policy string .*'mixed_float16'.*got 'mixed'",
    ),
    "autocast policy='q=f16'": (
        lambda: jamp.autocast(jnp.sin, policy="q=f16"),
        ValueError,
        r"Expected a policy key, one of .*got 'q'",
    ),
    "autocast policy=3": (
        lambda: jamp.autocast(jnp.sin, policy=3),
        TypeError,
        r"Expected a jamp.Policy or a policy string",
    ),
    "autocast enabled='yes'": (
        lambda: jamp.autocast(jnp.sin, enabled="yes"),
        TypeError,
        r"Expected a bool for `enabled`",
    ),
    # the dtype must be float16 or bfloat16, in autocast and in autocast_report
    "autocast dtype=jnp.float32": (
        lambda: jamp.autocast(jnp.sin, jnp.float32),
        ValueError,
        r"`dtype`",
    ),
    "autocast_report dtype=jnp.float32": (
        lambda: jamp.debug.autocast_report(jnp.sin, jnp.ones(2), dtype=jnp.float32),
        ValueError,
        r"`dtype`",
    ),
    "autocast dtype='float32'": (lambda: jamp.autocast(jnp.sin, "float32"), ValueError, r"`dtype`"),
    "autocast_report dtype='float32'": (
        lambda: jamp.debug.autocast_report(jnp.sin, jnp.ones(2), dtype="float32"),
        ValueError,
        r"`dtype`",
    ),
    "autocast dtype='full'": (lambda: jamp.autocast(jnp.sin, "full"), ValueError, r"`dtype`"),
    "autocast_report dtype='full'": (
        lambda: jamp.debug.autocast_report(jnp.sin, jnp.ones(2), dtype="full"),
        ValueError,
        r"`dtype`",
    ),
    "autocast dtype=jnp.float64": (
        lambda: jamp.autocast(jnp.sin, jnp.float64),
        ValueError,
        r"`dtype`",
    ),
    "autocast_report dtype=jnp.float64": (
        lambda: jamp.debug.autocast_report(jnp.sin, jnp.ones(2), dtype=jnp.float64),
        ValueError,
        r"`dtype`",
    ),
    "autocast dtype='f64'": (lambda: jamp.autocast(jnp.sin, "f64"), ValueError, r"`dtype`"),
    "autocast_report dtype='f64'": (
        lambda: jamp.debug.autocast_report(jnp.sin, jnp.ones(2), dtype="f64"),
        ValueError,
        r"`dtype`",
    ),
    "autocast dtype=jnp.float8_e4m3fn": (
        lambda: jamp.autocast(jnp.sin, jnp.float8_e4m3fn),
        ValueError,
        r"`dtype`",
    ),
    "autocast_report dtype=jnp.float8_e4m3fn": (
        lambda: jamp.debug.autocast_report(jnp.sin, jnp.ones(2), dtype=jnp.float8_e4m3fn),
        ValueError,
        r"`dtype`",
    ),
    "autocast dtype='float8_e5m2'": (
        lambda: jamp.autocast(jnp.sin, "float8_e5m2"),
        ValueError,
        r"`dtype`",
    ),
    "autocast_report dtype='float8_e5m2'": (
        lambda: jamp.debug.autocast_report(jnp.sin, jnp.ones(2), dtype="float8_e5m2"),
        ValueError,
        r"`dtype`",
    ),
    # so must the policy's compute dtype
    "autocast policy='full' (compute dtype)": (
        lambda: jamp.autocast(jnp.sin, policy="full"),
        ValueError,
        r"float16 or bfloat16 for the compute dtype of `policy`",
    ),
    "autocast policy='f64' (compute dtype)": (
        lambda: jamp.autocast(jnp.sin, policy="f64"),
        ValueError,
        r"float16 or bfloat16 for the compute dtype of `policy`",
    ),
    "autocast policy='p=f32,c=f32,o=bf16' (compute dtype)": (
        lambda: jamp.autocast(jnp.sin, policy="p=f32,c=f32,o=bf16"),
        ValueError,
        r"float16 or bfloat16 for the compute dtype of `policy`",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])


@settings(max_examples=12, deadline=None)
@given(
    in_dtype=st.sampled_from([F16, BF16, F32]),
    low=st.sampled_from(HALF),
    rows=st.integers(1, 3),
)
def test_output_dtypes_are_preserved(in_dtype, low, rows):
    def f(x):
        y = x @ x.T
        return jnp.exp(y - jnp.max(y)), jnp.sum(x, axis=0), x.shape[0]

    x = jax.ShapeDtypeStruct((rows, 2), in_dtype)
    out = jax.eval_shape(jamp.autocast(f, low), x)
    want = jax.eval_shape(f, x)
    assert tree_dtypes(out) == tree_dtypes(want)
    assert_autocast_jaxpr(jax.make_jaxpr(jamp.autocast(f, low))(x), low)


def test_a_none_function_is_named_under_jit_and_the_decorator_forms_still_work():
    """Issue #35: ``jamp.autocast(None, jnp.bfloat16)(x, y)`` failed inside Python's call
    machinery ("takes 2 positional arguments but 3 were given") since the decorator form."""
    x = jnp.ones((2, 2))
    with pytest.raises(TypeError, match=r"^Expected a callable for `fun`.*got None"):
        jax.jit(lambda x: jamp.autocast(None, jnp.bfloat16)(x, x))(x)

    @jamp.autocast(dtype=jnp.float16)
    def half(a, b):
        return a @ b

    @jamp.autocast()
    def default(a, b):
        return a @ b

    @jamp.autocast(enabled=False)
    def kept(a, b):
        return a @ b

    def dots(f):
        jaxpr = jax.make_jaxpr(f)(x, x)
        return [str(e.outvars[0].aval.dtype) for e in eqns_named(jaxpr, "dot_general")]

    assert dots(half) == ["float16"] and dots(default) == ["bfloat16"]
    assert dots(jamp.autocast(lambda a, b: kept(a, b) + a @ b)) == ["float32", "bfloat16"]


# ---------------------------------------------------------------- one rounding per expression


def test_cross_entropy_under_jit_is_never_negative():
    """Issue #42: the log-sum-exp was computed from the logits lifted to float32 (``3 * (x @
    w + b)`` recomputed from the half product) while the label's logit it subtracts was
    picked from the bfloat16 logits: one formula, two roundings of one value, and a negative
    loss on 42 of 150 draws (the first: -0.042 against float32's 0.0046). A value whose
    elements a consumer passes on as they are (a gather) now gets no float32 computation."""

    def ce(w, b, x, t):
        return optax.softmax_cross_entropy_with_integer_labels(3 * (x @ w + b[None]), t).mean()

    ours, want = jax.jit(jamp.autocast(ce, jnp.bfloat16)), jax.jit(ce)
    rng = np.random.default_rng(7)
    losses = []
    for _ in range(150):
        x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((8, 4)) * 4, jnp.float32)
        b = jnp.asarray(rng.standard_normal(4), jnp.float32)
        t = jnp.argmax(x @ w + b[None], -1)
        losses.append((float(ours(w, b, x, t)), float(want(w, b, x, t))))
    got, f32 = np.asarray(losses).T
    assert np.all(got >= 0), np.sum(got < 0)
    # Each as far from float32 as the logits' bfloat16 rounding makes it: on the first draw
    # 0.00318 against 0.00305 (it was -0.042).
    assert abs(got[0] - f32[0]) < 5e-4, (got[0], f32[0])


@pytest.mark.standard_promotion  # Flax's dtype= modules mix their dtypes under strict promotion
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_layer_norm_statistics_see_one_rounding_of_their_input(dtype):
    """Issue #42: Flax's LayerNorm computes its variance as ``E[x**2] - E[x]**2`` (the fast
    variance). With ``x`` a Dense output plus its bias (features of mean ~8), ``E[x**2]`` came
    from ``x`` computed in float32 from its half inputs and ``E[x]`` from ``x`` rounded to the
    half dtype: the subtraction cancels what the roundings differ by. Every float32 consumer
    of ``x`` now reads the same float32 computation. Gradient error against float32: bfloat16
    0.0172 -> 0.00354 (Flax ``dtype=bfloat16``: 0.00363), float16 0.00185 -> 0.00035 (Flax:
    0.00139)."""
    from flax import linen as nn

    class DenseNorm(nn.Module):
        dtype: object = None

        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm(dtype=self.dtype)(nn.Dense(64, dtype=self.dtype)(x))
            return nn.Dense(1, dtype=self.dtype)(h)

    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((32, 16), (32, 1)))
    params = DenseNorm().init(jax.random.key(0), x)
    params["params"]["Dense_0"]["bias"] = params["params"]["Dense_0"]["bias"] + 8.0

    def loss(model):
        return lambda p, x, y: jnp.mean((model.apply(p, x).astype(jnp.float32) - y) ** 2)

    def flat(g):
        return np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(g)])

    want = flat(jax.jit(jax.grad(loss(DenseNorm())))(params, x, y))

    def error(f):
        g = flat(jax.jit(jax.grad(f))(params, x, y))
        return float(np.linalg.norm(g - want) / np.linalg.norm(want))

    ours = error(jamp.autocast(loss(DenseNorm()), dtype))
    flax_dtype = error(loss(DenseNorm(dtype=dtype)))
    assert ours <= flax_dtype, (ours, flax_dtype)
    assert ours < {"bfloat16": 5e-3, "float16": 6e-4}[jnp.dtype(dtype).name], ours
