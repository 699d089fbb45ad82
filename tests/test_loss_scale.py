"""The loss-scale state, its constructors, scale/unscale and the update rule."""

import dataclasses

import _golden
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _bad_input import assert_clear_error
from _problem import X, assert_trees_equal, loss_fn, params0
from hypothesis import given, settings
from hypothesis import strategies as st

import jamp
from jamp._src import loss_scale as ls

FLOAT_DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
EAGER_AND_JIT = [pytest.param(lambda f: f, id="eager"), pytest.param(jax.jit, id="jit")]


def with_tracker(state, tracker):
    return dataclasses.replace(state, growth_tracker=jnp.asarray(tracker, jnp.int32))


# ---------------------------------------------------------------- construction


def test_defaults_are_torchs():
    s = jamp.dynamic_loss_scale()
    assert s.scale.dtype == jnp.float32 and s.scale.shape == ()
    assert s.growth_tracker.dtype == jnp.int32 and s.growth_tracker.shape == ()
    assert float(s.scale) == 65536.0 and int(s.growth_tracker) == 0
    assert (s.growth_factor, s.backoff_factor, s.growth_interval) == (2.0, 0.5, 2000)
    assert (s.min_scale, s.max_scale, s.hysteresis) == (2.0**-126, 2.0**126, 1)
    assert not s.scale.weak_type and not s.growth_tracker.weak_type


def test_static_and_none():
    s = jamp.static_loss_scale(128.0)
    assert s.kind == "static" and float(s.scale) == 128.0
    n = jamp.no_loss_scale()
    assert n.kind == "none" and float(n.scale) == 1.0 and not n.enabled


def test_flatten_unflatten_keeps_every_field():
    s = jamp.dynamic_loss_scale(
        1024.0, 3.0, 0.25, 7, min_scale=128.0, max_scale=2.0**20, hysteresis=3
    )
    leaves, treedef = jax.tree_util.tree_flatten(s)
    assert len(leaves) == 3
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert back == s or all(
        getattr(back, f.name) is getattr(s, f.name) for f in dataclasses.fields(s)
    )
    for f in dataclasses.fields(s):
        if f.metadata.get("static"):
            assert getattr(back, f.name) == getattr(s, f.name)


def test_min_scale_survives_jit():
    # jmp drops min_loss_scale in tree_flatten: under jit a floor of 128 becomes 1.
    s = jamp.dynamic_loss_scale(256.0, min_scale=128.0)
    step = jax.jit(jamp.update)
    for _ in range(5):
        s = step(s, jnp.bool_(False))
    assert float(s.scale) == 128.0
    assert s.min_scale == 128.0


def test_init_scale_array_accepted_and_rounded():
    s = jamp.dynamic_loss_scale(jnp.float32(512.0))
    assert float(s.scale) == 512.0
    s = jamp.dynamic_loss_scale(0.1)
    assert float(s.scale) == float(np.float32(0.1))  # torch rounds init_scale to float32


# ---------------------------------------------------------------- scale / unscale


def test_api_facts_scalar_and_mixed_dtypes():
    facts = _golden.load("api_facts.json")["facts"]
    fact = facts["scale(bfloat16 0-dim)"]
    got = jamp.scale(jamp.dynamic_loss_scale(), jnp.asarray(_golden.array(fact["input"])))
    assert _golden.bits_equal(np.asarray(got), _golden.array(fact["output"]))
    # One unscale over a float32 and a bfloat16 group, as torch groups by dtype.
    calls = facts["mixed_dtype_grads_kernel_calls"]
    grads = [jnp.asarray(_golden.array(c["grads_in"][0])) for c in calls]
    state = jamp.static_loss_scale(1.0 / _golden.scalar(calls[0]["inv_scale"]))
    out, finite = jamp.unscale_and_check(state, grads)
    assert bool(finite)
    for o, c in zip(out, calls, strict=True):
        assert _golden.bits_equal(np.asarray(o), _golden.array(c["grads_out"][0]))


