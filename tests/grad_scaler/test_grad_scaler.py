"""jamp.GradScaler, and the recorded torch trajectories replayed with real optimizers."""

import dataclasses
import json
import math
import traceback

import _golden
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _bad_input import assert_clear_error

import jamp
from jamp._src import loss_scale as ls

TORCH_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}


# ---------------------------------------------------------------- construction


def test_defaults_hashable_immutable():
    scaler = jamp.GradScaler()
    assert (scaler.init_scale, scaler.growth_factor, scaler.backoff_factor) == (2.0**16, 2.0, 0.5)
    assert scaler.growth_interval == 2000 and scaler.is_enabled()
    assert hash(scaler) == hash(jamp.GradScaler()) and scaler == jamp.GradScaler()
    with pytest.raises(dataclasses.FrozenInstanceError):
        scaler.init_scale = 1.0  # type: ignore[misc]
    # hashable, so it can be a static argument of jit
    out = jax.jit(lambda sc, x: sc.scale(sc.init(), x), static_argnums=0)(scaler, jnp.float32(2.0))
    assert float(out) == 2.0**17


def test_disabled_skips_validation_and_keeps_a_valid_skip():
    # disabled: no validation, as in torch; a valid `skip` is accepted
    kwargs = dict(skip="select", enabled=False, growth_factor=0.5)
    assert jamp.GradScaler(**kwargs).skip == kwargs["skip"]


def test_disabled_skips_validation_like_torch():
    scaler = jamp.GradScaler(growth_factor=0.5, enabled=False)
    assert not scaler.is_enabled()


# ---------------------------------------------------------------- the loop


def test_scale_any_pytree():
    scaler = jamp.GradScaler(init_scale=4.0)
    state = scaler.init()
    outs = {"a": jnp.float32(1.0), "b": [jnp.float32(2.0), (jnp.float32(3.0),)]}
    scaled = scaler.scale(state, outs)  # torch returns a `map` over the keys for a dict
    assert float(scaled["a"]) == 4.0 and float(scaled["b"][1][0]) == 12.0
    assert isinstance(scaled["b"], list) and isinstance(scaled["b"][1], tuple)


def sgd_problem():
    params = {"w": jnp.array([1.0, -2.0]), "b": jnp.array([0.5])}
    tx = optax.sgd(0.5)
    return params, tx, tx.init(params)


def loss(p):
    return jnp.sum(p["w"] ** 2) + jnp.sum(p["b"] ** 2)


@pytest.mark.parametrize("skip", ["cond", "select"])
@pytest.mark.parametrize(
    "wrap", [pytest.param(lambda f: f, id="eager"), pytest.param(jax.jit, id="jit")]
)
def test_step_and_update(wrap, skip):
    scaler = jamp.GradScaler(init_scale=1024.0, growth_interval=2, skip=skip)
    state = scaler.init()
    params, tx, opt_state = sgd_problem()

    def iteration(state, params, opt_state, poison):
        grads = jax.grad(lambda p: scaler.scale(state, loss(p)))(params)
        grads = jax.tree_util.tree_map(lambda g: jnp.where(poison, jnp.nan, g), grads)
        params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)
        assert state.stage == "stepped" and len(state.found_infs) == 1
        found_inf = scaler.found_inf(state)
        return scaler.update(state), params, opt_state, found_inf

    iteration = wrap(iteration)
    state, p1, opt_state, found = iteration(state, params, opt_state, jnp.bool_(False))
    assert not bool(found)
    np.testing.assert_allclose(np.asarray(p1["w"]), [0.0, 0.0])
    state, p2, opt_state, found = iteration(state, p1, opt_state, jnp.bool_(True))
    assert bool(found) and float(scaler.get_scale(state)) == 512.0
    assert np.array_equal(np.asarray(p2["w"]), np.asarray(p1["w"]))


def test_unscale_clip_then_step_like_torch():
    # torch: scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt); scaler.update()
    scaler = jamp.GradScaler(init_scale=2.0**10)
    state = scaler.init()
    params, tx, opt_state = sgd_problem()
    grads = jax.grad(lambda p: scaler.scale(state, loss(p)))(params)
    grads, state = scaler.unscale(state, grads)
    assert state.stage == "unscaled" and not bool(scaler.found_inf(state))
    clipped = optax.clip_by_global_norm(0.1).update(grads, optax.EmptyState())[0]
    new_params, _, state = scaler.step(state, tx, clipped, opt_state, params)
    assert state.stage == "stepped" and len(state.found_infs) == 1  # one check, unscale's
    assert not bool(scaler.found_inf(state))
    moved = optax.tree.norm(jax.tree_util.tree_map(jnp.subtract, params, new_params))
    np.testing.assert_allclose(float(moved), 0.5 * 0.1, rtol=1e-6)  # not unscaled twice


