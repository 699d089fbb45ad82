"""all_finite, unscale_and_check: exactness on both branches, golden unscale cases, devices."""

import functools
from collections.abc import Callable
from typing import NamedTuple

import _golden
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _bad_input import assert_clear_error
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jamp
from jamp._src import loss_scale as ls
from jamp._src.finite.check import check_unscaled
from jamp._src.finite.cpu import cpu_finite
from jamp._src.finite.default import default_finite
from jamp._src.leaves import float_leaves, unscale_leaf

EAGER_AND_JIT = [pytest.param(lambda f: f, id="eager"), pytest.param(jax.jit, id="jit")]


# ---------------------------------------------------------------- the branches


class Branch(NamedTuple):
    """A finite check as the tests call it."""

    all_finite: Callable  # (tree) -> bool scalar
    check_unscaled: Callable  # (state, tree) -> bool scalar
    unscale_and_check: Callable  # (state, tree) -> (unscaled tree, bool scalar)


def _called_directly(branch_fn):
    """The checks computed by one branch (``cpu_finite`` or ``default_finite``) called
    directly on the tree's floating leaves, as ``lax.platform_dependent`` calls it: on
    this CPU the public functions only ever run ``cpu_finite``."""

    def all_finite(tree):
        return branch_fn(*float_leaves(tree, "all_finite"))

    def check(state, tree):
        inv = ls.inverse_scale(state) if state.enabled else None
        return branch_fn(*float_leaves(tree, "unscale_and_check"), inv=inv)

    def unscale_and_check(state, tree):
        return jamp.unscale(state, tree), check(state, tree)

    return Branch(all_finite, check, unscale_and_check)


# Made once, so that jax.jit of the same function hits its cache from test to test.
BRANCHES = {
    # the public functions: lax.platform_dependent picks the platform's branch
    "dispatch": Branch(jamp.all_finite, check_unscaled, jamp.unscale_and_check),
    # the CPU branch, and the branch of every other platform (GPU, TPU), called directly
    "cpu": _called_directly(cpu_finite),
    "default": _called_directly(default_finite),
}
# The exactness tests run on both branches. The dispatch (the public functions) runs the
# CPU branch's program on this machine (eagerly, lax.platform_dependent calls cpu_finite
# itself; under jit it lowers that branch alone): it is tested on its own, eagerly and
# under jit, by test_the_public_functions_run_the_platforms_branch, under vmap and
# across devices below.
BOTH = ["cpu", "default"]
EVERY = list(BRANCHES)  # the dispatch and both branches


# ---------------------------------------------------------------- all_finite


@pytest.mark.parametrize("branch", BOTH)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.complex64])
@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("size", [7, 4096, 100_003])
def test_all_finite_catches_every_kind_in_large_leaves(wrap, bad, size, dtype, branch):
    # jnp.max drops NaN on >= 4096 elements on XLA:CPU; our check must not.
    # float16 leaves take their own path (all(isfinite), not a float32 sum).
    all_finite = BRANCHES[branch].all_finite
    x = np.ones(size, dtype)
    x[size // 2] = bad
    tree = {"a": jnp.ones(3), "b": jnp.asarray(x)}
    assert not bool(wrap(all_finite)(tree))
    assert not bool(wrap(all_finite)({"b": jnp.asarray(x)}))
    assert bool(wrap(all_finite)({"a": jnp.ones(3), "b": jnp.ones(size, dtype)}))


@pytest.mark.parametrize("branch", BOTH)
@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
def test_all_finite_large_finite_values_do_not_overflow(wrap, branch):
    # A sum of these overflows float32; they are all finite.
    x = jnp.full((1000,), 3e38, jnp.float32)
    h = jnp.full((1000,), 60000.0, jnp.float16)
    assert bool(wrap(BRANCHES[branch].all_finite)([x, -x, h]))


@pytest.mark.parametrize("branch", BOTH)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64])
def test_all_finite_every_dtype(dtype, branch):
    all_finite = BRANCHES[branch].all_finite
    x = jnp.ones((64,), dtype)
    assert bool(all_finite(x))
    assert not bool(all_finite(x.at[3].set(jnp.asarray(np.inf).astype(dtype))))
    assert not bool(all_finite(x.at[3].set(jnp.asarray(np.nan).astype(dtype))))


