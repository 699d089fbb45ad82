"""jamp.get_loss_scale and jamp.metrics: finding the loss-scale state in any optimizer state."""

import dataclasses

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
    poison,
)

import jamp

# ---------------------------------------------------------------- get_loss_scale


def _nesting_cases():
    inner = jamp.loss_scaling(optax.adam(1e-3), jamp.dynamic_loss_scale(256.0))
    return {
        "plain": inner,
        "chain": optax.chain(optax.clip(1.0), inner),
        "multisteps": optax.MultiSteps(inner, every_k_schedule=2),
        "inject_hyperparams": optax.inject_hyperparams(
            lambda learning_rate: jamp.loss_scaling(
                optax.adam(learning_rate), jamp.dynamic_loss_scale(256.0)
            )
        )(learning_rate=1e-3),
        "named_chain": optax.named_chain(("clip", optax.clip(1.0)), ("scaled", inner)),
    }


@pytest.mark.parametrize("name", list(_nesting_cases()))
def test_get_loss_scale_in_any_nesting(name):
    tx = _nesting_cases()[name]
    state = tx.init(params0())
    ls = jamp.get_loss_scale(state)
    assert isinstance(ls, jamp.LossScaleState) and float(ls.scale) == 256.0
    assert float(jax.jit(jamp.get_loss_scale)(state).scale) == 256.0


@pytest.mark.standard_promotion
def test_get_loss_scale_in_flax_train_state():
    from flax.training import train_state

    tx = jamp.loss_scaling(optax.adam(1e-3), jamp.dynamic_loss_scale(64.0))
    ts = train_state.TrainState.create(apply_fn=None, params=params0(), tx=tx)
    assert float(jamp.get_loss_scale(ts).scale) == 64.0
    assert float(jamp.get_loss_scale(ts.opt_state).scale) == 64.0

    @jax.jit
    def step(ts):
        ls = jamp.get_loss_scale(ts.opt_state)
        grads = jax.grad(lambda p: jamp.scale(ls, loss_fn(p, X)))(ts.params)
        return ts.apply_gradients(grads=grads)

    ts = step(ts)
    assert int(ts.opt_state.inner_state[0].count) == 1
    bad = jax.jit(lambda ts: ts.apply_gradients(grads=poison(ts.params)))(ts)
    assert_trees_equal(bad.params, ts.params)
    assert float(jamp.get_loss_scale(bad).scale) == 32.0


@pytest.mark.standard_promotion
def test_get_loss_scale_in_nnx_optimizer():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 2, rngs=rngs)

        def __call__(self, x):
            return self.lin(x)

    model = Model(nnx.Rngs(0))
    tx = jamp.loss_scaling(optax.adam(1e-2), jamp.dynamic_loss_scale(128.0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ls = jamp.get_loss_scale(opt)
    assert isinstance(ls.scale, jax.Array) and float(ls.scale) == 128.0
    assert float(jamp.get_loss_scale(opt.opt_state).scale) == 128.0

    @nnx.jit
    def step(model, opt, x, poison_it):
        ls = jamp.get_loss_scale(opt)
        grads = nnx.grad(lambda m: jamp.scale(ls, jnp.mean(m(x) ** 2)))(model)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(poison_it, jnp.inf, g), grads)
        opt.update(model, grads)

    before = jax.tree_util.tree_map(jnp.copy, nnx.state(model, nnx.Param))
    step(model, opt, X, jnp.bool_(True))
    assert_trees_equal(nnx.state(model, nnx.Param), before)
    assert float(jamp.get_loss_scale(opt).scale) == 64.0
    step(model, opt, X, jnp.bool_(False))
    after = nnx.state(model, nnx.Param)
    assert not np.array_equal(
        np.asarray(after["lin"]["kernel"][...]), np.asarray(before["lin"]["kernel"][...])
    )


def test_get_loss_scale_and_metrics_find_a_train_state_field():
    """The flax ImageNet layout: a TrainState field beside a plain optimizer."""
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        loss_scale: jamp.LossScaleState

    ts = TrainState.create(
        apply_fn=None, params=params0(), tx=optax.sgd(0.1), loss_scale=jamp.dynamic_loss_scale(8.0)
    )
    assert float(jamp.get_loss_scale(ts).scale) == 8.0
    assert sorted(jamp.metrics(ts)) == ["growth_tracker", "loss_scale"]
    # A loss-scaling optimizer state still comes first.
    ts = TrainState.create(
        apply_fn=None,
        params=params0(),
        tx=jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(4.0)),
        loss_scale=jamp.dynamic_loss_scale(8.0),
    )
    assert float(jamp.get_loss_scale(ts).scale) == 4.0
    assert "skipped_steps" in jamp.metrics(ts)


# ---------------------------------------------------------------- metrics


