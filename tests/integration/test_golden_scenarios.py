"""Every step of every recorded torch.amp.GradScaler scenario, replayed through the core.

The scaled gradients torch saw are fed to ``unscale_and_check`` and ``update``;
the scale used, the skip decision, the scale after and the growth tracker after
must match torch exactly while torch's scale stays within jamp's bounds.
"""

import dataclasses

import _golden
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp._src import loss_scale as ls

SCENARIOS = _golden.scenario_names()


def test_all_scenarios_present():
    assert len(SCENARIOS) == 10


def make_state(ctor):
    if not ctor["enabled"]:
        return jamp.no_loss_scale()
    return jamp.dynamic_loss_scale(
        ctor["init_scale"], ctor["growth_factor"], ctor["backoff_factor"], ctor["growth_interval"]
    )


def in_bounds(x: float) -> bool:
    return ls.MIN_SCALE <= x <= ls.MAX_SCALE


@pytest.fixture(scope="module")
def step_fn():
    @jax.jit
    def step(state, grads):
        _, finite = jamp.unscale_and_check(state, grads)
        return finite, jamp.update(state, finite)

    return step


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_scale_tracker_and_skips(name, step_fn):
    sc = _golden.scenario(name)
    state = make_state(sc["scaler_ctor"])
    enabled = sc["scaler_ctor"]["enabled"]
    held_at_floor = 0
    for step in sc["steps"]:
        update_call = step["update_call"]["new_scale"]
        torch_used = _golden.scalar(step["scale_used"]) if enabled else 1.0
        if enabled and in_bounds(torch_used):
            assert float(state.scale) == np.float32(torch_used), step["index"]
            assert int(state.growth_tracker) == step["growth_tracker_before"]
        grads = {k: jnp.asarray(_golden.array(v)) for k, v in step["scaled_grads"].items()}
        finite, new_state = step_fn(state, grads)
        torch_found = step["found_inf_combined"] not in (None, 0.0)
        taken = all(o["step_taken"] for o in step["optimizers"].values())
        if enabled and in_bounds(torch_used):
            assert bool(finite) == (not torch_found), step["index"]
            assert taken == (not torch_found)
        elif not enabled:
            # torch applies non-finite steps when disabled; jamp still reports them.
            injected = any(not np.isfinite(np.asarray(g)).all() for g in grads.values())
            assert bool(finite) == (not injected)
        if update_call is not None:
            # update(new_scale=...): the scale is set, the tracker left alone (GradScaler tests
            # replay this through jamp.GradScaler.update).
            new_state = dataclasses.replace(
                state, scale=jnp.asarray(_golden.scalar(step["scale_after"]), jnp.float32)
            )
        state = new_state
        if not enabled:
            assert float(state.scale) == 1.0
            continue
        torch_after = _golden.scalar(step["scale_after"])
        if in_bounds(torch_after):
            assert float(state.scale) == np.float32(torch_after), step["index"]
            assert int(state.growth_tracker) == step["growth_tracker_after"], step["index"]
        else:
            # torch left [2**-126, 2**126]; jamp holds the scale at the bound.
            assert float(state.scale) == (ls.MIN_SCALE if torch_after < 1 else ls.MAX_SCALE)
            held_at_floor += 1
    if name == "consecutive_infs_to_zero":
        assert held_at_floor > 20


def test_consecutive_infs_final_finite_step_stays_finite():
    """torch's scale reaches 0.0, its last finite step turns into NaN and is applied.

    jamp's scale stays at 2**-126: the unscaled gradients of that step are
    finite, reported finite, and produce a finite SGD update.
    """
    sc = _golden.scenario("consecutive_infs_to_zero")
    first_finite = next(i for i, s in enumerate(sc["steps"]) if s["spec"]["grad"] == "finite")
    assert first_finite == 170
    last = sc["steps"][first_finite]
    assert _golden.scalar(last["scale_used"]) == 0.0 and last["found_inf_combined"] == 0.0
    torch_params = {
        k: _golden.array(v) for k, v in last["optimizers"]["opt"]["params_after"].items()
    }
    assert any(np.isnan(p).any() for p in torch_params.values())
    state = jamp.dynamic_loss_scale()
    for _ in range(first_finite):
        state = jamp.update(state, jnp.bool_(False))
    assert float(state.scale) == 2.0**-126
    grads = {k: jnp.asarray(_golden.array(v)) for k, v in last["scaled_grads"].items()}
    unscaled, finite = jamp.unscale_and_check(state, grads)
    assert bool(finite)
    assert all(np.isfinite(np.asarray(g)).all() for g in unscaled.values())