def test_all_finite_ignores_non_float_and_empty():
    assert jamp.all_finite({}).dtype == jnp.bool_ and bool(jamp.all_finite({}))
    assert bool(jamp.all_finite({"i": jnp.arange(3), "n": None, "b": jnp.array([True])}))
    out = jamp.all_finite(jnp.ones(3))
    assert out.shape == () and out.dtype == jnp.bool_


@st.composite
def trees_with_injections(draw):
    n = draw(st.integers(1, 5))
    leaves = []
    for _ in range(n):
        dtype = draw(st.sampled_from([np.float16, np.float32, ml_dtypes.bfloat16]))
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, max_side=6))
        arr = draw(
            hnp.arrays(
                dtype, shape, elements=st.floats(-1000, 1000, width=16, allow_subnormal=False)
            )
        )
        if arr.size and draw(st.booleans()):
            idx = draw(st.integers(0, arr.size - 1))
            arr = arr.copy().reshape(-1)
            arr[idx] = draw(st.sampled_from([np.inf, -np.inf, np.nan]))
            arr = arr.reshape(shape)
        leaves.append(arr)
    return leaves


# The CPU branch eagerly, as the public functions run it here (primitive by primitive); the
# default branch, which runs on GPUs and TPUs, compiled: here its eager run would be an
# XLA:CPU run of a program no CPU runs, with the same logic (sums of zeros and NaNs), and
# one program per drawn tree costs less than one per primitive.
@pytest.mark.parametrize(
    "branch,wrap",
    [pytest.param("cpu", lambda f: f, id="cpu"), pytest.param("default", jax.jit, id="default")],
)
@settings(max_examples=40, deadline=None)
@given(leaves=trees_with_injections())
def test_all_finite_equals_numpy(leaves, branch, wrap):
    expected = all(np.isfinite(x.astype(np.float32)).all() for x in leaves)
    tree = {f"l{i}": jnp.asarray(x) for i, x in enumerate(leaves)}
    assert bool(wrap(BRANCHES[branch].all_finite)(tree)) == expected


# ---------------------------------------------------------------- golden unscale kernel


def _unscale_cases():
    cases = []
    for c in _golden.load("unit_unscale.json")["cases"]:
        inv = float(_golden.array(c["inv_scale"]).reshape(()))
        if not (np.isfinite(inv) and ls.MIN_SCALE <= inv <= ls.MAX_SCALE):
            continue  # 1/scale outside the normal range: jamp's bounds never produce it
        if any(g["dtype"] == "float64" for g in c["grads_in"]):
            continue  # float64 needs jax_enable_x64, which these tests leave off
        cases.append(c)
    return cases


def _state_with_inverse(inv: np.float32):
    """A static state whose float32 1/scale is exactly ``inv``, if one exists."""
    s0 = np.float32(1) / inv
    for s in (s0, np.nextafter(s0, np.float32(0)), np.nextafter(s0, np.float32(np.inf))):
        if np.float32(1) / s == inv:
            return jamp.static_loss_scale(float(s))
    return None


@functools.cache
def _kernel_outputs() -> list:
    """``unscale_leaf`` under jit on every golden case's gradients (the same for every
    branch: computed once per process)."""
    kernel = jax.jit(unscale_leaf)
    outs = []
    for c in _unscale_cases():
        inv = jnp.asarray(_golden.array(c["inv_scale"]).reshape(()))
        outs.append([np.asarray(kernel(jnp.asarray(_golden.array(g)), inv)) for g in c["grads_in"]])
    return outs


