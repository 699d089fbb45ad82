"""jamp/_src/float8/: quantisation, the float8 products' custom_vjps, TE's delayed recipe.

The recipe is checked bit-exactly against a NumPy model of Transformer
Engine's delayed scaling over several steps, and against flax.linen.fp8_ops
on the same inputs and history.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _autocast_helpers import eqns_named, rel_err
from _bad_input import assert_clear_error
from _float8_helpers import DNS, MM, ROW_MAX, numpy_recipe, operands, rng, spec
from flax.linen import fp8_ops
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jamp
from jamp._src.float8 import products
from jamp._src.float8.recipe import Float8State, check_values, init_state, next_state, traced_check

F32 = np.float32
E4M3 = np.dtype(jnp.float8_e4m3fn)


# --------------------------------------------------------------------------- quantisation


def test_quantize_is_a_saturating_round_to_nearest_and_keeps_non_finite_values():
    x = np.array([0.0, 1e-3, -0.3, 2.5, 447.9, 460.0, -1e6, np.inf, -np.inf, np.nan], F32)
    for dtype, big in ((jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)):
        got = np.asarray(products.quantize(jnp.asarray(x), F32(1.0), dtype))
        want = np.clip(x, -big, big).astype(np.dtype(dtype))
        finite = np.isfinite(x)
        assert got[finite].tobytes() == want[finite].tobytes()  # bit-exact, as ml_dtypes rounds
        # inf and NaN become NaN (float8_e5m2's infinities too): one pass, no select
        assert np.isnan(got[~finite].astype(F32)).all()
        # a finite value the scale takes past float32 is not finite either
        huge = products.quantize(jnp.asarray([3e38, -1.0], F32), F32(1e10), dtype)
        assert np.isnan(np.asarray(huge, F32)[0]) and np.asarray(huge, F32)[1] == -big


def test_quantize_runs_under_its_named_scope():
    """jamp.debug's precision_report finds a quantisation, its scale and its scaled tensor by
    the scope (numerics/report.py); a scope is metadata, so the program is the same."""
    from jamp._src.jaxprs import MARKER, SCOPE_QUANTIZE

    x, s = jnp.ones((2, 3), jnp.bfloat16), jnp.float32(2.0)
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        jaxpr = jax.make_jaxpr(functools.partial(products.quantize, dtype=dtype))(x, s)
        prims = [e.primitive.name for e in jaxpr.eqns]
        assert prims == ["convert_element_type", "mul", "clamp", "sub", "add"] + prims[-1:]
        assert prims[-1] == "convert_element_type"
        assert {str(e.source_info.name_stack) for e in jaxpr.eqns} == {SCOPE_QUANTIZE}
    # autocast runs a name stack holding its marker as a disabled region
    assert MARKER not in SCOPE_QUANTIZE


def test_current_scale_maps_amax_to_the_largest_finite_value():
    for amax, row, want in ((2.0, 0, 224.0), (1e-6, 0, 448e6), (1.0, 2, 57344.0)):
        assert float(products.current_scale(jnp.float32(amax), row)) == pytest.approx(want)
    assert float(products.current_scale(jnp.float32(0.0), 0)) == 2.0**126  # 1/scale is normal
    assert float(products.current_scale(jnp.float32(np.inf), 0)) == 0.0  # x * 0: inf -> NaN
    assert np.isnan(float(products.current_scale(jnp.float32(np.nan), 0)))


def test_tiny_values_keep_their_precision():
    x = jnp.asarray(rng(0).standard_normal(1000) * 1e-6, jnp.float32)
    s = products.current_scale(products.amax(x), 0)
    back = products.quantize(x, s, jnp.float8_e4m3fn).astype(jnp.float32) / s
    assert rel_err(back, x) < 0.04  # 3 mantissa bits: about 2**-5 relative per element
    # Without a scale, float8_e4m3fn flushes them all (smallest subnormal 2**-9).
    assert not np.any(np.asarray(x.astype(jnp.float8_e4m3fn), F32))


# --------------------------------------------------------------------------- the products


@pytest.mark.parametrize("dn", DNS, ids=["mm", "mm_t", "batched", "two_contracting"])
def test_current_dot_and_its_gradients_match_float32(dn):
    # One jitted program per case: the dimension numbers are handled as the product is
    # traced, the same eagerly (eager products: test_non_finite_operands_give_...).
    lhs, rhs = operands(dn, 1)

    def plain(a, b):
        return lax.dot_general(a, b, dn)

    @jax.jit
    def products_and_gradients(lhs, rhs, ct):
        out, vjp = jax.vjp(lambda a, b: products.current_dot(a, b, spec(dn)), lhs, rhs)
        want, want_vjp = jax.vjp(plain, lhs, rhs)
        return out, want, vjp(ct), want_vjp(ct)

    ct = jnp.asarray(rng(2).standard_normal(jax.eval_shape(plain, lhs, rhs).shape), jnp.float32)
    out, want, grads, want_grads = products_and_gradients(lhs, rhs, ct)
    assert out.dtype == jnp.float32 and rel_err(out, want) < 0.08
    for got, ref in zip(grads, want_grads, strict=True):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        assert rel_err(got, ref) < 0.1


def test_the_forward_and_backward_jaxprs_hold_e4m3_and_e5m2_operands():
    lhs, rhs = operands(MM, 3)
    f = lambda a, b: jnp.sum(products.current_dot(a, b, spec()))  # noqa: E731
    fwd = jax.make_jaxpr(f)(lhs, rhs)
    bwd = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(lhs, rhs)

    def dots(jaxpr):
        return [
            ([str(v.aval.dtype) for v in e.invars], str(e.outvars[0].aval.dtype),
             str(e.params["precision"]))
            for e in eqns_named(jaxpr, "dot_general")
        ]  # fmt: skip

    assert dots(fwd) == [(["float8_e4m3fn", "float8_e4m3fn"], "float32", "None")]
    # The gradient products (x weight, x input) are each chosen at lowering: on CUDA GPUs
    # float32 accumulation without fast accumulation (docs/float8-design.md), elsewhere DEFAULT.
    assert sorted(dots(bwd)) == [
        (["float8_e4m3fn", "float8_e4m3fn"], "float32", "None"),  # the forward product
        *[(["float8_e5m2", "float8_e4m3fn"], "float32", "ANY_F8_ANY_F8_F32")] * 2,
        *[(["float8_e5m2", "float8_e4m3fn"], "float32", "None")] * 2,
    ]
    (choice,) = {e.params["branches_platforms"] for e in eqns_named(bwd, "cond")}
    assert choice == (("cuda",), None)


def test_non_finite_operands_give_non_finite_products_and_gradients():
    lhs, rhs = operands(MM, 4)
    lhs = lhs.at[0, 0].set(jnp.inf)
    out, vjp = jax.vjp(lambda a, b: products.current_dot(a, b, spec()), lhs, rhs)
    assert not np.isfinite(np.asarray(out)).all()
    out, vjp = jax.vjp(lambda a, b: products.current_dot(a, b, spec()), *operands(MM, 5))
    d_lhs, d_rhs = vjp(jnp.full(out.shape, jnp.inf))  # an overflowed gradient stays one
    assert not np.isfinite(np.asarray(d_lhs)).all() and not np.isfinite(np.asarray(d_rhs)).all()


# --------------------------------------------------------------------------- delayed scaling


def numpy_quantize(x, scale, dtype):
    big = F32(ml_dtypes.finfo(dtype).max)
    y = x.astype(F32) * scale
    return np.where(np.isfinite(x), np.clip(y, -big, big), y).astype(dtype)


def steps(n, shape_l=(4, 6), shape_r=(6, 3)):
    """Per step (lhs, rhs, output cotangent), with magnitudes that move; one all-zero step
    and one with an infinite gradient, which the recipe must not turn into a scale."""
    r = rng(7)
    out = []
    for t in range(n):
        mag = 10.0 ** r.uniform(-4, 3, size=3)
        lhs = (r.standard_normal(shape_l) * mag[0]).astype(F32)
        rhs = (r.standard_normal(shape_r) * mag[1]).astype(F32)
        ct = (r.standard_normal((shape_l[0], shape_r[1])) * mag[2]).astype(F32)
        if t == 2:
            lhs = np.zeros_like(lhs)
        if t == 4:
            ct[0, 0] = np.inf
        out.append((lhs, rhs, ct))
    return out


RECIPES = [
    jamp.float8.DelayedScaling(amax_history_len=4),
    jamp.float8.DelayedScaling(amax_history_len=3, margin=2, amax_compute_algo="most_recent"),
    jamp.float8.DelayedScaling(amax_history_len=1),
]


@pytest.mark.parametrize("recipe", RECIPES, ids=["max", "most_recent_margin", "h1"])
def test_delayed_state_evolves_bit_exactly_as_the_numpy_model_of_the_recipe(recipe):
    state = init_state(recipe, scale=1.0)  # TE's start, so every step uses the state
    history, scale = np.zeros((3, recipe.amax_history_len), F32), np.ones(3, F32)
    s = spec(recipe=recipe)

    @jax.jit
    def step(state, lhs, rhs, ct):
        def f(a, b, hist, scale):
            return products.delayed_dot(a, b, hist, scale, s)

        out, vjp = jax.vjp(f, lhs, rhs, *state)
        return out, Float8State(*vjp(ct)[2:])

    for t, (lhs, rhs, ct) in enumerate(steps(7)):
        out, state = step(state, lhs, rhs, ct)
        # The forward pass quantised with the scales of the state it was given.
        q_l = numpy_quantize(lhs, scale[0], ml_dtypes.float8_e4m3fn).astype(np.float64)
        q_r = numpy_quantize(rhs, scale[1], ml_dtypes.float8_e4m3fn).astype(np.float64)
        want = (q_l @ q_r) / (np.float64(scale[0]) * np.float64(scale[1]))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * abs(want).max())
        amaxes = np.array([abs(lhs).max(), abs(rhs).max(), abs(ct).max()], F32)
        history, scale = numpy_recipe(history, scale, amaxes, recipe)
        assert np.asarray(state.amax_history).tobytes() == history.tobytes(), t
        assert np.asarray(state.scale).tobytes() == scale.tobytes(), t
    assert np.isinf(history).any() or recipe.amax_history_len < 3  # the inf step is recorded


def test_delayed_scaling_matches_flax_fp8_ops_on_the_same_inputs_and_history():
    """flax.linen.fp8_ops keeps the reciprocal of jamp's scale and computes it at the start
    of a step from the history jamp computed it from at the end of the step before: the
    histories agree bit for bit, the scales are reciprocals, the products agree."""
    recipe = jamp.float8.DelayedScaling(amax_history_len=5)
    h = recipe.amax_history_len
    state = init_state(recipe, scale=1.0)  # Flax's start
    meta = dict(
        lhs_scale=jnp.ones(1), rhs_scale=jnp.ones(1), grad_scale=jnp.ones(1),
        lhs_amax_history=jnp.zeros(h), rhs_amax_history=jnp.zeros(h),
        grad_amax_history=jnp.zeros(h),
    )  # fmt: skip
    s = spec(recipe=recipe)

    @jax.jit
    def ours(state, lhs, rhs, ct):
        def f(a, b, hist, scale):
            return products.delayed_dot(a, b, hist, scale, s)

        out, vjp = jax.vjp(f, lhs, rhs, *state)
        d_l, d_r, *new = vjp(ct)
        return out, (d_l, d_r), Float8State(*new)

    @jax.jit
    def theirs(meta, lhs, rhs, ct):
        def f(lhs, rhs, meta):
            return fp8_ops.fp8_scaled_dot_general(
                lhs, rhs, MM, preferred_element_type=jnp.float32, **meta
            )

        out, vjp = jax.vjp(f, lhs, rhs, meta)
        d_l, d_r, new = vjp(ct)
        return out, (d_l, d_r), new

    for lhs, rhs, ct in steps(4):  # the steps before the infinite gradient
        out, grads, new_state = ours(state, lhs, rhs, ct)
        f_out, f_grads, new_meta = theirs(meta, lhs, rhs, ct)
        for row, name in enumerate(("lhs", "rhs", "grad")):
            hist, f_hist = new_state.amax_history[row], new_meta[f"{name}_amax_history"]
            assert np.asarray(hist).tobytes() == np.asarray(f_hist).tobytes(), name
            used, f_used = state.scale[row], new_meta[f"{name}_scale"][0]  # this step's
            assert np.asarray(F32(1) / used).tobytes() == np.asarray(f_used).tobytes(), name
        assert rel_err(out, f_out) < 1e-2
        for a, b in zip(grads, f_grads, strict=True):
            assert rel_err(a, b) < 1e-2
        state, meta = new_state, new_meta


def _delayed(recipe, state, lhs, rhs, ct):
    f = lambda a, b, h, c: products.delayed_dot(a, b, h, c, spec(recipe=recipe))  # noqa: E731
    out, vjp = jax.vjp(f, lhs, rhs, *state)
    return out, vjp(ct)


def test_unmeasured_current_a_fresh_state_quantises_with_the_current_scales():
    """Scale 0 is "not measured yet": the first step is current scaling, bit for bit."""
    recipe = jamp.float8.DelayedScaling(amax_history_len=2, unmeasured="current")
    lhs, rhs = operands(MM, 8)
    lhs = lhs * 1e-6  # TE's start (scale 1) would flush it: float8_e4m3fn's smallest is 2**-9
    ct = jnp.ones((3, 5))
    fresh = init_state(recipe)
    np.testing.assert_array_equal(fresh.scale, np.zeros(3))
    out, (d_l, d_r, hist, scale) = _delayed(recipe, fresh, lhs, rhs, ct)
    want, vjp = jax.vjp(lambda a, b: products.current_dot(a, b, spec()), lhs, rhs)
    assert np.asarray(out).tobytes() == np.asarray(want).tobytes()
    for a, b in zip((d_l, d_r), vjp(ct), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    np.testing.assert_array_equal(scale, ROW_MAX / np.asarray(hist)[:, 0])
    assert rel_err(_delayed(recipe, Float8State(hist, scale), lhs, rhs, ct)[0], want) < 1e-6
    te = jamp.float8.DelayedScaling(amax_history_len=2)  # unmeasured="one": TE's start flushes it
    assert not np.any(np.asarray(_delayed(te, init_state(te), lhs, rhs, ct)[0]))


def test_unmeasured_one_quantises_a_zero_state_with_scale_1():
    """TE's start (that the quantisation never waits for the operand's amax is pinned in
    test_implementation_pins.py)."""
    recipe = jamp.float8.DelayedScaling(amax_history_len=2)
    lhs, rhs = operands(MM, 9)
    ct = jnp.ones((3, 5))
    fresh = init_state(recipe)
    np.testing.assert_array_equal(fresh.scale, np.ones(3))
    zero = Float8State(fresh.amax_history, jnp.zeros(3))
    assert (
        np.asarray(_delayed(recipe, zero, lhs, rhs, ct)[0]).tobytes()
        == np.asarray(_delayed(recipe, fresh, lhs, rhs, ct)[0]).tobytes()
    )


@settings(max_examples=20, deadline=None)
@given(
    amaxes=st.lists(
        st.sampled_from([0.0, 1e-40, 1e-30, 3e-3, 0.5, 7.0, 1e4, 3e38, np.inf, np.nan]),
        min_size=3,
        max_size=3,
    ),
    old=st.sampled_from([1.0, 0.25, 3e5]),
    recipe=st.sampled_from(RECIPES),
)
def test_next_state_is_the_numpy_recipe_for_any_amaxes(amaxes, old, recipe):
    h = recipe.amax_history_len
    history = np.linspace(0, 2, 3 * h, dtype=F32).reshape(3, h)
    state = Float8State(jnp.asarray(history), jnp.full(3, old, jnp.float32))
    amaxes = np.array(amaxes, F32)
    got = next_state(state, jnp.asarray(amaxes), recipe)
    want_h, want_s = numpy_recipe(history, np.full(3, old, F32), amaxes, recipe)
    assert np.asarray(got.amax_history).tobytes() == want_h.tobytes()
    assert np.asarray(got.scale).tobytes() == want_s.tobytes()
    assert np.isfinite(np.asarray(got.scale)).all() and (np.asarray(got.scale) > 0).all()


# ----------------------------------------------------------- a corrupted state under jit

ALL_RECIPES = [*RECIPES, jamp.float8.DelayedScaling(amax_history_len=2, unmeasured="current")]


def _step(recipe, checked=True):
    """A jitted step of one delayed product: (output, gradients, next state); with
    ``checked=False``, the product as it was before issue #35's traced check."""

    def f(a, b, hist, scale):
        return products.delayed_dot(a, b, hist, scale, spec(recipe=recipe))

    @jax.jit
    def step(state, lhs, rhs, ct):
        out, vjp = jax.vjp(f, lhs, rhs, *state)
        d_l, d_r, *new = vjp(ct)
        return out, (d_l, d_r), Float8State(*new)

    if checked:
        return step

    def unchecked(*args):
        with pytest.MonkeyPatch.context() as mp:  # traced while patched: its own trace
            mp.setattr(products, "traced_check", lambda *args: None)
            return step(*args)

    return unchecked


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=["max", "most_recent_margin", "h1", "current"])
def test_the_traced_check_leaves_every_state_of_the_recipe_bit_for_bit(recipe):
    """Issue #35: the check multiplies the inverse scales by exactly 1 for every state the
    recipe makes: fresh, measured over seven decades, after an all-zero operand (whose scale
    the recipe keeps: with a history of 1 its amaxes have all rolled out) and after an
    infinite gradient (a non-finite amax: the scale is kept for the history's length)."""
    state = init_state(recipe)
    checked, unchecked = _step(recipe), _step(recipe, checked=False)
    for t, (lhs, rhs, ct) in enumerate(steps(7)):
        got, want = checked(state, lhs, rhs, ct), unchecked(state, lhs, rhs, ct)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), t
        if t != 4:  # the infinite gradient's step
            assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got[:2])), t
        state = got[2]
        assert float(traced_check(*state, recipe)) == 1.0, t


