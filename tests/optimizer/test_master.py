"""``jamp.master_weights``: bfloat16 parameters with an exact, stochastic, compensated or
no master, through a plain ``optax.apply_updates`` under strict dtype promotion."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _bad_input import assert_clear_error

import jamp
from jamp._src.optimizer import rounding as R

BF16 = jnp.bfloat16
ROUNDINGS = ("exact", "stochastic", "kahan", "nearest")


def _bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _step(tx, jit=True):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    return jax.jit(step) if jit else step


def _grads(t, like, scale=1.0):
    key = jax.random.fold_in(jax.random.key(42), t)
    return jax.tree.map(lambda x: scale * jax.random.normal(key, x.shape, jnp.float32), like)


# ---------------------------------------------------------------- exact


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_exact_moves_the_master_as_float32_does_except_where_no_update_reaches(jit):
    """Given the same gradients, the exact master is float32 sgd's parameter bit for bit,
    at every step and element, but where a parameter lands nearer zero than its step is
    long and no bfloat16 update can land it there (checked here independently, with
    ml_dtypes): there the master restarts where ``apply_updates`` lands. sgd with a
    power-of-two rate: the float32 arithmetic of both programs is the same."""
    lr = 2.0**-7
    ref = {"w": 0.05 * jax.random.normal(jax.random.key(0), (4096,), jnp.float32)}
    ref = jax.tree.map(lambda x: x.astype(BF16).astype(jnp.float32), ref)
    params = jax.tree.map(lambda x: x.astype(BF16), ref)
    tx = jamp.master_weights(optax.sgd(lr))
    state = tx.init(params)
    step = _step(tx, jit)
    plain = _step(optax.sgd(lr), jit)
    plain_state = optax.sgd(lr).init(ref)
    restarts = 0
    for t in range(30):
        g32 = _grads(t, ref, 0.2)
        grads = jax.tree.map(lambda g: g.astype(BF16), g32)
        wide = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        p_old = np.asarray(params["w"])
        params, state, updates = step(params, state, grads)
        ref, plain_state, _ = plain(ref, plain_state, wide)
        # What apply_updates can reach from the old bfloat16 parameter, in numpy.
        target = np.asarray(R.split(ref["w"])[0])
        u = (target.astype(np.float32) - p_old.astype(np.float32)).astype(ml_dtypes.bfloat16)
        landed = (p_old.astype(np.float32) + u.astype(np.float32)).astype(ml_dtypes.bfloat16)
        missed = _bits(landed) != _bits(target)
        restarts += int(missed.sum())
        want = np.asarray(ref["w"]).copy()
        want[missed] = landed[missed].astype(np.float32)
        ref = {"w": jnp.asarray(want)}
        master = R.merge(params["w"], state.residual["w"])
        assert np.array_equal(_bits(master), _bits(want)), t
        assert np.array_equal(_bits(params["w"]), _bits(R.split(master)[0])), t
        assert updates["w"].dtype == BF16 and params["w"].dtype == BF16
    assert 0 < restarts < 0.01 * 30 * 4096, restarts  # measured: a few per step, near zero


def _regression(n=256, d=32, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (n, d), jnp.float32).astype(BF16)
    y = x.astype(jnp.float32) @ jax.random.normal(k2, (d, 4), jnp.float32)
    # Weights far from zero: no parameter lands near it, so no update misses.
    w = 1.0 + 0.25 * jax.random.uniform(k3, (d, 4), jnp.float32)
    return x, y, w


def _loss(w, x, y):
    out = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return jnp.mean((out - y) ** 2)


def _round_ties_away(master):
    """float32 to bfloat16, to nearest with ties away from zero, in numpy."""
    bits = _bits(master)
    high = ((bits & 0x7FFFFFFF) + 0x8000) >> 16 | (bits & 0x80000000) >> 16
    return jnp.asarray(high.astype(np.uint16).view(ml_dtypes.bfloat16))


def test_exact_training_is_bit_identical_to_classic_mixed_precision():
    """A whole training run, forward included: classic mixed precision (a float32 master,
    the forward at its bfloat16 rounding, sgd with a power-of-two rate) and the exact
    recipe (bfloat16 parameters and low bits) give the same losses, gradients and masters
    bit for bit, step after step. The rounding is the recipe's, to nearest with ties away
    from zero: this run has masters on ties, where a cast (ties to even) differs for half
    of them, and the test counts them so that the rule is exercised."""
    x, y, w0 = _regression()
    lr = 2.0**-9
    grad = jax.jit(jax.value_and_grad(_loss))
    master = w0.astype(BF16).astype(jnp.float32)
    tx = jamp.master_weights(optax.sgd(lr))
    params = master.astype(BF16)
    state = tx.init(params)
    step = _step(tx)
    ties = 0
    for t in range(60):
        loss_ref, g_ref = grad(_round_ties_away(master), x, y)
        descent = jax.tree.map(lambda g: -lr * g, g_ref.astype(jnp.float32))
        master = optax.apply_updates(master, descent)
        loss, g = grad(params, x, y)
        params, state, _ = step(params, state, g)
        assert _bits(loss) == _bits(loss_ref) and np.array_equal(_bits(g), _bits(g_ref)), t
        assert np.array_equal(_bits(R.merge(params, state.residual)), _bits(master)), t
        assert np.array_equal(_bits(params), _bits(_round_ties_away(master))), t
        ties += int(((_bits(master) & 0xFFFF) == 0x8000).sum())
    assert ties > 0


def test_exact_keeps_what_sub_ulp_steps_add_up_to():
    """Steps of 2**-12, far below half a bfloat16 ulp of 1.0 (2**-8): the parameter
    moves once they add up, exactly as float32 would have it."""
    params = {"w": jnp.ones((3,), BF16)}
    tx = jamp.master_weights(optax.sgd(2.0**-12))
    state = tx.init(params)
    step = _step(tx)
    for _ in range(16):
        params, state, _ = step(params, state, {"w": jnp.ones((3,), BF16)})
    master = R.merge(params["w"], state.residual["w"])
    assert float(master[0]) == 1 - 16 * 2.0**-12
    assert float(params["w"][0]) == 0.99609375  # 1 - 2**-8


# ---------------------------------------------------------------- the other recipes


def _drift(rounding, steps=64, n=20000, seed=0):
    """Parameters at 1.0 after ``steps`` sgd steps of 2**-12 each, with ``rounding``."""
    params = {"w": jnp.ones((n,), BF16)}
    tx = jamp.master_weights(optax.sgd(2.0**-12), rounding=rounding, seed=seed)
    state = tx.init(params)
    step = _step(tx)
    for _ in range(steps):
        params, state, _ = step(params, state, {"w": jnp.ones((n,), BF16)})
    return params, state


def test_nearest_stalls_where_stochastic_is_unbiased_and_kahan_keeps_the_rest():
    """Below half an ulp, to-nearest never moves; stochastic rounding moves on average
    exactly as float32 does (within its standard error); Kahan's parameter plus its
    compensation is the float32 value."""
    want = 1 - 64 * 2.0**-12
    p, state = _drift("nearest")
    assert (np.asarray(p["w"], np.float32) == 1.0).all() and state.residual["w"] is None
    p, state = _drift("stochastic")
    values = np.asarray(p["w"], np.float64)
    assert len(np.unique(values)) > 2  # it moved, up and down by whole ulps
    assert abs(values.mean() - want) < 5 * values.std() / np.sqrt(values.size)
    assert int(state.rounding_count) == 64
    p, state = _drift("kahan")
    total = np.asarray(p["w"], np.float32) + np.asarray(state.residual["w"], np.float32)
    assert np.allclose(total, want, rtol=0, atol=2.0**-16)
    assert state.residual["w"].dtype == BF16


def test_stochastic_is_reproducible_from_its_seed():
    a, _ = _drift("stochastic", steps=8, n=4096, seed=3)
    b, _ = _drift("stochastic", steps=8, n=4096, seed=3)
    c, _ = _drift("stochastic", steps=8, n=4096, seed=4)
    assert np.array_equal(_bits(a["w"]), _bits(b["w"]))
    assert not np.array_equal(_bits(a["w"]), _bits(c["w"]))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
def test_float16_parameters_work_with_the_recipes_that_fit_them(rounding):
    """float16 parameters: the stochastic, Kahan and nearest recipes round into float16,
    and the updates are float16, so apply_updates keeps the dtype."""
    params = {"w": jnp.ones((4096,), jnp.float16)}
    tx = jamp.master_weights(optax.sgd(2.0**-14), rounding=rounding)
    state = tx.init(params)
    step = _step(tx)
    for _ in range(32):
        params, state, updates = step(params, state, {"w": jnp.ones((4096,), jnp.float16)})
    assert params["w"].dtype == updates["w"].dtype == jnp.float16
    mean = float(jnp.mean(params["w"].astype(jnp.float32)))
    if rounding == "nearest":  # 2**-14 is below half float16's ulp at 1.0 (2**-11)
        assert mean == 1.0
    else:
        assert abs(mean - (1 - 32 * 2.0**-14)) < 2.0**-11 / 8


def test_exact_refuses_float16_parameters_and_says_which_recipe_to_use():
    tx = jamp.master_weights(optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"rounding='exact'.*float16.*rounding='kahan'"):
        tx.init({"w": jnp.ones(3, jnp.float16)})


def test_float32_leaves_are_their_own_master_and_pass_through():
    """A float32 leaf beside bfloat16 ones (a norm's scale) gets the inner optimizer's
    update unchanged, bit for bit, and holds no residual."""
    params = {"w": jnp.ones((8, 8), BF16), "scale": jnp.linspace(0.5, 1.5, 8)}
    tx = jamp.master_weights(optax.sgd(0.1, momentum=0.9), rounding="kahan")
    state = tx.init(params)
    plain = optax.sgd(0.1, momentum=0.9)
    plain_state = plain.init({"scale": params["scale"]})
    for t in range(3):
        g = _grads(t, {"w": params["w"], "scale": params["scale"]})
        grads = {"w": g["w"].astype(BF16), "scale": g["scale"]}
        updates, state = tx.update(grads, state, params)
        want, plain_state = plain.update({"scale": g["scale"]}, plain_state, params)
        assert np.array_equal(_bits(updates["scale"]), _bits(want["scale"]))
        params = optax.apply_updates(params, updates)
    assert state.residual["scale"] is None and state.residual["w"].dtype == BF16


@pytest.mark.standard_promotion
def test_adamw_sees_a_float32_master_and_float32_gradients():
    """The inner optimizer's state is made for float32 parameters (adam's moments are
    float32), and its updates are float32 before the wrapper rounds them."""
    seen = []

    def record(updates, state, params=None):
        seen.append({jnp.dtype(x.dtype) for x in jax.tree.leaves((updates, params))})
        return updates, state

    inner = optax.chain(
        optax.GradientTransformation(lambda p: optax.EmptyState(), record), optax.adamw(1e-3)
    )
    tx = jamp.master_weights(inner)
    params = {"w": jnp.ones((16,), BF16)}
    state = tx.init(params)
    assert {x.dtype for x in jax.tree.leaves(state.optimizer_state) if x.ndim} == {
        jnp.dtype(jnp.float32)
    }
    params, state, updates = _step(tx)(params, state, {"w": jnp.ones((16,), BF16)})
    # exact's updates are float32 under standard promotion (adam needs it here)
    assert seen == [{jnp.dtype(jnp.float32)}] and updates["w"].dtype == jnp.float32
    assert params["w"].dtype == BF16


# ---------------------------------------------------------------- bad input


def test_bad_arguments_are_refused_at_construction_naming_them():
    with pytest.raises(
        ValueError, match=r"`rounding`.*'exact', 'stochastic', 'kahan', 'nearest'.*'up'"
    ):
        jamp.master_weights(optax.sgd(0.1), rounding="up")
    with pytest.raises(TypeError, match=r"`rounding`"):
        jamp.master_weights(optax.sgd(0.1), rounding=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`seed`"):
        jamp.master_weights(optax.sgd(0.1), seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`seed`.*2\*\*32"):
        jamp.master_weights(optax.sgd(0.1), seed=-1)
    with pytest.raises(TypeError, match=r"`inner`.*optax.sgd\(0.1\), not optax.sgd"):
        jamp.master_weights(optax.sgd)  # type: ignore[arg-type]


def test_bad_steps_are_refused_with_the_fix():
    tx = jamp.master_weights(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"no.*|got none.*param_dtype=jnp.bfloat16"):
        tx.init({"w": jnp.ones(3)})
    params = {"w": jnp.ones(3, BF16)}
    state = tx.init(params)
    with pytest.raises(
        ValueError, match=r"expected `params`, got None.*tx.update\(grads, state, params\)"
    ):
        tx.update(params, state)
    with pytest.raises(TypeError, match=r"MasterWeightsState"):
        tx.update(params, optax.sgd(0.1).init(params), params)
    with pytest.raises(ValueError, match=r"shape"):
        tx.update({"w": jnp.ones(4, BF16)}, state, params)


@pytest.mark.parametrize("rounding", ["exact", "kahan", "stochastic", "nearest"])
def test_master_params_reads_the_master_out_of_any_optimizer_state(rounding):
    """Inside loss_scaling and a chain: exact gives the master bit for bit, Kahan the
    parameter plus compensation, the others the parameters widened; float32 leaves as
    they are. A state with no master, or two, is refused."""
    params = {"w": jnp.ones((64,), BF16), "s": jnp.ones((2,))}
    inner = jamp.master_weights(optax.sgd(2.0**-12), rounding=rounding)
    tx = jamp.loss_scaling(optax.chain(optax.identity(), inner), jamp.no_loss_scale())
    state = tx.init(params)
    for t in range(5):
        grads = {"w": jnp.full((64,), 1.0 + t, BF16), "s": jnp.ones((2,))}
        updates, state = jax.jit(tx.update)(grads, state, params)
        params = optax.apply_updates(params, updates)
    got = jamp.optimizer.master_params(params, state)
    assert got["w"].dtype == jnp.float32 and got["s"] is params["s"]
    exact = 1 - (1 + 2 + 3 + 4 + 5) * 2.0**-12
    if rounding == "exact":
        assert (np.asarray(got["w"]) == np.float32(exact)).all()
    elif rounding == "kahan":
        assert np.allclose(got["w"], exact, atol=2.0**-16, rtol=0)
    else:
        assert np.array_equal(np.asarray(got["w"]), np.asarray(params["w"], np.float32))
    with pytest.raises(ValueError, match=r"one MasterWeightsState.*found 0"):
        jamp.optimizer.master_params(params, optax.sgd(0.1).init(params))
    with pytest.raises(ValueError, match=r"found 2"):
        jamp.optimizer.master_params(params, (state, state))


# ---------------------------------------------------------------- exact's float32 updates


def _diabetes():
    """scikit-learn's diabetes regression, standardised: 442 samples, 10 features."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x = jnp.asarray((x - x.mean(0)) / x.std(0), jnp.float32)
    y = jnp.asarray(((y - y.mean()) / y.std())[:, None], jnp.float32)
    return x, y