def test_two_optimizers_share_one_scale():
    """torch's multiple-optimizer example: each skips on its own grads, one backoff."""
    scaler = jamp.GradScaler(init_scale=1024.0)
    state = scaler.init()
    p0, p1 = {"w": jnp.ones(2)}, {"w": jnp.ones(3)}
    tx0, tx1 = optax.sgd(0.1), optax.sgd(0.1, momentum=0.9)
    s0, s1 = tx0.init(p0), tx1.init(p1)

    @jax.jit
    def iteration(state, p0, p1, s0, s1, poison1):
        def total(p0, p1):
            l0, l1 = jnp.sum(p0["w"] ** 2), jnp.sum(p1["w"] ** 3)
            return sum(scaler.scale(state, [l0, l1]))

        g0, g1 = jax.grad(total, argnums=(0, 1))(p0, p1)
        g1 = jax.tree_util.tree_map(lambda g: jnp.where(poison1, jnp.inf, g), g1)
        p0, s0, state = scaler.step(state, tx0, g0, s0, p0)
        p1, s1, state = scaler.step(state, tx1, g1, s1, p1)
        inf0, inf1 = state.found_infs  # one check per optimizer, as torch's per-optimizer state
        return scaler.update(state), p0, p1, s0, s1, inf0, inf1

    state, q0, q1, s0, s1, inf0, inf1 = iteration(state, p0, p1, s0, s1, jnp.bool_(True))
    assert not bool(inf0) and bool(inf1)
    assert not np.array_equal(np.asarray(q0["w"]), np.ones(2))  # optimizer 0 stepped
    assert np.array_equal(np.asarray(q1["w"]), np.ones(3))  # optimizer 1 skipped
    assert float(scaler.get_scale(state)) == 512.0  # backed off once, not twice
    state, *_ = iteration(state, q0, q1, s0, s1, jnp.bool_(False))
    assert float(scaler.get_scale(state)) == 512.0 and int(scaler.get_growth_tracker(state)) == 1


def test_update_new_scale_keeps_tracker():
    scaler = jamp.GradScaler(init_scale=8.0)
    state = dataclasses.replace(scaler.init(), growth_tracker=jnp.int32(5))
    for value in (100.0, jnp.float32(3.0), np.float64(0.1)):
        new = scaler.update(state, new_scale=value)
        assert float(new.scale) == float(np.float32(value)) and int(new.growth_tracker) == 5
    traced = jax.jit(lambda s, v: scaler.update(s, new_scale=v))(state, jnp.float32(7.0))
    assert float(traced.scale) == 7.0


def test_getters_and_setters():
    scaler = jamp.GradScaler()
    state = scaler.init()
    state = scaler.set_growth_factor(state, 4.0)
    state = scaler.set_backoff_factor(state, 0.25)
    state = scaler.set_growth_interval(state, 3)
    assert scaler.get_growth_factor(state) == 4.0
    assert scaler.get_backoff_factor(state) == 0.25
    assert scaler.get_growth_interval(state) == 3
    for _ in range(3):  # three finite steps, growth by 4
        state = jamp.update(state, jnp.bool_(True))
    assert float(state.scale) == 2.0**18
    state = jamp.update(state, jnp.bool_(False))  # found_inf: backoff by 0.25
    assert float(state.scale) == 2.0**16
    with pytest.raises(ValueError, match=r"growth_factor=0\.5"):
        scaler.set_growth_factor(state, 0.5)
    with pytest.raises(ValueError, match=r"backoff_factor=2\.0"):
        scaler.set_backoff_factor(state, 2.0)
    with pytest.raises(ValueError, match=r"growth_interval=0"):
        scaler.set_growth_interval(state, 0)


def test_disabled_is_identity_and_always_steps():
    scaler = jamp.GradScaler(enabled=False)
    state = scaler.init()
    outputs = {"loss": jnp.float16(2.0)}
    assert scaler.scale(state, outputs) is outputs
    assert float(scaler.get_scale(state)) == 1.0 and int(scaler.get_growth_tracker(state)) == 0
    assert scaler.state_dict(state) == {}
    assert scaler.update(state) is state  # no "No inf checks" error: torch does nothing
    params, tx, opt_state = sgd_problem()
    grads = {"w": jnp.array([jnp.inf, 1.0]), "b": jnp.array([1.0])}
    assert scaler.unscale(state, grads) == (grads, state)  # torch's unscale_ does nothing
    new_params, _, new_state = scaler.step(state, tx, grads, opt_state, params)
    assert new_state is state and not bool(scaler.found_inf(new_state))
    assert np.isinf(np.asarray(new_params["w"])[0])  # applied, as torch does
    assert float(scaler.load_state_dict({"scale": 5.0}).scale) == 1.0  # a no-op, as in torch


def test_as_optax():
    scaler = jamp.GradScaler(init_scale=256.0, growth_interval=5)
    tx = scaler.as_optax(optax.sgd(0.1))
    state = tx.init({"w": jnp.ones(2)})
    ls_state = jamp.get_loss_scale(state)
    assert float(ls_state.scale) == 256.0 and ls_state.growth_interval == 5


# ---------------------------------------------------------------- state_dict