def test_metrics_are_device_scalars():
    tx = jamp.loss_scaling(optax.sgd(0.1))
    state = tx.init({"w": jnp.ones(2)})
    m = jax.jit(jamp.metrics)(state)
    assert set(m) == {"loss_scale", "growth_tracker", "last_finite", "skipped_steps"}
    assert all(isinstance(v, jax.Array) and v.shape == () for v in m.values())
    m = jamp.metrics(jamp.dynamic_loss_scale())
    assert set(m) == {"loss_scale", "growth_tracker"}
    out = jamp.value_and_grad(jnp.sum, max_retries=1)(jamp.dynamic_loss_scale(), jnp.ones(2))
    assert set(jamp.metrics(out)) == {"loss_scale", "growth_tracker", "last_finite", "retries"}


def test_metrics_from_train_state_and_nnx():
    from flax import nnx
    from flax.training import train_state

    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(32.0))
    ts = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    assert float(jamp.metrics(ts)["loss_scale"]) == 32.0
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    m = jamp.metrics(opt)
    assert float(m["loss_scale"]) == 32.0 and int(m["skipped_steps"]) == 0
    assert all(isinstance(v, jax.Array) for v in m.values())


# ---------------------------------------------------------------- trees restored without a target


def _restored_without_target(tmp_path, state):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path / "ckpt", state)
        ckptr.wait_until_finished()
        return ckptr.restore(tmp_path / "ckpt")  # no target: nested dicts of arrays


def test_metrics_of_an_orbax_restore_without_a_target_are_validated(tmp_path):
    """Issue #26, item 3: metrics/get_loss_scale of a tree restored without a target took
    a NaN scale, a tracker of -7 and the string "2.0" as they were."""
    tx = jamp.loss_scaling(optax.adam(1e-3), jamp.dynamic_loss_scale(512.0))
    state = tx.init(params0())
    restored = _restored_without_target(tmp_path / "good", state)
    assert isinstance(restored["loss_scale"], dict)  # the configuration is gone
    m = jamp.metrics(restored)
    assert float(m["loss_scale"]) == 512.0 and int(m["skipped_steps"]) == 0
    assert float(jamp.get_loss_scale(restored).scale) == 512.0
    crashed = state._replace(
        loss_scale=dataclasses.replace(state.loss_scale, scale=jnp.float32(jnp.nan))
    )
    restored = _restored_without_target(tmp_path / "crashed", crashed)
    for call in (jamp.metrics, jamp.get_loss_scale):
        with pytest.raises(
            ValueError,
            match=r"\['loss_scale'\]\['scale'\]` to be positive.*"
            r"check_restored",
        ):
            call(restored)


def test_a_scale_restored_without_a_target_is_checked_as_the_float32_the_state_holds():
    """Issue #35: 5e-324 (and 1e-46) passed as positive float64 numbers and came back 0.0,
    the float32 they round to. jamp's own bounds, 2**-126 and 2**126, still pass."""
    for v in (2.0**-126, 2.0**126, np.float64(1024.0), np.float32(3.0), 7):
        got = jamp.get_loss_scale(_flat(scale=v)).scale
        assert got.dtype == jnp.float32 and float(got) == float(np.float32(v)), v


def _flat(**values):
    """A loss_scaling state as a checkpoint restored without a target holds it."""
    inner = {"scale": 1024.0, "growth_tracker": 3, "overflow_streak": 0}
    inner.update({k: v for k, v in values.items() if k in inner})
    outer = {"last_finite": True, "skipped_steps": 2}
    outer.update({k: v for k, v in values.items() if k in outer})
    return {"loss_scale": inner, "inner_state": {}, **outer}


# ---------------------------------------------------------------- bad input


def _lss():
    return jamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})


def _two_in_a_chain():
    two = optax.chain(jamp.loss_scaling(optax.sgd(0.1)), jamp.loss_scaling(optax.sgd(0.1)))
    return two.init(params0())