def _measured(recipe):
    """A state after two real steps: every row measured (``steps``' third has a zero
    operand, whose row keeps its scale)."""
    state, step = init_state(recipe), _step(recipe)
    for lhs, rhs, ct in steps(2):
        state = step(state, lhs, rhs, ct)[2]
    return state


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=["max", "most_recent_margin", "h1", "current"])
@pytest.mark.parametrize("row", [0, 1, 2], ids=["lhs", "rhs", "grad"])
@pytest.mark.parametrize("bad", [1e30, 1e-30, 3.0, -1.0, np.inf, np.nan])
def test_under_jit_a_scale_its_history_does_not_give_makes_the_product_non_finite(recipe, row, bad):
    """Issue #35: traced, a scale of 1e30 gave a product of 0.0 and finite gradients, so
    loss scaling applied the step. Eagerly check_values refuses it; under jit the product
    and both gradients are now NaN, whichever row is wrong (the gradient's scale is only
    used by the backward pass: the forward output is NaN too)."""
    state = _measured(recipe)
    lhs, rhs, ct = steps(4)[3]
    scale = np.asarray(state.scale).copy()
    scale[row] = bad
    corrupted = state._replace(scale=jnp.asarray(scale))
    with pytest.raises(ValueError, match=r"scale"):
        check_values(corrupted, "the state", recipe)  # eagerly: refused
    out, grads, _ = _step(recipe)(corrupted, lhs, rhs, ct)
    for x in (out, *grads):
        assert np.isnan(np.asarray(x)).all()
    out, grads, _ = _step(recipe, checked=False)(corrupted, lhs, rhs, ct)
    if bad in (1e30, 1e-30, 3.0) and row != 2:  # before: finite and wrong
        assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(grads[0])).all()


