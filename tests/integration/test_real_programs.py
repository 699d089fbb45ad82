"""Real programs: the failures found when real training code ran against jamp.

Each test is the shape of program a user wrote (two TrainStates under
donation, a step on an explicit mesh, a restore from a dict, an optimizer
whose state dtype differs from the gradients'), not the internal helper that
was fixed.
"""

import dataclasses
import functools
import logging
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, serialization
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jamp


class MLP(nn.Module):
    features: int = 16
    param_dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.features, param_dtype=self.param_dtype)(x))
        return nn.Dense(1, param_dtype=self.param_dtype)(x)


def _loss(apply, params, x, y):
    return jnp.mean((apply({"params": params}, x).astype(jnp.float32) - y) ** 2)


def _train_step(state, x, y):
    ls = jamp.get_loss_scale(state.opt_state)

    def scaled(p):
        return jamp.scale(ls, _loss(state.apply_fn, p, x, y))

    return state.apply_gradients(grads=jax.grad(scaled)(state.params))


X = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(8, 4)
Y = jnp.sum(X, axis=1, keepdims=True)


# ---------------------------------------------------------------- 1. donation


TRANSFORMATIONS = {
    "loss_scaling": lambda: jamp.loss_scaling(optax.sgd(0.1)),
    "as_optax": lambda: jamp.GradScaler().as_optax(optax.sgd(0.1)),
    "multi_steps": lambda: jamp.multi_steps(jamp.loss_scaling(optax.sgd(0.1)), 2),
}


@pytest.mark.parametrize("make", list(TRANSFORMATIONS), ids=list(TRANSFORMATIONS))
def test_two_train_states_from_one_tx_survive_donation(make):
    """A GAN's generator and discriminator share `tx`; the step donates its state."""
    tx = TRANSFORMATIONS[make]()
    model = MLP()
    step = jax.jit(_train_step, donate_argnums=0)
    generator = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), X)["params"], tx=tx
    )
    discriminator = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(1), X)["params"], tx=tx
    )
    for _ in range(3):
        generator = step(generator, X, Y)
        discriminator = step(discriminator, X, Y)  # RuntimeError: Array has been deleted, before
    assert int(generator.step) == int(discriminator.step) == 3
    assert float(jamp.get_loss_scale(discriminator.opt_state).scale) == 2.0**16
    # Re-init to reset, after the first state was donated away.
    fresh = tx.init(generator.params)
    generator = step(generator.replace(opt_state=fresh), X, Y)
    assert float(jamp.get_loss_scale(generator.opt_state).scale) == 2.0**16


def test_init_hands_out_new_buffers_every_call():
    tx = jamp.loss_scaling(optax.sgd(0.1))
    a, b = tx.init({"w": jnp.ones(2)}), tx.init({"w": jnp.ones(2)})
    for x, y in zip(jax.tree.leaves(a.loss_scale), jax.tree.leaves(b.loss_scale), strict=True):
        assert x.unsafe_buffer_pointer() != y.unsafe_buffer_pointer()


# ---------------------------------------------------------------- 2. explicit sharding


@pytest.fixture
def explicit_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        yield mesh


def _sharded(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _specs(tree):
    return jax.tree.map(lambda x: jax.typeof(x).sharding.spec, tree)


@pytest.mark.standard_promotion  # adamw
@pytest.mark.parametrize("skip", ["cond", "select"])
def test_explicit_mesh_train_step_bf16_grads_f32_params_adamw(explicit_mesh, skip):
    """jax.make_mesh's default (explicit) axes with jax.set_mesh: a full jitted step."""
    params = {
        "w": _sharded(explicit_mesh, jnp.ones((8, 16)), P("data", "model")),
        "b": _sharded(explicit_mesh, jnp.zeros((16,)), P("model")),
    }
    tx = jamp.loss_scaling(optax.adamw(1e-2), skip=skip)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, poison):
        ls = jamp.get_loss_scale(opt_state)

        def loss(p):
            bf16 = jax.tree.map(lambda v: v.astype(jnp.bfloat16), p)
            h = x.astype(jnp.bfloat16) @ bf16["w"] + bf16["b"][None]
            return jnp.mean(h.astype(jnp.float32) ** 2) * poison

        grads = jax.grad(lambda p: jamp.scale(ls, loss(p)))(params)
        grads = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)  # bf16 gradients
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    x = _sharded(explicit_mesh, jnp.ones((4, 8)), P("data", None))
    new_params, new_state = step(params, opt_state, x, jnp.float32(1.0))
    assert _specs(new_params) == _specs(params)
    assert bool(new_state.last_finite) and not np.allclose(new_params["w"], params["w"])
    same_params, skipped = step(new_params, new_state, x, jnp.float32(jnp.inf))
    assert not bool(skipped.last_finite) and int(skipped.skipped_steps) == 1
    np.testing.assert_array_equal(same_params["w"], new_params["w"])
    assert _specs(same_params) == _specs(params)


