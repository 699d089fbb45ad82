"""The contract every jamp Optax wrapper keeps, after optax's ``contrib/_common_test.py``.

Over the four wrappers (``jamp.loss_scaling``, ``jamp.multi_steps``,
``jamp.master_weights``, ``jamp.low_precision_state``), each around plain SGD with
momentum, it checks that:

- extra keyword arguments of ``update`` reach the inner transformation, and a second
  call with them does not recompile;
- an ``optax.inject_hyperparams`` inner works inside: the same updates as the plain
  inner, and its learning rate found and changed through the wrapper's state;
- updates have the parameters' dtype, and the state keeps its dtypes across a step;
- a step keeps the state's tree (structure, shapes, dtypes), so the same step runs
  under ``jit`` and as a ``lax.scan`` body, with the same result;
- ``optax.tree.get`` finds every field of the wrapper's state, and the inner's;
- the step runs with its parameters and state donated (every donated buffer used: a
  buffer XLA cannot reuse is a warning, an error in this suite), with the same result.

The wrapper-specific behaviour is tested beside each wrapper; this file only holds them
to the shape of an Optax transformation.
"""

import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp.optimizer import LowPrecisionState, MasterWeightsState

F32, BF16 = jnp.float32, jnp.bfloat16

# name -> (the wrapper around an inner transformation, the type of its state)
WRAPPERS = {
    "loss_scaling": (
        lambda inner: jamp.loss_scaling(inner, jamp.dynamic_loss_scale(8.0)),
        jamp.ScaledOptimizerState,
    ),
    "multi_steps": (
        lambda inner: jamp.multi_steps(inner, every_k_schedule=2),
        optax.MultiStepsState,
    ),
    "master_weights": (lambda inner: jamp.master_weights(inner), MasterWeightsState),
    "low_precision_state": (
        lambda inner: jamp.low_precision_state(inner, {"trace": BF16}),
        LowPrecisionState,
    ),
}
NAMES = list(WRAPPERS)


def wrap(name, inner):
    return WRAPPERS[name][0](inner)


def params0(name, dtype=None):
    """Two leaves of ``dtype``: float32 by default, bfloat16 for master_weights, whose
    scale stays float32 (its own master; master_weights refuses a tree with no bfloat16
    leaf). The others get one dtype: under strict promotion, ``optax.inject_hyperparams``
    and SGD's momentum refuse to mix a float32 state with bfloat16 gradients."""
    if name == "master_weights":
        dtype, scale = dtype or BF16, F32
    else:
        dtype = scale = dtype or F32
    w = jax.random.normal(jax.random.PRNGKey(0), (4, 8)).astype(dtype)
    return {"w": w, "scale": jnp.ones((8,), scale)}


def loss(params):
    y = params["w"].astype(F32) * params["scale"].astype(F32)[None, :]
    return jnp.sum(jnp.square(y - 1.0))


def grads_of(name, params, state):
    """The gradients the wrapper expects: of the scaled loss under ``loss_scaling``,
    cast to the parameters' dtypes."""
    if name == "loss_scaling":
        g = jax.grad(lambda p: jamp.scale(jamp.get_loss_scale(state), loss(p)))(params)
    else:
        g = jax.grad(loss)(params)
    return jax.tree.map(lambda x, p: x.astype(p.dtype), g, params)


def make_step(name, tx, **extra):
    def step(params, state):
        grads = grads_of(name, params, state)
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state, updates

    return step


def assert_close(a, b):
    """``a`` and ``b`` alike to a few units in the last place of each leaf's largest value:
    two different programs' results (one folds its rates, the other reads them), where
    XLA may contract a product and a sum into one rounding in one program and not in the
    other (XLA:CPU's elemental emitters, the suite's on jax 0.10, did: one unit in the
    last place of a float32 update). Under the fusion emitters they were bit for bit."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        ulp = float(jnp.finfo(x.dtype).eps)
        x, y = np.asarray(x, F32), np.asarray(y, F32)
        np.testing.assert_allclose(x, y, rtol=0, atol=4 * ulp * max(float(np.abs(y).max()), 1.0))


def specs(tree):
    """The tree's structure with each array's shape and dtype."""
    return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), tree)


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, F32), np.asarray(y, F32))


class ValueState(typing.NamedTuple):
    """The recording inner's state: the last ``value`` its update was given."""

    last_value: jax.Array


def recording_inner():
    """SGD with momentum, then a transformation that keeps the ``value`` keyword
    argument of ``update`` (required: a wrapper that drops it fails) in its state and
    accepts any other keyword argument."""

    def init_fn(params):
        del params
        return ValueState(jnp.zeros((), F32))

    def update_fn(updates, state, params=None, *, value, **extra):
        del state, params, extra
        return updates, ValueState(jnp.asarray(value, F32))

    record = optax.GradientTransformationExtraArgs(init_fn, update_fn)
    return optax.chain(optax.sgd(0.1, momentum=0.9), record)


@pytest.mark.parametrize("name", NAMES)
def test_extra_args_reach_the_inner_transformation(name):
    tx = wrap(name, recording_inner())
    extra = {"value": jnp.float32(3.0), "unexpected_extra_args_your_optimizer_doesnt_expect": 1}
    step = jax.jit(make_step(name, tx, **extra))
    params = params0(name)
    state = tx.init(params)
    # Two steps: multi_steps runs the inner at the second (every_k_schedule=2).
    for _ in range(2):
        params, state, _ = step(params, state)
    assert float(optax.tree.get(state, "last_value")) == 3.0
    cached = step._cache_size()
    step(params, state)
    assert step._cache_size() == cached, "the step recompiled on its second call"