@pytest.mark.standard_promotion  # float32 updates: optax.apply_updates adds bf16 + f32
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_exact_holds_the_parameters_to_a_float32_masters_rounding_at_every_step(jit):
    """A linear regression on the diabetes data from zero weights, sgd(2**-6): the
    bfloat16 parameters are, at every step (2,000 under jit, 30 eagerly), the rounding
    (to nearest, ties away from zero) of a float32 master updated by hand with the same
    gradients, and parameter and low bits are that master, bit for bit. The float32
    arithmetic is the same: ``m + (-lr) * g`` with a power-of-two rate, once each step.
    With bfloat16 updates the parameters left the master's rounding at step 18, where a
    weight's step was larger than where it landed."""
    x, y = _diabetes()

    def loss(p):
        out = x @ p["w"].astype(jnp.float32) + p["b"].astype(jnp.float32)[None, :]
        return jnp.mean((out - y) ** 2)

    lr = 2.0**-6
    tx = jamp.master_weights(optax.sgd(lr))
    grad = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
    step = _step(tx, jit)
    params = {"w": jnp.zeros((10, 1), BF16), "b": jnp.zeros((1,), BF16)}
    state = tx.init(params)
    master = {n: np.zeros(p.shape, np.float32) for n, p in params.items()}
    for t in range(2000 if jit else 30):
        g = grad(params)
        params, state, updates = step(params, state, g)
        master = {n: m + np.float32(-lr) * np.asarray(g[n], np.float32) for n, m in master.items()}
        for n, m in master.items():
            assert updates[n].dtype == jnp.float32 and params[n].dtype == BF16
            np.testing.assert_array_equal(_bits(params[n]), _bits(_round_ties_away(m)), str(t))
            np.testing.assert_array_equal(_bits(R.merge(params[n], state.residual[n])), _bits(m))
    assert int(state.restarted_steps) == 0
    assert float(loss(params)) < (0.49 if jit else 0.6)  # it trained