def test_disabled_scale_is_identity():
    n = jamp.no_loss_scale()
    tree = {"x": jnp.ones(2, jnp.float16)}
    assert jamp.scale(n, tree) is tree
    assert jamp.unscale(n, tree) is tree


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([np.float16, ml_dtypes.bfloat16, np.float32]),
    exponent=st.integers(-20, 20),
    data=st.data(),
)
def test_unscale_inverts_scale_for_powers_of_two(dtype, exponent, data):
    x = data.draw(
        hnp.arrays(
            dtype,
            hnp.array_shapes(max_dims=2, max_side=5),
            elements=st.floats(-100, 100, width=16).map(lambda v: 0.0 if abs(v) < 1e-3 else v),
        )
    )
    state = jamp.static_loss_scale(2.0**exponent)
    scaled = jamp.scale(state, jnp.asarray(x))
    back = jamp.unscale(state, scaled)
    assert back.dtype == x.dtype
    # Exact while the scaled values stay normal numbers of their dtype (zero only where x
    # is: hypothesis found float16 2**-9 scaled by 2**-16 flushed to zero, not invertible).
    s = np.abs(np.asarray(scaled).astype(np.float32))
    zero = np.asarray(x).astype(np.float32) == 0
    if np.isfinite(s).all() and (zero | (s >= float(jnp.finfo(dtype).tiny))).all():
        np.testing.assert_array_equal(np.asarray(back), x)


# ---------------------------------------------------------------- update rule


def _in_bounds_cases():
    cases = _golden.load("unit_update_scale.json")["cases"]
    keep = []
    for c in cases:
        s = float(_golden.array(c["scale_in"]))
        if not (ls.MIN_SCALE <= s <= ls.MAX_SCALE):
            continue
        if not (
            0 < c["backoff_factor"] < 1 and c["growth_factor"] > 1 and c["growth_interval"] >= 1
        ):
            continue  # configurations jamp rejects at construction
        keep.append(c)
    return keep


def test_unit_update_scale_golden_bit_for_bit():
    cases = _in_bounds_cases()
    assert len(cases) == 365
    assert sum(not c["float32_only_arithmetic_matches"] for c in cases) == 18
    # One batched update per configuration (32 of them; padded to one length, so eager
    # dispatch reuses its kernels): the same elementwise arithmetic as a scalar update,
    # vmapped, eagerly and in one jitted program.
    groups = {}
    for c in cases:
        groups.setdefault(
            (c["growth_factor"], c["backoff_factor"], c["growth_interval"]), []
        ).append(c)
    width = max(len(g) for g in groups.values())
    states, finites, wants = [], [], []
    for (growth, backoff, interval), group in groups.items():
        group = group + [group[0]] * (width - len(group))
        scales = np.stack([_golden.array(c["scale_in"]).reshape(()) for c in group])
        state = jamp.dynamic_loss_scale(float(scales[0]), growth, backoff, interval)
        states.append(dataclasses.replace(
            state,
            scale=jnp.asarray(scales, jnp.float32),
            growth_tracker=jnp.asarray([c["growth_tracker_in"] for c in group], jnp.int32),
            overflow_streak=jnp.zeros(width, jnp.int32),
        ))  # fmt: skip
        # torch: any non-zero found_inf is "found"
        finites.append(jnp.asarray([float(_golden.array(c["found_inf"])) == 0 for c in group]))
        expected = np.stack([_golden.array(c["scale_out"]).reshape(()) for c in group])
        # jamp holds the scale in [min_scale, max_scale] where torch leaves it.
        expected = np.clip(expected, np.float32(ls.MIN_SCALE), np.float32(ls.MAX_SCALE))
        wants.append((expected, np.asarray([c["growth_tracker_out"] for c in group]), group))

    def every_group(states, finites):
        return [jax.vmap(jamp.update)(s, f) for s, f in zip(states, finites, strict=True)]

    checked = 0
    for outs in (every_group(states, finites), jax.jit(every_group)(states, finites)):
        for out, (expected, trackers, group) in zip(outs, wants, strict=True):
            assert _golden.bits_equal(np.asarray(out.scale), expected), group
            np.testing.assert_array_equal(np.asarray(out.growth_tracker), trackers)
            checked += len({id(c) for c in group})
    assert checked == 2 * 365
    # And the scalar call a user writes, eagerly and under jit, on a case of each kind.
    jitted = jax.jit(jamp.update)
    for c in (cases[0], next(c for c in cases if not c["float32_only_arithmetic_matches"])):
        state = jamp.dynamic_loss_scale(
            float(_golden.array(c["scale_in"])), c["growth_factor"], c["backoff_factor"],
            c["growth_interval"],
        )  # fmt: skip
        state = with_tracker(state, c["growth_tracker_in"])
        expected = np.clip(_golden.array(c["scale_out"]).reshape(()), np.float32(ls.MIN_SCALE),
                           np.float32(ls.MAX_SCALE))  # fmt: skip
        for fn in (jamp.update, jitted):
            out = fn(state, jnp.asarray(float(_golden.array(c["found_inf"])) == 0))
            assert _golden.bits_equal(np.asarray(out.scale), expected), c
            assert int(out.growth_tracker) == c["growth_tracker_out"], c