def test_every_public_function_traces_under_explicit_sharding(explicit_mesh, caplog):
    big = np.ones((8, 2 * 2**16), np.float32)
    big[7, -1] = np.inf  # in the last shard
    tree = {
        "big": _sharded(explicit_mesh, jnp.asarray(big), P("data", "model")),
        "w": _sharded(explicit_mesh, jnp.ones((8, 16)), P(None, "model")),
        "b": _sharded(explicit_mesh, jnp.ones((16,), jnp.bfloat16), P("model")),
    }
    state = jamp.dynamic_loss_scale(4.0)
    clean = {k: v for k, v in tree.items() if k != "big"}
    jit = jax.jit

    assert _specs(jit(lambda t: jamp.scale(state, t))(tree)) == _specs(tree)
    assert _specs(jit(lambda t: jamp.unscale(state, t))(tree)) == _specs(tree)
    assert not bool(jit(jamp.all_finite)(tree)) and bool(jit(jamp.all_finite)(clean))
    unscaled, finite = jit(lambda t: jamp.unscale_and_check(state, t))(tree)
    assert _specs(unscaled) == _specs(tree) and not bool(finite)
    assert float(jit(jamp.update)(state, finite).scale) == 2.0
    picked = jit(jamp.compat.select_tree)(
        jnp.bool_(False), clean, jax.tree.map(jnp.zeros_like, clean)
    )
    assert _specs(picked) == _specs(clean)
    report = jit(jamp.debug.nonfinite_report)(tree)
    assert int(report["big"].inf) == 1 and int(report["w"].inf) == 0
    with caplog.at_level(logging.WARNING, logger="jamp"):
        assert not bool(jit(jamp.debug.log_nonfinite)(tree))
        jax.effects_barrier()
    assert "big: 1 inf, 0 nan" in caplog.text

    vg = jit(jamp.value_and_grad(lambda p: jnp.sum(p["w"].astype(jnp.float32) ** 2)))
    out = vg(state, clean)
    assert _specs(out.grads) == _specs(clean) and bool(out.finite)

    scaler = jamp.GradScaler(init_scale=4.0)
    tx = optax.sgd(0.1)
    params = clean
    grads = jax.tree.map(lambda p: (p * 4).astype(p.dtype), params)
    new_params, _, stepped = jit(lambda g, o, p: scaler.step(scaler.init(), tx, g, o, p))(
        grads, tx.init(params), params
    )
    assert _specs(new_params) == _specs(params) and not bool(scaler.found_inf(stepped))

    # report_nonfinite on a large sharded leaf, and multi_steps, under loss_scaling
    tx2 = jamp.multi_steps(jamp.loss_scaling(optax.sgd(0.1), report_nonfinite=True), 2)
    opt_state = tx2.init(tree)
    with caplog.at_level(logging.WARNING, logger="jamp"):
        for _ in range(2):
            updates, opt_state = jit(tx2.update)(tree, opt_state, tree)
        jax.effects_barrier()
    assert _specs(updates) == _specs(tree)
    assert "skipped step: " in caplog.text
    assert jamp.metrics(opt_state)["skipped_steps"] == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
def test_autocast_under_explicit_sharding_keeps_the_gradients_shardings(explicit_mesh, dtype):
    x = _sharded(explicit_mesh, jnp.ones((8, 16)), P("data", None))
    w = _sharded(explicit_mesh, jnp.full((16, 32), 0.1), P(None, "model"))
    b = _sharded(explicit_mesh, jnp.zeros((32,)), P("model"))

    def loss(w, b, x):
        return jnp.mean(jax.nn.gelu(x @ w + b[None, :]).astype(jnp.float32))

    grads = jax.jit(jax.grad(jamp.autocast(loss, dtype), argnums=(0, 1)))(w, b, x)
    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(w, b, x)
    assert _specs(grads) == _specs((w, b))
    for g, r in zip(grads, want, strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, r, rtol=2e-2, atol=1e-4)


