"""jamp.loss_scaling and jamp.multi_steps: the Optax wrapper, and its composition with Optax."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _bad_input import assert_clear_error
from _problem import (
    X,
    assert_trees_close,
    assert_trees_equal,
    grads_tree,
    loss_fn,
    params0,
    poison,
    scaled_grads,
)

import jamp

EAGER_AND_JIT = [pytest.param(lambda f: f, id="eager"), pytest.param(jax.jit, id="jit")]


# ---------------------------------------------------------------- the wrapper


def test_state_fields_are_unique_and_findable():
    tx = jamp.loss_scaling(optax.adam(1e-2))
    state = tx.init(params0())
    assert isinstance(state, jamp.ScaledOptimizerState)
    assert state._fields == ("loss_scale", "inner_state", "last_finite", "skipped_steps")
    assert optax.tree.get(state, "loss_scale") is state.loss_scale
    assert int(optax.tree.get(state, "skipped_steps")) == 0
    assert bool(optax.tree.get(state, "last_finite"))
    assert float(state.loss_scale.scale) == 2.0**16  # torch's default
    assert state.skipped_steps.dtype == jnp.int32 and state.last_finite.dtype == jnp.bool_


@pytest.mark.standard_promotion
@pytest.mark.parametrize("skip", ["cond", "select"])
@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_nonfinite_step_is_skipped_and_inner_state_frozen(wrap, bad, skip):
    tx = jamp.loss_scaling(optax.adam(1e-2), jamp.dynamic_loss_scale(1024.0), skip=skip)
    p = params0()
    state = tx.init(p)
    update = wrap(tx.update)
    u, state = update(scaled_grads(state, p), state, p)
    p = optax.apply_updates(p, u)
    inner_before = state.inner_state
    u, new_state = update(poison(scaled_grads(state, p), bad), state, p)
    assert all(not np.any(np.asarray(x)) for x in jax.tree_util.tree_leaves(u))
    assert_trees_equal(new_state.inner_state, inner_before)  # count, mu, nu bit for bit
    assert int(new_state.inner_state[0].count) == 1
    assert not bool(new_state.last_finite) and int(new_state.skipped_steps) == 1
    assert float(new_state.loss_scale.scale) == 512.0
    # A clean step afterwards applies and advances.
    u, state2 = update(scaled_grads(new_state, p), new_state, p)
    assert bool(state2.last_finite) and int(state2.inner_state[0].count) == 2
    assert any(np.any(np.asarray(x)) for x in jax.tree_util.tree_leaves(u))


@pytest.mark.parametrize("skip", ["cond", "select"])
def test_skipped_updates_are_zeros_of_the_inner_updates_dtype(skip):
    # An inner transformation whose updates differ in dtype from the
    # gradients: a skipped step still returns zeros, typed like its updates.
    to_half = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree_util.tree_map(lambda g: g.astype(jnp.float16), u), s),
    )
    tx = jamp.loss_scaling(optax.chain(optax.sgd(0.1), to_half), skip=skip)
    p = {"w": jnp.ones((3,))}
    state = tx.init(p)
    u, _ = jax.jit(tx.update)({"w": jnp.array([1.0, jnp.nan, 2.0])}, state, p)
    assert u["w"].dtype == jnp.float16 and not np.any(np.asarray(u["w"]))
    u, _ = jax.jit(tx.update)({"w": jnp.ones((3,))}, state, p)
    assert u["w"].dtype == jnp.float16 and np.all(np.asarray(u["w"]) != 0)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("skip", ["cond", "select"])
def test_updates_equal_plain_optimizer_on_unscaled_grads(skip):
    inner = optax.adamw(1e-2)
    tx = jamp.loss_scaling(inner, jamp.dynamic_loss_scale(2.0**10), skip=skip)
    p = params0()
    s, s_plain = tx.init(p), inner.init(p)
    for _ in range(3):
        u, s = tx.update(scaled_grads(s, p), s, p)
        u_plain, s_plain = inner.update(jax.grad(loss_fn)(p, X), s_plain, p)
        # A power-of-two scale makes unscaling exact; XLA may still fuse the two
        # backward passes differently (FMA contraction), hence one-ulp tolerance.
        assert_trees_close(u, u_plain)
        p = optax.apply_updates(p, u)


@pytest.mark.standard_promotion
def test_jitted_train_step_traces_once_and_needs_no_transfers():
    traces = []
    tx = jamp.loss_scaling(optax.adam(1e-2), jamp.dynamic_loss_scale(4.0, growth_interval=2))

    @jax.jit
    def step(p, s, x):
        traces.append(1)
        u, s = tx.update(scaled_grads(s, p, x), s, p)
        return optax.apply_updates(p, u), s

    p = params0()
    s = tx.init(p)
    xs = [X, X * 2, X.at[0, 0].set(jnp.inf), X, X, X, X]
    xs = [jax.device_put(x) for x in xs]
    p, s = step(p, s, xs[0])
    scales = [float(s.loss_scale.scale)]
    with jax.transfer_guard("disallow"):
        for x in xs[1:]:
            p, s = step(p, s, x)
            scales.append(s.loss_scale.scale)
    scales = [float(v) for v in scales]
    assert len(traces) == 1
    assert scales == [4.0, 8.0, 4.0, 4.0, 8.0, 8.0, 16.0]
    assert int(s.skipped_steps) == 1


def test_extra_args_are_forwarded():
    seen = []

    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, value=None, **extra):
        seen.append(value)
        return updates, state

    inner = optax.GradientTransformationExtraArgs(init, update)
    tx = jamp.loss_scaling(optax.chain(inner, optax.sgd(0.1)))
    p = params0()
    s = tx.init(p)
    tx.update(scaled_grads(s, p), s, p, value=jnp.float32(3.0))
    assert seen and float(seen[0]) == 3.0


@pytest.mark.standard_promotion
def test_reduce_on_plateau_gets_the_value():
    tx = jamp.loss_scaling(optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1)))
    p = params0()
    s = tx.init(p)
    u, s = tx.update(scaled_grads(s, p), s, p, value=loss_fn(p, X))
    assert bool(s.last_finite)


def test_static_and_no_loss_scale_still_skip_nonfinite():
    for ls in (jamp.static_loss_scale(8.0), jamp.no_loss_scale()):
        tx = jamp.loss_scaling(optax.sgd(0.1), ls)
        p = params0()
        s = tx.init(p)
        u, s2 = tx.update(poison(scaled_grads(s, p), jnp.nan), s, p)
        assert not bool(s2.last_finite)
        assert float(s2.loss_scale.scale) == float(ls.scale)
        assert all(not np.any(np.asarray(x)) for x in jax.tree_util.tree_leaves(u))


def test_skipped_steps_saturate():
    tx = jamp.loss_scaling(optax.sgd(0.1))
    p = params0()
    s = tx.init(p)
    s = s._replace(skipped_steps=jnp.asarray(2**31 - 2, jnp.int32))
    g = poison(scaled_grads(s, p))
    for _ in range(3):
        _, s = jax.jit(tx.update)(g, s, p)
    assert int(s.skipped_steps) == 2**31 - 1


def test_bfloat16_params_and_grads_keep_dtype():
    p = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params0())
    tx = jamp.loss_scaling(optax.sgd(0.1))
    s = tx.init(p)
    g = scaled_grads(s, p, X.astype(jnp.bfloat16))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(g))
    u, s = jax.jit(tx.update)(g, s, p)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(u))
    assert bool(s.last_finite)


# ---------------------------------------------------------------- composition


@pytest.mark.standard_promotion
def test_clipping_inside_sees_unscaled_grads():
    clip_then_adam = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))
    tx = jamp.loss_scaling(clip_then_adam, jamp.dynamic_loss_scale(2.0**14))
    p = params0()
    s, s_ref = tx.init(p), clip_then_adam.init(p)
    u, s = tx.update(scaled_grads(s, p), s, p)
    u_ref, _ = clip_then_adam.update(jax.grad(loss_fn)(p, X), s_ref, p)
    assert_trees_close(u, u_ref)


def test_clip_by_global_norm_norm_is_of_unscaled_grads():
    tx = jamp.loss_scaling(
        optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1.0)),
        jamp.dynamic_loss_scale(2.0**14),
    )
    p = params0()
    s = tx.init(p)
    assert float(optax.tree.norm(jax.grad(loss_fn)(p, X))) > 1.0
    u, s = jax.jit(tx.update)(scaled_grads(s, p), s, p)
    # Clipped to norm 0.1 in unscaled units; clipping the scaled grads (forgetting
    # torch's unscale_) would have given a norm of 0.1 / 2**14.
    np.testing.assert_allclose(float(optax.tree.norm(u)), 0.1, rtol=1e-6)


@pytest.mark.standard_promotion
def test_multisteps_accumulation_scale_constant_across_micro_steps():
    k = 3
    tx = optax.MultiSteps(
        jamp.loss_scaling(optax.sgd(0.5), jamp.dynamic_loss_scale(2.0**8, growth_interval=1)), k
    )
    p = params0()
    s = tx.init(p)
    micro = [X, X * 0.5, X * 2.0]
    step = jax.jit(tx.update)
    scales = []
    for x in micro:
        u, s = step(scaled_grads(s, p, x), s, p)
        scales.append(float(jamp.get_loss_scale(s).scale))
        p = optax.apply_updates(p, u)
    assert scales == [256.0, 256.0, 512.0]  # constant across micro-steps, grows at the boundary
    ref = params0()
    mean_grad = jax.tree_util.tree_map(
        lambda *g: sum(g) / k, *[jax.grad(loss_fn)(ref, x) for x in micro]
    )
    expected = jax.tree_util.tree_map(lambda w, g: w - 0.5 * g, ref, mean_grad)
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    # An inf in one micro-step skips the whole accumulated step at the boundary.
    before = p
    for i, x in enumerate(micro):
        g = scaled_grads(s, p, x)
        if i == 1:
            g = poison(g)
        u, s = step(g, s, p)
        p = optax.apply_updates(p, u)
    assert_trees_equal(p, before)
    assert float(jamp.get_loss_scale(s).scale) == 256.0


def run_accumulation(tx, n_steps, k, poison_at):
    p = params0()
    s = tx.init(p)
    step = jax.jit(tx.update)
    history = []
    for i in range(n_steps * k):
        g = scaled_grads(s, p, X * (1.0 + 0.1 * (i % 3)))
        if i == poison_at:
            g = poison(g)
        u, s = step(g, s, p)
        p = optax.apply_updates(p, u)
        history.append(p)
    return p, s, history


@pytest.mark.standard_promotion  # optax.MultiSteps multiplies int32 by float32 inside optax
@pytest.mark.parametrize("skip", ["cond", "select"])
def test_multi_steps_recovers_after_an_overflow(skip):
    k = 2
    inner = jamp.loss_scaling(
        optax.sgd(0.1), jamp.dynamic_loss_scale(2.0**8, growth_interval=100), skip=skip
    )
    tx = jamp.multi_steps(inner, k)
    p, s, history = run_accumulation(tx, 5, k, poison_at=1)
    ls = jamp.get_loss_scale(s)
    assert float(ls.scale) == 128.0  # backed off once, at the first boundary
    assert int(s.inner_opt_state.skipped_steps) == 1  # only the poisoned step
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(s.acc_grads))
    # every later boundary applied an update
    for i in range(3, 10, 2):
        assert not np.array_equal(np.asarray(history[i]["w"]), np.asarray(history[i - 2]["w"]))


@pytest.mark.standard_promotion
def test_loss_scaling_around_multisteps_drops_only_the_bad_micro_batch():
    k = 2
    tx = jamp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), k), jamp.dynamic_loss_scale(2.0**8))
    p, s, history = run_accumulation(tx, 3, k, poison_at=1)
    assert int(s.skipped_steps) == 1 and float(s.loss_scale.scale) == 128.0
    # the poisoned micro-batch did not count: the first boundary comes one call later
    assert np.array_equal(np.asarray(history[1]["w"]), np.asarray(params0()["w"]))
    assert not np.array_equal(np.asarray(history[2]["w"]), np.asarray(params0()["w"]))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(p))


@pytest.mark.parametrize("skip", ["cond", "select"])
def test_schedule_does_not_drift_on_skipped_steps(skip):
    sched = optax.linear_schedule(1.0, 0.0, 10)
    tx = jamp.loss_scaling(optax.inject_hyperparams(optax.sgd)(learning_rate=sched), skip=skip)
    p = params0()
    s = tx.init(p)
    for i in range(6):
        g = scaled_grads(s, p)
        if i % 2:
            g = poison(g)
        u, s = tx.update(g, s, p)
    inner = s.inner_state
    assert int(inner.count) == 3  # only the clean steps advanced the schedule
    np.testing.assert_allclose(float(inner.hyperparams["learning_rate"]), float(sched(2)))


# ---------------------------------------------------------------- report_nonfinite


@pytest.mark.parametrize("skip", ["cond", "select"])
def test_loss_scaling_report_nonfinite(caplog, skip):
    tx = jamp.loss_scaling(optax.sgd(0.1), report_nonfinite=True, skip=skip)
    params = grads_tree(jnp.bool_(False))
    state = tx.init(params)
    step = jax.jit(tx.update)
    with caplog.at_level(logging.WARNING, logger="jamp"):
        _, state = step(grads_tree(jnp.bool_(False)), state, params)
        jax.effects_barrier()
        assert not caplog.records
        _, state = step(grads_tree(jnp.bool_(True)), state, params)
        jax.effects_barrier()
    assert not bool(state.last_finite)
    (record,) = caplog.records
    assert (
        record.getMessage()
        == "skipped step: non-finite values in params/Dense_3/kernel: 4 inf, 0 nan"
    )
    with pytest.raises(TypeError, match=r"`report_nonfinite` to be a bool"):
        jamp.loss_scaling(optax.sgd(0.1), report_nonfinite="yes")


@pytest.mark.parametrize("skip", ["cond", "select"])
def test_report_counts_the_unscaled_values(caplog, skip):
    # A scale below 1 makes a finite gradient overflow once unscaled: the
    # report names it, counted on the unscaled values of a large leaf.
    tx = jamp.loss_scaling(
        optax.sgd(0.1), jamp.static_loss_scale(2.0**-4), report_nonfinite=True, skip=skip
    )
    params = {"w": jnp.ones(3 * 2**16 + 1)}
    state = tx.init(params)
    grads = {"w": jnp.ones(3 * 2**16 + 1).at[2**17 + 3].set(3e38)}
    with caplog.at_level(logging.WARNING, logger="jamp"):
        _, state = jax.jit(tx.update)(grads, state, params)
        jax.effects_barrier()
    assert not bool(state.last_finite)
    (record,) = caplog.records
    assert record.getMessage() == "skipped step: non-finite values in w: 1 inf, 0 nan"


# ---------------------------------------------------------------- checkpoints


@pytest.mark.standard_promotion
def test_orbax_round_trip_continues_identically(tmp_path):
    import orbax.checkpoint as ocp

    tx = jamp.loss_scaling(
        optax.adam(1e-2), jamp.dynamic_loss_scale(2.0**10, growth_interval=2, min_scale=1.0)
    )

    @jax.jit
    def step(p, s, x):
        u, s = tx.update(scaled_grads(s, p, x), s, p)
        return optax.apply_updates(p, u), s

    xs = [X, X.at[0, 1].set(jnp.inf), X * 0.5, X, X * 3.0, X]
    p, s = params0(), tx.init(params0())
    for x in xs[:3]:
        p, s = step(p, s, x)
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"params": p, "opt_state": s})
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, {"params": p, "opt_state": s})
    p2, s2 = restored["params"], restored["opt_state"]
    assert isinstance(s2, jamp.ScaledOptimizerState)
    assert jamp.get_loss_scale(s2).min_scale == 1.0 and jamp.get_loss_scale(s2).growth_interval == 2
    for x in xs[3:]:
        p, s = step(p, s, x)
        p2, s2 = step(p2, s2, x)
    assert_trees_equal((p, s), (p2, s2))


# ---------------------------------------------------------------- multi_steps


@pytest.mark.standard_promotion  # optax.MultiSteps multiplies int32 by float32 inside optax
def test_multi_steps_has_updated_as_optax_multisteps():
    tx = jamp.multi_steps(jamp.loss_scaling(optax.sgd(0.1)), lambda step: 3)
    reference = optax.MultiSteps(jamp.loss_scaling(optax.sgd(0.1)), 3)
    p = params0()
    s, r = tx.init(p), reference.init(p)
    flags = []
    for i in range(7):
        g = jax.tree_util.tree_map(lambda x, i=i: jnp.full_like(x, float(i)), p)
        s = tx.update(g, s, p)[1]
        r = reference.update(g, r, p)[1]
        flags.append(bool(tx.has_updated(s)))
        assert flags[-1] == bool(reference.has_updated(r))
    assert flags == [False, False, True, False, False, True, False]


# ---------------------------------------------------------------- a skipped step keeps every bit


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


@pytest.mark.parametrize("skip", ["auto", "cond", "select"])
def test_skipped_step_leaves_every_parameter_bit_identical_minus_zero_included(skip):
    """Issue #26, item 4: a jitted train step whose gradient overflows leaves each parameter
    as it was, bit for bit: -0.0 stays -0.0 (a +0.0 update turned it into +0.0)."""
    params = {
        "w": jnp.array([[-0.0, 0.0], [1.5, -3.0]], jnp.float32),
        "b": jnp.array([-0.0, 2.0**-126, -(2.0**100)], jnp.float32),
        "h": jnp.array([-0.0, 0.5], jnp.bfloat16),
    }
    tx = jamp.loss_scaling(optax.adamw(1e-2, weight_decay=0.1), skip=skip)
    opt_state = tx.init(params)

    def loss(p, x):
        h = p["h"].astype(jnp.float32)
        return jnp.sum((x @ p["w"]) ** 2) + jnp.sum(p["b"] ** 2) + jnp.sum(h**2)

    @jax.jit
    def train_step(params, opt_state, x):
        ls = jamp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: jamp.scale(ls, loss(p, x)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    with jax.numpy_dtype_promotion("standard"):  # adamw's bias correction
        new, state = train_step(params, opt_state, jnp.array([[1.0, 1e30]], jnp.float32))
    assert not bool(state.last_finite) and int(state.skipped_steps) == 1  # it overflowed
    for name in params:
        assert np.array_equal(_bits(new[name]), _bits(params[name])), name
    assert_trees_equal(state.inner_state, opt_state.inner_state)


# ---------------------------------------------------------------- inputs that do not match


@pytest.mark.standard_promotion  # optax.lookahead mixes a float and a bool
def test_lookahead_gradients_of_the_fast_parameters_still_pass():
    """Gradients and `params` of different structures are not refused: optax.lookahead
    takes the fast parameters' gradients with both parameter sets."""
    tx = jamp.loss_scaling(optax.lookahead(optax.sgd(0.1), sync_period=2, slow_step_size=0.5))
    params = optax.LookaheadParams.init_synced(params0())
    state = tx.init(params)
    grads = scaled_grads(state, params.fast)
    updates, state = tx.update(grads, state, params)
    assert bool(state.last_finite)
    assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(params)