def test_state_dict_json_round_trip_continues_identically():
    scaler = jamp.GradScaler(
        init_scale=2.0**10, growth_factor=1.1, backoff_factor=0.3, growth_interval=2
    )
    state = scaler.init()
    flags = [True, False, True, True, True, False, True, True]
    for f in flags[:4]:
        state = jamp.update(state, jnp.asarray(f))
    d = json.loads(json.dumps(scaler.state_dict(state)))
    assert set(d) == TORCH_KEYS
    resumed = jamp.GradScaler().load_state_dict(d)  # the dict carries the configuration
    assert resumed.growth_factor == 1.1 and resumed.backoff_factor == 0.3
    for f in flags[4:]:
        state = jamp.update(state, jnp.asarray(f))
        resumed = jamp.update(resumed, jnp.asarray(f))
        assert _golden.bits_equal(np.asarray(state.scale), np.asarray(resumed.scale))
        assert int(state.growth_tracker) == int(resumed.growth_tracker)


@pytest.mark.parametrize("name", _golden.scenario_names())
def test_loads_every_torch_state_dict_and_writes_it_back(name):
    sc = _golden.scenario(name)
    scaler = jamp.GradScaler()
    for step in sc["steps"]:
        d = step["state_dict_after"]
        if not d:
            assert not sc["scaler_ctor"]["enabled"]
            continue
        d = {
            k: (_golden.scalar(v) if k != "_growth_tracker" and k != "growth_interval" else v)
            for k, v in d.items()
        }
        if not (ls.MIN_SCALE <= d["scale"] <= ls.MAX_SCALE):
            if not (np.isfinite(d["scale"]) and d["scale"] > 0):
                with pytest.raises(ValueError, match=r"state_dict\['scale'\]"):
                    scaler.load_state_dict(d)
                continue
            # Restored, not constructed: a scale torch let leave jamp's bounds
            # (up to 2**127, or subnormal on the way to 0) is clamped into them.
            state = scaler.load_state_dict(d)
            clamped = min(max(d["scale"], ls.MIN_SCALE), ls.MAX_SCALE)
            assert scaler.state_dict(state) == {**d, "scale": clamped}
            continue
        state = scaler.load_state_dict(d)
        assert scaler.state_dict(state) == d


# ---------------------------------------------------------------- golden trajectories


def optimizer_for(sc):
    (opt,) = sc["optimizers"]
    kwargs = opt["kwargs"]
    if opt["class"].endswith("SGD"):
        sgd = optax.sgd(kwargs["lr"], momentum=kwargs.get("momentum") or None)
        if sc["name"] == "new_scale_midrun":
            # Scales like 0.1 make 1/scale inexact; XLA fuses the unscale multiply
            # into the momentum update as an FMA, which rounds once where torch
            # rounds twice: one ulp.
            return sgd, (2.5e-7, 0.0)
        return sgd, (0.0, 0.0)  # power-of-two scales on dyadic data: bit for bit
    assert opt["class"].endswith("Adam")
    # torch's for-loop Adam divides and adds eps in another order: within 1e-4 of lr per step.
    return optax.adam(kwargs["lr"]), (1e-5, 1e-6)


def new_scale_of(step):
    call = step["update_call"]["new_scale"]
    if call is None:
        return None
    if "float" in call:
        return _golden.scalar(call["float"])
    return _golden.array(call["tensor"]).reshape(())


def assert_params(got, expected, tol):
    rtol, atol = tol
    for k, v in expected.items():
        g = np.asarray(got[k])
        if rtol == 0.0:
            assert _golden.bits_equal(g, v), (k, g, v)  # SGD on dyadic data: bit for bit
        else:
            np.testing.assert_allclose(g, v, rtol=rtol, atol=atol)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("skip", ["cond", "select"])