@pytest.mark.parametrize("promotion", ["standard", "strict"])
def test_exact_updates_are_float32_where_apply_updates_can_add_them(promotion):
    """Under standard promotion exact's updates are float32 (``optax.apply_updates`` adds
    ``bfloat16 + float32`` in float32 and casts the sum back); strict promotion refuses
    that add, so there they are bfloat16, as the other recipes' always are."""
    params = {"w": jnp.ones((4,), BF16)}
    grads = {"w": jnp.full((4,), 3.0, BF16)}
    with jax.numpy_dtype_promotion(promotion):
        for rounding in ROUNDINGS:
            tx = jamp.master_weights(optax.sgd(2.0**-10), rounding=rounding)
            for update in (tx.update, jax.jit(tx.update)):
                updates, _ = update(grads, tx.init(params), params)
                wide = rounding == "exact" and promotion == "standard"
                assert updates["w"].dtype == (jnp.float32 if wide else BF16), rounding
                assert optax.apply_updates(params, updates)["w"].dtype == BF16


@pytest.mark.standard_promotion
def test_an_add_that_widens_the_parameters_is_refused_at_the_next_step():
    """``eqx.apply_updates`` is ``p + u``: with exact's float32 updates it makes the
    parameters float32, which the next update refuses, naming the parameter and the add
    that casts back (the state's master would silently stop being used)."""
    import equinox as eqx

    params = {"w": jnp.ones((4,), BF16)}
    tx = jamp.master_weights(optax.sgd(2.0**-10))
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.ones((4,), BF16)}, state, params)
    widened = eqx.apply_updates(params, updates)
    assert widened["w"].dtype == jnp.float32
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(TypeError, match=r"`params\['w'\]` to be bfloat16.*optax.apply_updates"):
            update({"w": jnp.ones((4,), jnp.float32)}, state, widened)