@pytest.mark.parametrize("name", NAMES)
def test_inject_hyperparams_inside(name):
    wrapper = WRAPPERS[name][0]
    if name == "low_precision_state":
        # Its stochastic rounding draws each leaf's bits from the leaf's place among the
        # state's floating leaves, and the injected hyperparameters are leaves before the
        # momentum: round to nearest, for updates that must match bit for bit.
        def wrapper(inner):
            return jamp.low_precision_state(inner, {"trace": BF16}, rounding="nearest")

    plain = wrapper(optax.sgd(0.1, momentum=0.9))
    injected = wrapper(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9))
    params = params0(name)
    s_plain, s_inj = plain.init(params), injected.init(params)
    step_plain, step_inj = jax.jit(make_step(name, plain)), jax.jit(make_step(name, injected))
    p_plain = p_inj = params
    for _ in range(2):
        p_plain, s_plain, u_plain = step_plain(p_plain, s_plain)
        p_inj, s_inj, u_inj = step_inj(p_inj, s_inj)
        assert_close(u_inj, u_plain)
    assert_close(p_inj, p_plain)

    # The injected learning rate is found through the wrapper's state, and setting it
    # changes the next step: a zero learning rate leaves the parameters where they are.
    assert float(optax.tree.get(s_inj, "learning_rate")) == pytest.approx(0.1)
    s_zero = optax.tree.set(s_inj, learning_rate=jnp.zeros((), F32))
    for _ in range(2):  # multi_steps applies at every second step
        p_zero, s_zero, _ = step_inj(p_inj, s_zero)
        for a, b in zip(jax.tree.leaves(p_zero), jax.tree.leaves(p_inj), strict=True):
            np.testing.assert_array_equal(np.asarray(a, F32), np.asarray(b, F32))


DTYPE_CASES = [
    pytest.param(
        name,
        dtype,
        id=f"{name}-{jnp.dtype(dtype).name}",
    )
    for name in NAMES
    for dtype in (BF16, F32)
    # master_weights refuses a tree without bfloat16 leaves; its tree holds both dtypes.
    if (name, dtype) != ("master_weights", F32)
]


@pytest.mark.parametrize(("name", "dtype"), DTYPE_CASES)
def test_dtypes_are_preserved(name, dtype):
    tx = wrap(name, optax.sgd(0.1, momentum=0.9))
    params = params0(name, dtype)
    state = jax.jit(tx.init)(params)
    new_params, new_state, updates = jax.jit(make_step(name, tx))(params, state)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
        assert u.dtype == p.dtype
    assert specs(new_params) == specs(params)
    assert specs(new_state) == specs(state)


@pytest.mark.parametrize("name", NAMES)
def test_same_state_tree_under_jit_and_scan(name):
    tx = wrap(name, optax.sgd(0.1, momentum=0.9))
    params = params0(name)
    state = tx.init(params)
    step = make_step(name, tx)

    # One step keeps the state's tree, traced or eager (what `init` gave, exactly).
    assert specs(jax.eval_shape(step, params, state)[1]) == specs(state)
    p_jit, s_jit = params, state
    jitted = jax.jit(step)
    for _ in range(3):
        p_jit, s_jit, _ = jitted(p_jit, s_jit)
    assert specs(s_jit) == specs(state)

    # lax.scan refuses a body whose carry changes its tree, and computes the same.
    def body(carry, _):
        p, s, _ = step(*carry)
        return (p, s), None

    (p_scan, s_scan), _ = jax.jit(lambda c: jax.lax.scan(body, c, length=3))((params, state))
    assert_same(p_scan, p_jit)
    assert_same(s_scan, s_jit)


MISSING = object()


@pytest.mark.parametrize("name", NAMES)
def test_tree_get_finds_every_field(name):
    tx = wrap(name, optax.sgd(0.1, momentum=0.9))
    state = tx.init(params0(name))
    state_type = WRAPPERS[name][1]
    assert isinstance(state, state_type)
    for field in state_type._fields:
        value = getattr(state, field)
        found = optax.tree.get(state, field, default=MISSING)
        if value is None:
            # optax.tree.get cannot tell a None field from a missing one; the field is
            # still one of the state's, once.
            continue
        assert found is not None and found is not MISSING, field
        assert jax.tree.structure(found) == jax.tree.structure(value), field
        for a, b in zip(jax.tree.leaves(found), jax.tree.leaves(value), strict=True):
            assert a is b, field
    # The inner's own field, through the wrapper (low_precision_state stores it narrower).
    trace = optax.tree.get(state, "trace")
    assert trace is not None
    assert jax.tree.structure(trace) == jax.tree.structure(params0(name))


@pytest.mark.parametrize("name", NAMES)
def test_donation(name):
    tx = wrap(name, optax.sgd(0.1, momentum=0.9))
    step = make_step(name, tx)
    params = params0(name)
    expected = jax.jit(step)(params, tx.init(params))

    donated_params = jax.tree.map(jnp.copy, params)
    donated_state = tx.init(donated_params)
    # keep_unused: an argument the step does not read (a state field it overwrites) is
    # otherwise pruned from the program, and its donated buffer left alone.
    with warnings.catch_warnings():
        # "Some donated buffers were not usable" would say the step cannot run in place.
        warnings.simplefilter("error")
        got = jax.jit(step, donate_argnums=(0, 1), keep_unused=True)(donated_params, donated_state)
    for leaf in jax.tree.leaves((donated_params, donated_state)):
        assert leaf.is_deleted()
    assert_same(got, expected)
