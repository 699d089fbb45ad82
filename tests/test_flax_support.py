"""flax.serialization of a LossScaleState: to_state_dict/from_state_dict and msgpack checkpoints."""

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
)

import jamp


@pytest.mark.standard_promotion
def test_flax_msgpack_round_trip_continues_identically():
    """flax.serialization.to_bytes / from_bytes, the Linen checkpoint path."""
    from flax import serialization
    from flax.training import train_state

    tx = jamp.loss_scaling(
        optax.adam(1e-2), jamp.dynamic_loss_scale(2.0**10, growth_interval=2, min_scale=1.0)
    )

    @jax.jit
    def step(ts, x):
        ls = jamp.get_loss_scale(ts)
        grads = jax.grad(lambda p: jamp.scale(ls, loss_fn(p, x)))(ts.params)
        return ts.apply_gradients(grads=grads)

    xs = [X, X.at[0, 1].set(jnp.inf), X * 0.5, X, X.at[1, 0].set(jnp.nan), X * 3.0, X]
    ts = train_state.TrainState.create(apply_fn=None, params=params0(), tx=tx)
    for x in xs[:3]:
        ts = step(ts, x)
    saved = serialization.to_state_dict(ts)["opt_state"]["loss_scale"]
    assert set(saved) == {"scale", "growth_tracker", "overflow_streak"}
    blob = serialization.to_bytes(ts)
    target = train_state.TrainState.create(apply_fn=None, params=params0(), tx=tx)
    ts2 = serialization.from_bytes(target, blob)
    restored = jamp.get_loss_scale(ts2)
    assert restored.min_scale == 1.0 and restored.growth_interval == 2  # the target's config
    assert_trees_equal(jax.tree_util.tree_leaves(ts2), jax.tree_util.tree_leaves(ts))
    for x in xs[3:]:
        ts, ts2 = step(ts, x), step(ts2, x)
    assert_trees_equal(jax.tree_util.tree_leaves(ts2), jax.tree_util.tree_leaves(ts))
    assert int(ts2.opt_state.skipped_steps) == 2


def test_flax_state_dict_of_a_loss_scale_state_names_a_missing_key():
    from flax import serialization

    state = jamp.dynamic_loss_scale(8.0)
    d = serialization.to_state_dict(state)
    assert float(serialization.from_state_dict(state, {**d, "scale": np.float32(4.0)}).scale) == 4.0
    with pytest.raises(ValueError, match="overflow_streak"):
        serialization.from_state_dict(state, {k: d[k] for k in ("scale", "growth_tracker")})


# ---------------------------------------------------------------- restores (issue #26)


def _saved_train_state(tx, **opt_state_changes):
    """A flax TrainState trained one step with ``tx``, as from_bytes of its checkpoint
    gives it back, with ``opt_state_changes`` written into the checkpoint's opt_state."""
    from flax import serialization
    from flax.training import train_state

    ts = train_state.TrainState.create(apply_fn=None, params=params0(), tx=tx)
    grads = jax.grad(lambda p: jamp.scale(jamp.get_loss_scale(ts), loss_fn(p, X)))(ts.params)
    ts = ts.apply_gradients(grads=grads)
    saved = serialization.to_state_dict(ts)
    saved["opt_state"].update(opt_state_changes)
    return serialization.msgpack_restore(serialization.msgpack_serialize(saved))


@pytest.mark.parametrize("via", ["flax", "check_restored"])
def test_a_dynamic_checkpoint_resumed_without_loss_scaling_reports_scale_1(via):
    """A no_loss_scale target restored from a dynamic checkpoint kept its scale of 1024, so
    metrics reported 1024 (check_restored accepted it): the target's configuration wins."""
    from flax import serialization
    from flax.training import train_state

    dynamic = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(1024.0))
    saved = _saved_train_state(dynamic)
    assert float(saved["opt_state"]["loss_scale"]["scale"]) == 1024.0
    off = jamp.loss_scaling(optax.sgd(0.1), jamp.no_loss_scale())
    target = train_state.TrainState.create(apply_fn=None, params=params0(), tx=off)
    if via == "flax":
        restored = serialization.from_state_dict(target, saved)
    else:  # a checkpointer that rebuilds the tree itself, then check_restored
        ls = dataclasses.replace(target.opt_state.loss_scale, scale=jnp.float32(1024.0))
        restored = jamp.check_restored(
            target.replace(opt_state=target.opt_state._replace(loss_scale=ls))
        )
    assert float(jamp.metrics(restored)["loss_scale"]) == 1.0
    assert float(jamp.get_loss_scale(restored).scale) == 1.0


@pytest.mark.parametrize(
    "skipped, error, match",
    [
        (np.int64(2**40), ValueError, r"skipped_steps` to be an integer in \[0, 2\*\*31 - 1\]"),
        (np.int32(-5), ValueError, r"skipped_steps` to be an integer in .*-5"),
        (np.float32(np.nan), TypeError, r"skipped_steps` to be an integer scalar.*float32"),
    ],
)
def test_check_restored_refuses_the_skip_counter_a_checkpoint_cannot_hold(skipped, error, match):
    """flax restores loss_scaling's NamedTuple itself, counters as saved: 2**40 became 1
    after a jitted step (int64 into int32), -5 was accepted, NaN failed inside jax."""
    from flax import serialization
    from flax.training import train_state

    tx = jamp.loss_scaling(optax.sgd(0.1))
    saved = _saved_train_state(tx, skipped_steps=skipped)
    target = train_state.TrainState.create(apply_fn=None, params=params0(), tx=tx)
    restored = serialization.from_state_dict(target, saved)
    with pytest.raises(error, match=match):
        jamp.check_restored(restored)
    with pytest.raises(error, match=match.replace("skipped_steps`", "state.skipped_steps`")):
        restored.apply_gradients(grads=params0())  # the update refuses it too, eagerly
    ok = jamp.check_restored(serialization.from_state_dict(target, _saved_train_state(tx)))
    assert ok.opt_state.skipped_steps.dtype == jnp.int32


BAD_INPUT = {
    "from_flax_dynamic_scale(minimum_scale=True)": (
        lambda: jamp.compat.from_flax_dynamic_scale(
            {"fin_steps": 0, "scale": 2.0}, minimum_scale=True
        ),
        TypeError,
        r"`minimum_scale` to be a real number, got True",
    ),
    "from_flax_dynamic_scale(minimum_scale='a')": (
        lambda: jamp.compat.from_flax_dynamic_scale(
            {"fin_steps": 0, "scale": 2.0}, minimum_scale="a"
        ),
        TypeError,
        r"`minimum_scale` to be a real number, got 'a'",
    ),
    "from_flax_dynamic_scale(minimum_scale=1e200)": (
        lambda: jamp.compat.from_flax_dynamic_scale(
            {"fin_steps": 0, "scale": 2.0}, minimum_scale=1e200
        ),
        ValueError,
        r"`minimum_scale` in \[0, 2\*\*126\]",
    ),
    "from_flax_dynamic_scale(fin_steps=None)": (
        lambda: jamp.compat.from_flax_dynamic_scale({"fin_steps": None, "scale": 2.0}),
        TypeError,
        r"`fin_steps` of the flax DynamicScale to be an integer >= 0, got None",
    ),
    "from_flax_dynamic_scale(growth_factor='2')": (
        lambda: jamp.compat.from_flax_dynamic_scale(
            {"fin_steps": 0, "scale": 2.0}, growth_factor="2"
        ),
        TypeError,
        r"`growth_factor` to be a real number",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])
