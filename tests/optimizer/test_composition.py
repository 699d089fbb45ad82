"""jamp.master_weights and jamp.low_precision_state composed with the rest of a train step
(issue #33): inside jamp.loss_scaling, around gradient clipping, with gradient
accumulation, in Flax, NNX and Equinox, sharded over 8 devices, through an orbax
checkpoint, under donation, and reproducible from their seeds.

Every comparison is bit for bit (a -0.0 is not a 0.0) unless a comment says why not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jamp
from jamp._src.optimizer.rounding import merge
from jamp.optimizer import BlockQuantized, LowPrecisionState, MasterWeightsState

F32, BF16 = jnp.float32, jnp.bfloat16


# ---------------------------------------------------------------- the shared problem


def params0():
    """A two-layer model's parameters: bfloat16 but for a float32 output scale (its own
    master). ``w1`` has 5,120 elements, enough for 8-bit moments (4,096 and up)."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    return {
        "w1": (0.1 * jax.random.normal(k1, (64, 80))).astype(BF16),
        "b1": (0.1 * jax.random.normal(k2, (80,))).astype(BF16),
        "w2": (0.1 * jax.random.normal(k3, (80, 4))).astype(BF16),
        "scale": jnp.ones((4,), F32),
    }


X = jax.random.normal(jax.random.PRNGKey(1), (16, 64))
Y = jax.random.normal(jax.random.PRNGKey(2), (16, 4))


def loss_fn(p, x, y=Y):
    h = jnp.tanh(x @ p["w1"].astype(F32) + p["b1"].astype(F32)[None, :])
    return jnp.mean(((h @ p["w2"].astype(F32)) * p["scale"][None, :] - y) ** 2)


def grad_steps(n, params, scale=0.01, seed=3):
    """``n`` gradient trees of random values, typed like ``params``: what an optimizer sees,
    without a forward pass whose sums could be reordered by a sharded program."""
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    return [
        jax.tree.map(lambda p, k=k: (scale * jax.random.normal(k, p.shape)).astype(p.dtype), params)
        for k in keys
    ]


def jitted_step(tx):
    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    return step


def run(tx, params, grads):
    """Every ``(params, state)`` of a jitted run of ``tx`` over ``grads``."""
    step, state, out = jitted_step(tx), jax.jit(tx.init)(params), []
    for g in grads:
        params, state = step(params, state, g)
        out.append((params, state))
    return out


def bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def assert_bits_equal(a, b):
    """Same tree (static fields included), and every leaf of the same dtype, shape and bits."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        where = jax.tree_util.keystr(path)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), where
        assert np.array_equal(bits(x), bits(y)), where


def differing(a, b):
    """How many elements of ``a`` and ``b`` (one structure) differ in their bits."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return sum(int(np.sum(bits(x) != bits(y))) for x, y in pairs)


# ---------------------------------------------------------------- 1. a skipped step keeps every bit