# ---------------------------------------------------------------- 3. mixed-dtype inner state


@pytest.mark.standard_promotion  # adam
@pytest.mark.parametrize("param_dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("skip", ["cond", "select"])
def test_half_params_float32_grads_adam_under_loss_scaling_and_grad_scaler(param_dtype, skip):
    params = {"w": jnp.ones((4, 3), param_dtype)}
    grads = {"w": jnp.full((4, 3), 2.0**16 * 0.5, jnp.float32)}  # float32 grads of a scaled loss
    plain = optax.adam(1e-3)
    unscaled = {"w": jnp.full((4, 3), 0.5, jnp.float32)}
    want_updates, want_state = plain.update(unscaled, plain.init(params), params)

    tx = jamp.loss_scaling(optax.adam(1e-3), skip=skip)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], want_updates["w"], rtol=1e-6)
    assert jax.tree.map(lambda x: x.dtype, state.inner_state) == jax.tree.map(
        lambda x: x.dtype, want_state
    )
    bad = {"w": grads["w"].at[0, 0].set(jnp.inf)}
    zero, kept = jax.jit(tx.update)(bad, state, params)
    assert not bool(kept.last_finite) and not np.any(np.asarray(zero["w"]))

    scaler = jamp.GradScaler(skip=skip)
    new_params, opt_state, stepped = jax.jit(
        lambda g, o, p: scaler.step(scaler.init(), plain, g, o, p)
    )(grads, plain.init(params), params)
    assert new_params["w"].dtype == param_dtype and not bool(scaler.found_inf(stepped))
    same, _, stepped = jax.jit(lambda g, o, p: scaler.step(scaler.init(), plain, g, o, p))(
        bad, opt_state, new_params
    )
    assert bool(scaler.found_inf(stepped))
    np.testing.assert_array_equal(same["w"], new_params["w"])


class _OptaxLoss(nn.Module):  # optax's test_multi_steps_mixed_precision model
    @nn.compact
    def __call__(self, x, dtype=jnp.float32, param_dtype=jnp.float32):
        return jnp.sum(nn.Dense(10, dtype=dtype, param_dtype=param_dtype)(x) ** 2)


@pytest.mark.standard_promotion  # adam
@pytest.mark.parametrize("opt_kwargs", [{}, {"mu_dtype": jnp.float32}], ids=["adam", "mu_f32"])
def test_optax_multi_steps_mixed_precision_combinations(opt_kwargs):
    """optax's own test, for multi_steps(loss_scaling(adam)) against plain adam: the dtypes
    over k + 1 steps, for every pair of update and parameter dtypes. Dtypes are settled
    when jit traces the step, so each pair is evaluated as jit traces it (jax.eval_shape,
    states fed back step after step); the most mixed pair is also compiled and run."""
    k_steps, loss = 4, _OptaxLoss()
    dtypes = [jnp.float32, jnp.float16, jnp.bfloat16]
    dtype_of = lambda t: jax.tree.map(lambda x: x.dtype, t)  # noqa: E731
    for upd_dtype in dtypes:
        for param_dtype in dtypes:
            if upd_dtype == jnp.float16 and param_dtype == jnp.bfloat16:
                evaluate = jax.jit  # compiled and run
            else:
                evaluate = lambda f: functools.partial(jax.eval_shape, f)  # noqa: E731
            data = jnp.ones([32, 7], param_dtype)
            params = evaluate(
                lambda d, t=param_dtype: loss.init({"params": jax.random.key(0)}, d, param_dtype=t)
            )(data)["params"]
            opt = optax.adam(0.1, **opt_kwargs)
            ms = jamp.multi_steps(
                jamp.loss_scaling(optax.adam(0.1, **opt_kwargs), jamp.no_loss_scale()), k_steps
            )
            opt_state, ms_state = evaluate(opt.init)(params), evaluate(ms.init)(params)

            @evaluate
            def step(params, opt_state, ms_state, data, upd_dtype=upd_dtype, opt=opt, ms=ms):
                g = jax.grad(lambda p: loss.apply({"params": p}, data))(params)
                g = jax.tree.map(lambda x: x.astype(upd_dtype), g)
                updates, opt_state = opt.update(g, opt_state, params)
                ms_updates, ms_state = ms.update(g, ms_state, params)
                return updates, opt_state, ms_updates, ms_state

            apply_updates = evaluate(optax.apply_updates)
            for _ in range(k_steps + 1):
                updates, opt_state, ms_updates, ms_state = step(params, opt_state, ms_state, data)
                assert dtype_of(updates) == dtype_of(ms_updates), (upd_dtype, param_dtype)
                new_params = apply_updates(params, ms_updates)
                assert dtype_of(new_params) == dtype_of(params)
                params = new_params


