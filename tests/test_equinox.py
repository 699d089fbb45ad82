"""Equinox users: ``eqx.Module`` models go into jamp as they are.

Each training route (``filter_value_and_grad`` + ``step_if_finite``, the Optax
``loss_scaling`` with ``eqx.filter_grad`` and ``eqx.apply_updates``, and
``GradScaler.step``) trains ``eqx.nn.MLP``, a convolutional ``eqx.nn.Sequential``
and a model with ``eqx.nn.BatchNorm`` / ``eqx.nn.State`` under ``eqx.filter_jit``,
and an injected overflow skips the step: model, optimizer state and model state
come back unchanged, the scale backs off, and nothing recompiles.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp

eqx = pytest.importorskip("equinox")

KEY = jax.random.PRNGKey(0)


# ---------------------------------------------------------------- models


def mlp():
    return eqx.nn.MLP(4, 1, 16, 2, key=KEY), None


def conv():
    k1, k2 = jax.random.split(KEY)
    model = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(1, 4, 3, key=k1),  # 6x6 -> 4x4
            eqx.nn.Lambda(jax.nn.relu),
            eqx.nn.MaxPool2d(2, stride=2),  # 4x4 -> 2x2; holds a Python float and a function
            eqx.nn.Lambda(jnp.ravel),
            eqx.nn.Linear(16, 1, key=k2),
        ]
    )
    return model, None


class BatchNormNet(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(4, 8, key=k1)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.out = eqx.nn.Linear(8, 1, key=k2)

    def __call__(self, x, state):
        h, state = self.norm(self.linear(x), state)
        return self.out(jax.nn.relu(h)), state


def batch_norm():
    return eqx.nn.make_with_state(BatchNormNet)(KEY)


MODELS = {"mlp": mlp, "conv": conv, "batch_norm": batch_norm}


def data(name, batch=8, bad=False, seed=1):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    shape = (batch, 1, 6, 6) if name == "conv" else (batch, 4)
    x = jax.random.normal(kx, shape)
    if bad:
        x = x.at[0].set(jnp.inf)  # the injected overflow
    return x, jax.random.normal(ky, (batch, 1))


def loss_fn(model, state, x, y):
    """Mean squared error, and the model state the forward pass wrote (or None)."""
    if state is None:
        pred = jax.vmap(model)(x)
    else:
        pred, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            x, state
        )
    return jnp.mean((pred - y) ** 2), state


def arrays(tree):
    return [x for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def same_arrays(a, b):
    pairs = zip(arrays(a), arrays(b), strict=True)
    return all(x.dtype == y.dtype and bool(jnp.array_equal(x, y)) for x, y in pairs)


def statics(tree):
    return [x for x in jax.tree.leaves(tree) if not eqx.is_array(x)]


# ---------------------------------------------------------------- the three routes


def tx():
    return optax.sgd(0.05, momentum=0.9)


def route_filter_value_and_grad(model, traces):
    optimizer = tx()
    carry = (optimizer.init(eqx.filter(model, eqx.is_array)), jamp.dynamic_loss_scale(2.0**10))

    @eqx.filter_jit
    def step(model, state, carry, x, y):
        traces.append(1)
        opt_state, loss_scale = carry
        out = jamp.filter_value_and_grad(loss_fn, has_aux=True)(loss_scale, model, state, x, y)
        model, opt_state = jamp.step_if_finite(
            out.finite, optimizer, out.grads, opt_state, model, filter=eqx.is_array
        )
        state = jamp.compat.select_tree(out.finite, out.aux, state)  # the model-state recipe
        return model, state, (opt_state, out.loss_scale), out.finite

    return carry, step, lambda carry: carry[1].scale


def route_loss_scaling(model, traces):
    optimizer = jamp.loss_scaling(tx(), jamp.dynamic_loss_scale(2.0**10))
    carry = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, opt_state, x, y):
        traces.append(1)
        ls = jamp.get_loss_scale(opt_state)

        def scaled(m):
            loss, new_state = loss_fn(m, state, x, y)
            return jamp.scale(ls, loss), new_state

        grads, new_state = eqx.filter_grad(scaled, has_aux=True)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        state = jamp.compat.select_tree(opt_state.last_finite, new_state, state)
        return model, state, opt_state, opt_state.last_finite

    return carry, step, lambda opt_state: jamp.get_loss_scale(opt_state).scale


def route_grad_scaler(model, traces):
    optimizer = tx()
    scaler = jamp.GradScaler(init_scale=2.0**10)
    carry = (optimizer.init(eqx.filter(model, eqx.is_array)), scaler.init())

    @eqx.filter_jit
    def step(model, state, carry, x, y):
        traces.append(1)
        opt_state, st = carry

        def scaled(m):
            loss, new_state = loss_fn(m, state, x, y)
            return scaler.scale(st, loss), new_state

        grads, new_state = eqx.filter_grad(scaled, has_aux=True)(model)
        model, opt_state, st = scaler.step(
            st, optimizer, grads, opt_state, model, filter=eqx.is_array
        )
        finite = jnp.logical_not(scaler.found_inf(st))
        state = jamp.compat.select_tree(finite, new_state, state)
        return model, state, (opt_state, scaler.update(st)), finite

    return carry, step, lambda carry: scaler.get_scale(carry[1])


ROUTES = {
    "filter_value_and_grad": route_filter_value_and_grad,
    "loss_scaling": route_loss_scaling,
    "grad_scaler": route_grad_scaler,
}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_injected_overflow_is_skipped_under_filter_jit(name, route):
    model, state = MODELS[name]()
    traces = []
    carry, step, scale_of = ROUTES[route](model, traces)
    x, y = data(name)

    model1, state1, carry1, finite = step(model, state, carry, x, y)
    assert bool(finite) and not same_arrays(model1, model)
    if state is not None:
        assert not same_arrays(state1, state)  # the batch statistics moved

    bad_x, _ = data(name, bad=True)
    model2, state2, carry2, finite = step(model1, state1, carry1, bad_x, y)
    assert not bool(finite)
    assert same_arrays(model2, model1)  # the model, bit for bit
    assert same_arrays(
        carry2[0] if route != "loss_scaling" else carry2.inner_state,
        (carry1[0] if route != "loss_scaling" else carry1.inner_state),
    )  # the optimizer state (momentum)
    if state is not None:
        assert same_arrays(state2, state1)  # the model state, with the select_tree recipe
    assert float(scale_of(carry2)) == float(scale_of(carry1)) / 2
    # The module's functions and flags come back as they were.
    assert all(a is b for a, b in zip(statics(model2), statics(model), strict=True))
    assert jax.tree.structure(model2) == jax.tree.structure(model)

    model3, _, _, finite = step(model2, state2, carry2, x, y)
    assert bool(finite) and not same_arrays(model3, model2)
    assert len(traces) == 1  # neither the overflow nor the skip recompiled


def test_the_routes_train_the_same_model():
    """The three routes are the same algorithm: the same parameters after clean steps."""
    results = []
    for route in ROUTES.values():
        model, state = mlp()
        carry, step, _ = route(model, [])
        for i in range(3):
            x, y = data("mlp", seed=i)
            model, state, carry, _ = step(model, state, carry, x, y)
        results.append(model)
    for other in results[1:]:
        for a, b in zip(arrays(results[0]), arrays(other), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.standard_promotion  # optax.adam's bias correction mixes int32 and float32
def test_adam_count_does_not_advance_on_a_skipped_step():
    model, _ = mlp()
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    loss = lambda m, x, y: loss_fn(m, None, x, y)[0]  # noqa: E731

    @eqx.filter_jit
    def step(model, opt_state, loss_scale, x, y):
        out = jamp.filter_value_and_grad(loss)(loss_scale, model, x, y)
        model, opt_state = jamp.step_if_finite(
            out.finite, optimizer, out.grads, opt_state, model, filter=eqx.is_array
        )
        return model, opt_state, out.loss_scale

    model, opt_state, ls = step(model, opt_state, jamp.dynamic_loss_scale(), *data("mlp"))
    count = optax.tree.get(opt_state, "count")
    model2, opt_state2, _ = step(model, opt_state, ls, *data("mlp", bad=True))
    assert int(optax.tree.get(opt_state2, "count")) == int(count) == 1
    assert same_arrays(model2, model) and same_arrays(opt_state2, opt_state)


# ---------------------------------------------------------------- filter_value_and_grad


@pytest.mark.parametrize(
    "name,jit", [("mlp", False), ("mlp", True), ("conv", True), ("batch_norm", True)]
)
def test_filter_value_and_grad_is_eqx_filter_value_and_grad_unscaled(name, jit):
    model, state = MODELS[name]()
    x, y = data(name)
    vg = jamp.filter_value_and_grad(loss_fn, has_aux=True)
    if jit:
        vg = eqx.filter_jit(vg)
    out = vg(jamp.dynamic_loss_scale(2.0**12, growth_interval=1), model, state, x, y)
    # The reference, compiled once (its eager run would compile each primitive).
    (ref_loss, ref_state), ref_grads = eqx.filter_jit(
        eqx.filter_value_and_grad(loss_fn, has_aux=True)
    )(model, state, x, y)
    assert bool(out.finite) and float(out.loss_scale.scale) == 2.0**13
    np.testing.assert_allclose(out.value, ref_loss, rtol=1e-6)
    # Module-shaped, None where eqx.filter_grad leaves None; the values of a power-of-two
    # scale unscale exactly.
    assert jax.tree.structure(out.grads) == jax.tree.structure(ref_grads)
    for g, r in zip(jax.tree.leaves(out.grads), jax.tree.leaves(ref_grads), strict=True):
        assert g.dtype == r.dtype
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    if state is not None:
        assert same_arrays(out.aux, ref_state)


def test_the_growth_step_returns_the_true_gradient():
    """MPX unscales with the *new* scale, halving the gradient on every growth step;
    jamp unscales with the scale the loss was multiplied by."""
    model, _ = mlp()
    loss = lambda m, x, y: loss_fn(m, None, x, y)[0]  # noqa: E731
    x, y = data("mlp")
    ref = eqx.filter_grad(loss)(model, x, y)
    vg = eqx.filter_jit(jamp.filter_value_and_grad(loss))
    ls = jamp.dynamic_loss_scale(2.0**8, growth_interval=2)
    for _ in range(4):
        out = vg(ls, model, x, y)
        grew = float(out.loss_scale.scale) > float(ls.scale)
        for g, r in zip(jax.tree.leaves(out.grads), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-8)
        ls = out.loss_scale
    assert grew and float(ls.scale) == 2.0**10


def test_the_issue_value_and_grad_fails_and_filter_value_and_grad_works():
    model, _ = mlp()
    x, y = data("mlp")
    loss = lambda m, x, y: loss_fn(m, None, x, y)[0]  # noqa: E731
    # jamp's error, naming the leaf and the fix (was jax's "not a valid JAX type")
    with pytest.raises(TypeError, match=r"custom_jvp at path \.activation.*filter_value_and_grad"):
        jamp.value_and_grad(loss)(jamp.dynamic_loss_scale(), model, x, y)
    out = jamp.filter_value_and_grad(loss)(jamp.dynamic_loss_scale(), model, x, y)
    assert out.grads.activation is None and out.grads.layers[0].weight.shape == (16, 4)


def test_filter_value_and_grad_retries_at_a_lower_scale():
    model, _ = mlp()
    x, y = data("mlp")

    def loss(m, x, y):  # float16 output: overflows at a large scale
        return jamp.autocast(lambda m, x, y: loss_fn(m, None, x, y)[0], jnp.float16)(m, x, y)

    big = jamp.dynamic_loss_scale(2.0**126)
    out = eqx.filter_jit(jamp.filter_value_and_grad(loss, max_retries=200))(big, model, 1e3 * x, y)
    assert bool(out.finite) and int(out.retries) > 0
    assert float(out.loss_scale.scale) < 2.0**126


def test_filter_value_and_grad_errors():
    model, _ = mlp()
    with pytest.raises(TypeError, match=r"jamp\.filter_value_and_grad takes the loss-scale"):
        jamp.filter_value_and_grad(lambda m: 0.0)(model)
    with pytest.raises(TypeError, match=r"f\(loss_scale, model, \*args\)"):
        jamp.filter_value_and_grad(lambda m: 0.0)(jamp.dynamic_loss_scale())
    with pytest.raises(TypeError, match="Expected `fun` to be callable"):
        jamp.filter_value_and_grad(model.layers[0].weight)
    with pytest.raises(ValueError, match="max_retries"):
        jamp.filter_value_and_grad(lambda m: 0.0, max_retries=-1)
    with pytest.raises(TypeError, match=r"a pair \(loss, aux\)"):
        jamp.filter_value_and_grad(lambda m: jnp.sum(m.layers[0].bias), has_aux=True)(
            jamp.dynamic_loss_scale(), model
        )


# ---------------------------------------------------------------- step_if_finite / GradScaler


@pytest.mark.parametrize("skip", ["cond", "select"])
def test_step_if_finite_on_a_module(skip):
    model, _ = conv()
    optimizer = tx()
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    grads = eqx.filter_grad(lambda m: loss_fn(m, None, *data("conv"))[0])(model)

    @eqx.filter_jit
    def step(finite, model, opt_state):
        return jamp.step_if_finite(
            finite, optimizer, grads, opt_state, model, filter=eqx.is_array, skip=skip
        )

    applied, opt1 = step(jnp.bool_(True), model, opt_state)
    kept, opt2 = step(jnp.bool_(False), model, opt_state)
    expected = eqx.apply_updates(model, optimizer.update(grads, opt_state)[0])
    for a, b in zip(arrays(applied), arrays(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
    assert not same_arrays(applied, model) and same_arrays(kept, model)
    assert same_arrays(opt2, opt_state) and not same_arrays(opt1, opt_state)
    assert all(a is b for a, b in zip(statics(kept), statics(model), strict=True))


def test_without_a_filter_a_module_is_refused_with_the_fix():
    model, _ = mlp()
    optimizer = tx()
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    grads = eqx.filter_grad(lambda m: loss_fn(m, None, *data("mlp"))[0])(model)
    fix = r"filter=eqx\.is_array"
    with pytest.raises(TypeError, match=rf"`jamp\.step_if_finite` expected `params`.*"
                       rf"custom_jvp at path \.activation.*{fix}"):  # fmt: skip
        jamp.step_if_finite(jnp.bool_(True), optimizer, grads, opt_state, model)
    scaler = jamp.GradScaler()
    with pytest.raises(TypeError, match=rf"`jamp\.GradScaler\.step` expected `params`.*{fix}"):
        scaler.step(scaler.init(), optimizer, grads, opt_state, model)
    with pytest.raises(TypeError, match=r"jamp\.step_if_finite` expected `filter`"):
        jamp.step_if_finite(jnp.bool_(True), optimizer, grads, opt_state, model, filter=1)
    with pytest.raises(TypeError, match=r"optax\.sgd\(0\.1\), not optax\.sgd"):
        jamp.step_if_finite(jnp.bool_(True), optax.sgd, grads, opt_state, model)
    with pytest.raises(ValueError, match="Expected `skip`"):
        jamp.step_if_finite(jnp.bool_(True), optimizer, grads, opt_state, model, skip="no")


def test_grad_scaler_disabled_steps_a_module():
    model, _ = mlp()
    optimizer = tx()
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    scaler = jamp.GradScaler(enabled=False)
    grads = eqx.filter_grad(lambda m: loss_fn(m, None, *data("mlp"))[0])(model)
    new, _, stepped = scaler.step(
        scaler.init(), optimizer, grads, opt_state, model, filter=eqx.is_array
    )
    assert not bool(scaler.found_inf(stepped))
    expected = eqx.apply_updates(model, optimizer.update(grads, opt_state)[0])
    assert same_arrays(new, expected) and new.activation is model.activation


def test_grad_scaler_step_with_a_filter_that_leaves_out_integer_arrays():
    """``is_inexact_array`` for init and step: an integer leaf is passed through."""

    class Counted(eqx.Module):
        linear: eqx.nn.Linear
        seen: jax.Array

        def __call__(self, x):
            return self.linear(x)

    model = Counted(eqx.nn.Linear(4, 1, key=KEY), jnp.zeros((), jnp.int32))
    optimizer = tx()
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    scaler = jamp.GradScaler()
    st = scaler.init()
    grads = eqx.filter_grad(lambda m: scaler.scale(st, jnp.sum(jax.vmap(m)(data("mlp")[0]))))(model)
    new, _, stepped = eqx.filter_jit(scaler.step)(
        st, optimizer, grads, opt_state, model, filter=eqx.is_inexact_array
    )
    assert not bool(scaler.found_inf(stepped)) and new.seen is not None and int(new.seen) == 0
    assert not same_arrays(new.linear, model.linear)


# ---------------------------------------------------------------- the pure functions on a module


def test_pure_functions_take_a_module_with_the_equinox_filter():
    model, _ = conv()
    state = jamp.static_loss_scale(8.0)
    f = eqx.is_inexact_array
    scaled = jamp.scale(state, model, filter=f)
    back = jamp.unscale(state, scaled, filter=f)
    assert same_arrays(back, model)
    assert all(a is b for a, b in zip(statics(back), statics(model), strict=True))
    assert bool(jamp.all_finite(model, filter=f))
    unscaled, finite = jamp.unscale_and_check(state, scaled, filter=f)
    assert bool(finite) and same_arrays(unscaled, model)
    report = jamp.debug.nonfinite_report(model, filter=f)
    assert report.layers[1].fn is None and report.layers[2].init is None
    assert int(report.layers[0].weight.inf) == 0
    bad = eqx.tree_at(lambda m: m.layers[4].bias, model, jnp.array([jnp.nan]))
    assert not bool(jamp.all_finite(bad, filter=f))
    kept = jamp.compat.select_tree(jnp.bool_(False), bad, model, filter=f)
    assert same_arrays(kept, model)
    with pytest.raises(TypeError, match=r"filter=eqx\.is_inexact_array"):
        jamp.all_finite(model)


def test_loss_scaling_reports_module_paths_on_a_skipped_step(caplog):
    model, _ = mlp()
    optimizer = jamp.loss_scaling(tx(), report_nonfinite=True)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        ls = jamp.get_loss_scale(opt_state)
        grads = eqx.filter_grad(lambda m: jamp.scale(ls, loss_fn(m, None, x, y)[0]))(model)
        updates, opt_state = optimizer.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    with caplog.at_level(logging.WARNING, logger="jamp"):
        step(model, opt_state, *data("mlp", bad=True))
        jax.effects_barrier()
    [record] = caplog.records
    assert record.getMessage().startswith("skipped step: non-finite values in layers/0/weight")


def test_get_loss_scale_and_metrics_find_the_state_in_an_equinox_train_state():
    class TrainState(eqx.Module):
        model: eqx.Module
        opt_state: object

    model, _ = mlp()
    optimizer = jamp.loss_scaling(tx())
    ts = TrainState(model, optimizer.init(eqx.filter(model, eqx.is_array)))
    assert float(jamp.get_loss_scale(ts).scale) == 2.0**16
    assert bool(jamp.metrics(ts)["last_finite"])


# ---------------------------------------------------------------- autocast on a module


def test_autocast_runs_a_module_in_float16_with_float32_gradients():
    model, _ = conv()
    x, y = data("conv")
    loss = lambda m, x, y: loss_fn(m, None, x, y)[0]  # noqa: E731
    loss16 = jamp.autocast(loss, jnp.float16)
    report = jamp.debug.autocast_report(loss, model, x, y, dtype=jnp.float16)
    assert report.counts["conv_general_dilated"] == {"float16": 1}
    assert report.counts["dot_general"] == {"float16": 1}
    out = eqx.filter_jit(jamp.filter_value_and_grad(loss16))(jamp.dynamic_loss_scale(), model, x, y)
    assert out.value.dtype == jnp.float32 and bool(out.finite)
    assert {g.dtype for g in jax.tree.leaves(out.grads)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(out.value, loss(model, x, y), rtol=1e-2)