@pytest.mark.parametrize("branch", BOTH)
def test_unit_unscale_golden(branch):
    cases = _unscale_cases()
    assert len(cases) == 74
    checked = public = caught_by_jamp_only = 0
    for c, outs in zip(cases, _kernel_outputs(), strict=True):
        inv = _golden.array(c["inv_scale"]).reshape(())
        state = _state_with_inverse(inv)
        grads_in = [_golden.array(g) for g in c["grads_in"]]
        grads_out = [_golden.array(g) for g in c["grads_out"]]
        if state is not None:
            public += 1
            grads = [jnp.asarray(g) for g in grads_in]
            via_api, finite = BRANCHES[branch].unscale_and_check(state, grads)
            for a, b in zip(via_api, outs, strict=True):
                assert _golden.bits_equal(np.asarray(a), b)
            # jamp checks the unscaled values: torch's flag, plus overflows made by unscaling.
            expected_finite = all(np.isfinite(o.astype(np.float32)).all() for o in grads_out)
            assert bool(finite) == expected_finite, c
            torch_found = (
                _golden.scalar(c["found_inf_out"]) != 0 and _golden.scalar(c["found_inf_in"]) == 0
            )
            if torch_found:
                assert not bool(finite)
            elif not expected_finite:
                caught_by_jamp_only += 1
        for gin, gout, got in zip(grads_in, grads_out, outs, strict=True):
            assert got.dtype == gout.dtype and got.shape == gout.shape
            with np.errstate(over="ignore", invalid="ignore"):
                mid = gin.astype(np.float32) * inv
            flushed = (
                _golden.is_f32_subnormal(gin.astype(np.float32))
                | _golden.is_f32_subnormal(mid)
                | _golden.is_f32_subnormal(gout.astype(np.float32))
            )
            keep = ~flushed
            assert _golden.bits_equal(got[keep], gout[keep]), (c["inv_scale"], gin, got, gout)
            checked += int(keep.sum())
    assert checked > 1000 and public >= 40
    assert caught_by_jamp_only > 0  # inv=1024 on 3e38: torch misses it, jamp does not


@pytest.mark.parametrize("branch", BOTH)
def test_unscale_and_check_catches_overflow_created_by_unscaling(branch):
    state = jamp.static_loss_scale(2.0**-10)
    g = jnp.array([3e38, 1.0], jnp.float32)  # finite, scaled
    out, finite = BRANCHES[branch].unscale_and_check(state, g)
    assert not bool(finite) and np.isinf(np.asarray(out)[0])


@pytest.mark.parametrize("branch", BOTH)
def test_unscale_and_check_disabled_still_checks(branch):
    unscale_and_check = BRANCHES[branch].unscale_and_check
    _, finite = unscale_and_check(jamp.no_loss_scale(), {"g": jnp.array([jnp.nan])})
    assert not bool(finite)


