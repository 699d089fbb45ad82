"""Beyond GradScaler: which leaf overflowed, retry instead of skip, metrics for loggers."""

import logging

import hypothesis.extra.numpy as hnp
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jamp

# ---------------------------------------------------------------- nonfinite_report


@st.composite
def poisoned_trees(draw):
    tree = {}
    for i in range(draw(st.integers(1, 4))):
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, max_side=5))
        dtype = draw(st.sampled_from([np.float32, np.float16]))
        x = draw(
            hnp.arrays(
                dtype, shape, elements=st.sampled_from([0.0, 1.5, -2.0, np.inf, -np.inf, np.nan])
            )
        )
        tree[f"leaf{i}"] = x
    return tree


@settings(max_examples=50, deadline=None)
@given(poisoned_trees())
def test_report_counts_equal_numpy(tree):
    report = jax.jit(jamp.nonfinite_report)({k: jnp.asarray(v) for k, v in tree.items()})
    for k, v in tree.items():
        assert int(report[k].inf) == int(np.isinf(v).sum())
        assert int(report[k].nan) == int(np.isnan(v).sum())
        assert report[k].inf.dtype == jnp.int32


@pytest.mark.parametrize("n", [2**16 - 1, 2**16, 2**17, 3 * 2**16 + 5, 2**20])
def test_report_counts_large_leaves_chunk_by_chunk(n):
    # Leaves over 2**16 elements are counted a chunk at a time: every boundary,
    # the first chunk, the loop and the tail must all count.
    rng = np.random.default_rng(n)
    x = rng.normal(size=n).astype(np.float32)
    spots = {0, n - 1, min(2**16, n - 1), min(2**16 - 1, n - 1), int(rng.integers(0, n))}
    for j, i in enumerate(sorted(spots)):
        x[i] = [np.inf, -np.inf, np.nan][j % 3]
    for shape in [(n,), (1, n)]:
        r = jax.jit(jamp.nonfinite_report)({"x": jnp.asarray(x.reshape(shape))})["x"]
        assert (int(r.inf), int(r.nan)) == (int(np.isinf(x).sum()), int(np.isnan(x).sum()))


def test_report_adds_no_gradient_sized_temporary():
    # XLA allocates a branch's temporaries on every call; counting a whole leaf
    # at once made XLA:CPU copy it as int32 (a step's temp memory doubled).
    g = {f"l{i}": jnp.ones((1024, 1024)) for i in range(4)}
    mem = jax.jit(jamp.log_nonfinite).lower(g).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 4 * 1024 * 1024, mem.temp_size_in_bytes


def test_report_structure_and_non_float_leaves():
    tree = {"a": [jnp.ones(2), None], "i": jnp.arange(3)}
    report = jamp.nonfinite_report(tree)
    assert isinstance(report["a"][0], jamp.NonfiniteCount) and report["a"][1] is None
    assert int(report["i"].inf) == 0 and int(report["i"].nan) == 0
    with pytest.raises(TypeError, match=r"`jamp.nonfinite_report`.*type str at path \['s'\]"):
        jamp.nonfinite_report({"s": "x"})


# ---------------------------------------------------------------- log_nonfinite


def grads_tree(bad):
    return {
        "params": {
            "Dense_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)},
            "Dense_3": {
                "kernel": jnp.ones((3, 4)).at[0, :].set(jnp.where(bad, jnp.inf, 1.0)),
                "bias": jnp.zeros(4),
            },
        }
    }


def test_log_fires_only_on_overflow_and_names_the_path(caplog):
    @jax.jit
    def step(bad):
        return jamp.log_nonfinite(grads_tree(bad), prefix="step: ")

    with caplog.at_level(logging.WARNING, logger="jamp"):
        ok = step(jnp.bool_(False))
        jax.effects_barrier()
        assert bool(ok) and not caplog.records
        finite = step(jnp.bool_(True))
        jax.effects_barrier()
    assert not bool(finite)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert message == "step: non-finite values in params/Dense_3/kernel: 4 inf, 0 nan"