@pytest.mark.standard_promotion  # adamw's bias correction, inside optax
@pytest.mark.parametrize("skip", ["cond", "select"])
@pytest.mark.parametrize("rounding", ["exact", "kahan", "stochastic"])
def test_skipped_step_keeps_parameters_residual_moments_and_counters_bit_for_bit(rounding, skip):
    """Inside jamp.loss_scaling, a non-finite step changes nothing: the bfloat16 parameters,
    the residual (exact's int16 low bits, kahan's compensation), adamw's moments stored
    as bfloat16 (mu) and 8-bit blocks (nu), both stochastic-rounding counters and adam's
    count, bit for bit. The next finite step then gives exactly what it gives when the
    bad batch never came: a counter that advanced on the skip would draw other bits."""
    inner = jamp.low_precision_state(
        optax.adamw(1e-2, weight_decay=0.1), {"mu": BF16, "nu": "8bit"}, seed=5
    )
    tx = jamp.loss_scaling(
        jamp.master_weights(inner, rounding=rounding, seed=7),
        jamp.dynamic_loss_scale(2.0**10),
        skip=skip,
    )

    @jax.jit
    def step(p, s, x):
        ls = jamp.get_loss_scale(s)
        grads = jax.grad(lambda q: jamp.scale(ls, loss_fn(q, x)))(p)
        u, s = tx.update(grads, s, p)
        return optax.apply_updates(p, u), s

    p, s = params0(), tx.init(params0())
    for x in (X, 0.5 * X):
        p, s = step(p, s, x)
    master = s.inner_state
    assert isinstance(master, MasterWeightsState)
    stored = master.optimizer_state
    assert isinstance(stored, LowPrecisionState) and int(stored.storage_count) == 2
    adam = stored.stored_state[0]
    assert adam.mu["w1"].dtype == BF16 and isinstance(adam.nu["w1"], BlockQuantized)
    if rounding == "stochastic":
        assert int(master.rounding_count) == 2
    else:  # a residual of zeros kept would prove nothing
        assert master.residual["w1"].dtype == (jnp.int16 if rounding == "exact" else BF16)
        assert np.any(bits(master.residual["w1"]))

    p_skip, s_skip = step(p, s, X.at[3, 5].set(jnp.inf))
    assert not bool(s_skip.last_finite) and int(s_skip.skipped_steps) == 1
    assert_bits_equal(p_skip, p)
    assert_bits_equal(s_skip.inner_state, s.inner_state)

    # The scale halved on the skip; both scales are powers of two, so the unscaled
    # gradients are the same bits.
    p_next, s_next = step(p_skip, s_skip, 2.0 * X)
    p_ref, s_ref = step(p, s, 2.0 * X)
    assert bool(s_next.last_finite) and differing(p_next, p) > 0
    assert_bits_equal(p_next, p_ref)
    assert_bits_equal(s_next.inner_state, s_ref.inner_state)


# ---------------------------------------------------------------- 2. clipping sees float32


def keep_updates(seen):
    """A transformation that passes its updates through, keeps them in its state (so the
    test can read what the previous transformation gave), and records their dtypes
    in ``seen`` at trace time."""

    def init(params):
        return {"kept": jax.tree.map(jnp.zeros_like, params)}

    def update(updates, state, params=None):
        seen.append(jax.tree.map(lambda u: u.dtype, updates))
        return updates, {"kept": updates}

    return optax.GradientTransformation(init, update)


@pytest.mark.standard_promotion  # adamw's bias correction, inside optax
def test_clip_by_global_norm_in_the_chain_sees_the_float32_gradients():
    """In ``master_weights(optax.chain(optax.clip_by_global_norm(c), ..., optax.adamw))``,
    the clipping gets the gradients widened to float32 and clips them in float32: what
    it hands on is, bit for bit, float32 clipping of the widened gradients, not the
    bfloat16 clipping (a bfloat16 norm and bfloat16 products) that differs from it."""
    seen = []
    clip = optax.clip_by_global_norm(0.05)
    tx = jamp.master_weights(optax.chain(clip, keep_updates(seen), optax.adamw(1e-2)))
    p = params0()
    grads = jax.grad(loss_fn)(p, X)
    assert grads["w1"].dtype == BF16 and grads["scale"].dtype == F32
    wide = jax.tree.map(lambda g: g.astype(F32), grads)
    assert float(optax.tree.norm(wide)) > 0.1  # the clipping is active

    _, state = jax.jit(tx.update)(grads, tx.init(p), p)
    assert seen and all(d == F32 for d in jax.tree.leaves(seen))
    kept = state.optimizer_state[1]["kept"]

    reference = jax.jit(lambda g: clip.update(g, clip.init(g))[0])(wide)
    assert_bits_equal(kept, reference)
    in_bfloat16 = jax.jit(lambda g: clip.update(g, clip.init(g))[0])(grads)
    in_bfloat16 = jax.tree.map(lambda g: g.astype(F32), in_bfloat16)
    assert differing(reference, in_bfloat16) > 0  # the test tells the two apart


# ---------------------------------------------------------------- 3. gradient accumulation


def far_from_zero():
    """bfloat16 parameters in ±[0.5, 1.5]: small steps never cross zero, where "exact"
    may restart its master (see master_weights' docstring)."""

    def away(x):
        if x.dtype == F32:
            return x
        magnitude = 0.5 + jax.random.uniform(jax.random.PRNGKey(4), x.shape)
        return jnp.where(x < 0, -magnitude, magnitude).astype(BF16)

    return jax.tree.map(away, params0())