# ---------------------------------------------------------------- 4. restored states


def _checkpoint(tx, params):
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    return state, serialization.to_state_dict(state)


def _with_loss_scale(d, **values):
    d = jax.tree.map(lambda x: x, d)
    d["opt_state"]["loss_scale"].update(values)
    return d


@pytest.mark.parametrize("scale", [math.nan, 0.0, -1.0, math.inf])
def test_restoring_a_nonfinite_or_nonpositive_scale_is_a_clear_error(scale):
    tx = jamp.loss_scaling(optax.sgd(0.1))
    target, d = _checkpoint(tx, {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"opt_state/loss_scale/scale.*positive and finite"):
        serialization.from_state_dict(target, _with_loss_scale(d, scale=scale))


def test_restore_from_a_hand_converted_dict_of_python_numbers_trains():
    """A checkpoint converted by hand: plain Python numbers, a scale past max_scale, a
    tracker past the interval. It restores as arrays, clamped, and the next step grows."""
    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(growth_interval=4))
    target, d = _checkpoint(tx, {"w": jnp.ones(2)})
    d = _with_loss_scale(d, scale=2.0**127, growth_tracker=9, overflow_streak=0)
    restored = serialization.from_state_dict(target, d)
    ls = jamp.get_loss_scale(restored.opt_state)
    assert ls.scale.dtype == jnp.float32 and ls.growth_tracker.dtype == jnp.int32
    assert float(ls.scale) == 2.0**126 and int(ls.growth_tracker) == 3
    assert float(jamp.scale(ls, 1.0)) == 2.0**126  # eager, before: a Python float broke it
    d = _with_loss_scale(d, scale=1024.0)
    restored = serialization.from_state_dict(target, d)
    grads = jax.grad(lambda p: jamp.scale(jamp.get_loss_scale(restored.opt_state), p["w"].sum()))(
        restored.params
    )
    _, opt_state = tx.update(grads, restored.opt_state, restored.params)
    assert float(jamp.get_loss_scale(opt_state).scale) == 2048.0  # grows on the next step


def test_restore_clamps_a_scale_below_the_targets_min_scale():
    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(1.0, min_scale=0.5))
    target, d = _checkpoint(tx, {"w": jnp.ones(2)})
    restored = serialization.from_state_dict(target, _with_loss_scale(d, scale=0.125))
    assert float(jamp.get_loss_scale(restored.opt_state).scale) == 0.5


def test_orbax_restore_then_check_restored(tmp_path):
    import orbax.checkpoint as ocp

    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(growth_interval=4))
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    broken = state.replace(
        opt_state=state.opt_state._replace(
            loss_scale=dataclasses.replace(state.opt_state.loss_scale, scale=jnp.float32(jnp.nan))
        )
    )
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "bad", broken)
        ckptr.wait_until_finished()
        restored = ckptr.restore(tmp_path / "bad", state)
    with pytest.raises(ValueError, match=r"opt_state/loss_scale/scale"):
        jamp.check_restored(restored)
    good = jamp.check_restored(state)
    assert float(jamp.get_loss_scale(good.opt_state).scale) == 2.0**16