@pytest.mark.standard_promotion  # optax.MultiSteps counts in int32 beside float32
def test_multi_steps_takes_python_float_gradients_as_optax_does():
    for tx in (optax.MultiSteps(optax.sgd(1.0), 2), jamp.multi_steps(optax.sgd(1.0), 2)):
        state = tx.init({"a": 1.0})
        for _ in range(2):
            updates, state = tx.update({"a": 1.0}, state)
        assert float(updates["a"]) == -1.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, None])
def test_multi_steps_accumulator_dtype_floating_or_none_is_accepted(dtype):
    tx = jamp.multi_steps(optax.sgd(1.0), 2, accumulator_dtype=dtype)
    state = tx.init(params0())
    for _ in range(2):
        updates, state = tx.update(params0(), state)
    np.testing.assert_allclose(updates["w"], -np.asarray(params0()["w"]), rtol=1e-2)


@pytest.mark.standard_promotion  # optax.MultiSteps counts in int32 beside float32
def test_multi_steps_takes_schedules_and_refuses_an_optimizer_factory_under_jit():
    """Issue #35: ``every_k_schedule=optax.sgd`` failed at the first update, inside it."""
    schedules = {
        "constant": optax.constant_schedule(2),
        "piecewise (float)": optax.piecewise_constant_schedule(2, {100: 2}),
        "python branches": lambda step: 2 if step < 100 else 4,
        "jnp": lambda step: jnp.where(step < 100, 2, 4),
    }
    for name, schedule in schedules.items():
        tx = jamp.multi_steps(optax.sgd(1.0), every_k_schedule=schedule)
        state = tx.init(params0())
        for _ in range(2):
            updates, state = tx.update(params0(), state)
        assert int(state.gradient_step) == 1, name
        np.testing.assert_allclose(updates["w"], -np.asarray(params0()["w"]), err_msg=name)

    @jax.jit
    def built_in_the_step(grads):
        tx = jamp.multi_steps(optax.sgd(1.0), every_k_schedule=optax.sgd)
        return tx.update(grads, tx.init(grads))

    with pytest.raises(TypeError, match=r"^Expected `every_k_schedule`.*got sgd"):
        built_in_the_step(params0())