def master_of(p, residual):
    """The float32 master of "exact": each bfloat16 parameter and its int16 low bits."""
    return jax.tree.map(
        lambda x, r: x if r is None else merge(x, r), p, residual, is_leaf=lambda r: r is None
    )


def assert_moves_every(k, runs, p0):
    """The bfloat16 parameters keep their bits but on every k-th step, when they move."""
    before = p0
    for i, (p, _) in enumerate(runs):
        if (i + 1) % k:
            assert_bits_equal(p, before)
        else:
            assert differing(p, before) > 0
        before = p


@pytest.mark.parametrize("around", ["jamp.multi_steps", "optax.MultiSteps"])
@pytest.mark.standard_promotion  # optax.MultiSteps counts in int32 beside float32
def test_accumulation_around_master_weights_moves_every_k_steps_by_the_mean(around):
    """``jamp.multi_steps(master_weights(sgd), k)`` and ``optax.MultiSteps(...)``: the
    parameters keep their bits for k - 1 steps and then move by one SGD step on the
    mean gradient (Welford's mean of the k bfloat16 gradients in a float32 accumulator,
    handed on in the gradients' bfloat16): the exact master is that float32 step, bit
    for bit. The accumulator is float32 in this order too (optax's
    ``accumulator_dtype``), not the parameters' bfloat16."""
    k, lr = 3, 2.0**-6  # a power of two: lr * g is exact, so there is one rounding
    wrap = jamp.multi_steps if around == "jamp.multi_steps" else optax.MultiSteps
    tx = wrap(jamp.master_weights(optax.sgd(lr), rounding="exact"), k)
    p0 = far_from_zero()
    grads = grad_steps(2 * k, p0)
    runs = run(tx, p0, grads)
    assert_moves_every(k, runs, p0)

    master = jax.tree.map(lambda x: np.asarray(x, np.float32), p0)
    for step in range(2):
        mean = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), p0)
        for n, g in enumerate(grads[step * k : (step + 1) * k]):  # optax's Welford mean
            mean = jax.tree.map(
                lambda m, g, n=n: m + (np.asarray(g, np.float32) - m) / np.float32(n + 1), mean, g
            )
        mean = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(np.float32), mean, p0)
        master = jax.tree.map(lambda m, g: m + np.float32(-lr) * g, master, mean)
        p, s = runs[(step + 1) * k - 1]
        inner = s.inner_opt_state
        assert_bits_equal(master_of(p, inner.residual), master)
    assert {x.dtype for x in jax.tree.leaves(runs[0][1].acc_grads)} == {jnp.dtype(F32)}


@pytest.mark.standard_promotion  # optax.MultiSteps counts in int32 beside float32
def test_optax_multisteps_inside_master_weights_accumulates_in_float32():
    """``master_weights(optax.MultiSteps(sgd, k))``, as jamp.loss_scaling takes a MultiSteps
    for its inner optimizer: the accumulation gets the widened gradients, so the exact
    master is, bit for bit at every step, float32 ``optax.MultiSteps(sgd, k)`` run on the
    float32 parameters, and the bfloat16 parameters move only every k steps. Inside
    ``low_precision_state`` the accumulator stays float32 while the momentum is stored
    bfloat16."""
    k, lr = 3, 2.0**-6
    p0 = far_from_zero()
    grads = grad_steps(2 * k, p0)
    tx = jamp.master_weights(optax.MultiSteps(optax.sgd(lr), k), rounding="exact")
    runs = run(tx, p0, grads)
    assert_moves_every(k, runs, p0)
    reference = run(
        optax.MultiSteps(optax.sgd(lr), k),
        jax.tree.map(lambda x: x.astype(F32), p0),
        [jax.tree.map(lambda x: x.astype(F32), g) for g in grads],
    )
    for (p, s), (want, _) in zip(runs, reference, strict=True):
        assert_bits_equal(master_of(p, s.residual), want)

    stored = jamp.low_precision_state(
        optax.MultiSteps(optax.sgd(lr, momentum=0.9), k), {"trace": BF16}
    )
    runs = run(jamp.master_weights(stored, rounding="stochastic"), p0, grads)
    assert_moves_every(k, runs, p0)
    multi = runs[-1][1].optimizer_state.stored_state
    assert multi.acc_grads["w1"].dtype == F32
    assert multi.inner_opt_state[0].trace["w1"].dtype == BF16