# ---------------------------------------------------------------- the last of a chain


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("rounding", ["exact", "kahan"])
def test_a_transformation_chained_after_master_weights_counts_restarts(rounding, jit):
    """``chain(master_weights(sgd(2**-10)), scale(0.5))`` from 1.0 with gradient 1: the
    halved update of step 3 lands back on 1.0, not where the master's rounding is. The
    master's low bits belonged to that rounding, and merged with 1.0 they put the master
    at 1.00098, above its start, while sgd descends. Now the next step counts a restart
    (``restarted_steps``, in ``jamp.metrics``) and the master restarts at the parameter:
    it never rises above 1.0. Alone, master_weights counts none."""
    params0 = {"w": jnp.ones((8,), BF16)}
    grads = {"w": jnp.ones((8,), BF16)}
    for chained in (True, False):
        inner = jamp.master_weights(optax.sgd(2.0**-10), rounding=rounding)
        tx = optax.chain(inner, optax.scale(0.5)) if chained else inner
        params, state = params0, tx.init(params0)
        step = _step(tx, jit)
        for _ in range(12):
            params, state, _ = step(params, state, grads)
            mw = state[0] if chained else state
            master = jamp.optimizer.master_params(params, state)["w"]
            assert float(jnp.max(master)) <= 1.0
        restarts = int(jamp.metrics(state)["restarted_steps"])
        assert restarts == int(mw.restarted_steps)
        assert restarts >= 3 if chained else restarts == 0, (chained, restarts)


