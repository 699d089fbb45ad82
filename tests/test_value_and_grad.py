"""jamp.value_and_grad: gradients of a scaled loss, unscaled and checked, and retries."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _bad_input import assert_clear_error
from _problem import (
    X,
    assert_trees_equal,
    loss_fn,
    params0,
)

import jamp

EAGER_AND_JIT = [pytest.param(lambda f: f, id="eager"), pytest.param(jax.jit, id="jit")]


# ---------------------------------------------------------------- value_and_grad


@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
def test_value_and_grad_matches_direct_computation(wrap):
    ls = jamp.dynamic_loss_scale(2.0**12)
    vg = wrap(jamp.value_and_grad(loss_fn))
    out = vg(ls, params0(), X)
    value, grads = jax.value_and_grad(loss_fn)(params0(), X)
    assert float(out.value) == float(value) and out.aux is None
    assert_trees_equal(out.grads, grads)
    assert bool(out.finite) and int(out.retries) == 0
    assert int(out.loss_scale.growth_tracker) == 1


def test_value_and_grad_aux_argnums_kwargs():
    def f(x, p, *, k):
        loss = loss_fn(p, x) * k
        return loss, {"k": k}

    vg = jamp.value_and_grad(f, argnums=(1,), has_aux=True)
    out = vg(jamp.dynamic_loss_scale(8.0), X, params0(), k=jnp.float32(2.0))
    assert float(out.aux["k"]) == 2.0
    ref = jax.grad(lambda p: f(X, p, k=jnp.float32(2.0))[0])(params0())
    assert_trees_equal(out.grads[0], ref)
    out_neg = jamp.value_and_grad(f, argnums=-1, has_aux=True)(
        jamp.dynamic_loss_scale(8.0), X, params0(), k=jnp.float32(2.0)
    )
    assert_trees_equal(out_neg.grads, ref)


def test_value_and_grad_grows_on_the_interval_th_step_not_one_later():
    # flax's DynamicScale grows on the (growth_interval + 1)-th finite step.
    ls = jamp.dynamic_loss_scale(8.0, growth_interval=3)
    vg = jax.jit(jamp.value_and_grad(loss_fn))
    scales = []
    for _ in range(4):
        out = vg(ls, params0(), X)
        ls = out.loss_scale
        scales.append(float(ls.scale))
    assert scales == [8.0, 8.0, 16.0, 16.0]


def test_value_and_grad_overflow():
    vg = jamp.value_and_grad(lambda w: jnp.sum(w.astype(jnp.float16) ** 2).astype(jnp.float32))
    out = vg(jamp.dynamic_loss_scale(2.0**16), jnp.array([200.0, 1.0]))
    assert not bool(out.finite) and float(out.loss_scale.scale) == 2.0**15


# ---------------------------------------------------------------- retries


def fp16_loss(w, x):
    # The scaled loss is formed in float16 inside the backward pass, so the
    # cotangent overflows float16 at scale 2**16 and 2**15 but not at 2**14.
    h = x.astype(jnp.float16) * w.astype(jnp.float16)
    return jnp.sum(h.astype(jnp.float32))


def test_retry_returns_grads_of_the_first_finite_attempt():
    x = jnp.array([3.0, 1.0])
    w = jnp.array([1.0, 1.0])
    vg = jax.jit(jamp.value_and_grad(fp16_loss, max_retries=4))
    out = vg(jamp.dynamic_loss_scale(2.0**16), w, x)
    assert bool(out.finite) and int(out.retries) == 2
    assert float(out.loss_scale.scale) == 2.0**14 and int(out.loss_scale.growth_tracker) == 1
    direct = jamp.value_and_grad(fp16_loss)(jamp.dynamic_loss_scale(2.0**14), w, x)
    np.testing.assert_array_equal(np.asarray(out.grads), np.asarray(direct.grads))
    assert float(out.value) == float(direct.value)
    # without retries the step is lost and the scale backs off once
    once = jamp.value_and_grad(fp16_loss)(jamp.dynamic_loss_scale(2.0**16), w, x)
    assert not bool(once.finite) and float(once.loss_scale.scale) == 2.0**15


def test_retries_exhausted():
    vg = jamp.value_and_grad(lambda w: jnp.sum(w) * jnp.inf, max_retries=3)
    out = jax.jit(vg)(jamp.dynamic_loss_scale(2.0**10), jnp.ones(2))
    assert not bool(out.finite) and int(out.retries) == 3
    assert float(out.loss_scale.scale) == 2.0**6  # three retries and the final update


def test_retries_ignore_static_scale_and_validate():
    out = jamp.value_and_grad(lambda w: jnp.sum(w) * jnp.inf, max_retries=3)(
        jamp.static_loss_scale(4.0), jnp.ones(2)
    )
    assert int(out.retries) == 0
    with pytest.raises(
        ValueError, match=r"`max_retries` to be an integer >= 0, got max_retries=-1"
    ):
        jamp.value_and_grad(jnp.sum, max_retries=-1)


def test_retries_stop_at_min_scale():
    vg = jamp.value_and_grad(lambda w: jnp.sum(w) * jnp.nan, max_retries=1000)
    out = jax.jit(vg)(jamp.dynamic_loss_scale(2.0**10, min_scale=2.0**6), jnp.ones(2))
    assert not bool(out.finite) and int(out.retries) == 4  # 2**10 -> 2**6, then no more
    assert float(out.loss_scale.scale) == 2.0**6


def test_every_failed_retry_ignores_hysteresis_the_last_too():
    vg = jamp.value_and_grad(lambda w: jnp.sum(w) * jnp.nan, max_retries=3)
    out = jax.jit(vg)(jamp.dynamic_loss_scale(2.0**16, hysteresis=3), jnp.ones(2))
    assert int(out.retries) == 3
    assert float(out.loss_scale.scale) == 2.0**12  # four failed attempts, four backoffs


# ---------------------------------------------------------------- bad input

# Every invalid argument of value_and_grad and of the function it returns: id -> (call,
# exception, match).
BAD_INPUT = {
    "fun=3": (lambda: jamp.value_and_grad(3), TypeError, r"`fun` to be callable"),
    "argnums='a'": (lambda: jamp.value_and_grad(jnp.sum, argnums="a"), TypeError, r"`argnums`"),
    "argnums='x'": (
        lambda: jamp.value_and_grad(loss_fn, argnums="x"),
        TypeError,
        r"`argnums` to be an int or a sequence of ints",
    ),
    "argnums=5 called with 2": (
        lambda: jamp.value_and_grad(loss_fn, argnums=5)(jamp.dynamic_loss_scale(), params0(), X),
        ValueError,
        r"`argnums` to index one of the 2 positional",
    ),
    "state=GradScaler": (
        lambda: jamp.value_and_grad(jnp.sum)(jamp.GradScaler(), jnp.ones(2)),
        TypeError,
        r"loss-scale state as its first argument, got GradScaler",
    ),
    "state=dict (no state first)": (
        lambda: jamp.value_and_grad(loss_fn)(params0(), X),
        TypeError,
        r"takes the loss-scale state as its first argument, got dict",
    ),
    "has_aux without a pair": (
        lambda: jamp.value_and_grad(lambda w: jnp.sum(w), has_aux=True)(
            jamp.dynamic_loss_scale(), jnp.ones(2)
        ),
        TypeError,
        r"`fun` to return a pair \(loss, aux\)",
    ),
    # issue #26: accepted, then an OverflowError inside jax; has_aux never checked
    "max_retries=2**31": (
        lambda: jamp.value_and_grad(jnp.sum, max_retries=2**31),
        ValueError,
        r"`max_retries` to be an integer in \[0, 2\*\*31 - 1\].*got max_retries=2147483648",
    ),
    "max_retries=1.5": (
        lambda: jamp.value_and_grad(jnp.sum, max_retries=1.5),
        TypeError,
        r"`max_retries` to be an integer >= 0, got max_retries=1.5",
    ),
    "has_aux='yes'": (
        lambda: jamp.value_and_grad(jnp.sum, has_aux="yes"),
        TypeError,
        r"`has_aux` to be a bool.*got has_aux='yes'",
    ),
    "filter_value_and_grad has_aux=1": (
        lambda: jamp.filter_value_and_grad(jnp.sum, has_aux=1),
        TypeError,
        r"`has_aux` to be a bool",
    ),
    "differentiating an integer argument": (
        lambda: jamp.value_and_grad(lambda w: jnp.sum(w))(
            jamp.dynamic_loss_scale(), {"w": jnp.ones(2, jnp.int32)}
        ),
        TypeError,
        r"differentiates positional argument 0 of `fun`.*int32 at path \['w'\]",
    ),
    "differentiating a string": (
        lambda: jamp.value_and_grad(lambda w: w)(jamp.dynamic_loss_scale(), "abc"),
        TypeError,
        r"differentiates positional argument 0.*type str at path <root>",
    ),
    # step_if_finite: gradients, parameters and optimizer states that do not match
    "step_if_finite(opt_state of another optimizer)": (
        lambda: jamp.step_if_finite(
            jnp.bool_(True),
            optax.adam(1e-3),
            params0(),
            optax.sgd(0.1, 0.9).init(params0()),
            params0(),
        ),
        ValueError,
        r"`jamp.step_if_finite` expected `opt_state` to be the state that the optimizer's init",
    ),
    "step_if_finite(grads of other shapes)": (
        lambda: jamp.step_if_finite(
            jnp.bool_(True),
            optax.sgd(0.1),
            {"w": jnp.ones(4), "b": jnp.ones(2)},
            optax.sgd(0.1).init(params0()),
            params0(),
        ),
        ValueError,
        r"gradients and `params` to match leaf for leaf.*\['w'\]: shapes \(4,\) and \(2, 2\)",
    ),
    "step_if_finite(integer gradients)": (
        lambda: jamp.step_if_finite(
            jnp.bool_(True),
            optax.sgd(0.1),
            {"w": jnp.ones(2, jnp.int32)},
            optax.sgd(0.1).init({"w": jnp.ones(2)}),
            {"w": jnp.ones(2)},
        ),
        TypeError,
        r"gradients to be floating arrays, got .*int32 at path \['w'\]",
    ),
    "step_if_finite(a bool parameter)": (
        lambda: jamp.step_if_finite(
            jnp.bool_(True),
            optax.sgd(0.1),
            {"w": jnp.ones(2)},
            optax.sgd(0.1).init({"w": jnp.ones(2)}),
            {"w": jnp.zeros(2, bool)},
        ),
        TypeError,
        r"a float32 gradient for a bool parameter.*becomes True",
    ),
    "step_if_finite(params=None)": (
        lambda: jamp.step_if_finite(
            jnp.bool_(True), optax.sgd(0.1), {"w": jnp.ones(2)}, optax.sgd(0.1).init(None), None
        ),
        ValueError,
        r"`params` to hold the parameters the gradients update, got NoneType",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])


@pytest.mark.parametrize("skip", ["auto", "cond", "select"])
def test_step_if_finite_skipped_keeps_the_old_parameters_bit_for_bit(skip):
    """-0.0 and a float32 subnormal included (step_if_finite hands back the old buffers)."""
    params = {"w": jnp.array([-0.0, 1e-40, 2.0], jnp.float32)}
    tx = optax.adam(1e-2)
    vg = jamp.value_and_grad(lambda p, x: jnp.sum(p["w"] * x))

    @jax.jit
    def train_step(params, opt_state, loss_scale, x):
        out = vg(loss_scale, params, x)
        params, opt_state = jamp.step_if_finite(
            out.finite, tx, out.grads, opt_state, params, skip=skip
        )
        return params, opt_state, out.loss_scale

    opt_state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):  # adam's bias correction
        new, new_opt, _ = train_step(
            params, opt_state, jamp.dynamic_loss_scale(), jnp.full(3, 1e38)
        )
    assert np.array_equal(
        np.asarray(new["w"]).view(np.uint32), np.asarray(params["w"]).view(np.uint32)
    )
    assert_trees_equal(new_opt, opt_state)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_step_if_finite_updates_a_float8_parameter_in_float32(jit):
    """A float8 parameter meets a float32 update, which no promotion takes: the sum is made
    in float32 and rounded back to float8 (the fuzz test found a TypePromotionError). Every
    value here is exact in float32 and float8, so the comparison is exact whatever XLA fuses."""
    tx = optax.sgd(0.5)
    params = {"w": jnp.array([1.0, -2.0, 0.25], jnp.float8_e4m3fn)}
    grads = {"w": jnp.array([0.5, 1.0, 0.125], jnp.float32)}
    step = functools.partial(jamp.step_if_finite, jnp.bool_(True), tx)
    new, _ = (jax.jit(step) if jit else step)(grads, tx.init(params), params)
    want = (params["w"].astype(jnp.float32) - 0.5 * grads["w"]).astype(jnp.float8_e4m3fn)
    assert new["w"].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(new["w"], want)


def test_a_donated_grad_scaler_train_step_updates_float8_parameters():
    """The user's program: a jitted GradScaler train step over float8 weights whose
    gradients go to the optimizer in float32, parameters and optimizer state donated, run
    twice. Every value is exact in float8 and float32: the comparison is exact."""
    scaler, tx = jamp.GradScaler(init_scale=4.0), optax.sgd(0.5)
    x = jnp.array([1.0, 2.0, 0.5], jnp.float32)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, state):
        def loss(p):
            return scaler.scale(state, jnp.sum(p["w"].astype(jnp.float32) * x))

        # float8 gradients, as their parameters; the optimizer runs in float32
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), jax.grad(loss)(params))
        params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)
        return params, opt_state, scaler.update(state)

    params = {"w": jnp.array([1.0, -2.0, 0.25], jnp.float8_e4m3fn)}
    opt_state, state = tx.init(params), scaler.init()
    want = params["w"].astype(jnp.float32)
    for _ in range(2):
        params, opt_state, state = train_step(params, opt_state, state)
        want = (want - 0.5 * x).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    assert params["w"].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(params["w"].astype(jnp.float32), want)