def test_growth_and_backoff_sequence():
    s = jamp.dynamic_loss_scale(8.0, growth_interval=3)
    T, F = jnp.bool_(True), jnp.bool_(False)
    seen = []
    for flag in [T, T, T, T, F, T, T, T]:
        s = jamp.update(s, flag)
        seen.append((float(s.scale), int(s.growth_tracker)))
    assert seen == [(8, 1), (8, 2), (16, 0), (16, 1), (8, 0), (8, 1), (8, 2), (16, 0)]


def test_scale_held_at_bounds():
    s = jamp.dynamic_loss_scale(1.0, min_scale=0.25, max_scale=4.0, growth_interval=1)
    for _ in range(10):
        s = jamp.update(s, jnp.bool_(True))
    assert float(s.scale) == 4.0
    for _ in range(10):
        s = jamp.update(s, jnp.bool_(False))
    assert float(s.scale) == 0.25


def test_default_floor_after_many_overflows():
    # torch reaches exactly 0.0 after 166 overflows; jamp stops at 2**-126.
    s = jamp.dynamic_loss_scale()
    step = jax.jit(jamp.update)
    for _ in range(200):
        s = step(s, jnp.bool_(False))
    assert float(s.scale) == 2.0**-126
    assert np.isfinite(float(jnp.float32(1.0) / s.scale))
    s = step(s, jnp.bool_(True))
    assert float(s.scale) == 2.0**-126 and int(s.growth_tracker) == 1


def test_growth_capped_at_max_scale_and_tracker_reset():
    s = jamp.dynamic_loss_scale(2.0**125, growth_interval=1)
    s = jamp.update(s, jnp.bool_(True))
    assert float(s.scale) == 2.0**126
    s = jamp.update(s, jnp.bool_(True))
    assert float(s.scale) == 2.0**126 and int(s.growth_tracker) == 0


def test_hysteresis_backs_off_on_the_hth_overflow_in_a_row():
    s = jamp.dynamic_loss_scale(1024.0, hysteresis=3, growth_interval=100)
    T, F = jnp.bool_(True), jnp.bool_(False)
    scales = []
    for flag in [F, F, T, F, F, F, F, T, F]:
        s = jamp.update(s, flag)
        scales.append(float(s.scale))
    # streak resets on a finite step; backs off on the 3rd and every later one in a row.
    assert scales == [1024, 1024, 1024, 1024, 1024, 512, 256, 256, 256]
    assert int(s.overflow_streak) == 1 and int(s.growth_tracker) == 0


@pytest.mark.parametrize("kind", [jamp.static_loss_scale(4.0), jamp.no_loss_scale()])
def test_update_static_and_none_return_state(kind):
    assert jamp.update(kind, jnp.bool_(False)) is kind


def test_jitted_update_never_retraces_and_needs_no_transfers():
    traces = []

    @jax.jit
    def step(state, flag):
        traces.append(1)
        return jamp.update(state, flag)

    s = jamp.dynamic_loss_scale(4.0, growth_interval=1)
    flags = [jnp.asarray(v) for v in [True, False, True, True, False, True]]
    s = step(s, flags[0])  # compile outside the guard
    with jax.transfer_guard("disallow"):
        for f in flags[1:]:
            s = step(s, f)
    assert len(traces) == 1
    assert s.scale.dtype == jnp.float32 and s.growth_tracker.dtype == jnp.int32


@settings(max_examples=50, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=60),
    init=st.floats(2.0**-126, 2.0**126),
    growth=st.sampled_from([2.0, 1.1, 4.0, 1.5]),
    backoff=st.sampled_from([0.5, 0.3, 0.25, 0.9999]),
    interval=st.integers(1, 4),
)
def test_scale_always_within_bounds(flags, init, growth, backoff, interval):
    s = (
        jamp.dynamic_loss_scale(
            init, growth, backoff, interval, min_scale=2.0**-20, max_scale=2.0**20
        )
        if 2.0**-20 <= np.float32(init) <= 2.0**20
        else jamp.dynamic_loss_scale(init, growth, backoff, interval)
    )
    for f in flags:
        s = jamp.update(s, jnp.asarray(f))
        assert s.min_scale <= float(s.scale) <= s.max_scale