def test_master_weights_around_loss_scaling_is_refused():
    """``master_weights(loss_scaling(adamw))``, the order the docs warn against, was taken
    without a word (a skipped step advanced the rounding counter): init refuses it."""
    params = {"w": jnp.ones((4,), BF16)}
    tx = jamp.master_weights(jamp.loss_scaling(optax.sgd(0.1)), rounding="stochastic")
    for init in (tx.init, jax.jit(tx.init)):
        with pytest.raises(
            ValueError,
            match=r"`inner`.*jamp.loss_scaling.*`jamp.loss_scaling\(jamp.master_weights\(inner\)\)`",
        ):
            init(params)
    with pytest.raises(ValueError, match=r"jamp.loss_scaling"):
        jamp.master_weights(optax.chain(optax.clip(1.0), jamp.loss_scaling(optax.sgd(0.1)))).init(
            params
        )
    jamp.loss_scaling(jamp.master_weights(optax.sgd(0.1))).init(params)


# ---------------------------------------------------------------- bad state


def _update_with(rounding="exact", params=None, inner=None, state_params=None, **replace):
    """``tx.update`` of ``master_weights(inner)`` on ``params`` with the state from init
    (of ``state_params``, if given) with its fields ``replace``d."""
    params = {"w": jnp.ones((4, 3), BF16)} if params is None else params
    tx = jamp.master_weights(optax.sgd(0.1) if inner is None else inner, rounding=rounding)
    state = tx.init(params if state_params is None else state_params)._replace(**replace)
    grads = jax.tree.map(jnp.ones_like, params)

    def update():
        # JAX's default rank promotion: a state of other shapes would broadcast silently.
        with jax.numpy_rank_promotion("allow"):
            return tx.update(grads, state, params)

    return update


