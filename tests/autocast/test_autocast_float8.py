"""jamp.autocast(fun, "float8"), float8_init and autocast_float8, reached via them.

Float8 products in the forward and backward jaxprs, error against float32 on
an MLP far from 1 and near 1e-6, delayed scaling's state through jax.grad
(bit-exact against the NumPy model of the recipe), and composition with
loss scaling, jit, scan, remat, cond and sharding.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _autocast_helpers import BF16, F16, F32, eqns_named, randn, rel_err
from _bad_input import assert_clear_error
from _float8_helpers import numpy_recipe
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jamp

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
RECIPE = jamp.float8.DelayedScaling(amax_history_len=4)


def mlp(params, x):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"][None, :])
    return h @ params["w2"] + params["b2"][None, :]


def mlp_params(d_in=16, d_hidden=32, d_out=8, seed=0):
    return {
        "w1": randn(seed, d_in, d_hidden, scale=d_in**-0.5),
        "b1": randn(seed + 1, d_hidden, scale=0.1),
        "w2": randn(seed + 2, d_hidden, d_out, scale=d_hidden**-0.5),
        "b2": randn(seed + 3, d_out, scale=0.1),
    }


def mse(model):
    """``loss(*args, y)``: the mean squared error of ``model(*args)``."""

    def loss(*args):
        *inputs, y = args
        return jnp.mean(jnp.square(model(*inputs).astype(jnp.float32) - y))

    return loss


def dot_dtypes(jaxpr):
    """(operand dtypes, output dtype) of every dot_general, sub-jaxprs included."""
    return [
        (tuple(jnp.dtype(v.aval.dtype) for v in e.invars), jnp.dtype(e.outvars[0].aval.dtype))
        for e in eqns_named(jaxpr, "dot_general")
    ]


def dot_dtypes_of(eqn):
    return tuple(jnp.dtype(v.aval.dtype) for v in eqn.invars), jnp.dtype(eqn.outvars[0].aval.dtype)


def flat(tree):
    return np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(tree)])


def cosine(a, b):
    a, b = flat(a), flat(b)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# --------------------------------------------------------------------------- the jaxprs


def test_forward_and_backward_jaxprs_hold_e4m3_and_e5m2_and_the_rest_runs_in_bfloat16():
    params, x = mlp_params(), randn(5, 4, 16)
    f = jamp.autocast(mlp, "float8")
    fwd = jax.make_jaxpr(f)(params, x)
    assert dot_dtypes(fwd) == [((E4M3, E4M3), F32)] * 2  # float32 accumulation
    # The outputs are rescaled, cast to bfloat16, and the rest runs there.
    (tanh,) = eqns_named(fwd, "tanh")
    assert jnp.dtype(tanh.outvars[0].aval.dtype) == BF16
    assert jax.eval_shape(f, params, x).dtype == jnp.float32  # the dtype mlp returns
    bwd = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(f(p, x))))(params)
    grads = [e for e in eqns_named(bwd, "dot_general") if jnp.dtype(e.invars[0].aval.dtype) == E5M2]
    # 2 per product, each chosen at lowering (lax.platform_dependent, docs/float8-design.md): on
    # CUDA GPUs float32 accumulation without fast accumulation, the product rounded to the
    # gradient's dtype (bfloat16 for the hidden layer's input, float32 for the weights);
    # elsewhere DEFAULT into float32.
    by_precision = sorted((str(e.params["precision"]), dot_dtypes_of(e)) for e in grads)
    assert by_precision == [
        ("ANY_F8_ANY_F8_F32", ((E5M2, E4M3), BF16)),
        *[("ANY_F8_ANY_F8_F32", ((E5M2, E4M3), F32))] * 3,
        *[("None", ((E5M2, E4M3), F32))] * 4,
    ]
    g = jax.eval_shape(jax.grad(lambda p: jnp.sum(f(p, x))), params)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(g))


def test_convolutions_stay_bfloat16_float64_and_integer_products_are_untouched():
    def f(x, k, i, d):
        y = lax.conv_general_dilated(x, k, (1, 1), "SAME")
        return jnp.sum(y), i @ i, d @ d

    x, k = randn(0, 1, 2, 4, 4), randn(1, 3, 2, 3, 3)
    i = jnp.ones((2, 2), jnp.int32)
    with jax.enable_x64(True):
        d = jnp.ones((2, 2), jnp.float64)
        jaxpr = jax.make_jaxpr(jamp.autocast(f, "float8"))(x, k, i, d)
    (conv,) = eqns_named(jaxpr, "conv_general_dilated")
    assert [jnp.dtype(v.aval.dtype) for v in conv.invars] == [BF16, BF16]
    assert sorted(str(d[0][0]) for d in dot_dtypes(jaxpr)) == ["float64", "int32"]


def test_a_float16_policy_runs_the_rest_in_float16_and_a_wider_preferred_type_is_kept():
    def f(x, w):
        return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=F32), x @ w

    x, w = jnp.ones((2, 3), BF16), jnp.ones((3, 4), BF16)
    out = jax.eval_shape(jamp.autocast(f, "float8", policy="p=f32,c=f16,o=f32"), x, w)
    assert [o.dtype for o in out] == [F32, F32]  # the policy's output dtype
    jaxpr = jax.make_jaxpr(jamp.autocast(f, "float8", policy="p=f32,c=f16,o=bf16"))(x, w)
    calls = eqns_named(jaxpr, "custom_vjp_call")
    assert [jnp.dtype(c.outvars[0].aval.dtype) for c in calls] == [F32, F16]


def test_autocast_report_shows_the_float8_products():
    report = jamp.debug.autocast_report(mlp, mlp_params(), randn(5, 4, 16), dtype="float8")
    assert report.counts["dot_general"] == {"float8_e4m3fn": 2}
    assert ("dot_general", "float8", "float8_e4m3fn", 2) in report.rows
    assert report.counts["tanh"] == {"bfloat16": 1}
    assert "float8_e4m3fn" in report.residual_bytes  # the backward pass keeps float8 operands
    assert re.search(r"\ndot_general +float8 +float8_e4m3fn +2\n", str(report))


# --------------------------------------------------------------------------- numerics


def _with_output(model):
    """``(loss, output)`` of ``model``: one compiled step gives both."""

    def f(*args):
        *inputs, y = args
        out = model(*inputs).astype(jnp.float32)
        return jnp.mean(jnp.square(out - y)), out

    return f


# Shared by both magnitudes: compiled once.
_F32_STEP = jax.jit(jax.value_and_grad(_with_output(mlp), argnums=(0, 1), has_aux=True))
_CURRENT_STEP = jax.jit(
    jax.value_and_grad(_with_output(jamp.autocast(mlp, "float8")), argnums=(0, 1), has_aux=True)
)
_DELAYED = jamp.autocast(mlp, "float8", recipe=RECIPE)
_DELAYED_STEP = jax.jit(jax.value_and_grad(_with_output(_DELAYED), argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("magnitude", [1e3, 1e-6], ids=["far_from_1", "near_1e-6"])
def test_mlp_error_against_float32_far_from_1_and_near_1e_minus_6(magnitude):
    params = mlp_params()
    x = randn(10, 32, 16, scale=magnitude)
    y = randn(11, 32, 8, scale=magnitude)
    (_, want_out), want_grads = _F32_STEP(params, x, y)
    state = jamp.float8.init(_DELAYED, params, x)
    for _ in range(2):  # TE's start (scale 1) flushes inputs near 1e-6, a layer per step
        _, (state, *_) = _DELAYED_STEP(state, params, x, y)
    (_, current_out), current_grads = _CURRENT_STEP(params, x, y)
    (_, delayed_out), (_, *delayed_grads) = _DELAYED_STEP(state, params, x, y)
    for name, out, grads in (
        ("current", current_out, current_grads),
        ("delayed", delayed_out, delayed_grads),
    ):
        assert rel_err(out, want_out) <= 0.08, name
        assert cosine(grads, want_grads) >= 0.99, name
        assert np.abs(flat(grads)).max() > 0
    # Unscaled, float8 would flush every input near 1e-6 (smallest subnormal 2**-9).
    assert magnitude > 1 or not np.any(np.asarray(x.astype(E4M3), np.float32))


# --------------------------------------------------------------------------- delayed scaling


def test_delayed_state_through_autocast_evolves_bit_exactly_as_the_numpy_recipe():
    """One product; the cotangent reaching it is the bfloat16-exact ``ct``, so the NumPy
    model knows all three amaxes of every step."""
    r = np.random.default_rng(3)

    def f(w, x, ct):
        return jnp.sum((x @ w) * ct)

    g = jamp.autocast(f, "float8", recipe=RECIPE)
    w, x, ct = jnp.ones((6, 3)), jnp.ones((4, 6)), jnp.ones((4, 3))
    state = jamp.float8.init(g, w, x, ct)
    assert list(state) == ["0:dot_general"]
    history, scale = np.zeros((3, 4), np.float32), np.ones(3, np.float32)  # a fresh state
    step = jax.jit(jax.grad(g, argnums=0))
    for t in range(6):
        mags = 10.0 ** r.uniform(-5, 4, size=3)
        w = jnp.asarray(r.standard_normal((6, 3)) * mags[0], jnp.float32)
        x = jnp.asarray(r.standard_normal((4, 6)) * mags[1], jnp.float32)
        ct = jnp.asarray(r.standard_normal((4, 3)) * mags[2], BF16).astype(jnp.float32)
        state = step(state, w, x, ct)
        amaxes = np.array([jnp.max(jnp.abs(a)) for a in (x, w, ct)], np.float32)
        history, scale = numpy_recipe(history, scale, amaxes, RECIPE)
        got = state["0:dot_general"]
        assert np.asarray(got.amax_history).tobytes() == history.tobytes(), t
        assert np.asarray(got.scale).tobytes() == scale.tobytes(), t


def scan_model(ws, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = lax.scan(layer, x, ws)
    return jnp.sum(jnp.square(h))


def loop_model(ws, x):
    h = x
    for i in range(ws.shape[0]):
        h = jnp.tanh(h @ ws[i])
    return jnp.sum(jnp.square(h))


def test_a_product_in_a_scan_has_one_state_per_iteration_as_an_unrolled_loop_has():
    ws, x = randn(0, 3, 8, 8, scale=0.5), randn(1, 5, 8, scale=4.0)
    f_scan = jamp.autocast(scan_model, "float8", recipe=RECIPE)
    f_loop = jamp.autocast(loop_model, "float8", recipe=RECIPE)
    s_scan, s_loop = jamp.float8.init(f_scan, ws, x), jamp.float8.init(f_loop, ws, x)
    assert [v.scale.shape for v in s_scan.values()] == [(3, 3)]
    assert len(s_loop) == 3 and all(v.scale.shape == (3,) for v in s_loop.values())
    # Both jitted: XLA may keep bfloat16 intermediates in float32 (excess precision), and
    # float8 rounding magnifies such differences between a jitted and an eager run.
    g_scan = jax.jit(jax.grad(f_scan, argnums=(0, 1)))
    g_loop = jax.jit(jax.grad(f_loop, argnums=(0, 1)))
    for _ in range(2):
        s_scan, _ = g_scan(s_scan, ws, x)
    (stacked,) = s_scan.values()
    # Iteration i of the scan uses slice i of the stacked state: as the i-th unrolled product.
    s_loop = {k: jax.tree.map(lambda a, i=i: a[i], stacked) for i, k in enumerate(s_loop)}
    s_scan, d_scan = g_scan(s_scan, ws, x)
    s_loop, d_loop = g_loop(s_loop, ws, x)
    (stacked,) = s_scan.values()
    for i, one in enumerate(s_loop.values()):
        # The weights' amaxes are inputs: exact; the activations' and gradients' close. Not
        # equal: the scan's carry is float32, so its tanh is computed in float32 from the
        # half input (a carry is state, not rounded), where the loop's h is a bfloat16
        # activation; their gradients differ by a bfloat16 rounding (2**-8).
        assert (
            np.asarray(stacked.amax_history[i, 1]).tobytes()
            == np.asarray(one.amax_history[1]).tobytes()
        )
        np.testing.assert_allclose(stacked.amax_history[i], one.amax_history, rtol=2**-7)
        np.testing.assert_allclose(stacked.scale[i], one.scale, rtol=2**-7)
    # 0.023: a seventh of what float8's e5m2 gradients differ from float32's (0.157).
    assert rel_err(d_scan[0], d_loop[0]) < 0.05


def test_sites_follow_jit_remat_and_scan_while_cond_and_custom_rules_use_current_scaling():
    inner = jax.jit(lambda h, w: h @ w)

    def f(w, x):
        h = inner(x, w)  # the same jitted function twice: two products, two states
        h = inner(jnp.tanh(h), w)
        h = jax.checkpoint(lambda h: jnp.tanh(h @ w))(h)
        h = lax.cond(jnp.sum(h) > 0, lambda h: h @ w, lambda h: -h, h)
        h = lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ w), h)  # a scan: stacked
        v, h0 = lax.stop_gradient((w, h))  # a while loop cannot be differentiated
        h = h + lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ v), (0, h0))[1]
        h = jax.nn.relu(h)  # a custom_jvp around no product
        h = jamp.autocast(lambda h: h @ w, enabled=False)(h)
        return jnp.sum(h)

    g = jamp.autocast(f, "float8", recipe=RECIPE)
    w, x = randn(0, 6, 6, scale=0.4), randn(1, 3, 6)
    state = jamp.float8.init(g, w, x)
    assert [(k.split(":")[0], v.scale.shape) for k, v in state.items()] == [
        ("0", (3,)), ("1", (3,)), ("2", (3,)), ("3", (2, 3)),
    ]  # fmt: skip
    dtypes = dot_dtypes(jax.make_jaxpr(g)(state, w, x))
    assert dtypes.count(((E4M3, E4M3), F32)) == 6  # cond and while: current scaling
    assert ((F32, F32), F32) in dtypes  # the disabled region
    new, grads = jax.jit(jax.grad(g, argnums=(0, 1)))(state, w, x)
    for key, s in new.items():
        assert np.all(np.asarray(s.amax_history)[..., 0] > 0), key  # every product recorded
    assert np.isfinite(np.asarray(grads)).all()
    # Called again with other shapes, the same products have the same keys.
    assert list(jamp.float8.init(g, w, randn(2, 7, 6))) == list(state)


def test_a_product_that_does_not_reach_the_loss_gets_a_zero_state_which_is_never_used():
    """Its cotangent is zero (so under stop_gradient, or feeding only an aux output). A scale
    that is not positive is replaced: by 1, TE's start (``unmeasured="one"``), or by the
    current scale (``"current"``), never used to flush the product to zero."""

    def f(w, x):
        unused = x @ w.T  # noqa: F841
        return jnp.sum(x @ w)

    g = jamp.autocast(f, "float8", recipe=RECIPE)
    w, x = randn(0, 4, 4), randn(1, 2, 4, scale=30.0)
    state, _ = jax.jit(jax.grad(g, argnums=(0, 1)))(jamp.float8.init(g, w, x), w, x)
    zero = {"0:dot_general": state["0:dot_general"]}
    assert not np.any(np.asarray(zero["0:dot_general"].scale))

    def product(w, x):
        return x @ w.T

    one = jamp.autocast(product, "float8", recipe=RECIPE)
    current = jamp.autocast(
        product, "float8", recipe=jamp.float8.DelayedScaling(4, unmeasured="current")
    )
    pairs = (
        (one(zero, w, x), one(jamp.float8.init(one, w, x), w, x)),  # as a fresh state
        (current(zero, w, x), jamp.autocast(product, "float8")(w, x)),  # as current scaling
    )
    for got, want in pairs:
        assert np.any(np.asarray(got)) and np.asarray(got).tobytes() == np.asarray(want).tobytes()


# --------------------------------------------------------------------------- restored states

RECIPES = {
    "max": jamp.float8.DelayedScaling(4),
    "most_recent, margin 2": jamp.float8.DelayedScaling(
        4, margin=2, amax_compute_algo="most_recent"
    ),
    "current first": jamp.float8.DelayedScaling(3, unmeasured="current"),
}


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_every_state_the_recipe_makes_is_valid_and_a_corrupted_restore_is_refused(recipe):
    """Issue #26, item 1: a restored Float8State with a scale of 1e30 saturated every value
    and made the product 0.0 (finite: loss scaling applied the step). The state is now
    checked where it enters (an eager call) and by check_restored: every state the recipe
    makes passes, over six decades of amaxes, a zero amax and an overflowing input."""
    from flax import serialization

    params, y = mlp_params(), jnp.zeros((8, 8))
    model = jamp.autocast(mlp, "float8", recipe=recipe)
    loss = mse(model)
    next_state = jax.jit(jax.grad(loss))
    f8 = jamp.float8.init(model, params, randn(0, 8, 16))
    inputs = [randn(i, 8, 16, scale=10.0 ** (i - 3)) for i in range(6)]
    inputs += [jnp.zeros((8, 16)), randn(9, 8, 16).at[0, 0].set(jnp.inf)]
    for x in inputs:
        f8 = next_state(f8, params, x, y)
        jamp.check_restored(f8)  # raises unless valid
    model(f8, params, randn(1, 2, 16))  # an eager call checks it against the recipe
    # What a checkpoint hands back, with one scale corrupted.
    saved = serialization.to_state_dict(f8)
    key = next(iter(f8))
    saved[key]["scale"] = np.asarray(saved[key]["scale"]).copy()
    saved[key]["scale"][1] = 1e30
    restored = serialization.from_state_dict(f8, saved)
    with pytest.raises(ValueError, match=rf"{re.escape(key)}.scale\[1\] \(the scale of the right"):
        jamp.check_restored({"float8": restored})
    with pytest.raises(ValueError, match=r"its amax\s+history gives|the one its amax history"):
        model(restored, params, randn(1, 2, 16))
    for field, value, match in (
        ("scale", -1.0, r"scale to be finite and >= 0"),
        ("scale", np.nan, r"scale to be finite and >= 0"),
        ("amax_history", -2.0, r"amax_history to hold amaxes.*negative"),
    ):
        broken = np.asarray(getattr(f8[key], field)).copy()
        broken.flat[0] = value
        bad = {**f8, key: f8[key]._replace(**{field: jnp.asarray(broken)})}
        with pytest.raises(ValueError, match=match):
            jamp.check_restored(bad)


# --------------------------------------------------------------------------- composition


@pytest.mark.standard_promotion  # optax.adam's bias correction
def test_training_with_loss_scaling_skips_an_overflow_and_never_updates_the_state():
    """The float8 state is not a parameter: kept out of the optimizer, taken from the
    cotangent, and kept as it was on a skipped step. An overflow of the scaled gradients
    stays non-finite through the float8 products, so loss scaling skips the step."""
    params, x = mlp_params(), randn(20, 32, 16)
    y = jnp.tanh(randn(21, 32, 8))
    model = jamp.autocast(mlp, "float8", recipe=RECIPE, policy="p=f32,c=f16,o=f32")
    loss = mse(model)
    tx = jamp.loss_scaling(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
        jamp.dynamic_loss_scale(2.0**24, growth_interval=1000),
    )
    f8, opt_state = jamp.float8.init(model, params, x), tx.init(params)

    @jax.jit
    def step(params, f8, opt_state):
        ls = jamp.get_loss_scale(opt_state)
        scaled = lambda s, p: jamp.scale(ls, loss(s, p, x, y))  # noqa: E731
        f8_next, grads = jax.grad(scaled, argnums=(0, 1))(f8, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        f8 = jamp.compat.select_tree(
            opt_state.last_finite, f8_next, f8
        )  # a skipped step: as it was
        return optax.apply_updates(params, updates), f8, opt_state

    losses, finite = [], []
    for _ in range(12):
        before = (params, f8)
        params, f8, opt_state = step(params, f8, opt_state)
        finite.append(bool(opt_state.last_finite))
        if not finite[-1]:  # float16 overflow at 2**24: skipped, nothing moved
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((params, f8)), strict=True):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        losses.append(float(jax.jit(loss)(f8, params, x, y)))
    assert not finite[0] and finite[-1]  # overflowed first, then the scale backed off
    assert int(opt_state.skipped_steps) == finite.count(False) >= 1
    assert float(jamp.get_loss_scale(opt_state).scale) < 2.0**24
    assert losses[-1] < losses[finite.index(True)]  # it trains
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(f8))


def _train(recipe, steps, corrupt_at=None, policy=None):
    """The loop of docs/float8.md: jitted, loss-scaled, the float8 state kept on a skipped
    step; inputs over six decades, an all-zero batch and an overflowing one. Returns the
    trajectory: (params, float8 state, optimizer state) after every step. ``corrupt_at``:
    the step whose float8 state has its first scale set to 1e30 (a corrupted restore)."""
    params = mlp_params()
    y = jnp.tanh(randn(21, 32, 8))
    inputs = [randn(i, 32, 16, scale=10.0 ** (i % 7 - 3)) for i in range(steps)]
    inputs[3] = jnp.zeros((32, 16))
    inputs[5] = inputs[5].at[0, 0].set(jnp.inf)
    model = jamp.autocast(mlp, "float8", recipe=recipe, policy=policy)
    loss = mse(model)
    tx = jamp.loss_scaling(optax.sgd(1e-2), jamp.dynamic_loss_scale(2.0**15))
    f8, opt_state = jamp.float8.init(model, params, inputs[0]), tx.init(params)

    @jax.jit
    def step(params, f8, opt_state, x):
        ls = jamp.get_loss_scale(opt_state)
        scaled = lambda s, p: jamp.scale(ls, loss(s, p, x, y))  # noqa: E731
        f8_next, grads = jax.grad(scaled, argnums=(0, 1))(f8, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        f8 = jamp.compat.select_tree(opt_state.last_finite, f8_next, f8)
        return optax.apply_updates(params, updates), f8, opt_state

    out = []
    for t, x in enumerate(inputs):
        if t == corrupt_at:
            key = next(iter(f8))
            f8 = {**f8, key: f8[key]._replace(scale=f8[key].scale.at[0].set(1e30))}
        params, f8, opt_state = step(params, f8, opt_state, x)
        out.append((params, f8, opt_state))
    return out


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_the_traced_check_leaves_a_real_training_loop_bit_for_bit(recipe, monkeypatch):
    """Issue #35: the check of the state under jit changes nothing for the states the
    recipe makes, fresh (scale 1, or 0 with unmeasured="current"), measured, after a zero
    batch and after an overflow: every step's parameters, float8 state and optimizer
    state are the bits they were without it."""
    from jamp._src.float8 import products

    checked = _train(recipe, 12)
    monkeypatch.setattr(products, "traced_check", lambda *args: None)
    unchecked = _train(recipe, 12)
    for t, (a, b) in enumerate(zip(checked, unchecked, strict=True)):
        for x, z in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert np.asarray(x).tobytes() == np.asarray(z).tobytes(), t
    skipped = [not bool(o.last_finite) for _, _, o in checked]
    assert skipped[5] and skipped.count(True) == 1  # only the overflowing batch


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_under_jit_a_corrupted_float8_state_makes_loss_scaling_skip_the_step(recipe, monkeypatch):
    """Issue #35: a Float8State whose scale is 1e30 where its amax history gives ~10,
    passed traced as every jitted step passes it, gave a finite product, and loss scaling
    applied the step. Its products and gradients are now NaN: the step is skipped, and
    the parameters are kept, as on an overflow (eagerly, and in check_restored, it is
    refused: test_every_state_the_recipe_makes_is_valid_and_a_corrupted_restore_is_refused).
    """
    from jamp._src.float8 import products

    checked = _train(recipe, 8, corrupt_at=7)
    before, (params, f8, opt_state) = checked[6], checked[7]
    assert not bool(opt_state.last_finite)
    for x, z in zip(jax.tree.leaves(before[0]), jax.tree.leaves(params), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(z).tobytes()
    assert f8[next(iter(f8))].scale[0] == np.float32(1e30)  # kept, as a skipped step keeps it
    monkeypatch.setattr(products, "traced_check", lambda *args: None)
    _, _, applied = _train(recipe, 8, corrupt_at=7)[7]
    assert bool(applied.last_finite)  # what it did before: the step applied


def test_loss_scaling_refuses_a_float8_state_among_the_parameters_or_gradients():
    params, x = mlp_params(), randn(20, 4, 16)
    model = jamp.autocast(mlp, "float8", recipe=RECIPE)
    tree = {"model": params, "float8": jamp.float8.init(model, params, x)}
    grads = jax.eval_shape(jax.grad(lambda t: jnp.sum(model(t["float8"], t["model"], x))), tree)
    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale())
    where = r"Float8State in the {} .* at \['float8'\]\['0:dot_general'\]: .* not a parameter"
    with pytest.raises(TypeError, match=where.format("parameters")):
        tx.init(tree)
    with pytest.raises(TypeError, match=where.format("gradients")):
        tx.update(grads, tx.init(params), params)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_eight_devices_with_a_sharded_batch_agree_with_one(axis_type):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    batch = NamedSharding(mesh, PartitionSpec("data"))
    params, x = mlp_params(), randn(30, 16, 16)
    y = randn(31, 16, 8)
    model = jamp.autocast(mlp, "float8", recipe=RECIPE)
    f8 = jamp.float8.init(model, params, x)
    grad = jax.jit(jax.grad(mse(model), argnums=(0, 1)))
    one = grad(f8, params, x, y)
    with jax.set_mesh(mesh):  # explicit axes need it, as for jax.grad of the float32 model
        eight = grad(f8, params, jax.device_put(x, batch), jax.device_put(y, batch))
    # One amax per tensor: the maximum is taken over the whole batch, not per shard.
    for a, b in zip(jax.tree.leaves(one[0]), jax.tree.leaves(eight[0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=0.03)
    for run in (one, eight):  # the sharded input's amax is the whole batch's
        np.testing.assert_array_equal(
            run[0]["0:dot_general"].amax_history[:, 0][:2],
            np.asarray([jnp.max(jnp.abs(x)), jnp.max(jnp.abs(params["w1"]))]),
        )
    # The partitioned program rounds its bfloat16 intermediates differently (XLA's excess
    # precision), and float8 rounding magnifies that: close, not equal.
    assert rel_err(flat(one[1]), flat(eight[1])) < 0.05


def test_remat_of_the_whole_step_gives_the_same_state_and_gradients():
    params, x = mlp_params(), randn(40, 8, 16)
    y = randn(41, 8, 8)
    model = jamp.autocast(mlp, "float8", recipe=RECIPE)
    f8 = jamp.float8.init(model, params, x)
    plain = jax.jit(jax.grad(mse(model), argnums=(0, 1)))(f8, params, x, y)
    remat = jax.jit(jax.grad(jax.checkpoint(mse(model)), argnums=(0, 1)))(f8, params, x, y)
    for a, b in zip(jax.tree.leaves(plain[0]), jax.tree.leaves(remat[0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-2)
    assert rel_err(flat(plain[1]), flat(remat[1])) < 1e-2


# --------------------------------------------------------------------------- bad input


def _delayed():
    return jamp.autocast(mlp, "float8", recipe=RECIPE)


BAD_INPUT = {
    "autocast recipe without float8": (
        lambda: jamp.autocast(mlp, jnp.bfloat16, recipe=RECIPE),
        ValueError,
        r"Expected dtype='float8' with `recipe`",
    ),
    "autocast recipe='delayed'": (
        lambda: jamp.autocast(mlp, "float8", recipe="delayed"),
        TypeError,
        r"Expected a jamp.float8.DelayedScaling .* for `recipe`, got 'delayed'",
    ),
    "autocast dtype=jnp.float8_e4m3fn names float8 mode": (
        lambda: jamp.autocast(mlp, jnp.float8_e4m3fn),
        ValueError,
        r"`dtype`.*float8_e4m3fn.*jamp.autocast\(fun, 'float8'\)",
    ),
    "float8_init of a current-scaling function": (
        lambda: jamp.float8.init(jamp.autocast(mlp, "float8"), mlp_params(), jnp.ones((2, 16))),
        TypeError,
        r"Expected for `fun` a function returned by jamp.autocast\(f, 'float8', recipe=",
    ),
    "delayed function called without its state": (
        lambda: _delayed()(mlp_params(), jnp.ones((2, 16))),
        TypeError,
        r"Expected the float8 state .* as the first argument .* then the arguments of mlp",
    ),
    "delayed function called with an array for the state": (
        lambda: _delayed()(jnp.ones(2), mlp_params(), jnp.ones((2, 16))),
        TypeError,
        r"Expected a dict of jamp.float8.Float8State for the float8 state .* got ArrayImpl",
    ),
    "delayed function with a state missing a product": (
        lambda: _delayed()({}, mlp_params(), jnp.ones((2, 16))),
        ValueError,
        r"keys \['0:dot_general', '1:dot_general'\], got keys \[\].*jamp.float8.init",
    ),
    "delayed function with a Float8State of lists": (
        lambda: _delayed()(
            {
                k: jamp.float8.Float8State([[0.0] * 4] * 3, [1.0, 1.0, 1.0])
                for k in ("0:dot_general", "1:dot_general")
            },
            mlp_params(),
            jnp.ones((2, 16)),
        ),
        ValueError,
        r"Float8State of float32 arrays.*'0:dot_general'.*got \('list', 'list'\)",
    ),
    "delayed function with a scale of 1e30": (
        lambda: _delayed()(
            {
                k: v._replace(scale=jnp.full(3, 1e30, jnp.float32))
                for k, v in jamp.float8.init(_delayed(), mlp_params(), jnp.ones((2, 16))).items()
            },
            mlp_params(),
            jnp.ones((2, 16)),
        ),
        ValueError,
        r"'0:dot_general'.scale\[0\].*never measured.*scale is 1 or 0",
    ),
    "delayed function with another history length": (
        lambda: _delayed()(
            jamp.float8.init(
                jamp.autocast(mlp, "float8", recipe=jamp.float8.DelayedScaling(8)),
                mlp_params(),
                jnp.ones((2, 16)),
            ),
            mlp_params(),
            jnp.ones((2, 16)),
        ),
        ValueError,
        r"shapes \{'amax_history': \(3, 4\), 'scale': \(3,\)\}.*'0:dot_general'",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])


def test_disabled_with_a_recipe_keeps_the_signature_and_ignores_the_state():
    params, x = mlp_params(), randn(2, 4, 16)
    off = jamp.autocast(mlp, "float8", recipe=RECIPE, enabled=False)
    assert jamp.float8.init(off, params, x) == {}
    np.testing.assert_array_equal(off({}, params, x), mlp(params, x))
    dots = dot_dtypes(jax.make_jaxpr(off)({}, params, x))
    assert dots == [((F32, F32), F32)] * 2


def test_float8_init_takes_shapes_and_static_arguments():
    def f(w, x, *, act):
        return act(x @ w)

    g = jamp.autocast(f, "float8", recipe=RECIPE)
    w = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    state = jamp.float8.init(g, w, jnp.ones((2, 4)), act=jnp.tanh)
    assert state["0:dot_general"].amax_history.dtype == jnp.float32
    np.testing.assert_array_equal(state["0:dot_general"].scale, np.ones(3))  # TE's start
    jitted = functools.partial(jax.jit, static_argnames="act")(g)
    assert jitted(state, jnp.ones((4, 4)), jnp.ones((2, 4)), act=jnp.tanh).shape == (2, 4)


def test_a_delayed_scaling_method_takes_the_state_first():
    """``@jamp.autocast(dtype="float8", recipe=...)`` on a method: ``m.f(state, x)`` passes the
    state first and ``m`` as ``self``, as the function ``f(state, m, x)`` would."""

    class Model:
        def __init__(self, w):
            self.w = w

        @jamp.autocast(dtype="float8", recipe=RECIPE)
        def apply(self, x):
            return jnp.sum(x @ self.w)

    m, x = Model(jnp.full((3, 3), 0.5)), jnp.ones((2, 3))
    state = jamp.float8.init(m.apply, x)
    assert state.keys() == jamp.float8.init(Model.apply, m, x).keys() == {"0:dot_general"}
    np.testing.assert_array_equal(m.apply(state, x), Model.apply(state, m, x))
    new, _ = jax.grad(lambda s, x: m.apply(s, x), argnums=(0, 1))(state, x)
    np.testing.assert_array_equal(new["0:dot_general"].amax_history[:, 0], [1.0, 0.5, 1.0])
