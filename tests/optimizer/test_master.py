"""``jamp.master_weights``: bfloat16 parameters with an exact, stochastic, compensated or
no master, through a plain ``optax.apply_updates`` under strict dtype promotion."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jamp
from jamp._src.optimizer import rounding as R

BF16 = jnp.bfloat16


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
    assert seen == [{jnp.dtype(jnp.float32)}] and updates["w"].dtype == BF16


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