def _other_grads():
    params = {"w": jnp.ones((4, 3), BF16)}
    tx = jamp.master_weights(optax.sgd(0.1))
    return lambda: tx.update([jnp.ones((4, 3), BF16)], tx.init(params), params)


_MOMENTUM = optax.sgd(0.1, momentum=0.9)
_W3 = {"w": jnp.ones((3,), BF16)}

BAD_INPUT = {
    "gradients of another structure": (
        _other_grads(),
        ValueError,
        r"`jamp.master_weights\(...\).update` expected the gradients and `params` to match",
    ),
    "inner state of other shapes": (
        _update_with("stochastic", inner=_MOMENTUM, state_params=_W3),
        ValueError,
        r"`state.optimizer_state`.*different shapes at .*\(3,\) and \(4, 3\)",
    ),
    "residual of another shape": (
        _update_with(residual={"w": jnp.zeros((3,), jnp.int16)}),
        ValueError,
        r"`state.residual\['w'\]` to have the parameter's shape \(4, 3\), got \(3,\)",
    ),
    "state for other parameters": (
        _update_with(inner=_MOMENTUM, state_params=_W3),
        ValueError,
        r"`state.residual\['w'\]` to have the parameter's shape",
    ),
    "residual of another dtype": (
        _update_with(residual={"w": jnp.zeros((4, 3), jnp.float32)}),
        TypeError,
        r"`state.residual\['w'\]` to be a int16 array.*float32",
    ),
    "residual missing": (
        _update_with("kahan", residual={"w": None}),
        TypeError,
        r"`state.residual\['w'\]` to be a bfloat16 array.*got None",
    ),
    "residual of another tree": (
        _update_with(residual=[jnp.zeros((4, 3), jnp.int16)]),
        ValueError,
        r"`state.residual` to be shaped as `params`",
    ),
    "rounding_count None, stochastic": (
        _update_with("stochastic", rounding_count=None),
        TypeError,
        r"`state.rounding_count` to be a uint32 scalar.*got None",
    ),
    "rounding_count, exact": (
        _update_with(rounding_count=jnp.zeros((), jnp.uint32)),
        TypeError,
        r"`state.rounding_count` to be None",
    ),
    "restarted_steps None": (
        _update_with(restarted_steps=None),
        TypeError,
        r"`state.restarted_steps` to be a int32 scalar.*got None",
    ),
    "params_checksum of another tree": (
        _update_with(params_checksum={"v": jnp.zeros((), jnp.uint32)}),
        ValueError,
        r"`state.params_checksum` to be shaped as `params`",
    ),
    "float32 parameters for a bfloat16 state": (
        _update_with(params={"w": jnp.ones((4, 3))}, state_params={"w": jnp.ones((4, 3), BF16)}),
        TypeError,
        r"`params\['w'\]` to be bfloat16.*got float32.*optax.apply_updates",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])


def test_bad_state_is_refused_while_traced_too():
    """The checks read shapes, dtypes and structures: under jit they raise at trace time,
    naming the same argument, before anything reaches the optimizer."""
    params = {"w": jnp.ones((4, 3), BF16)}
    tx = jamp.master_weights(optax.sgd(0.1))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    bad = state._replace(residual={"w": jnp.zeros((3,), jnp.int16)})
    with pytest.raises(ValueError, match=r"`state.residual\['w'\]` to have the parameter's shape"):
        jax.jit(tx.update)(grads, bad, params)
    with pytest.raises(ValueError, match=r"expected the gradients and `params` to match"):
        jax.jit(tx.update)([grads["w"]], state, params)
    stochastic = jamp.master_weights(optax.sgd(0.1), rounding="stochastic")
    bad = stochastic.init(params)._replace(rounding_count=None)
    with pytest.raises(TypeError, match=r"`state.rounding_count` to be a uint32 scalar"):
        jax.jit(stochastic.update)(grads, bad, params)