def test_log_every_nth_overflow(caplog):
    @jax.jit
    def step(count):
        return jamp.log_nonfinite({"g": jnp.array([jnp.nan])}, every=3, count=count)

    with caplog.at_level(logging.WARNING, logger="jamp"):
        for c in range(7):
            step(jnp.int32(c))
        jax.effects_barrier()
    assert len(caplog.records) == 3  # counts 0, 3 and 6
    assert "g: 0 inf, 1 nan" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(every=0), r"`every` to be an int >= 1, got every=0"),
        (dict(every=2), r"Expected `count`"),
    ],
)
def test_log_nonfinite_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jamp.log_nonfinite({"g": jnp.ones(1)}, **kwargs)


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


# ---------------------------------------------------------------- retries


def fp16_loss(w, x):
    # The scaled loss is formed in float16 inside the backward pass, so the
    # cotangent overflows float16 at scale 2**16 and 2**15 but not at 2**14.
    h = x.astype(jnp.float16) * w.astype(jnp.float16)
    return jnp.sum(h.astype(jnp.float32))


def test_retry_returns_grads_of_the_first_finite_attempt():
    x = jnp.array([3.0, 1.0])
    w = jnp.array([1.0, 1.0])
    vg = jax.jit(jamp.value_and_grad(fp16_loss, max_retries=4))
    out = vg(jamp.dynamic_loss_scale(2.0**16), w, x)
    assert bool(out.finite) and int(out.retries) == 2
    assert float(out.loss_scale.scale) == 2.0**14 and int(out.loss_scale.growth_tracker) == 1
    direct = jamp.value_and_grad(fp16_loss)(jamp.dynamic_loss_scale(2.0**14), w, x)
    np.testing.assert_array_equal(np.asarray(out.grads), np.asarray(direct.grads))
    assert float(out.value) == float(direct.value)
    # without retries the step is lost and the scale backs off once
    once = jamp.value_and_grad(fp16_loss)(jamp.dynamic_loss_scale(2.0**16), w, x)
    assert not bool(once.finite) and float(once.loss_scale.scale) == 2.0**15


def test_retries_exhausted():
    vg = jamp.value_and_grad(lambda w: jnp.sum(w) * jnp.inf, max_retries=3)
    out = jax.jit(vg)(jamp.dynamic_loss_scale(2.0**10), jnp.ones(2))
    assert not bool(out.finite) and int(out.retries) == 3
    assert float(out.loss_scale.scale) == 2.0**6  # three retries and the final update


def test_retries_ignore_static_scale_and_validate():
    out = jamp.value_and_grad(lambda w: jnp.sum(w) * jnp.inf, max_retries=3)(
        jamp.static_loss_scale(4.0), jnp.ones(2)
    )
    assert int(out.retries) == 0
    with pytest.raises(ValueError, match=r"`max_retries` to be an int >= 0, got max_retries=-1"):
        jamp.value_and_grad(jnp.sum, max_retries=-1)


# ---------------------------------------------------------------- metrics


def test_metrics_are_device_scalars():
    tx = jamp.loss_scaling(optax.sgd(0.1))
    state = tx.init({"w": jnp.ones(2)})
    m = jax.jit(jamp.metrics)(state)
    assert set(m) == {"loss_scale", "growth_tracker", "last_finite", "skipped_steps"}
    assert all(isinstance(v, jax.Array) and v.shape == () for v in m.values())
    m = jamp.metrics(jamp.dynamic_loss_scale())
    assert set(m) == {"loss_scale", "growth_tracker"}
    out = jamp.value_and_grad(jnp.sum, max_retries=1)(jamp.dynamic_loss_scale(), jnp.ones(2))
    assert set(jamp.metrics(out)) == {"loss_scale", "growth_tracker", "last_finite", "retries"}


def test_metrics_from_train_state_and_nnx():
    from flax import nnx
    from flax.training import train_state

    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(32.0))
    ts = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
    assert float(jamp.metrics(ts)["loss_scale"]) == 32.0
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    m = jamp.metrics(opt)
    assert float(m["loss_scale"]) == 32.0 and int(m["skipped_steps"]) == 0
    assert all(isinstance(v, jax.Array) for v in m.values())


def test_metrics_error_without_state():
    with pytest.raises(ValueError, match=r"found none"):
        jamp.metrics(optax.sgd(0.1).init({"w": jnp.ones(2)}))


# ---------------------------------------------------------------- review fixes