def _step_of(tx):
    """A fresh jitted train step (its own compilation cache, as in a resumed process)."""

    @jax.jit
    def train_step(params, opt_state):
        ls = jamp.get_loss_scale(opt_state)
        loss = lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"])  # noqa: E731
        grads = jax.grad(lambda p: jamp.scale(ls, loss(p)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return train_step


@pytest.mark.parametrize("lowered_interval", [False, True])
def test_a_step_resumed_from_orbax_through_check_restored_compiles_no_more(
    tmp_path, lowered_interval
):
    """Issue #26: Orbax restores committed arrays; check_restored returned new, uncommitted
    ones beside them, and the resumed step compiled once more for the mix. It keeps the
    restored arrays (or puts a changed value, a tracker past a lowered interval, where the
    restored one was), so one compilation serves Orbax's arrays, the checked ones and the
    step's own outputs."""
    import orbax.checkpoint as ocp

    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(growth_interval=8))
    params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
    opt_state = tx.init(params)
    train_step = _step_of(tx)
    for _ in range(6):
        params, opt_state = train_step(params, opt_state)
    assert int(opt_state.loss_scale.growth_tracker) == 6
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", {"params": params, "opt_state": opt_state})
        ckptr.wait_until_finished()
    if lowered_interval:  # resumed with growth_interval=4: the tracker of 6 is held at 3
        tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(growth_interval=4))
    target = {"params": params, "opt_state": tx.init(params)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(tmp_path / "ckpt", abstract)
    checked = jamp.check_restored(restored)
    assert int(checked["opt_state"].loss_scale.growth_tracker) == (3 if lowered_interval else 6)
    for leaf, orig in zip(jax.tree.leaves(checked), jax.tree.leaves(restored), strict=True):
        assert leaf.sharding == orig.sharding and leaf.committed == orig.committed

    train_step = _step_of(tx)  # a resumed process
    train_step(restored["params"], restored["opt_state"])
    new_params, new_state = train_step(checked["params"], checked["opt_state"])
    train_step(new_params, new_state)
    assert train_step._cache_size() == 1, "check_restored's arrays compiled the step again"


def test_grad_scaler_loads_a_torch_dict_whose_scale_reached_2_to_127():
    scaler = jamp.GradScaler()
    d = dict(scale=2.0**127, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)
    state = scaler.load_state_dict({**d, "_growth_tracker": 7})
    assert float(state.scale) == 2.0**126 and int(state.growth_tracker) == 7


def test_flax_dynamic_scale_checkpoint_converts():
    from flax.training.dynamic_scale import DynamicScale

    ds = DynamicScale(growth_interval=3, scale=jnp.float32(1024.0), fin_steps=jnp.int32(3))
    state = jamp.compat.from_flax_dynamic_scale(ds)
    assert state.growth_interval == 3 and float(state.scale) == 1024.0
    assert int(state.growth_tracker) == 2  # flax grows on its next finite step; so does jamp
    assert float(jamp.update(state, jnp.bool_(True)).scale) == 2048.0
    saved = serialization.to_state_dict(ds)
    assert set(saved) == {"fin_steps", "scale"}
    from_dict = jamp.compat.from_flax_dynamic_scale(saved, growth_interval=3)
    assert float(from_dict.scale) == 1024.0 and int(from_dict.growth_tracker) == 2
    assert from_dict.min_scale == float(jnp.finfo(jnp.float32).tiny)  # flax's default floor
    with pytest.raises(ValueError, match="positive and finite"):
        jamp.compat.from_flax_dynamic_scale({"fin_steps": 0, "scale": float("nan")})
    with pytest.raises(ValueError, match=r"missing \['fin_steps'\]"):
        jamp.compat.from_flax_dynamic_scale({"scale": 1.0})
    with pytest.raises(TypeError, match="`dynamic_scale`"):
        jamp.compat.from_flax_dynamic_scale(3.0)


# ---------------------------------------------------------------- 5. counters and factors


def test_hysteresis_of_int32_max_never_wraps_the_overflow_streak():
    state = jamp.dynamic_loss_scale(1024.0, hysteresis=2**31 - 1)
    state = dataclasses.replace(state, overflow_streak=jnp.int32(2**31 - 2))
    for expect in (2**31 - 1, 2**31 - 1):
        state = jax.jit(jamp.update)(state, jnp.bool_(False))
        assert int(state.overflow_streak) == expect
    assert float(state.scale) == 256.0  # the streak reached hysteresis: it backs off, twice


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(backoff_factor=1 - 2**-25), "backoff_factor"),
        (dict(backoff_factor=1 - 2**-26), "backoff_factor"),
        (dict(backoff_factor=1 - 1.5 * 2**-25), "backoff_factor"),
        (dict(growth_factor=1 + 2**-24), "growth_factor"),
        (dict(growth_factor=1 + 2**-30), "growth_factor"),
    ],
)
def test_factors_that_cannot_move_a_float32_scale_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=rf"`{name}` to move a float32 scale"):
        jamp.dynamic_loss_scale(**kwargs)
    with pytest.raises(ValueError, match=rf"`{name}` to move a float32 scale"):
        jamp.GradScaler(**kwargs)