@pytest.mark.parametrize("rounding", ["exact", "stochastic", "kahan", "nearest"])
def test_a_zero_step_keeps_a_minus_zero_parameter_as_float32_optax_does(rounding):
    """A parameter whose gradient is zero (an embedding row not in the batch, under SGD)
    gets the step ``-lr * 0.0 = -0.0``, and float32 optax keeps every bit of it, ``-0.0``
    included. So must the bfloat16 parameter under master_weights, in every rounding: its
    update must be ``-0.0``, since ``p + 0.0`` turns ``-0.0`` into ``0.0``."""
    p = {"w": jnp.array([-0.0, 0.0, 1.0, -1.0], BF16)}
    grads = [{"w": jnp.zeros((4,), BF16)}] * 2
    wide = {"w": p["w"].astype(F32)}
    reference = run(optax.sgd(2.0**-6), wide, [{"w": g["w"].astype(F32)} for g in grads])
    runs = run(jamp.master_weights(optax.sgd(2.0**-6), rounding=rounding), p, grads)
    for (q, _), (want, _) in zip(runs, reference, strict=True):
        assert_bits_equal(want, wide)  # float32 optax keeps -0.0
        assert_bits_equal(q, p)


# ---------------------------------------------------------------- 4. Flax, NNX, Equinox


def sgd_recipe(rounding="stochastic", seed=0, trace=BF16, moment_seed=0):
    """SGD with momentum on a bfloat16 master, its momentum stored narrower: strict-safe."""
    return jamp.master_weights(
        jamp.low_precision_state(
            optax.sgd(2.0**-4, momentum=0.9), {"trace": trace}, seed=moment_seed
        ),
        rounding=rounding,
        seed=seed,
    )


def test_flax_train_state_apply_gradients_matches_the_manual_step():
    """A Linen model with ``param_dtype=bfloat16`` in a ``TrainState`` with
    ``tx=master_weights(...)``: ``apply_gradients`` keeps the parameters bfloat16 and gives
    the manual ``tx.update`` + ``optax.apply_updates`` step, bit for bit, over 3 steps."""
    import flax.linen as nn
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(80, dtype=F32, param_dtype=BF16)(x))
            return nn.Dense(4, dtype=F32, param_dtype=BF16)(h)

    net, tx = Net(), sgd_recipe()
    params = net.init(jax.random.PRNGKey(0), X)
    assert all(x.dtype == BF16 for x in jax.tree.leaves(params))

    def loss(p, x):
        return jnp.mean((net.apply(p, x) - Y) ** 2)

    @jax.jit
    def flax_step(ts, x):
        return ts.apply_gradients(grads=jax.grad(loss)(ts.params, x))

    @jax.jit
    def manual_step(p, s, x):
        u, s = tx.update(jax.grad(loss)(p, x), s, p)
        return optax.apply_updates(p, u), s

    ts = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=tx)
    p, s = params, tx.init(params)
    for x in (X, 0.5 * X, X):
        ts = flax_step(ts, x)
        p, s = manual_step(p, s, x)
    assert isinstance(ts.opt_state, MasterWeightsState) and int(ts.step) == 3
    assert all(x.dtype == BF16 for x in jax.tree.leaves(ts.params))
    assert differing(ts.params, params) > 0
    assert_bits_equal(ts.params, p)
    assert_bits_equal(ts.opt_state, s)