def test_complex_entries_are_counted_once():
    values = [complex(np.inf, 0), complex(0, np.nan), complex(np.inf, np.nan), 1 + 1j]
    v = jnp.array(values, jnp.complex64)
    r = jax.jit(jamp.nonfinite_report)(v)
    assert (int(r.inf), int(r.nan)) == (1, 2)  # inf+nanj is one NaN entry


def test_leaves_past_int32_offsets_are_not_sliced_by_element():
    """A dynamic slice's element offset is an int32: past 2**31 elements a leaf
    is counted by whole chunks (a view) or in one reduction, never by offsets
    that would wrap (traced only: no 2 GB array is made)."""
    for n, chunked in [(2**31, True), (2**31 + 2**17 + 3, False)]:
        jaxpr = jax.make_jaxpr(jamp.nonfinite_report)(jax.ShapeDtypeStruct((n,), jnp.float8_e5m2))
        text = str(jaxpr)
        assert ("dynamic_slice" in text) == chunked, n
        if chunked:
            assert "f8_e5m2[32768,65536]" in text


@pytest.mark.parametrize("nested", [False, True])
def test_log_under_vmap_calls_back_only_when_a_member_overflows(caplog, nested):
    """A cond on a batched flag becomes a select, whose callback would run on
    every step for every member; jamp calls back once, only when one fires."""
    grads = {"w": jnp.ones((4, 3))}
    fn = jax.vmap(lambda g: jamp.log_nonfinite(g, prefix="ens: "))
    if nested:
        fn = jax.vmap(fn)
        grads = {"w": jnp.ones((2, 4, 3))}
    fn = jax.jit(fn)
    with caplog.at_level(logging.WARNING, logger="jamp"):
        assert bool(jnp.all(fn(grads)))
        jax.effects_barrier()
        assert not caplog.records
        bad = jax.tree.map(lambda a: a.at[(1, 2, 0) if nested else (2, 0)].set(jnp.inf), grads)
        finite = fn(bad)
        jax.effects_barrier()
    expected = np.ones(finite.shape, bool)
    expected[(1, 2) if nested else 2] = False
    np.testing.assert_array_equal(np.asarray(finite), expected)
    member = "(1, 2)" if nested else "2"
    assert [r.getMessage() for r in caplog.records] == [
        f"ens: vmap member {member}: non-finite values in w: 1 inf, 0 nan"
    ]


def test_log_under_vmap_has_no_callback_outside_a_cond():
    jaxpr = jax.make_jaxpr(jax.vmap(jamp.log_nonfinite))({"w": jnp.ones((4, 3))})

    def callbacks_outside_cond(j):
        n = 0
        for eqn in j.eqns:
            if eqn.primitive.name == "debug_callback":
                n += 1
            elif eqn.primitive.name != "cond":
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    n += callbacks_outside_cond(sub)
        return n

    assert callbacks_outside_cond(jaxpr.jaxpr) == 0


def test_prefix_must_be_a_str():
    with pytest.raises(TypeError, match=r"`prefix` to be a str"):
        jax.jit(lambda g, s: jamp.log_nonfinite(g, prefix=s))({"w": jnp.ones(2)}, jnp.int32(3))


def test_retries_stop_at_min_scale():
    vg = jamp.value_and_grad(lambda w: jnp.sum(w) * jnp.nan, max_retries=1000)
    out = jax.jit(vg)(jamp.dynamic_loss_scale(2.0**10, min_scale=2.0**6), jnp.ones(2))
    assert not bool(out.finite) and int(out.retries) == 4  # 2**10 -> 2**6, then no more
    assert float(out.loss_scale.scale) == 2.0**6


def test_every_failed_retry_ignores_hysteresis_the_last_too():
    vg = jamp.value_and_grad(lambda w: jnp.sum(w) * jnp.nan, max_retries=3)
    out = jax.jit(vg)(jamp.dynamic_loss_scale(2.0**16, hysteresis=3), jnp.ones(2))
    assert int(out.retries) == 3
    assert float(out.loss_scale.scale) == 2.0**12  # four failed attempts, four backoffs


def test_has_aux_needs_a_pair():
    vg = jamp.value_and_grad(lambda w: jnp.sum(w), has_aux=True)
    with pytest.raises(TypeError, match=r"`fun` to return a pair \(loss, aux\)"):
        vg(jamp.dynamic_loss_scale(), jnp.ones(2))