# Every state in which get_loss_scale or metrics finds no single loss-scale state:
# id -> (call, exception, match).
BAD_INPUT = {
    "get_loss_scale(plain optax)": (
        lambda: jamp.get_loss_scale(optax.sgd(0.1).init({"w": jnp.ones(2)})),
        ValueError,
        r"`opt_state` to contain a jamp loss-scale state, found none",
    ),
    "get_loss_scale(adam's state)": (
        lambda: jamp.get_loss_scale(optax.adam(1e-3).init(params0())[0]),
        ValueError,
        r"found none in ScaleByAdamState.*jamp.loss_scaling",
    ),
    "get_loss_scale({})": (
        lambda: jamp.get_loss_scale({}),
        ValueError,
        r"`opt_state`.*found none in dict",
    ),
    "get_loss_scale(two)": (
        lambda: jamp.get_loss_scale((_lss(), _lss())),
        ValueError,
        r"exactly one loss-scale state in `opt_state`, found 2",
    ),
    "get_loss_scale(two in a chain)": (
        lambda: jamp.get_loss_scale(_two_in_a_chain()),
        ValueError,
        r"exactly one loss-scale state.*found 2 at \[0\]\.loss_scale, \[1\]\.loss_scale",
    ),
    "metrics(plain optax)": (
        lambda: jamp.metrics(optax.sgd(0.1).init({"w": jnp.ones(2)})),
        ValueError,
        r"found none",
    ),
    # issue #26: trees restored without a target are validated, and the fix is named
    "get_loss_scale(restored, scale=nan)": (
        lambda: jamp.get_loss_scale(_flat(scale=np.float32(np.nan))),
        ValueError,
        (r"`opt_state\['loss_scale'\]\['scale'\]` to be positive and finite", r"check_restored"),
    ),
    # issue #35: checked as the state holds it, in float32, not as the float64 it was read as
    "get_loss_scale(restored, scale=5e-324)": (
        lambda: jamp.get_loss_scale(_flat(scale=5e-324)),
        ValueError,
        (
            r"`opt_state\['loss_scale'\]\['scale'\]` to be positive and finite",
            r"5e-324 \(0\.0 as a float32\)",
        ),
    ),
    "get_loss_scale(restored, scale=1e-46)": (
        lambda: jamp.get_loss_scale(_flat(scale=1e-46)),
        ValueError,
        r"\['scale'\]` to be positive and finite.*1e-46 \(0\.0 as a float32\)",
    ),
    "get_loss_scale(restored, scale=float64 1e-46)": (
        lambda: jamp.get_loss_scale(_flat(scale=np.float64(1e-46))),
        ValueError,
        r"\['scale'\]` to be positive and finite.*\(0\.0 as a float32\)",
    ),
    "metrics(restored, scale=5e-324)": (
        lambda: jamp.metrics(_flat(scale=5e-324)),
        ValueError,
        r"`state\['loss_scale'\]\['scale'\]` to be positive and finite.*0\.0 as a float32",
    ),
    "get_loss_scale(restored, scale=1e39)": (
        lambda: jamp.get_loss_scale(_flat(scale=1e39)),
        ValueError,
        r"\['scale'\]` to be positive and finite.*\(inf as a float32\)",
    ),
    "get_loss_scale(restored, scale=1e-40: a float32 subnormal)": (
        lambda: jamp.get_loss_scale(_flat(scale=1e-40)),
        ValueError,
        r"\['scale'\]` in \[2\*\*-126, 2\*\*126\].*1e-40",
    ),
    "get_loss_scale(restored, scale=2**127)": (
        lambda: jamp.get_loss_scale(_flat(scale=2.0**127)),
        ValueError,
        r"\['scale'\]` in \[2\*\*-126, 2\*\*126\]",
    ),
    "get_loss_scale(restored, scale='2.0')": (
        lambda: jamp.get_loss_scale(_flat(scale="2.0")),
        TypeError,
        r"`opt_state\['loss_scale'\]\['scale'\]` to be a real number, got '2.0'",
    ),
    "get_loss_scale(restored, scale='abc')": (
        lambda: jamp.get_loss_scale(_flat(scale="abc")),
        TypeError,
        r"\['scale'\]` to be a real number, got 'abc'",
    ),
    "get_loss_scale(restored, growth_tracker=-7)": (
        lambda: jamp.get_loss_scale(_flat(growth_tracker=np.int32(-7))),
        ValueError,
        r"\['growth_tracker'\]` to be an integer in \[0, 2\*\*31 - 1\].*-7",
    ),
    "metrics(restored, scale=-1)": (
        lambda: jamp.metrics(_flat(scale=-1.0)),
        ValueError,
        r"`state\['loss_scale'\]\['scale'\]` to be positive",
    ),
    "metrics(restored, skipped_steps=nan)": (
        lambda: jamp.metrics(_flat(skipped_steps=np.float32(np.nan))),
        TypeError,
        r"`state\['skipped_steps'\]` to be an integer scalar",
    ),
    "metrics(restored, last_finite='yes')": (
        lambda: jamp.metrics(_flat(last_finite="yes")),
        TypeError,
        r"`state\['last_finite'\]` to be a boolean scalar",
    ),
    "check_restored(skipped_steps=2**40)": (
        lambda: jamp.check_restored(_lss()._replace(skipped_steps=np.int64(2**40))),
        ValueError,
        r"`skipped_steps` to be an integer in \[0, 2\*\*31 - 1\]",
    ),
    "check_restored(last_finite=1.0)": (
        lambda: jamp.check_restored(_lss()._replace(last_finite=np.float32(1.0))),
        TypeError,
        r"`last_finite` to be a boolean scalar",
    ),
    "check_restored(growth_tracker=None)": (
        lambda: jamp.check_restored(
            _lss()._replace(loss_scale=dataclasses.replace(_lss().loss_scale, growth_tracker=None))
        ),
        TypeError,
        r"`loss_scale/growth_tracker` to be an integer >= 0, got None",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])
