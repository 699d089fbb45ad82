"""``jamp.low_precision_state``: any Optax optimizer's floating state stored narrower
between steps, chosen by field name, widened to float32 before the optimizer runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _bad_input import assert_clear_error

import jamp
from jamp._src.optimizer.quantize import dequantize
from jamp.optimizer import BlockQuantized, LowPrecisionState

BF16 = jnp.bfloat16


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.standard_promotion
def test_adam_moments_are_stored_as_their_dtypes_say_and_take_those_bytes():
    """adam's mu and nu in bfloat16, 8-bit blocks or float8 blocks; its count stays int32;
    a leaf under 4,096 elements stays float32 in blocks' recipes. The bytes between steps
    are what the dtypes say: 2 + 2, and 2 * (1 + 4/256) per parameter."""
    params = {"w": jnp.zeros((256, 64)), "b": jnp.zeros((64,))}
    n = 256 * 64
    cases = {
        "bf16": ({"mu": BF16, "nu": BF16}, 2 + 2),
        "8bit": ({"mu": "8bit", "nu": "8bit"}, 2 * (1 + 4 / 256)),
        "float8": ({"mu": jnp.float8_e4m3fn, "nu": jnp.float8_e5m2}, 2 * (1 + 4 / 256)),
    }
    for name, (dtypes, per_param) in cases.items():
        tx = jamp.low_precision_state(optax.adam(1e-3), dtypes)
        state = tx.init(params)
        assert isinstance(state, LowPrecisionState)
        adam = state.stored_state[0]
        assert adam.count.dtype == jnp.int32
        w_bytes = _nbytes((adam.mu["w"], adam.nu["w"]))
        assert w_bytes == pytest.approx(per_param * n), name
        if name == "bf16":
            assert adam.mu["b"].dtype == BF16
        else:
            assert isinstance(adam.mu["w"], BlockQuantized)
            assert adam.mu["b"].dtype == jnp.float32  # 64 elements: kept float32
        updates, state = jax.jit(tx.update)(params, state, params)
        assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))
        assert _nbytes((state.stored_state[0].mu["w"], state.stored_state[0].nu["w"])) == w_bytes


def test_fields_are_chosen_by_name_anywhere_in_the_state_and_widened_before_the_optimizer():
    """sgd's momentum ``trace`` inside a chain is stored in bfloat16; the optimizer sees
    float32; what is not named stays as it was."""
    seen = []

    def record(updates, state, params=None):
        seen.append(state)
        return updates, state

    class Kept(optax.TraceState):
        pass

    inner = optax.chain(
        optax.GradientTransformation(lambda p: Kept(trace=jax.tree.map(jnp.zeros_like, p)), record),
        optax.sgd(0.1, momentum=0.9),
    )
    tx = jamp.low_precision_state(inner, {"trace": BF16})
    params = {"w": jnp.ones((8,))}
    state = tx.init(params)
    traces = [x for x in jax.tree.leaves(state.stored_state)]
    assert {x.dtype for x in traces} == {jnp.dtype(BF16)}
    jax.jit(tx.update)(params, state, params)
    assert seen[0].trace["w"].dtype == jnp.float32


def _nu_after_gradients_shrink(rounding, dtype=BF16, n=4096):
    """adam's nu after 200 steps of gradient 1 then 2,000 of gradient 0.1: float32's nu
    decays toward 0.01 (0.999 per step); a stored nu that rounds to nearest stalls."""
    tx = jamp.low_precision_state(optax.scale_by_adam(), {"nu": dtype}, rounding=rounding)
    params = jnp.zeros((n,))
    state = tx.init(params)

    def body(state, g):
        _, state = tx.update(jnp.full((n,), g), state, params)
        return state, None

    grads = jnp.concatenate([jnp.ones(200), jnp.full(2000, 0.1)])
    state, _ = jax.lax.scan(body, state, grads)
    return np.asarray(state.stored_state.nu.astype(jnp.float32))


@pytest.mark.standard_promotion
def test_nearest_bfloat16_nu_stalls_where_stochastic_follows_float32():
    """The reason the default is stochastic: at b2 = 0.999 the change of nu per step is
    0.1% of it, under half a bfloat16 ulp (0.2-0.4%), so to-nearest never decays."""
    nu32 = (1 - 0.999**200) * 0.999**2000 + 0.01 * (1 - 0.999**2000)  # float32's, closed
    nearest = _nu_after_gradients_shrink("nearest")
    stochastic = _nu_after_gradients_shrink("stochastic")
    assert nearest.mean() > 1.5 * nu32  # stalled near where the decay began
    assert abs(stochastic.mean() / nu32 - 1) < 0.01


@pytest.mark.standard_promotion
@pytest.mark.parametrize("storage", ["8bit", "bf16", "float8"])
def test_narrow_moments_train_a_regression_as_float32_moments_do(storage):
    """A least-squares fit with adam and a decaying rate: the stored moments' final loss is
    within a few percent of float32 moments' (on the same data and start)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (256, 64))
    y = x @ jax.random.normal(k2, (64, 64))

    def loss(w):
        return jnp.mean((x @ w - y) ** 2)

    sched = optax.cosine_decay_schedule(1e-2, 800)

    def run(tx):
        w = jnp.zeros((64, 64))
        state = tx.init(w)

        def body(carry, _):
            w, state = carry
            g = jax.grad(loss)(w)
            u, state = tx.update(g, state, w)
            return (optax.apply_updates(w, u), state), None

        (w, _), _ = jax.lax.scan(body, (w, state), None, length=800)
        return float(loss(w))

    base = run(optax.adam(sched))
    dtypes = {"bf16": BF16, "8bit": "8bit", "float8": jnp.float8_e4m3fn}[storage]
    got = run(jamp.low_precision_state(optax.adam(sched), {"mu": dtypes, "nu": dtypes}))
    assert got < 1.05 * base, (storage, got, base)


