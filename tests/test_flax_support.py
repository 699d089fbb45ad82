"""flax.serialization of a LossScaleState: to_state_dict/from_state_dict and msgpack checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
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