def test_nnx_optimizer_update_matches_the_manual_step():
    """``nnx.Optimizer(model, master_weights(...), wrt=nnx.Param)`` over bfloat16
    ``nnx.Linear`` layers: ``optimizer.update(model, grads)`` under ``nnx.jit`` keeps the
    parameters bfloat16 and gives the manual step on the model's pure state, bit for bit."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(64, 80, dtype=F32, param_dtype=BF16, rngs=rngs)
            self.out = nnx.Linear(80, 4, dtype=F32, param_dtype=BF16, rngs=rngs)

        def __call__(self, x):
            return self.out(jnp.tanh(self.hidden(x)))

    tx = sgd_recipe()
    model = Net(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.as_pure(params)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer, x):
        optimizer.update(model, nnx.grad(lambda m: jnp.mean((m(x) - Y) ** 2))(model))

    def loss(p, x):
        return jnp.mean((nnx.merge(graphdef, p)(x) - Y) ** 2)

    @jax.jit
    def manual_step(p, s, x):
        u, s = tx.update(jax.grad(loss)(p, x), s, p)
        return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    for x in (X, 0.5 * X, X):
        nnx_step(model, optimizer, x)
        p, s = manual_step(p, s, x)
    trained = nnx.as_pure(nnx.state(model, nnx.Param))
    assert all(x.dtype == BF16 for x in jax.tree.leaves(trained))
    assert differing(trained, params) > 0
    assert_bits_equal(trained, p)
    assert_bits_equal(nnx.as_pure(optimizer.opt_state), s)


def test_equinox_bfloat16_mlp_trains_as_its_leaves_do():
    """An ``eqx.nn.MLP(dtype=bfloat16)`` with its state made from ``eqx.filter(model,
    eqx.is_inexact_array)``, its gradients from ``eqx.filter_grad`` and its step from
    ``eqx.apply_updates`` under ``eqx.filter_jit``: the MLP's activation functions are
    no leaves, so the stochastic bits (drawn per leaf index) and every result are those
    of the same step on the plain list of its arrays, bit for bit."""
    import equinox as eqx

    model = eqx.nn.MLP(64, 4, 80, 1, dtype=BF16, key=jax.random.PRNGKey(0))
    tx = sgd_recipe()
    x = X.astype(BF16)

    def loss(m, x):
        return jnp.mean((jax.vmap(m)(x).astype(F32) - Y) ** 2)

    @eqx.filter_jit
    def eqx_step(model, s, x):
        u, s = tx.update(
            eqx.filter_grad(loss)(model, x), s, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, u), s

    leaves, treedef = jax.tree.flatten(eqx.filter(model, eqx.is_inexact_array))
    static = eqx.filter(model, eqx.is_inexact_array, inverse=True)

    @jax.jit
    def list_step(p, s, x):
        g = jax.grad(lambda p: loss(eqx.combine(jax.tree.unflatten(treedef, p), static), x))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    s_eqx, p, s = tx.init(eqx.filter(model, eqx.is_inexact_array)), leaves, tx.init(leaves)
    trained = model
    for xb in (x, x[::-1], x):
        trained, s_eqx = eqx_step(trained, s_eqx, xb)
        p, s = list_step(p, s, xb)
    trained_leaves = jax.tree.leaves(eqx.filter(trained, eqx.is_inexact_array))
    assert all(a.dtype == BF16 for a in trained_leaves)
    assert differing(trained_leaves, leaves) > 0
    assert_bits_equal(trained_leaves, p)
    assert_bits_equal(jax.tree.leaves(s_eqx), jax.tree.leaves(s))


# ---------------------------------------------------------------- 5. sharded over 8 devices


def mesh():
    return Mesh(np.array(jax.devices()), ("x",))


def shard(tree):
    """Every leaf split over the 8 devices on its first axis, but w1 on its second: its
    shards are then no runs of consecutive elements."""
    m = mesh()

    def put(path, x):
        spec = P(None, "x") if jax.tree_util.keystr(path) == "['w1']" else P("x")
        return jax.device_put(x, NamedSharding(m, spec))

    return jax.tree_util.tree_map_with_path(put, tree)


def sharded_params():
    """params0 without its float32 scale (4 elements do not split 8 ways)."""
    return {k: v for k, v in params0().items() if k != "scale"}


@pytest.mark.multidevice
@pytest.mark.parametrize("trace", ["bfloat16", "8bit"])
def test_stochastic_rounding_does_not_depend_on_the_sharding(trace):
    """``master_weights(sgd(momentum=0.9), rounding="stochastic")`` with the momentum
    stored as bfloat16 or in 8-bit blocks (also stochastic): 5 steps with the parameters,
    gradients and state sharded over 8 devices are bit-identical to the single-device
    run, parameters and state. Each element's bits come from its global index (its
    block's, for 8-bit), not its shard's."""
    tx = sgd_recipe(seed=11, moment_seed=12, trace=BF16 if trace == "bfloat16" else trace)
    p0 = sharded_params()
    grads = grad_steps(5, p0)
    single = run(tx, p0, grads)
    sharded = run(tx, shard(p0), [shard(g) for g in grads])
    p, s = sharded[-1]
    assert p["w1"].sharding.spec == P(None, "x") and p["b1"].sharding.spec == P("x")
    stored = s.optimizer_state.stored_state[0].trace
    if trace == "bfloat16":
        assert stored["w2"].sharding.spec == P("x") and stored["w2"].dtype == BF16
    else:
        assert isinstance(stored["w1"], BlockQuantized)
    for i, (a, b) in enumerate(zip(single, sharded, strict=True)):
        assert differing(a, b) == 0, f"step {i + 1}"
    assert_bits_equal(sharded[-1], single[-1])


def where_differing(runs, others):
    """Per parameter, the elements whose bits differ between two runs in any step."""
    out = {}
    for (p, _), (q, _) in zip(runs, others, strict=True):
        for name in p:
            out[name] = out.get(name, False) | (bits(p[name]) != bits(q[name]))
    return out


@pytest.mark.multidevice
@pytest.mark.standard_promotion  # adam's bias correction, inside optax
def test_sharded_adam_recipe_differs_no_more_than_float32_adam():
    """adamw, 4 steps: the sharded and single-device runs of float32 adamw are measured
    against each other, and the recipe's runs (bfloat16 parameters rounded
    stochastically, mu and nu stored bfloat16) differ only where float32 adamw's do.

    The tolerance: both runs get the same gradients, and both draw the same rounding
    bits for an element (hashed from its global index), so given the same float32 inputs
    they round the same way. A difference can only come from float32 adam itself: a
    sharded program that XLA fuses or associates otherwise can give a last-bit-different
    float32 value, which a rounding can then carry to the neighbouring bfloat16 value, at
    that element (adam is elementwise). So the recipe may differ at the elements where
    float32 adamw differs in some step, and nowhere else. On XLA:CPU float32 adamw is
    measured bit-identical under the sharding: the tolerance is zero, and the recipe's
    runs, parameters and state, must be bit-identical too."""
    opt = optax.adamw(1e-2, weight_decay=0.1)
    p0 = sharded_params()
    grads = grad_steps(4, p0)
    wide = jax.tree.map(lambda x: x.astype(F32), p0)
    wide_grads = [jax.tree.map(lambda x: x.astype(F32), g) for g in grads]
    f32_single = run(opt, wide, wide_grads)
    f32_sharded = run(opt, shard(wide), [shard(g) for g in wide_grads])
    assert f32_sharded[-1][0]["w2"].sharding.spec == P("x")
    f32_differs = where_differing(f32_single, f32_sharded)

    tx = jamp.master_weights(jamp.low_precision_state(opt, seed=3), rounding="stochastic", seed=4)
    single = run(tx, p0, grads)
    sharded = run(tx, shard(p0), [shard(g) for g in grads])
    assert sharded[-1][0]["w1"].sharding.spec == P(None, "x")
    recipe_differs = where_differing(single, sharded)
    for name, mask in recipe_differs.items():
        beyond = int(np.sum(mask & ~f32_differs[name]))
        assert beyond == 0, f"{name}: {beyond} elements differ where float32 adamw does not"
    if not any(np.any(m) for m in f32_differs.values()):  # as measured on XLA:CPU
        assert_bits_equal(sharded, single)


# ---------------------------------------------------------------- 6. orbax


@pytest.mark.standard_promotion  # adamw's bias correction, inside optax
def test_orbax_round_trip_of_exact_master_and_8bit_moments_continues_identically(tmp_path):
    """``master_weights(low_precision_state(adamw, mu and nu "8bit"), rounding="exact")``:
    the parameters and state saved with ``ocp.StandardCheckpointer`` and restored into
    the abstract target ``jax.eval_shape(tx.init, params)`` come back bit-identical, the
    ``BlockQuantized`` blocks with their static shape and code, and two more steps from
    the restored state give the same bits as from the original."""
    import orbax.checkpoint as ocp

    inner = jamp.low_precision_state(
        optax.adamw(1e-2, weight_decay=0.1), {"mu": "8bit", "nu": "8bit"}
    )
    tx = jamp.master_weights(inner, rounding="exact")

    @jax.jit
    def step(p, s, x):
        u, s = tx.update(jax.grad(loss_fn)(p, x), s, p)
        return optax.apply_updates(p, u), s

    params = params0()
    p, s = params, tx.init(params)
    for x in (X, 0.5 * X):
        p, s = step(p, s, x)
    nu = s.optimizer_state.stored_state[0].nu["w1"]
    assert isinstance(nu, BlockQuantized) and nu.codes.dtype == jnp.uint8 and nu.code == "positive"

    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {"params": p, "opt_state": s})
    target = {
        "params": jax.eval_shape(lambda: params),
        "opt_state": jax.eval_shape(tx.init, params),
    }
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, target)
    p2, s2 = restored["params"], restored["opt_state"]
    assert isinstance(s2, MasterWeightsState)
    assert_bits_equal((p2, s2), (p, s))
    for x in (2.0 * X, X):
        p, s = step(p, s, x)
        p2, s2 = step(p2, s2, x)
    assert_bits_equal((p2, s2), (p, s))


# ---------------------------------------------------------------- 7. donation


@pytest.mark.parametrize("rounding", ["exact", "stochastic"])
def test_donated_train_states_step_as_undonated_ones(rounding):
    """Two Flax ``TrainState``s made by one ``tx`` (master weights, 8-bit momentum),
    each stepped twice by a ``jit`` that donates it: no donated-buffer error or warning,
    the donated buffers are consumed, and every result equals the undonated step's."""
    from flax.training import train_state

    tx = sgd_recipe(rounding, trace="8bit")

    def step(ts, x):
        return ts.apply_gradients(grads=jax.grad(loss_fn)(ts.params, x))

    def fresh():
        return train_state.TrainState.create(
            apply_fn=None, params=jax.tree.map(jnp.copy, params0()), tx=tx
        )

    plain, donating = jax.jit(step), jax.jit(step, donate_argnums=0)
    reference, a, b = fresh(), fresh(), fresh()
    assert isinstance(a.opt_state.optimizer_state.stored_state[0].trace["w1"], BlockQuantized)
    for x in (X, 0.5 * X):
        given = [leaf for leaf in jax.tree.leaves(a) if isinstance(leaf, jax.Array)]
        reference = plain(reference, x)
        a = donating(a, x)
        b = donating(b, x)
        assert all(leaf.is_deleted() for leaf in given)
        assert_bits_equal(a, reference)
        assert_bits_equal(b, reference)
    assert differing(a.params, params0()) > 0


# ---------------------------------------------------------------- 8. seeds


def test_a_run_is_reproducible_from_its_seeds():
    """Two runs of ``master_weights(low_precision_state(sgd momentum), "stochastic")`` made
    separately with the same seeds are bit-identical. Another ``master_weights`` seed
    rounds the parameters otherwise but stores the same momentum (the gradients are
    fixed, and the two streams are separate); another ``low_precision_state`` seed
    stores another momentum."""
    p0 = params0()
    grads = grad_steps(3, p0)
    first = run(sgd_recipe(seed=1, moment_seed=2), p0, grads)
    again = run(sgd_recipe(seed=1, moment_seed=2), p0, grads)
    assert_bits_equal(again, first)

    def trace(state):
        return state.optimizer_state.stored_state[0].trace

    other_seed = run(sgd_recipe(seed=9, moment_seed=2), p0, grads)
    assert differing(other_seed[0][0], first[0][0]) > 0  # from the first step
    assert_bits_equal(trace(other_seed[0][1]), trace(first[0][1]))

    other_moment_seed = run(sgd_recipe(seed=1, moment_seed=9), p0, grads)
    assert differing(trace(other_moment_seed[0][1]), trace(first[0][1])) > 0