def test_several_losses_one_state():
    ls = jamp.dynamic_loss_scale(2.0**10)

    def two_losses(p):
        a = loss_fn(p, X)
        b = 0.5 * jnp.mean(p["w"] ** 2)
        return a, b

    # Summed after scaling, as a list, and as a dict: all the same grads.
    g_sum = jax.grad(lambda p: sum(jamp.scale(ls, list(two_losses(p)))))(params0())
    g_dict = jax.grad(
        lambda p: sum(jamp.scale(ls, dict(zip("ab", two_losses(p), strict=True))).values())
    )(params0())
    ref = jax.grad(lambda p: sum(two_losses(p)))(params0())
    unscaled, finite = jamp.unscale_and_check(ls, g_sum)
    assert bool(finite)
    assert_trees_equal(unscaled, ref)
    assert_trees_equal(g_dict, g_sum)


# ---------------------------------------------------------------- bad input

DYN = jamp.dynamic_loss_scale
STATIC2 = jamp.static_loss_scale(2.0)


def _lss():
    return jamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})


# Every invalid state, flag or leaf given to scale, unscale and update: id -> (call,
# exception, match). A tuple of patterns: each must match (two tables checked that call).
BAD_INPUT = {
    # update's finite flag
    "update finite=int32": (
        lambda: jamp.update(DYN(), jnp.int32(1)),
        TypeError,
        r"`finite` to be a boolean scalar, got dtype int32",
    ),
    "update finite=float32": (
        lambda: jamp.update(DYN(), jnp.float32(1.0)),
        TypeError,
        (r"`finite`.*dtype float32", r"`finite` to be a boolean scalar, got dtype float32"),
    ),
    "update finite=vector": (
        lambda: jamp.update(DYN(), jnp.ones(2, bool)),
        ValueError,
        (
            r"`finite` to be a scalar.*\(2,\)",
            r"`finite` to be a scalar \(shape \(\)\), got shape \(2,\)",
        ),
    ),
    "update finite=np [True]": (
        lambda: jamp.update(DYN(), np.array([True])),
        ValueError,
        r"`finite` to be a scalar.*\(1,\)",
    ),
    "update finite=1": (lambda: jamp.update(DYN(), 1), TypeError, r"`finite`.*got int"),
    "update finite=None": (lambda: jamp.update(DYN(), None), TypeError, r"`finite`.*got NoneType"),
    "update finite='yes'": (
        lambda: jamp.update(DYN(), "yes"),
        TypeError,
        r"`finite` to be a boolean scalar array .* got str",
    ),
    # a state of another structure
    "unscale state=ScaledOptimizerState": (
        lambda: jamp.unscale(_lss(), {"w": jnp.ones(2)}),
        TypeError,
        r"jamp\.unscale` expected `state` to be a LossScaleState.*got ScaledOptimizerState",
    ),
    "unscale state=dict": (
        lambda: jamp.unscale({"scale": jnp.float32(2.0)}, {"w": jnp.ones(2)}),
        TypeError,
        r"jamp\.unscale` expected `state` to be a LossScaleState.*got dict",
    ),
    "scale state=float": (
        lambda: jamp.scale(2.0, jnp.ones(2)),
        TypeError,
        (
            r"jamp\.scale` expected `state` to be a LossScaleState.*got float",
            r"`jamp.scale` expected `state` to be a LossScaleState.*got float",
        ),
    ),
    "update state=ScaledOptimizerState": (
        lambda: jamp.update(_lss(), jnp.bool_(True)),
        TypeError,
        r"jamp\.update` expected `state` to be a LossScaleState.*got ScaledOptimizerState",
    ),
    # trees with strings and objects: the message names the path
    "scale leaf=str": (
        lambda: jamp.scale(DYN(), {"a": jnp.ones(2), "b": "x"}),
        TypeError,
        r"jamp\.scale` expected a pytree of arrays.*str at path \['b'\]",
    ),
    "unscale leaf=object": (
        lambda: jamp.unscale(DYN(), {"a": [jnp.ones(2), object()]}),
        TypeError,
        r"object at path \['a'\]\[1\]",
    ),
    "scale nested leaf=str": (
        lambda: jamp.scale(STATIC2, {"params": {"w": jnp.ones(2), "name": "dense"}}),
        TypeError,
        r"leaf of type str at path \['params'\]\['name'\]",
    ),
    "scale list leaf=object": (
        lambda: jamp.scale(STATIC2, [jnp.ones(2), object()]),
        TypeError,
        r"leaf of type object at path \[1\]",
    ),
    "unscale nested leaf=str": (
        lambda: jamp.unscale(STATIC2, {"params": {"w": jnp.ones(2), "name": "dense"}}),
        TypeError,
        r"leaf of type str at path \['params'\]\['name'\]",
    ),
    "unscale list leaf=object": (
        lambda: jamp.unscale(STATIC2, [jnp.ones(2), object()]),
        TypeError,
        r"leaf of type object at path \[1\]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])