def test_a_scale_of_another_margin_or_algorithm_is_no_corruption():
    """A state saved with another margin (check_restored takes any in [0, 14]), or by
    "most_recent" and resumed with "max", runs, its first step with its own scales, as
    before. (A "max" state resumed with "most_recent" is not checked against its largest
    amax, which only "max" computes: there only its newest amax vouches for a scale.)"""
    lhs, rhs, ct = steps(4)[3]
    pairs = (
        (jamp.float8.DelayedScaling(4, margin=3), jamp.float8.DelayedScaling(4)),
        (
            jamp.float8.DelayedScaling(4, margin=3, amax_compute_algo="most_recent"),
            jamp.float8.DelayedScaling(4, margin=14, amax_compute_algo="most_recent"),
        ),
        (
            jamp.float8.DelayedScaling(4, margin=3, amax_compute_algo="most_recent"),
            jamp.float8.DelayedScaling(4),
        ),
    )
    for saved_by, recipe in pairs:
        saved = _measured(saved_by)
        got = _step(recipe)(saved, lhs, rhs, ct)
        want = _step(recipe, checked=False)(saved, lhs, rhs, ct)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # A scale off by more than the tolerance of another backend's rounding is not.
    saved, recipe = _measured(pairs[0][0]), pairs[0][1]
    off = saved._replace(scale=saved.scale * np.float32(1.01))
    assert np.isnan(float(traced_check(*off, recipe)))
    ok = saved._replace(scale=saved.scale * np.float32(1 + 2.0**-10))
    assert float(traced_check(*ok, recipe)) == 1.0