def test_python_int_gradients_are_named_under_jit():
    """Issue #35: ``loss_scaling(...).update`` of ``10**400`` raised optax's OverflowError."""
    params = {"w": jnp.ones(())}
    with pytest.raises(TypeError, match=r"the gradients to be floating.*401 digits"):
        jax.jit(lambda s: SGD_LS.update({"w": 10**400}, s, params))(SGD_LS.init(params))
    ms = jamp.multi_steps(SGD, 2)
    with pytest.raises(TypeError, match=r"the gradients to be floating.*Python int"):
        jax.jit(lambda s: ms.update({"w": 3}, s, params))(ms.init(params))


def _restored(**fields):
    """A loss_scaling state as an unvalidated checkpoint might hold it."""
    state = jamp.loss_scaling(SGD).init(params0())
    return state._replace(**fields)


# ---------------------------------------------------------------- bad input

SGD = optax.sgd(0.1)
SGD_LS = jamp.loss_scaling(SGD)

# Every invalid argument of loss_scaling, its update and multi_steps: id -> (call,
# exception, match).
BAD_INPUT = {
    # loss_scaling
    "inner=function": (
        lambda: jamp.loss_scaling(optax.sgd),
        TypeError,
        r"`inner` to be an optax.GradientTransformation",
    ),
    "inner=None": (lambda: jamp.loss_scaling(None), TypeError, r"`inner`"),
    "inner='adam'": (
        lambda: jamp.loss_scaling("adam"),
        TypeError,
        r"`inner` to be an optax.GradientTransformation, got str",
    ),
    "loss_scale=1024.0": (
        lambda: jamp.loss_scaling(SGD, 1024.0),
        TypeError,
        r"`loss_scale` to be a jamp.LossScaleState.*got float",
    ),
    "loss_scale=2.0": (
        lambda: jamp.loss_scaling(SGD, 2.0),
        TypeError,
        r"`loss_scale` to be a jamp.LossScaleState",
    ),
    "loss_scale=GradScaler": (
        lambda: jamp.loss_scaling(SGD, jamp.GradScaler()),
        TypeError,
        r"`loss_scale`.*got GradScaler",
    ),
    "skip='where'": (
        lambda: jamp.loss_scaling(SGD, None, skip="where"),
        ValueError,
        r"`skip` to be one of .*got 'where'",
    ),
    "skip=None": (
        lambda: jamp.loss_scaling(SGD, None, skip=None),
        TypeError,  # a wrong kind; a wrong string is a ValueError
        r"`skip` to be one of .*got None",
    ),
    "update(state=dict)": (
        lambda: jamp.loss_scaling(SGD).update({"w": jnp.ones(2)}, {}, None),
        TypeError,
        r"`state` to be the ScaledOptimizerState.*got dict",
    ),
    # update: gradients, parameters and states that do not match (issue #26)
    "update(grads of other shapes than params)": (
        lambda: jamp.loss_scaling(optax.adam(1e-3)).update(
            {"w": jnp.ones(4)},
            jamp.loss_scaling(optax.adam(1e-3)).init({"w": jnp.ones(3)}),
            {"w": jnp.ones(3)},
        ),
        ValueError,
        (r"gradients and `params` to match", r"\['w'\]: shapes \(4,\) and \(3,\)"),
    ),
    "update(state made for other shapes)": (
        lambda: jamp.loss_scaling(optax.adam(1e-3)).update(
            {"w": jnp.ones(4)}, jamp.loss_scaling(optax.adam(1e-3)).init({"w": jnp.ones(3)})
        ),
        ValueError,
        (r"`state.inner_state` to be the state", r"shapes \(3,\) and \(4,\)", r"tx.init"),
    ),
    "update(state of another optimizer)": (
        lambda: jamp.loss_scaling(optax.adam(1e-3)).update(
            {"w": jnp.ones(3)},
            jamp.loss_scaling(optax.sgd(1e-3, momentum=0.9)).init({"w": jnp.ones(3)}),
            {"w": jnp.ones(3)},
        ),
        ValueError,
        (r"`state.inner_state` to be the state that the optimizer's init made", r"structure"),
    ),
    # issue #35: a Python int gradient (10**400 raised OverflowError inside optax; 3 reached
    # the optimizer neither unscaled nor checked), as check_gradients refuses it
    "update(10**400 gradients)": (
        lambda: SGD_LS.update({"w": 10**400}, SGD_LS.init({"w": 1.0}), {"w": 1.0}),
        TypeError,
        (
            r"^`jamp.loss_scaling\(...\).update` expected the gradients to be floating arrays",
            r"Python int at path \['w'\] \(an integer of 401 digits\)",
        ),
    ),
    "update(10**400 gradients), no params": (
        lambda: SGD_LS.update({"w": 10**400}, SGD_LS.init({"w": 1.0})),
        TypeError,
        r"the gradients to be floating arrays.*Python int at path \['w'\]",
    ),
    "update(10**400 as the gradients)": (
        lambda: SGD_LS.update(10**400, SGD_LS.init(1.0), 1.0),
        TypeError,
        r"the gradients to be floating arrays.*Python int at path <root>",
    ),
    "update(a Python int gradient)": (
        lambda: SGD_LS.update({"w": 3}, SGD_LS.init({"w": 1.0}), {"w": 1.0}),
        TypeError,
        r"the gradients to be floating arrays.*Python int at path \['w'\] \(3\)",
    ),
    "update(a Python bool gradient)": (
        lambda: SGD_LS.update({"w": True}, SGD_LS.init({"w": 1.0}), {"w": 1.0}),
        TypeError,
        r"the gradients to be floating arrays.*Python bool at path \['w'\]",
    ),
    "multi_steps update(10**400 gradients)": (
        lambda: jamp.multi_steps(SGD, 2).update(
            {"w": 10**400}, jamp.multi_steps(SGD, 2).init({"w": 1.0}), {"w": 1.0}
        ),
        TypeError,
        r"^`jamp.multi_steps\(...\).update` expected the gradients.*401 digits",
    ),
    "update(skipped_steps=2**40 restored unchecked)": (
        lambda: SGD_LS.update(params0(), _restored(skipped_steps=np.int64(2**40)), params0()),
        ValueError,
        (r"`state.skipped_steps` to be an integer in \[0, 2\*\*31 - 1\]", r"check_restored"),
    ),
    "update(skipped_steps=-5)": (
        lambda: SGD_LS.update(params0(), _restored(skipped_steps=jnp.int32(-5)), params0()),
        ValueError,
        r"`state.skipped_steps`.*got -5",
    ),
    "update(skipped_steps=nan)": (
        lambda: SGD_LS.update(params0(), _restored(skipped_steps=np.float32("nan")), params0()),
        TypeError,
        r"`state.skipped_steps` to be an integer scalar, got .*float32",
    ),
    "update(last_finite='yes')": (
        lambda: SGD_LS.update(params0(), _restored(last_finite="yes"), params0()),
        TypeError,
        r"`state.last_finite` to be a bool scalar, got str",
    ),
    "update(loss_scale=2.0)": (
        lambda: SGD_LS.update(params0(), _restored(loss_scale=2.0), params0()),
        TypeError,
        r"`state.loss_scale` to be a jamp.LossScaleState, got float",
    ),
    # multi_steps
    "multi_steps inner=function": (
        lambda: jamp.multi_steps(optax.sgd, 2),
        TypeError,
        r"`inner`.*sgd.*call it",
    ),
    "multi_steps every_k_schedule=0": (
        lambda: jamp.multi_steps(SGD, 0),
        ValueError,
        r"every_k_schedule=0",
    ),
    "multi_steps every_k_schedule=-2": (
        lambda: jamp.multi_steps(SGD, -2),
        ValueError,
        r"every_k_schedule=-2",
    ),
    "multi_steps every_k_schedule=2.5": (
        lambda: jamp.multi_steps(SGD, 2.5),
        TypeError,
        r"`every_k_schedule`.*2\.5",
    ),
    "multi_steps every_k_schedule=True": (
        lambda: jamp.multi_steps(SGD, True),
        TypeError,
        r"`every_k_schedule`.*True",
    ),
    "multi_steps every_k_schedule=2**31": (
        lambda: jamp.multi_steps(SGD, 2**31),
        ValueError,
        r"`every_k_schedule` to be an integer in \[1, 2\*\*31 - 1\].*2147483648",
    ),
    # issue #35: a function that is no schedule is refused where multi_steps is built, not
    # at the first update with "unsupported operand type(s) for -"
    "multi_steps every_k_schedule=optax.sgd": (
        lambda: jamp.multi_steps(SGD, every_k_schedule=optax.sgd),
        TypeError,
        (
            r"^Expected `every_k_schedule` to be an integer >= 1 or a function of the step "
            r"count returning one, got sgd, which returned GradientTransformation",
            r"an optimizer is no schedule",
        ),
    ),
    "multi_steps every_k_schedule=list": (
        lambda: jamp.multi_steps(SGD, every_k_schedule=list),
        TypeError,
        r"^Expected `every_k_schedule`.*got list, which raised TypeError",
    ),
    "multi_steps every_k_schedule=lambda: 2": (
        lambda: jamp.multi_steps(SGD, every_k_schedule=lambda: 2),
        TypeError,
        r"^Expected `every_k_schedule`.*which raised TypeError given the step count 0",
    ),
    "multi_steps every_k_schedule returns an array": (
        lambda: jamp.multi_steps(SGD, every_k_schedule=lambda step: jnp.full(2, 4)),
        TypeError,
        r"^Expected `every_k_schedule`.*returned ArrayImpl of shape \(2,\)",
    ),
    "multi_steps every_k_schedule returns 0": (
        lambda: jamp.multi_steps(SGD, every_k_schedule=lambda step: step),
        ValueError,
        r"^Expected `every_k_schedule`.*returned 0\.0 micro-steps",
    ),
    "multi_steps accumulator_dtype=int32": (
        lambda: jamp.multi_steps(SGD, 2, accumulator_dtype=jnp.int32),
        TypeError,
        r"`accumulator_dtype` to be None or a floating dtype",
    ),
    "multi_steps accumulator_dtype=bool": (
        lambda: jamp.multi_steps(SGD, 2, accumulator_dtype=bool),
        TypeError,
        r"`accumulator_dtype`.*integer or boolean accumulator",
    ),
    "multi_steps accumulator_dtype='abc'": (
        lambda: jamp.multi_steps(SGD, 2, accumulator_dtype="abc"),
        TypeError,
        r"`accumulator_dtype`.*'abc'",
    ),
    "multi_steps should_skip_update_fn=3": (
        lambda: jamp.multi_steps(SGD, 2, should_skip_update_fn=3),
        TypeError,
        r"`should_skip_update_fn` to be None or a function",
    ),
    "multi_steps use_grad_mean='yes'": (
        lambda: jamp.multi_steps(SGD, 2, use_grad_mean="yes"),
        TypeError,
        r"`use_grad_mean` to be a bool, got use_grad_mean='yes'",
    ),
    "multi_steps update(state=dict)": (
        lambda: jamp.multi_steps(SGD, 2).update(params0(), {}),
        TypeError,
        r"`state` to be the optax.MultiStepsState.*got dict",
    ),
    "multi_steps update(state made for other shapes)": (
        lambda: jamp.multi_steps(SGD, 2).update(
            {"w": jnp.ones(4)}, jamp.multi_steps(SGD, 2).init({"w": jnp.ones(3)})
        ),
        ValueError,
        (r"gradients to match `state.acc_grads`", r"shapes \(4,\) and \(3,\)"),
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])
