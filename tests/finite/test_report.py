"""nonfinite_report and log_nonfinite: which leaf overflowed, counted on device and logged."""

import logging

import hypothesis.extra.numpy as hnp
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _bad_input import assert_clear_error
from _problem import grads_tree
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


# Every such tree takes the one small-leaf path (a leaf under 2**16 elements is counted in
# one reduction; the chunked path: test_report_counts_large_leaves_chunk_by_chunk), and
# each example compiles its own program: 20 examples, not 50.
@settings(max_examples=20, deadline=None)
@given(poisoned_trees())
def test_report_counts_equal_numpy(tree):
    report = jax.jit(jamp.debug.nonfinite_report)({k: jnp.asarray(v) for k, v in tree.items()})
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
        r = jax.jit(jamp.debug.nonfinite_report)({"x": jnp.asarray(x.reshape(shape))})["x"]
        assert (int(r.inf), int(r.nan)) == (int(np.isinf(x).sum()), int(np.isnan(x).sum()))


def test_report_structure_and_non_float_leaves():
    tree = {"a": [jnp.ones(2), None], "i": jnp.arange(3)}
    report = jamp.debug.nonfinite_report(tree)
    assert isinstance(report["a"][0], jamp.debug.NonfiniteCount) and report["a"][1] is None
    assert int(report["i"].inf) == 0 and int(report["i"].nan) == 0
    with pytest.raises(TypeError, match=r"`jamp.debug.nonfinite_report`.*type str at path \['s'\]"):
        jamp.debug.nonfinite_report({"s": "x"})


# ---------------------------------------------------------------- log_nonfinite


def test_log_fires_only_on_overflow_and_names_the_path(caplog):
    @jax.jit
    def step(bad):
        return jamp.debug.log_nonfinite(grads_tree(bad), prefix="step: ")

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
        return jamp.debug.log_nonfinite({"g": jnp.array([jnp.nan])}, every=3, count=count)

    with caplog.at_level(logging.WARNING, logger="jamp"):
        for c in range(7):
            step(jnp.int32(c))
        jax.effects_barrier()
    assert len(caplog.records) == 3  # counts 0, 3 and 6
    assert "g: 0 inf, 1 nan" in caplog.records[0].getMessage()


# ---------------------------------------------------------------- review fixes


def test_complex_entries_are_counted_once():
    values = [complex(np.inf, 0), complex(0, np.nan), complex(np.inf, np.nan), 1 + 1j]
    v = jnp.array(values, jnp.complex64)
    r = jax.jit(jamp.debug.nonfinite_report)(v)
    assert (int(r.inf), int(r.nan)) == (1, 2)  # inf+nanj is one NaN entry


@pytest.mark.parametrize("nested", [False, True])
def test_log_under_vmap_calls_back_only_when_a_member_overflows(caplog, nested):
    """A cond on a batched flag becomes a select, whose callback would run on
    every step for every member; jamp calls back once, only when one fires."""
    grads = {"w": jnp.ones((4, 3))}
    fn = jax.vmap(lambda g: jamp.debug.log_nonfinite(g, prefix="ens: "))
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


def test_prefix_must_be_a_str():
    with pytest.raises(TypeError, match=r"`prefix` to be a str"):
        jax.jit(lambda g, s: jamp.debug.log_nonfinite(g, prefix=s))(
            {"w": jnp.ones(2)}, jnp.int32(3)
        )


# ---------------------------------------------------------------- bad input

# Every invalid argument of log_nonfinite: id -> (call, exception, match).
BAD_INPUT = {
    "every=0": (
        lambda: jamp.debug.log_nonfinite({"g": jnp.ones(1)}, every=0),
        ValueError,
        r"`every` to be an int >= 1, got every=0",
    ),
    "every=2 without count": (
        lambda: jamp.debug.log_nonfinite({"g": jnp.ones(1)}, every=2),
        ValueError,
        r"Expected `count`",
    ),
    "prefix=3": (
        lambda: jamp.debug.log_nonfinite({"w": jnp.ones(2)}, prefix=3),
        TypeError,
        r"`prefix` to be a str",
    ),
    # issue #26: accepted, then an OverflowError inside jax; a string or an array for count
    "every=2**31": (
        lambda: jamp.debug.log_nonfinite({"g": jnp.ones(1)}, every=2**31, count=jnp.int32(1)),
        ValueError,
        r"`every` to be an int >= 1, got every=2147483648 instead \(at most 2\*\*31 - 1",
    ),
    "count='abc'": (
        lambda: jamp.debug.log_nonfinite({"g": jnp.ones(1)}, every=2, count="abc"),
        TypeError,
        r"`count` to be an integer scalar.*'abc' \(type str\)",
    ),
    "count=array": (
        lambda: jamp.debug.log_nonfinite({"g": jnp.ones(1)}, every=2, count=jnp.ones(3, jnp.int32)),
        ValueError,
        r"`count` to be a scalar.*shape \(3,\)",
    ),
    "count=float": (
        lambda: jamp.debug.log_nonfinite({"g": jnp.ones(1)}, every=2, count=jnp.float32(2)),
        TypeError,
        r"`count` to be an integer scalar",
    ),
    "count=2**40": (
        lambda: jamp.debug.log_nonfinite({"g": jnp.ones(1)}, every=2, count=2**40),
        ValueError,
        r"`count` to fit in an int32",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])