def test_a_row_never_measured_is_checked_for_its_value_only():
    """The documented limit: a row whose history is all zero holds a scale the recipe kept
    (1 or 0 when fresh, an earlier measured one once its amaxes have rolled out of the
    history), which that history cannot vouch for: any finite scale >= 0 passes traced;
    eagerly (check_values) only 1 and 0 do."""
    recipe = jamp.float8.DelayedScaling(amax_history_len=4)
    fresh = init_state(recipe)
    for value, ok in ((1.0, True), (0.0, True), (1e30, True), (-1.0, False), (np.nan, False)):
        state = fresh._replace(scale=jnp.full(3, value, jnp.float32))
        assert (float(traced_check(*state, recipe)) == 1.0) == ok, value


BAD_INPUT = {
    "DelayedScaling(amax_history_len=0)": (
        lambda: jamp.float8.DelayedScaling(amax_history_len=0),
        ValueError,
        r"Expected `amax_history_len` >= 1, got 0",
    ),
    "DelayedScaling(amax_history_len=2.0)": (
        lambda: jamp.float8.DelayedScaling(amax_history_len=2.0),
        TypeError,
        r"Expected an int for `amax_history_len`, got 2.0",
    ),
    "DelayedScaling(margin=-1)": (
        lambda: jamp.float8.DelayedScaling(margin=-1),
        ValueError,
        r"Expected `margin` >= 0, got -1",
    ),
    "DelayedScaling(margin=True)": (
        lambda: jamp.float8.DelayedScaling(margin=True),
        TypeError,
        r"Expected an int for `margin`",
    ),
    "DelayedScaling(amax_compute_algo='mean')": (
        lambda: jamp.float8.DelayedScaling(amax_compute_algo="mean"),
        ValueError,
        r"'max' or 'most_recent' for `amax_compute_algo`, got 'mean'",
    ),
    "DelayedScaling(amax_compute_algo=max)": (
        lambda: jamp.float8.DelayedScaling(amax_compute_algo=max),
        TypeError,
        r"Expected a string for `amax_compute_algo`",
    ),
    "DelayedScaling(unmeasured='zero')": (
        lambda: jamp.float8.DelayedScaling(unmeasured="zero"),
        ValueError,
        r"Expected 'one' or 'current' for `unmeasured`, got 'zero'",
    ),
    "DelayedScaling(unmeasured=1.0)": (
        lambda: jamp.float8.DelayedScaling(unmeasured=1.0),
        TypeError,
        r"Expected a string for `unmeasured` \('one' or 'current'\), got 1.0",
    ),
    # issue #26: a margin of 200 made every scale 0 and every output 0.0; 2**28 steps of
    # history allocated 3 GiB per product, 2**31 failed inside XLA
    "DelayedScaling(margin=200)": (
        lambda: jamp.float8.DelayedScaling(margin=200),
        ValueError,
        r"`margin` in \[0, 14\], got margin=200.*smallest normal",
    ),
    "DelayedScaling(margin=15)": (
        lambda: jamp.float8.DelayedScaling(margin=15),
        ValueError,
        r"`margin` in \[0, 14\]",
    ),
    "DelayedScaling(margin=10**400)": (
        lambda: jamp.float8.DelayedScaling(margin=10**400),
        ValueError,
        r"`margin` in \[0, 14\], got margin=<an integer of 401 digits>",
    ),
    "DelayedScaling(amax_history_len=2**28)": (
        lambda: jamp.float8.DelayedScaling(amax_history_len=2**28),
        ValueError,
        r"`amax_history_len` <= 2\*\*16 = 65536, got amax_history_len=268435456",
    ),
    "DelayedScaling(amax_history_len=2**31)": (
        lambda: jamp.float8.DelayedScaling(amax_history_len=2**31),
        ValueError,
        r"`amax_history_len` <= 2\*\*16",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])


def test_the_largest_margin_and_history_still_give_usable_scales():
    assert jamp.float8.DelayedScaling(amax_history_len=2**16).amax_history_len == 2**16
    recipe = jamp.float8.DelayedScaling(amax_history_len=4, margin=14)
    state = init_state(recipe)
    new = next_state(state, jnp.array([10.0, 1.0, 1e-3], jnp.float32), recipe)
    scales = np.asarray(new.scale)
    assert np.all(np.isfinite(scales) & (scales > 0))
    # The largest value quantises to a normal float8_e4m3fn number (>= 2**-6), not to 0.
    assert float(10.0 * scales[0]) >= 2.0**-6
    check_values(new, "the state", recipe)