def test_bad_arguments_are_refused_naming_them():
    sgd = optax.sgd(0.1, momentum=0.9)
    with pytest.raises(TypeError, match=r"`dtypes`.*non-empty dict"):
        jamp.low_precision_state(sgd, ["trace"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`dtypes`.*non-empty dict"):
        jamp.low_precision_state(sgd, {})
    with pytest.raises(
        ValueError, match=r"`dtypes\['trace'\]`.*float32 is what the state already is"
    ):
        jamp.low_precision_state(sgd, {"trace": jnp.float32})
    with pytest.raises(ValueError, match=r"`dtypes\['trace'\]`.*'8bit'.*'4bit'"):
        jamp.low_precision_state(sgd, {"trace": "4bit"})
    with pytest.raises(ValueError, match=r"`rounding`.*'stochastic', 'nearest'.*'exact'"):
        jamp.low_precision_state(sgd, {"trace": BF16}, rounding="exact")
    with pytest.raises(TypeError, match=r"`inner`"):
        jamp.low_precision_state(object(), {"trace": BF16})  # type: ignore[arg-type]
    tx = jamp.low_precision_state(sgd, {"trace": BF16})
    with pytest.raises(TypeError, match=r"LowPrecisionState"):
        tx.update({"w": jnp.ones(2)}, sgd.init({"w": jnp.ones(2)}), {"w": jnp.ones(2)})


@pytest.mark.standard_promotion
def test_a_parameter_named_like_a_field_is_not_taken_for_one():
    """Fields are named above the parameters' own keys: a parameter called ``nu`` inside
    adam's ``mu`` is part of ``mu`` (the signed code, its sign kept), and one called
    ``trace`` in MultiSteps' gradient accumulator is in no chosen field."""
    g = {"nu": jnp.full((64, 80), -1.0), "w": jnp.full((64, 80), -1.0)}
    tx = jamp.low_precision_state(optax.adam(1e-2), {"mu": "8bit", "nu": "8bit"})
    state = tx.init(g)
    for _ in range(2):
        updates, state = jax.jit(tx.update)(g, state, g)
    adam = state.stored_state[0]
    assert adam.mu["nu"].code == adam.mu["w"].code == "signed"
    assert adam.nu["nu"].code == "positive"
    assert np.array_equal(np.asarray(updates["nu"]), np.asarray(updates["w"]))
    params = {"trace": jnp.ones((4,)), "w": jnp.ones((4,))}
    tx = jamp.low_precision_state(
        optax.MultiSteps(optax.sgd(0.1, momentum=0.9), 2), {"trace": BF16}
    )
    state = tx.init(params)
    assert state.stored_state.acc_grads["trace"].dtype == jnp.float32
    assert state.stored_state.inner_opt_state[0].trace["trace"].dtype == BF16


# ---------------------------------------------------------------- refused: float16 squares


def test_float16_is_refused_for_a_field_of_squares_saying_what_to_use():
    """float16's range, 6e-8 to 65504, does not hold squares of gradients: near 1e-4 they
    are stored as 0 and near 1e3 they overflow. adam's ``nu`` (and every field the code
    knows for squares) is refused in float16; its first moment is not."""
    for field in ("nu", "v_row", "sum_of_squares"):
        with pytest.raises(
            ValueError,
            match=rf"`dtypes\['{field}'\]`.*jnp.bfloat16, '8bit'.*float32.*jnp.float16.*squares",
        ):
            jamp.low_precision_state(optax.adam(1e-3), {field: jnp.float16})
    jamp.low_precision_state(optax.adam(1e-3), {"mu": jnp.float16, "nu": BF16})


# ---------------------------------------------------------------- refused: no such field


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_field_that_matches_nothing_is_refused_naming_the_fields_there_are(jit):
    """``{"mom": ...}`` around adam, or the default ``{"mu", "nu"}`` around momentum (whose
    field is ``trace``), kept everything in float32 without a word: init refuses them,
    naming the floating fields the optimizer's state has."""
    params = {"w": jnp.zeros((8,))}
    cases = [
        (optax.adam(1e-3), {"mom": BF16}, r"'mom', which matches none.*'mu', 'nu'"),
        (optax.adam(1e-3), {"mu": BF16, "mom": BF16}, r"'mom', which matches none"),
        (optax.sgd(0.1, momentum=0.9), None, r"'mu', 'nu', which match none.*'trace'"),
        (optax.sgd(0.1), {"trace": BF16}, r"'trace'.*no floating field"),
    ]
    for inner, dtypes, match in cases:
        tx = jamp.low_precision_state(inner, dtypes)
        init = jax.jit(tx.init) if jit else tx.init
        with pytest.raises(ValueError, match=r"`dtypes` names.*" + match):
            init(params)
    # A field named above a parameter called like it: mu/nu of adam over {"trace": ...}.
    jamp.low_precision_state(optax.adam(1e-3)).init({"trace": jnp.zeros(3)})


# ---------------------------------------------------------------- float8 second moments

# The step after a float8 store, against float32 adam's: nu comes back within one rounding,
# so the update sqrt(nu32 / nu8) within these, for every element whose gradient is at least
# 2**-14.5 of its block's largest (the formats' normals reach 2**-14.8 for e4m3fn's root and
# 2**-14.9 for e5m2's moment). To nearest: e4m3fn's root within 2**-4, e5m2's nu within
# 2**-3; stochastically, within one ulp (twice that).
F8_BOUNDS = {
    ("e4m3fn", "nearest"): (16 / 17, 16 / 15),
    ("e5m2", "nearest"): ((8 / 9) ** 0.5, (8 / 7) ** 0.5),
    ("e4m3fn", "stochastic"): (8 / 9, 8 / 7),
    ("e5m2", "stochastic"): ((4 / 5) ** 0.5, (4 / 3) ** 0.5),
}


@pytest.mark.standard_promotion  # optax's adam
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("key", list(F8_BOUNDS), ids=["-".join(k) for k in F8_BOUNDS])
def test_a_float8_second_moment_steps_within_its_documented_bound(key, jit):
    """Gradients spread over 2**-24 to 1 of each block's largest. Stored as it was (nu in
    e4m3fn, blocks scaled to 448), an element below about 1/480 of its block's largest
    held the format's smallest value for its nu, and its step 2 was up to 98% too small.
    Now step 2 is within the bound at every element down to 2**-14.5 of its block's
    largest (below, the formats' subnormals, then their smallest value, as the 8-bit
    code's last level below 2**-15.9)."""
    fmt, rounding = key
    dtype = {"e4m3fn": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[fmt]
    rng = np.random.default_rng(7)
    n = 64 * 256
    g1 = (2.0 ** rng.uniform(-24, 0, n) * rng.choice([-1, 1], n)).astype(np.float32)
    g2 = (g1 * rng.uniform(0.5, 1.5, n)).astype(np.float32)

    def second_step(tx):
        update = jax.jit(tx.update) if jit else tx.update
        state = tx.init(jnp.zeros(n))
        _, state = update(jnp.asarray(g1), state)
        return np.asarray(update(jnp.asarray(g2), state)[0])

    want = second_step(optax.scale_by_adam(eps=0.0))
    got = second_step(
        jamp.low_precision_state(optax.scale_by_adam(eps=0.0), {"nu": dtype}, rounding=rounding)
    )
    ratio = got / want
    relative = np.abs(g1) / np.repeat(np.abs(g1).reshape(-1, 256).max(1), 256)
    lo, hi = F8_BOUNDS[key]
    above = relative >= 2.0**-14.5
    assert 0.9 * n > above.sum() > 0.5 * n
    assert ratio[above].min() >= lo * (1 - 1e-5) and ratio[above].max() <= hi * (1 + 1e-5)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_a_float8_momentum_of_tiny_gradients_is_kept(dtype, jit):
    """Momentum's trace in float8 over gradients near 1e-36 (normal float32 values): the
    block's absmax over the format's largest is a float32 subnormal, and the stored
    trace came back as zeros. It comes back as float32's trace, to float8's spacing."""
    n = 4096
    g = jnp.asarray(1e-36 * np.random.default_rng(8).uniform(0.1, 1.0, n), jnp.float32)
    tx = jamp.low_precision_state(optax.sgd(0.1, momentum=0.9), {"trace": dtype}, "nearest")
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(jnp.zeros(n))
    for _ in range(2):
        _, state = update(g, state)
    stored = state.stored_state[0].trace
    assert isinstance(stored, BlockQuantized)
    back = np.asarray(dequantize(stored))
    mantissa = 3 if dtype == jnp.float8_e4m3fn else 2
    np.testing.assert_allclose(back, 1.9 * np.asarray(g), rtol=2.0 ** -(mantissa - 1))


# ---------------------------------------------------------------- bad input


def _stepped(rounding="stochastic", **replace):
    """A low_precision_state around momentum, its state after init with ``replace``d fields."""
    tx = jamp.low_precision_state(optax.sgd(0.1, momentum=0.9), {"trace": BF16}, rounding)
    params = {"w": jnp.ones((4, 3))}
    state = tx.init(params)._replace(**replace)
    return lambda: tx.update(params, state, params)


def _other_shapes():
    tx = jamp.low_precision_state(optax.sgd(0.1, momentum=0.9), {"trace": BF16})
    state = tx.init({"w": jnp.ones((3,))})

    def update():
        # JAX's default rank promotion: the (3,) momentum would broadcast silently.
        with jax.numpy_rank_promotion("allow"):
            return tx.update({"w": jnp.ones((4, 3))}, state, {"w": jnp.ones((4, 3))})

    return update


BAD_INPUT = {
    "storage_count=None, stochastic": (
        _stepped(storage_count=None),
        TypeError,
        r"`state.storage_count` to be a uint32 scalar \(rounding='stochastic'.*got None",
    ),
    "storage_count, nearest": (
        _stepped("nearest", storage_count=jnp.zeros((), jnp.uint32)),
        TypeError,
        r"`state.storage_count` to be None \(rounding='nearest'\)",
    ),
    "storage_count float32": (
        _stepped(storage_count=jnp.zeros((), jnp.float32)),
        TypeError,
        r"`state.storage_count` to be a uint32 scalar.*float32",
    ),
    "state of other shapes": (
        _other_shapes(),
        ValueError,
        (r"`state.stored_state`.*different shapes at .*\(3,\) and \(4, 3\)", r"tx.init\(params\)"),
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])


def test_bad_state_is_refused_while_traced_too():
    """Each check is of shapes and dtypes: under jit it raises at trace time, the same."""
    tx = jamp.low_precision_state(optax.sgd(0.1, momentum=0.9), {"trace": BF16})
    params = {"w": jnp.ones((4, 3))}
    state = tx.init(params)
    with pytest.raises(TypeError, match=r"`state.storage_count` to be a uint32 scalar"):
        jax.jit(tx.update)(params, state._replace(storage_count=None), params)
    other = tx.init({"w": jnp.ones((3,))})
    with pytest.raises(ValueError, match=r"`state.stored_state`.*different shapes"):
        jax.jit(tx.update)(params, other, params)


@pytest.mark.parametrize("promotion", ["strict", "standard"])
def test_over_bfloat16_parameters_the_inner_computes_as_unwrapped(promotion):
    # The stored trace is widened to the dtype the inner's own init gives it (bfloat16
    # here), not to float32: the updates keep the parameters' dtype and equal optax's
    # own, bit for bit (a bfloat16 trace stored as bfloat16 is stored exactly). Widened to
    # float32, strict promotion refused the bfloat16 gradient inside optax, and standard
    # promotion made float32 updates.
    params = {"w": jnp.linspace(-1.0, 1.0, 64, dtype=jnp.bfloat16)}
    grads = {"w": jnp.linspace(0.5, -0.25, 64, dtype=jnp.bfloat16)}
    plain = optax.sgd(0.1, momentum=0.9)
    wrapped = jamp.low_precision_state(plain, {"trace": jnp.bfloat16}, rounding="nearest")
    with jax.numpy_dtype_promotion(promotion):
        s_plain, s_wrapped = plain.init(params), wrapped.init(params)
        for _ in range(3):
            u_plain, s_plain = jax.jit(plain.update)(grads, s_plain, params)
            u_wrapped, s_wrapped = jax.jit(wrapped.update)(grads, s_wrapped, params)
            assert u_wrapped["w"].dtype == jnp.bfloat16
            np.testing.assert_array_equal(
                np.asarray(u_wrapped["w"], np.float32), np.asarray(u_plain["w"], np.float32)
            )