@pytest.mark.parametrize("branch", BOTH)
@pytest.mark.parametrize("shape", [(128, 128), (3, 40, 1024), (100_003,), (784, 2048), (5000,)])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_check_is_exact_on_float32_leaves_up_to_the_largest(shape, bad, branch):
    # Large float32 leaves (the CPU's product rows) and small ones (gathered):
    # any inf or NaN, first, middle or last, is found, and finite values up to
    # float32's largest are finite. On a CPU this takes one read, with no exact
    # branch (test_implementation_pins.py pins that); elsewhere (the default
    # branch) the sums are of zeros and NaNs, which cannot overflow.
    jitted = jax.jit(BRANCHES[branch].all_finite)

    def check(*leaves):
        return jitted(list(leaves))

    # Two programs per shape: the leaf alone, and a small leaf then the leaf.
    big = np.full(shape, np.finfo(np.float32).max, np.float32)
    big.reshape(-1)[::2] *= -1
    assert bool(check(jnp.asarray(big)))
    assert bool(check(jnp.ones(3), jnp.asarray(np.abs(big))))
    assert not bool(check(jnp.full((3,), np.nan), jnp.asarray(big)))
    n = int(np.prod(shape))
    for where in (0, n // 2 + 1, n - 1):
        x = np.ones(shape, np.float32)
        x.reshape(-1)[where] = bad
        assert not bool(check(jnp.asarray(x))), where
        assert not bool(check(jnp.ones(3), jnp.asarray(x))), where


# One leaf of each kind the CPU check sorts leaves into, and the values that
# overflow once unscaled at a scale of 2**-10.
_KINDS = {
    "rows": ((64, 512), np.float32, 3e38),
    "small32": ((30,), np.float32, 3e38),
    "small16": ((3, 5), np.float16, 60000.0),
    "smallbf16": ((7,), ml_dtypes.bfloat16, 3e38),
    "smallc64": ((4,), np.complex64, 3e38),
    "half": ((200, 100), np.float16, 60000.0),
    "narrow": ((20_000, 2), np.float32, 3e38),
    "bigbf16": ((128, 128), ml_dtypes.bfloat16, 3e38),
}


def _leaves_of_every_kind(hit=None, bad=None) -> dict:
    """A leaf of each kind in ``_KINDS``; ``hit``'s middle element set to ``bad`` ("big":
    its kind's value that overflows once unscaled at a scale of 2**-10)."""
    rng = np.random.default_rng(0)
    leaves = {k: rng.normal(size=s).astype(d) for k, (s, d, _) in _KINDS.items()}
    if hit is not None:
        shape, _, big = _KINDS[hit]
        leaves[hit].reshape(-1)[int(np.prod(shape)) // 2] = big if bad == "big" else bad
    return leaves


def _unscaled_is_finite(leaves: dict, scale: float) -> bool:
    """NumPy: whether every leaf unscaled as jamp.unscale does it (float32 arithmetic,
    rounded to the leaf's dtype; a complex leaf's parts in float32) is finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        inv = np.float32(1 / scale)
        return all(
            np.isfinite(
                v * inv if v.dtype == np.complex64 else (v.astype(np.float32) * inv).astype(v.dtype)
            ).all()
            for v in leaves.values()
        )


@pytest.mark.parametrize("branch", BOTH)
@pytest.mark.parametrize("scale", [2.0**-10, 1.0, 2.0**10])
@pytest.mark.parametrize("hit", list(_KINDS))
@pytest.mark.parametrize("bad", ["big", np.inf, np.nan])
def test_check_is_exact_on_every_kind_of_leaf(scale, hit, bad, branch):
    leaves = _leaves_of_every_kind(hit, bad)
    state = jamp.static_loss_scale(scale)
    tree = {k: jnp.asarray(v) for k, v in leaves.items()}
    b = BRANCHES[branch]
    assert bool(jax.jit(b.check_unscaled)(state, tree)) == _unscaled_is_finite(leaves, scale)
    assert bool(jax.jit(b.all_finite)(tree)) == (bad == "big")


# ---------------------------------------------------------------- the dispatch


@pytest.mark.parametrize("wrap", EAGER_AND_JIT)
def test_the_public_functions_run_the_platforms_branch(wrap):
    """The public functions, eagerly and under jit, on a tree of large and small float32
    and float16 leaves: each answer is NumPy's (the branches' exactness is tested above),
    the unscaled values are jamp.unscale's, a disabled state still checks, and invalid
    input is refused under jit too."""
    all_finite, check = wrap(jamp.all_finite), wrap(check_unscaled)
    unscale_and_check = wrap(jamp.unscale_and_check)
    state = jamp.static_loss_scale(2.0**-10)  # unscaling can overflow: the exact branch runs
    kinds = ("rows", "small32", "small16", "half")
    # clean; a NaN in a large float32 leaf; an inf among the gathered float16 values; a
    # float16 leaf that overflows once unscaled only
    for hit, bad in [(None, None), ("rows", np.nan), ("small16", np.inf), ("half", "big")]:
        leaves = {k: v for k, v in _leaves_of_every_kind(hit, bad).items() if k in kinds}
        tree = {k: jnp.asarray(v) for k, v in leaves.items()}
        raw, want = bad in (None, "big"), _unscaled_is_finite(leaves, 2.0**-10)
        assert bool(all_finite(tree)) == raw, hit
        assert bool(check(state, tree)) == want, hit
        grads, finite = unscale_and_check(state, tree)
        assert bool(finite) == want, hit
        for k, v in jamp.unscale(state, tree).items():
            a, b = np.asarray(grads[k]), np.asarray(v)
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), k
        _, finite = unscale_and_check(jamp.no_loss_scale(), tree)  # disabled: still checks
        assert bool(finite) == raw, hit
    with pytest.raises(TypeError, match=r"expected `state` to be a LossScaleState.*got dict"):
        wrap(lambda t: jamp.unscale_and_check({}, t))(tree)
    with pytest.raises(TypeError, match=r"`filter` to return a bool for each leaf"):
        wrap(lambda t: jamp.all_finite(t, filter=lambda x: jnp.ones(2, bool)))(tree)


@pytest.mark.parametrize("branch", BOTH)
@pytest.mark.parametrize("scale", [2.0**-10, 1.0, 2.0**10])
def test_fast_path_and_fallback_agree_with_numpy(scale, branch):
    state = jamp.static_loss_scale(scale)
    rng = np.random.default_rng(0)
    cases = [
        np.ones(100, np.float32),
        np.full(100, 3e38, np.float32),  # finite, but the sum overflows: fallback
        np.array([3e38, 1.0], np.float32),  # overflows only once unscaled when scale < 1
        rng.normal(size=50).astype(np.float32),
        np.full(100, 60000.0, np.float16),  # float16: overflows once unscaled when scale < 1
        np.array([60000.0, np.inf], np.float16),
        rng.normal(size=50).astype(np.float16),
    ]
    for x in cases:
        with np.errstate(over="ignore"):
            # as unscaled: float32 arithmetic, rounded to the leaf's dtype
            unscaled = (x.astype(np.float32) * np.float32(1 / scale)).astype(x.dtype)
            expected = np.isfinite(unscaled).all()
        _, finite = jax.jit(BRANCHES[branch].unscale_and_check)(state, jnp.asarray(x))
        assert bool(finite) == expected, (scale, x[:3])


@pytest.mark.parametrize("branch", BOTH)
def test_fallback_is_exact_on_many_leaves_of_mixed_dtypes(branch):
    rng = np.random.default_rng(1)
    shapes = [(3, 5), (7,), (2, 2, 2), (1,), (11, 4)] * 4
    dtypes = [np.float32, ml_dtypes.bfloat16, np.float16]
    leaves = [rng.normal(size=s).astype(dtypes[i % 3]) for i, s in enumerate(shapes)]
    state = jamp.static_loss_scale(2.0**-10)  # scale < 1: the exact branch always runs
    check = jax.jit(BRANCHES[branch].check_unscaled)

    def expected(leaves):
        with np.errstate(over="ignore"):
            return all(
                np.isfinite((x.astype(np.float32) * np.float32(2.0**10)).astype(x.dtype)).all()
                for x in leaves
            )

    assert bool(check(state, [jnp.asarray(x) for x in leaves])) == expected(leaves)
    for i in (0, 7, 14):  # float32, bfloat16, float16: overflows once unscaled, then NaN
        big = 60000.0 if leaves[i].dtype == np.float16 else 3e38
        for bad in (big, np.nan):
            hit = [x.copy() for x in leaves]
            hit[i].reshape(-1)[-1] = bad
            got = bool(check(state, [jnp.asarray(x) for x in hit]))
            assert got == expected(hit) and not got, (i, bad)


# ---------------------------------------------------------------- devices


@pytest.mark.multidevice
def test_eight_devices():
    assert jax.device_count() == 8


@pytest.mark.multidevice
@pytest.mark.parametrize("shape", [(8, 16), (8 * 128, 256)], ids=["small", "matrix-vector"])
def test_shard_map_axis_name_agreement(shape):
    # Per replica, the larger leaf is (128, 256): summed by the CPU's
    # matrix-vector product, under shard_map's varying-axes checks.
    mesh = Mesh(np.array(jax.devices()), ("data",))
    state = jamp.dynamic_loss_scale(4.0)
    g = np.ones(shape, np.float32)
    g[shape[0] * 5 // 8, 3] = np.inf  # only the 6th shard sees it

    def local(grads):
        _, finite = jamp.unscale_and_check(state, grads, axis_name="data")
        local_only = jamp.all_finite(grads)
        return finite[None], local_only[None]

    f = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P("data")))
    )
    agreed, local_only = f(jnp.asarray(g))
    assert not np.asarray(agreed).any()  # every replica reports non-finite
    assert np.asarray(local_only).sum() == 7  # without axis_name, only one would


@pytest.mark.multidevice
def test_pmap_axis_name_agreement():
    g = np.ones((8, 4), np.float32)
    g[2, 1] = np.nan
    out = jax.pmap(lambda x: jamp.all_finite(x, axis_name="i"), axis_name="i")(jnp.asarray(g))
    assert out.shape == (8,) and not np.asarray(out).any()
    ok = jax.pmap(lambda x: jamp.all_finite(x, axis_name="i"), axis_name="i")(jnp.ones((8, 4)))
    assert np.asarray(ok).all()


@pytest.mark.multidevice
def test_sharded_jit_needs_no_axis_name():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    g = np.ones((8, 16), np.float32)
    g[7, 0] = -np.inf
    x = jax.device_put(jnp.asarray(g), NamedSharding(mesh, P("data")))
    assert not bool(jax.jit(jamp.all_finite)(x))


@pytest.mark.multidevice
@pytest.mark.parametrize("spec", [P("data", None), P(None, "data"), P(("data",), None)])
def test_sharded_large_leaf_is_checked_where_it_lies(spec):
    # The CPU check contracts the last dimension without reshaping, so a leaf
    # sharded along either dimension is checked where it lies (the compiled
    # program's lack of gathers is pinned in test_implementation_pins.py).
    mesh = Mesh(np.array(jax.devices()), ("data",))
    g = np.ones((512, 1024), np.float32)
    x = jax.device_put(jnp.asarray(g), NamedSharding(mesh, spec))
    check = jax.jit(jamp.all_finite)
    assert bool(check(x))
    g[300, 1000] = np.nan
    assert not bool(check(jax.device_put(jnp.asarray(g), NamedSharding(mesh, spec))))


@pytest.mark.parametrize("branch", EVERY)
def test_vmap_checks_each_large_leaf_alone(branch):
    g = np.ones((4, 128, 256), np.float32)
    g[2, 100, 7] = np.nan
    out = jax.jit(jax.vmap(BRANCHES[branch].all_finite))(jnp.asarray(g))
    assert out.tolist() == [True, True, False, True]


def test_a_program_exported_for_several_platforms_is_exact_here():
    # A program exported for several platforms picks the CPU form when run
    # here, and stays exact.
    from jax import export

    x = jnp.ones((256, 256))
    both = export.export(jax.jit(jamp.all_finite), platforms=("cpu", "cuda"))(x)
    bad = np.ones((256, 256), np.float32)
    bad[3, 4] = np.nan
    assert bool(both.call(x)) and not bool(both.call(jnp.asarray(bad)))


@pytest.mark.parametrize("branch", BOTH)
@pytest.mark.parametrize("scale", [2.0**-1, 1.0, 2.0**10])
@pytest.mark.parametrize("fill", [1e38, 2e38, 3e38])
def test_large_leaves_unscaling_overflow_is_exact(scale, fill, branch):
    # Large float32 leaves (the CPU's matrix-vector sum) near float32's
    # largest: with a scale below 1 only the exact pass can tell whether
    # unscaling overflows; with a scale >= 1 it cannot.
    x = np.full((128, 256), fill, np.float32)
    x[::2] *= -1
    with np.errstate(over="ignore"):
        expected = bool(np.isfinite(x * np.float32(1 / scale)).all())
    unscale_and_check = jax.jit(BRANCHES[branch].unscale_and_check)
    _, finite = unscale_and_check(jamp.static_loss_scale(scale), jnp.asarray(x))
    assert bool(finite) == expected
    assert expected == (scale >= 1 or fill < 2e38)


@pytest.mark.parametrize("branch", BOTH)
def test_float64_leaves_are_checked_exactly(branch):
    # float64 leaves are summed in float32 on the first read, where 1e300
    # overflows; the exact branch then decides, in float64.
    with jax.enable_x64(True):
        big = jnp.full((200, 100), 1e300, jnp.float64)
        small = jnp.array([1e300, -1e300, 1.0], jnp.float64)
        check = jax.jit(BRANCHES[branch].all_finite)
        assert bool(check([big, small, jnp.ones((300, 300))]))
        assert not bool(check([big.at[7, 9].set(jnp.nan), small]))
        assert not bool(check([big, small.at[2].set(-jnp.inf)]))
        state = jamp.static_loss_scale(2.0**-10)
        unscaled = jax.jit(BRANCHES[branch].check_unscaled)
        assert bool(unscaled(state, [big, small]))
        assert not bool(unscaled(state, [big.at[0, 0].set(1e308), small]))


@pytest.mark.parametrize("branch", BOTH)
def test_python_float_leaves_are_checked_as_unscale_makes_them(branch):
    """A Python float leaf becomes float32 in jamp.unscale (as in torch), under
    x64 too: the flag describes that float32 value, not a float64 one."""
    with jax.enable_x64(True):
        state = jamp.static_loss_scale(0.5)  # unscaling doubles
        unscale_and_check = BRANCHES[branch].unscale_and_check
        for wrap in (lambda f: f, jax.jit):
            grads, finite = wrap(lambda: unscale_and_check(state, {"g": 3e38}))()
            assert grads["g"].dtype == jnp.float32 and np.isinf(np.asarray(grads["g"]))
            assert not bool(finite)
            grads, finite = wrap(lambda: unscale_and_check(state, {"g": 1e38}))()
            assert bool(finite) and np.isfinite(np.asarray(grads["g"]))


# ---------------------------------------------------------------- bad input

# Every invalid tree or state given to all_finite and unscale_and_check: id -> (call,
# exception, match).
BAD_INPUT = {
    "all_finite leaf=str": (
        lambda: jamp.all_finite({"s": "text"}),
        TypeError,
        r"jamp\.all_finite`.*str at path \['s'\]",
    ),
    "all_finite nested leaf=str": (
        lambda: jamp.all_finite({"x": ["oops"]}),
        TypeError,
        r"`jamp.all_finite`.*type str at path \['x'\]\[0\]",
    ),
    "unscale_and_check leaf=str": (
        lambda: jamp.unscale_and_check(jamp.dynamic_loss_scale(), ("x",)),
        TypeError,
        r"str at path \[0\]",
    ),
    "unscale_and_check state=dict": (
        lambda: jamp.unscale_and_check({}, {"w": jnp.ones(2)}),
        TypeError,
        r"expected `state` to be a LossScaleState.*got dict",
    ),
    # issue #26: an object array holding NaN was ignored (all_finite said True)
    "all_finite object array holding NaN": (
        lambda: jamp.all_finite({"g": np.array([np.nan, 1.0], dtype=object)}),
        TypeError,
        r"`jamp.all_finite` expected a pytree of numeric arrays, got .*dtype object.*\['g'\]",
    ),
    "all_finite str array": (
        lambda: jamp.all_finite(np.array(["nan"])),
        TypeError,
        r"numeric arrays.*dtype <U3 at path <root>",
    ),
    "all_finite filter returning an array": (
        lambda: jamp.all_finite({"w": jnp.ones(2)}, filter=lambda x: jnp.ones(2, bool)),
        TypeError,
        r"`filter` to return a bool for each leaf.*ArrayImpl of shape \(2,\)",
    ),
    "unscale_and_check filter returning None": (
        lambda: jamp.unscale_and_check(jamp.dynamic_loss_scale(), [1.0], filter=lambda x: None),
        TypeError,
        r"`filter` to return a bool.*NoneType",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])