@pytest.mark.parametrize("factor", [1 - 2**-24, 1 - 2**-23, 0.9999])
def test_backoff_factors_close_to_one_that_move_every_scale_are_accepted(factor):
    state = jamp.dynamic_loss_scale(backoff_factor=factor)
    for s in (1.0, 1.0 + 2**-23, 2.0**16, 3.0):
        moved = jamp.update(dataclasses.replace(state, scale=jnp.float32(s)), jnp.bool_(False))
        assert float(moved.scale) < np.float32(s)


def test_bounds_are_float32_numbers_at_construction_and_at_run_time():
    # 0.1 is no float32: the bound is float32(0.1), compared as the update rule compares it.
    state = jamp.dynamic_loss_scale(0.1, max_scale=0.1, growth_interval=1)
    assert state.max_scale == float(np.float32(0.1))
    grown = jamp.update(state, jnp.bool_(True))
    assert float(grown.scale) == float(np.float32(0.1))  # held at the bound, as constructed
    state = jamp.dynamic_loss_scale(0.1, min_scale=0.1)
    assert float(jamp.update(state, jnp.bool_(False)).scale) == float(np.float32(0.1))


# ---------------------------------------------------------------- 6. multi_steps logging


@pytest.mark.parametrize("skip", ["cond", "select"])
def test_multi_steps_logs_once_per_real_skip(caplog, skip):
    tx = jamp.multi_steps(
        jamp.loss_scaling(optax.sgd(0.1), report_nonfinite=True, skip=skip), every_k_schedule=4
    )
    params = {"w": jnp.ones(3)}
    opt_state = tx.init(params)
    update = jax.jit(tx.update)
    batches = [jnp.ones(3)] * 8
    batches[1] = jnp.array([1.0, jnp.inf, 1.0])  # one bad micro-batch in the first step
    with caplog.at_level(logging.WARNING, logger="jamp"):
        for g in batches:
            _, opt_state = update({"w": g}, opt_state, params)
        jax.effects_barrier()
    skips = [r for r in caplog.records if "skipped step" in r.getMessage()]
    assert len(skips) == 1, [r.getMessage() for r in skips]
    assert jamp.metrics(opt_state)["skipped_steps"] == 1
    assert int(opt_state.gradient_step) == 2


def test_multi_steps_runs_the_inner_update_only_on_the_last_micro_step():
    calls = []

    def counting(updates, state, params=None):
        jax.debug.callback(lambda: calls.append(1))
        return updates, state

    inner = optax.GradientTransformation(lambda p: optax.EmptyState(), counting)
    tx = jamp.multi_steps(jamp.loss_scaling(inner, jamp.no_loss_scale()), 3)
    state = tx.init({"w": jnp.ones(2)})
    for _ in range(6):
        _, state = jax.jit(tx.update)({"w": jnp.ones(2)}, state)
    jax.effects_barrier()
    assert len(calls) == 2


# ---------------------------------------------------------------- 7. NNX


def test_get_loss_scale_and_metrics_of_nnx_state():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(512.0)), wrt=nnx.Param
    )
    state = nnx.state(optimizer)
    ls = jamp.get_loss_scale(state)
    assert float(ls.scale) == 512.0 and int(ls.growth_tracker) == 0
    assert jamp.metrics(state) == {
        "loss_scale": 512.0,
        "growth_tracker": 0,
        "last_finite": True,
        "skipped_steps": 0,
    }
    assert float(jamp.scale(ls, jnp.float32(2.0))) == 1024.0

    @jax.jit
    def step(graphdef, state, x):
        model, optimizer = nnx.merge(graphdef, state)
        loss_scale = jamp.get_loss_scale(nnx.state(optimizer))

        def loss(model):
            return jamp.scale(loss_scale, jnp.sum(model(x) ** 2))

        optimizer.update(model, nnx.grad(loss)(model))
        return nnx.state((model, optimizer))

    graphdef, state = nnx.split((model, optimizer))
    state = step(graphdef, state, jnp.ones((1, 2)))
    _, optimizer = nnx.merge(graphdef, state)
    assert jamp.metrics(nnx.state(optimizer))["growth_tracker"] == 1
    assert jamp.metrics(optimizer)["growth_tracker"] == 1