@pytest.mark.parametrize("path", ["loss_scaling", "grad_scaler"])
@pytest.mark.parametrize("name", _golden.scenario_names())
def test_replay_trajectory_with_optimizer(name, path, skip):
    sc = _golden.scenario(name)
    ctor = sc["scaler_ctor"]
    inner, rtol = optimizer_for(sc)
    scaler = jamp.GradScaler(
        ctor["init_scale"],
        ctor["growth_factor"],
        ctor["backoff_factor"],
        ctor["growth_interval"],
        ctor["enabled"],
        skip=skip,
    )
    if path == "loss_scaling" and not ctor["enabled"]:
        # torch applies inf/NaN steps when disabled; loss_scaling deliberately never does.
        tx = scaler.as_optax(inner)
        params = {k: jnp.asarray(_golden.array(v)) for k, v in sc["initial_params"].items()}
        state = tx.init(params)
        for step in sc["steps"]:
            grads = {k: jnp.asarray(_golden.array(v)) for k, v in step["scaled_grads"].items()}
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            assert all(np.isfinite(np.asarray(p)).all() for p in params.values())
        return

    params = {k: jnp.asarray(_golden.array(v)) for k, v in sc["initial_params"].items()}
    if path == "loss_scaling":
        tx = scaler.as_optax(inner)
        opt_state = tx.init(params)

        @jax.jit
        def run(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return (
                optax.apply_updates(params, updates),
                opt_state,
                jnp.logical_not(opt_state.last_finite),
            )
    else:
        state = scaler.init()
        opt_state = inner.init(params)

        @jax.jit
        def run(state, params, opt_state, grads):
            params, opt_state, state = scaler.step(state, inner, grads, opt_state, params)
            return params, opt_state, state, scaler.found_inf(state)

    compared = 0
    for step in sc["steps"]:
        grads = {k: jnp.asarray(_golden.array(v)) for k, v in step["scaled_grads"].items()}
        torch_used = _golden.scalar(step["scale_used"]) if ctor["enabled"] else 1.0
        in_bounds = ls.MIN_SCALE <= torch_used <= ls.MAX_SCALE
        if path == "loss_scaling":
            ls_before = opt_state.loss_scale
            params, opt_state, found_inf = run(params, opt_state, grads)
            ls_state = opt_state.loss_scale
        else:
            params, opt_state, stepped, found_inf = run(state, params, opt_state, grads)
        torch_opt = step["optimizers"]["opt"]
        if in_bounds:
            assert bool(found_inf) == (torch_opt["found_inf"] != 0 and ctor["enabled"]), step[
                "index"
            ]
            assert_params(
                params, {k: _golden.array(v) for k, v in torch_opt["params_after"].items()}, rtol
            )
            compared += 1
        # the scale update: dynamic, or update(new_scale=...) as torch was told
        new_scale = new_scale_of(step)
        if path == "loss_scaling":
            if new_scale is not None:
                # torch's update(new_scale=) replaces the dynamic update: tracker untouched
                opt_state = opt_state._replace(
                    loss_scale=scaler.update(ls_before, new_scale=new_scale)
                )
            ls_state = opt_state.loss_scale
        else:
            state = scaler.update(stepped, new_scale)
            ls_state = state
        if not ctor["enabled"]:
            continue
        torch_after = _golden.scalar(step["scale_after"])
        if ls.MIN_SCALE <= torch_after <= ls.MAX_SCALE:
            assert float(ls_state.scale) == np.float32(torch_after), step["index"]
            assert int(ls_state.growth_tracker) == step["growth_tracker_after"]
        else:
            assert float(ls_state.scale) == ls.MIN_SCALE
    assert compared >= 4
    # Nothing is ever lost to NaN, even where torch's parameters became NaN.
    if ctor["enabled"]:
        assert all(np.isfinite(np.asarray(p)).all() for p in params.values())


# ---------------------------------------------------------------- what a porting user gets wrong


def test_lowering_the_growth_interval_below_the_tracker_grows_on_the_next_finite_step():
    scaler = jamp.GradScaler(init_scale=8.0, growth_interval=10)
    state = scaler.init()
    for _ in range(6):
        state = jamp.update(state, jnp.bool_(True))
    assert int(state.growth_tracker) == 6
    state = scaler.set_growth_interval(state, 4)  # torch: the tracker would never equal 4 again
    assert int(state.growth_tracker) == 3
    state = jamp.update(state, jnp.bool_(True))
    assert (float(state.scale), int(state.growth_tracker)) == (16.0, 0)
    # A tracker below the new interval is kept.
    state = jamp.update(state, jnp.bool_(True))
    assert int(scaler.set_growth_interval(state, 3).growth_tracker) == 1


@pytest.mark.parametrize("bad", [[], (), "state"], ids=["[]", "()", "a state"])
def test_update_new_scale_of_the_wrong_kind_is_named_under_jit(bad):
    """Issue #35: ``[]``, ``()`` and a state got the "takes no found_inf" sentence."""
    state = GS().init()
    value = state if bad == "state" else bad
    with pytest.raises(TypeError, match=r"^Expected `new_scale` to be a Python float"):
        jax.jit(lambda s: GS().update(s, new_scale=value))(state)


@pytest.mark.parametrize("jit", [False, True])
def test_update_new_scale_under_jit_never_takes_a_nonfinite_or_nonpositive_scale(jit):
    scaler = jamp.GradScaler(init_scale=8.0)
    state = scaler.init()
    update = jax.jit(scaler.update) if jit else scaler.update
    for bad in (np.nan, np.inf, -np.inf, 0.0, -1.0):
        if jit:
            assert float(update(state, new_scale=jnp.float32(bad)).scale) == 8.0, bad
        else:
            with pytest.raises(ValueError, match="new_scale"):
                update(state, new_scale=jnp.float32(bad))
    assert float(update(state, new_scale=jnp.float32(128.0)).scale) == 128.0
    with pytest.raises(ValueError, match="`new_scale` to be a scalar"):
        update(state, new_scale=jnp.ones(3, jnp.float32))
    if jit:  # outside [min_scale, max_scale]: clamped, as it cannot raise
        assert float(update(state, new_scale=jnp.float32(1e38)).scale) == state.max_scale


@pytest.mark.parametrize("to_array", [np.asarray, jnp.asarray], ids=["numpy", "jax"])
def test_load_state_dict_takes_zero_d_arrays(to_array):
    """What Orbax or np.load hand back for a saved state_dict."""
    scaler = jamp.GradScaler(init_scale=64.0, growth_interval=3)
    state = jamp.update(scaler.init(), jnp.bool_(True))
    saved = scaler.state_dict(state)
    loaded = scaler.load_state_dict({k: to_array(v) for k, v in saved.items()})
    assert scaler.state_dict(loaded) == saved
    assert loaded.growth_tracker.dtype == jnp.int32 and loaded.scale.dtype == jnp.float32
    with pytest.raises(TypeError, match="_growth_tracker"):  # a wrong type: TypeError
        scaler.load_state_dict({**saved, "_growth_tracker": to_array(1.5)})


# ---------------------------------------------------------------- bad input


def valid_state_dict(**changes):
    """A valid PyTorch GradScaler state dict, with ``changes``."""
    d = dict(scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=10)
    return {**d, "_growth_tracker": 0, **changes}


GS = jamp.GradScaler
INIT = jamp.GradScaler().init()
# What a porting user passes where the LossScaleState belongs: the optimizer state.
OPT_STATE = jamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
TO_GET_LOSS_SCALE = r"GradScalerState.*jamp\.get_loss_scale\(opt_state\)"
PARAMS = {"w": jnp.ones(2)}

# Every invalid argument of GradScaler and its methods: id -> (call, exception, match).
# A tuple of patterns: each must match (two tables checked that call).
BAD_INPUT = {
    # the constructor
    "init_scale=0": (lambda: GS(init_scale=0.0), ValueError, r"init_scale=0\.0"),
    "init_scale=-2": (lambda: GS(init_scale=-2.0), ValueError, r"init_scale=-2\.0"),
    "init_scale=bfloat16": (
        lambda: GS(init_scale=jnp.asarray(8, jnp.bfloat16)),
        TypeError,
        r"`init_scale`.*bfloat16",
    ),
    "init_scale='cuda' (torch's device argument)": (
        lambda: GS("cuda"),
        TypeError,
        r"`init_scale`.*'cuda'.*device",
    ),
    "growth_factor=0.5": (lambda: GS(growth_factor=0.5), ValueError, r"growth_factor=0\.5"),
    "growth_factor=1": (lambda: GS(growth_factor=1.0), ValueError, r"growth_factor=1\.0"),
    "backoff_factor=0": (lambda: GS(backoff_factor=0.0), ValueError, r"backoff_factor=0\.0"),
    "backoff_factor=1": (lambda: GS(backoff_factor=1.0), ValueError, r"backoff_factor=1\.0"),
    "growth_interval=0": (lambda: GS(growth_interval=0), ValueError, r"growth_interval=0"),
    "enabled=1": (lambda: GS(enabled=1), TypeError, r"`enabled` to be a bool, got enabled=1"),
    "enabled='yes'": (lambda: GS(enabled="yes"), TypeError, r"`enabled` to be a bool"),
    "skip='jnp.where'": (
        lambda: GS(skip="jnp.where"),
        ValueError,
        r"`skip` to be one of \('auto', 'cond', 'select'\)",
    ),
    "skip=3": (  # a wrong kind of value: a TypeError; a wrong string: a ValueError
        lambda: GS(skip=3),
        TypeError,
        r"`skip` to be one of \('auto', 'cond', 'select'\).*got 3 instead",
    ),
    # setters
    "set_growth_interval(0)": (
        lambda: GS().set_growth_interval(INIT, 0),
        ValueError,
        r"growth_interval=0",
    ),
    # update: torch's update() takes no flag, the state records the checks
    "update(no inf check)": (
        lambda: GS().update(INIT),
        RuntimeError,
        (r"^No inf checks were recorded prior to update\..*scaler\.step", r"`new_scale`"),
    ),
    "update(new_scale=0)": (
        lambda: GS().update(INIT, new_scale=0.0),
        ValueError,
        (r"`new_scale`.*new_scale=0\.0", r"`new_scale` to be positive and finite"),
    ),
    "update(new_scale=inf)": (
        lambda: GS().update(INIT, new_scale=math.inf),
        ValueError,
        r"new_scale=inf",
    ),
    "update(inf) positional, as torch's": (
        lambda: GS().update(INIT, math.inf),
        ValueError,
        r"new_scale=inf",
    ),
    "update(found_inf flag)": (
        lambda: GS().update(INIT, jnp.bool_(False)),
        TypeError,
        r"takes no `found_inf`.*scaler\.update\(state\)",
    ),
    "update([found_inf0, found_inf1])": (
        lambda: GS().update(INIT, [jnp.bool_(False)] * 2),
        TypeError,
        r"takes no `found_inf`",
    ),
    "update(found_inf=vector)": (
        lambda: GS().update(INIT, found_inf=jnp.ones(2, bool)),
        TypeError,
        r"takes no `found_inf`",
    ),
    # load_state_dict
    "load_state_dict({})": (
        lambda: GS().load_state_dict({}),
        ValueError,
        (r"state dict is empty", r"The source state dict is empty"),
    ),
    "load_state_dict(scale only)": (
        lambda: GS().load_state_dict({"scale": 1.0}),
        ValueError,
        r"missing \['growth_factor', 'backoff_factor', 'growth_interval', '_growth_tracker'\]",
    ),
    "load_state_dict(list)": (
        lambda: GS().load_state_dict([("scale", 1.0)]),
        TypeError,
        r"`state_dict` to be a mapping",
    ),
    "load_state_dict(scale=0)": (
        lambda: GS().load_state_dict(valid_state_dict(scale=0.0)),
        ValueError,
        (r"state_dict\['scale'\]", r"collapsed to 0"),
    ),
    "load_state_dict(scale='inf')": (
        lambda: GS().load_state_dict(valid_state_dict(scale="inf")),
        TypeError,
        r"state_dict\['scale'\]",
    ),
    "load_state_dict(tracker=-1)": (
        lambda: GS().load_state_dict(valid_state_dict(_growth_tracker=-1)),
        ValueError,
        r"_growth_tracker",
    ),
    "load_state_dict(growth_factor=0.5)": (
        lambda: GS().load_state_dict(valid_state_dict(growth_factor=0.5)),
        ValueError,
        r"growth_factor=0\.5",
    ),
    # what a porting user gets wrong: an optimizer factory, the optimizer state
    "step(tx=optax.sgd)": (
        lambda: GS().step(INIT, optax.sgd, PARAMS, optax.sgd(0.1).init(PARAMS), PARAMS),
        TypeError,
        r"`tx`.*sgd.*call it",
    ),
    "get_scale(opt_state)": (lambda: GS().get_scale(OPT_STATE), TypeError, TO_GET_LOSS_SCALE),
    "update(opt_state)": (
        lambda: GS().update(OPT_STATE),
        TypeError,
        TO_GET_LOSS_SCALE,
    ),
    "state_dict(opt_state)": (lambda: GS().state_dict(OPT_STATE), TypeError, TO_GET_LOSS_SCALE),
    "set_growth_interval(opt_state)": (
        lambda: GS().set_growth_interval(OPT_STATE, 10),
        TypeError,
        TO_GET_LOSS_SCALE,
    ),
    "scale(state=dict)": (
        lambda: GS().scale({"w": 1.0}, jnp.float32(1.0)),
        TypeError,
        r"`GradScaler.scale` expected `state`.*dict",
    ),
    # issue #26
    "step(filter=3)": (
        lambda: GS().step(
            INIT, optax.sgd(0.1), PARAMS, optax.sgd(0.1).init(PARAMS), PARAMS, filter=3
        ),
        TypeError,
        r"`jamp.GradScaler.step` expected `filter` to be a function of a leaf",
    ),
    "update(new_scale=[1.0])": (
        lambda: GS().update(INIT, new_scale=[1.0]),
        TypeError,
        r"`new_scale` to be a Python float or a scalar array, got list \[1.0\]",
    ),
    # issue #35: an empty list, an empty tuple or a state is no found_inf flag
    "update(new_scale=[])": (
        lambda: GS().update(INIT, new_scale=[]),
        TypeError,
        r"^Expected `new_scale` to be a Python float or a scalar array, got list \[\]",
    ),
    "update(new_scale=())": (
        lambda: GS().update(INIT, new_scale=()),
        TypeError,
        r"^Expected `new_scale` to be a Python float or a scalar array, got tuple \(\)",
    ),
    "update(state, state)": (
        lambda: GS().update(INIT, INIT),
        TypeError,
        (
            r"^Expected `new_scale`.*got a GradScalerState",
            r"takes the state once",
            r"not a found_inf flag: `GradScaler\.update` takes no `found_inf`",
        ),
    ),
    "update(new_scale=LossScaleState)": (
        lambda: GS().update(INIT, new_scale=jamp.dynamic_loss_scale()),
        TypeError,
        r"^Expected `new_scale`.*got a LossScaleState",
    ),
    "update(new_scale=10**400)": (
        lambda: GS().update(INIT, new_scale=10**400),
        ValueError,
        r"`new_scale` to be a finite number",
    ),
    "load_state_dict(_growth_tracker=None)": (
        lambda: GS().load_state_dict(valid_state_dict(_growth_tracker=None)),
        TypeError,
        r"state_dict\['_growth_tracker'\] to be an integer >= 0, got None",
    ),
    "load_state_dict(scale=10**400)": (
        lambda: GS().load_state_dict(valid_state_dict(scale=10**400)),
        ValueError,
        r"state_dict\['scale'\]",
    ),
    "load_state_dict(growth_interval='10')": (
        lambda: GS().load_state_dict(valid_state_dict(growth_interval="10")),
        TypeError,
        r"`state_dict\['growth_interval'\]` to be an integer",
    ),
    "step(opt_state of another optimizer)": (
        lambda: GS().step(INIT, optax.adam(1e-3), PARAMS, optax.sgd(0.1, 0.9).init(PARAMS), PARAMS),
        ValueError,
        r"`jamp.GradScaler.step` expected `opt_state` to be the state that the optimizer's init",
    ),
    "step(grads of other shapes)": (
        lambda: GS().step(
            INIT, optax.sgd(0.1), {"w": jnp.ones(3)}, optax.sgd(0.1).init(PARAMS), PARAMS
        ),
        ValueError,
        r"gradients and `params` to match.*shapes \(3,\) and \(2,\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])


# ---------------------------------------------------------------- the stage, in the state


def leaves_equal(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(bool(jnp.array_equal(x, y)) for x, y in pairs)


def staged_states():
    """A state at each stage of an iteration: ready, unscaled, stepped, and two optimizers."""
    scaler = jamp.GradScaler(init_scale=8.0)
    params, tx, opt_state = sgd_problem()
    ready = scaler.init()
    grads = jax.grad(lambda p: scaler.scale(ready, loss(p)))(params)
    # Each from its own initial state: a state that unscale or step took is used up.
    _, unscaled = scaler.unscale(scaler.init(), grads)
    _, _, stepped = scaler.step(scaler.init(), tx, grads, opt_state, params)
    _, _, two = scaler.step(stepped, tx, grads, opt_state, params)
    return scaler, {"ready": ready, "unscaled": unscaled, "stepped": stepped, "two": two}


def test_each_stage_is_static_metadata_and_found_infs_are_leaves():
    _, states = staged_states()
    expected = {"ready": ("ready", 0), "unscaled": ("unscaled", 1), "stepped": ("stepped", 1)}
    expected["two"] = ("stepped", 2)
    for name, state in states.items():
        assert isinstance(state, jamp.GradScalerState) and isinstance(state, jamp.LossScaleState)
        assert (state.stage, len(state.found_infs)) == expected[name], name
        leaves, treedef = jax.tree_util.tree_flatten(state)
        assert len(leaves) == 3 + len(state.found_infs)  # scale, tracker, streak + the checks
        back = jax.tree_util.tree_unflatten(treedef, leaves)
        assert type(back) is jamp.GradScalerState and back.stage == state.stage
        assert back.growth_interval == state.growth_interval
        through_jit = jax.jit(lambda s: s)(state)
        assert jax.tree_util.tree_structure(through_jit) == treedef
        assert leaves_equal(leaves, back)
    # Only the ready state has the structure of the start of an iteration.
    structures = {n: jax.tree_util.tree_structure(s) for n, s in states.items()}
    assert len(set(structures.values())) == 4


def test_the_loss_scale_functions_take_the_state_at_any_stage():
    scaler, states = staged_states()
    for state in states.values():
        assert float(jamp.scale(state, jnp.float32(1.0))) == 8.0
        found = jamp.get_loss_scale({"scaler": state})
        assert type(found) is jamp.GradScalerState and found.stage == state.stage
        assert set(jamp.metrics(state)) == {"loss_scale", "growth_tracker"}
        assert scaler.state_dict(state)["scale"] == 8.0
        # The pure update keeps the stage: it is GradScaler's bookkeeping, not the rule's.
        assert jamp.update(state, jnp.bool_(True)).stage == state.stage


def test_an_iteration_is_a_lax_scan_carry_and_matches_the_python_loop():
    scaler = jamp.GradScaler(init_scale=2.0**10, growth_interval=3)
    params, tx, opt_state = sgd_problem()
    poison = jnp.array([False, True, False, False, False, True, False, False])

    def iteration(carry, bad):
        state, params, opt_state = carry
        grads = jax.grad(lambda p: scaler.scale(state, loss(p)))(params)
        grads = jax.tree.map(lambda g: jnp.where(bad, jnp.inf, g), grads)
        grads, state = scaler.unscale(state, grads)
        params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)
        found_inf = scaler.found_inf(state)
        return (scaler.update(state), params, opt_state), found_inf

    carry = (scaler.init(), params, opt_state)
    scanned, found = jax.jit(lambda c, xs: jax.lax.scan(iteration, c, xs))(carry, poison)
    looped = carry
    for bad in poison:
        looped, _ = jax.jit(iteration)(looped, bad)
    np.testing.assert_array_equal(np.asarray(found), np.asarray(poison))
    assert scanned[0].stage == "ready" and scanned[0].found_infs == ()
    assert leaves_equal(scanned, looped)
    assert float(scanned[0].scale) == 2.0**10 / 4 * 2  # two backoffs, one growth


def test_flax_serialization_saves_the_loss_scale_fields_and_restores_a_ready_state():
    from flax import serialization

    scaler, states = staged_states()
    two = states["two"]
    saved = serialization.to_state_dict({"scaler": two})
    assert set(saved["scaler"]) == {"scale", "growth_tracker", "overflow_streak"}
    raw = serialization.to_bytes({"scaler": scaler.update(two)})
    restored = serialization.from_bytes({"scaler": scaler.init()}, raw)["scaler"]
    assert type(restored) is jamp.GradScalerState and restored.stage == "ready"
    assert int(restored.growth_tracker) == 1


def test_two_optimizers_one_unscaled_in_either_order():
    """torch: unscale_(opt0); step(opt0); step(opt1); update() — and opt1 first."""
    scaler = jamp.GradScaler(init_scale=16.0)
    params, tx, opt_state = sgd_problem()
    state = scaler.init()
    grads = jax.grad(lambda p: scaler.scale(state, loss(p)))(params)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)

    g0, s = scaler.unscale(state, grads)
    p0, _, s = scaler.step(s, tx, g0, opt_state, params)
    p1, _, s = scaler.step(s, tx, bad, opt_state, params)
    assert [bool(f) for f in s.found_infs] == [False, True]
    after = scaler.update(s)
    assert float(after.scale) == 8.0 and after.stage == "ready"

    q1, _, s = scaler.step(scaler.init(), tx, bad, opt_state, params)
    g0, s = scaler.unscale(s, grads)
    q0, _, s = scaler.step(s, tx, g0, opt_state, params)
    assert [bool(f) for f in s.found_infs] == [True, False]
    assert float(scaler.update(s).scale) == 8.0
    assert leaves_equal(p0, q0) and leaves_equal(p1, q1) and leaves_equal(p1, params)


def test_unscale_then_update_without_step_counts_the_check_as_torch_does():
    scaler = jamp.GradScaler(init_scale=16.0)
    _, state = scaler.unscale(scaler.init(), {"w": jnp.array([jnp.inf])})
    assert float(scaler.update(state).scale) == 8.0


def test_update_new_scale_resets_the_stage_and_a_plain_state_stays_plain():
    scaler, states = staged_states()
    after = scaler.update(states["two"], new_scale=2.0)
    assert (after.stage, after.found_infs, float(after.scale)) == ("ready", (), 2.0)
    plain = jamp.dynamic_loss_scale(8.0)
    assert type(scaler.update(plain, new_scale=4.0)) is jamp.LossScaleState
    params, tx, opt_state = sgd_problem()
    _, _, stepped = scaler.step(plain, tx, params, opt_state, params)
    assert type(stepped) is jamp.GradScalerState and stepped.stage == "stepped"


def test_found_inf_is_false_before_any_check():
    scaler = jamp.GradScaler()
    assert not bool(scaler.found_inf(scaler.init()))


def test_a_state_captured_from_outside_a_trace_is_not_marked():
    """Traced twice (two shapes), a closure over an eager state must not see its own mark."""
    scaler = jamp.GradScaler(init_scale=4.0)
    state = scaler.init()
    tx = optax.sgd(0.1)

    @jax.jit
    def step(params):
        grads = jax.grad(lambda p: scaler.scale(state, jnp.sum(p**2)))(params)
        grads, s = scaler.unscale(state, grads)
        params, _, s = scaler.step(s, tx, grads, tx.init(params), params)
        return params, scaler.update(s)

    step(jnp.ones(2))
    step(jnp.ones(3))  # a second trace with the same captured state
    # Eagerly, a ready state can be updated with new_scale as often as one likes.
    for v in (2.0, 3.0):
        assert float(scaler.update(state, new_scale=v).scale) == v


@pytest.mark.parametrize("skip", ["auto", "cond", "select"])
def test_a_skipped_step_hands_back_the_old_parameters_subnormals_and_minus_zero_included(skip):
    """GradScaler.step keeps the old buffers on a skipped step: every bit, -0.0 and a
    float32 subnormal (which XLA:CPU's arithmetic would flush) included."""
    scaler = jamp.GradScaler(skip=skip)
    params = {"w": jnp.array([-0.0, 1e-40, -1e-42, 3.0], jnp.float32)}
    tx = optax.sgd(0.1, momentum=0.9)

    @jax.jit
    def train_step(state, params, opt_state, x):
        grads = jax.grad(lambda p: scaler.scale(state, jnp.sum(p["w"] * x)))(params)
        params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)
        return params, opt_state, scaler.update(state)

    opt_state = tx.init(params)
    new, new_opt, state = train_step(scaler.init(), params, opt_state, jnp.full(4, jnp.inf))
    assert float(state.scale) == 2.0**15  # it overflowed and backed off
    assert np.array_equal(
        np.asarray(new["w"]).view(np.uint32), np.asarray(params["w"]).view(np.uint32)
    )
    for a, b in zip(jax.tree.leaves(new_opt), jax.tree.leaves(opt_state), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_complex_new_scale_under_jit_is_refused_not_truncated():
    """Under jit a complex new_scale lost its imaginary part (issue #26)."""
    scaler = jamp.GradScaler()
    with pytest.raises(TypeError, match=r"`new_scale` to be a float32 .*complex64"):
        jax.jit(lambda s: scaler.update(scaler.init(), new_scale=s))(jnp.complex64(4 + 3j))
    with pytest.raises(TypeError, match=r"`new_scale`.*bool|found_inf"):
        jax.jit(lambda s: scaler.update(scaler.init(), new_scale=s))(jnp.bool_(True))
    state = jax.jit(lambda s: scaler.update(scaler.init(), new_scale=s))(jnp.int32(4))
    assert float(state.scale) == 4.0


@pytest.mark.parametrize("mode", ["quiet_remove_frames", "remove_frames"])
def test_a_misuse_refused_under_jit_is_shown_from_the_users_line(mode):
    """GradScaler's and validate's frames leave JAX's filtered traceback (as JAX's own do)."""
    scaler = jamp.GradScaler()

    def train_step(state):
        return scaler.update(state)  # no step recorded an inf check: refused

    before = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", mode)
    try:
        with pytest.raises(RuntimeError, match="No inf checks") as info:
            jax.jit(train_step)(scaler.init())
    finally:
        jax.config.update("jax_traceback_filtering", before)
    assert traceback.extract_tb(info.value.__traceback__)[-1].name == "train_step"
