"""The rounding pieces under the optimizer-memory recipes: the exact split of a float32
master, stochastic rounding into bfloat16, float16 and float8, the random bits, and the
block-quantised codes of the moments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jamp._src.optimizer import quantize as Q
from jamp._src.optimizer import rounding as R


def _bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _as_f32(bits):
    return jax.lax.bitcast_convert_type(jnp.asarray(bits, jnp.uint32), jnp.float32)


# ---------------------------------------------------------------- split / merge

_SPECIAL = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF,  # 0, inf, max
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x007FFFFF,  # subnormals, ties
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x7F7F8000,  # ties: even, odd, signs
    0x3F807FFF, 0x3F808001, 0x3F80FFFF, 0x3F7FFFFF,
]  # fmt: skip


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_split_and_merge_are_the_master_bit_for_bit(jit):
    """Every float32 but NaN survives the split exactly: 2**21 random patterns (all
    exponents, both signs) plus zeros, infinities, the largest values, subnormals and
    ties of both parities."""
    rng = np.random.default_rng(0)
    bits = np.concatenate(
        [rng.integers(0, 2**32, 2**21, dtype=np.uint64).astype(np.uint32), _SPECIAL]
    ).astype(np.uint32)
    master = _as_f32(bits)
    split, merge = (jax.jit(R.split), jax.jit(R.merge)) if jit else (R.split, R.merge)
    high, low = split(master)
    assert high.dtype == jnp.bfloat16 and low.dtype == jnp.int16
    back = _bits(merge(high, low))
    nan = np.isnan(np.asarray(master))
    assert np.array_equal(back[~nan], bits[~nan])
    assert np.isnan(np.asarray(merge(high, low))[nan]).all()


def test_the_high_part_is_round_to_nearest_with_ties_away_from_zero():
    """Off ties, the high part is the cast's rounding; on a tie, the value away from zero
    (where the cast, ties to even, differs only when the lower bfloat16 is even)."""
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 0x7F7F0000, 2**18, dtype=np.uint64).astype(np.uint32)
    ties = (bits & 0xFFFF0000) | 0x8000
    signs = np.uint32(0x80000000) * rng.integers(0, 2, bits.size).astype(np.uint32)
    for b in (bits | signs, ties | signs):
        master = _as_f32(b)
        high = _bits(R.split(master)[0]).astype(np.uint32)
        cast = _bits(master.astype(jnp.bfloat16)).astype(np.uint32)
        tie = (b & 0xFFFF) == 0x8000
        assert np.array_equal(high[~tie], cast[~tie])
        # away from zero: the magnitude's high half plus one
        assert np.array_equal(high[tie] & 0x7FFF, ((b[tie] & 0x7FFFFFFF) >> 16) + 1)
        even_below = tie & (((b >> 16) & 1) == 0)
        assert np.array_equal(high[tie & ~even_below], cast[tie & ~even_below])
        assert (high[even_below] != cast[even_below]).all()


def test_an_even_bfloat16_has_65537_masters_under_ties_to_even():
    """Why ties go away from zero: with the cast's rounding, the masters that round to
    1.0 (even) are 65,537, one more than a signed 16-bit remainder can name."""
    low = np.arange(0x3F7F8000, 0x3F808001, dtype=np.uint64).astype(np.uint32)
    rounds_to_one = _bits(_as_f32(low).astype(jnp.bfloat16)) == 0x3F80
    assert rounds_to_one.sum() == 65537
    high, _ = R.split(_as_f32(low))
    assert (_bits(high) == 0x3F80).sum() == 65536


# ---------------------------------------------------------------- stochastic rounding


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(dtype):
    """Each value goes to one of its two neighbours in ``dtype``, and the mean over many
    draws is the value itself, within the draws' standard error."""
    x = np.float32(1.0) + np.float32(2.0**-3) * np.arange(1, 9, dtype=np.float32) / 9
    x = x * np.float32(0.37)
    n = 200_000
    xs = jnp.asarray(np.repeat(x[:, None], n, axis=1))
    key = R.step_key(7, R.MOMENTS, jnp.uint32(3))
    y = jax.jit(lambda v: R.stochastic_round(v, dtype, R.random_bits(key, 0, v.shape)))(xs)
    yf = np.asarray(y.astype(jnp.float32), np.float64)
    lo = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)
    for i, v in enumerate(x.astype(np.float64)):
        values = np.unique(yf[i])
        assert len(values) <= 2 and values.min() <= v <= values.max()
        gap = values.max() - values.min() if len(values) == 2 else abs(v - lo[i]) + 1e-30
        se = gap * 0.5 / np.sqrt(n)
        assert abs(yf[i].mean() - v) < 5 * se + 1e-12, (dtype, v, yf[i].mean())


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_stochastic_rounding_keeps_what_the_format_holds(dtype):
    """Values the format holds, zeros of both signs, infinities and NaN come back as a
    cast gives them, whatever the bits."""
    grid = np.asarray(jnp.linspace(-3, 3, 97).astype(dtype).astype(jnp.float32))
    specials = np.array([0.0, -0.0], np.float32)
    if dtype != jnp.float8_e4m3fn:  # no infinities in e4m3fn
        specials = np.concatenate([specials, [np.inf, -np.inf]]).astype(np.float32)
    x = jnp.asarray(np.concatenate([grid, specials]))
    for draw in range(4):
        bits = R.random_bits(R.step_key(draw, 1, jnp.uint32(draw)), 0, x.shape)
        assert np.array_equal(_bits(R.stochastic_round(x, dtype, bits)), _bits(x.astype(dtype)))
    nan = R.stochastic_round(jnp.asarray([np.nan], jnp.float32), dtype, jnp.zeros(1, jnp.uint32))
    assert np.isnan(np.asarray(nan.astype(jnp.float32))).all()


def test_random_bits_are_uniform_fresh_per_step_and_leaf():
    """The bits' 16 high bits fill their 65,536 bins evenly (a chi-squared test), and a
    new step or another leaf gives bits uncorrelated with the first."""
    shape = (512, 1024)
    key = R.step_key(0, R.PARAMETERS, jnp.uint32(0))
    bits = np.asarray(R.random_bits(key, 0, shape)).ravel()
    counts = np.bincount(bits >> 16, minlength=65536)
    expected = bits.size / 65536
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert abs(chi2 - 65535) < 6 * np.sqrt(2 * 65535), chi2
    for other in (
        R.random_bits(R.step_key(0, R.PARAMETERS, jnp.uint32(1)), 0, shape),
        R.random_bits(key, 1, shape),
        R.random_bits(R.step_key(1, R.PARAMETERS, jnp.uint32(0)), 0, shape),
        R.random_bits(R.step_key(0, R.MOMENTS, jnp.uint32(0)), 0, shape),
    ):
        u, v = R.uniform(jnp.asarray(bits)), R.uniform(other.ravel())
        assert abs(float(jnp.corrcoef(u, v)[0, 1])) < 0.01
        assert float(jnp.mean(jnp.asarray(bits) == other.ravel())) < 1e-3


@pytest.mark.multidevice
def test_random_bits_do_not_depend_on_sharding():
    """The same bits whether the array lives on one device or is split over eight, on
    either axis: each element's bits come from its global index."""
    mesh = jax.make_mesh((8,), ("d",))
    key = R.step_key(3, R.PARAMETERS, jnp.uint32(11))
    want = np.asarray(R.random_bits(key, 2, (64, 48)))
    for spec in (PartitionSpec("d", None), PartitionSpec(None, "d")):
        out = jax.jit(
            lambda k: R.random_bits(k, 2, (64, 48)),
            out_shardings=NamedSharding(mesh, spec),
        )(key)
        assert len(out.sharding.device_set) == 8
        assert np.array_equal(np.asarray(out), want)


def test_reach_lands_on_the_target_unless_the_step_overshoots_where_it_lands():
    """The update that ``optax.apply_updates`` adds lands exactly on the target when the
    target is not much nearer zero than the step is long; from 256, no bfloat16 update
    reaches 1.0078125 (the adds land on whole numbers there)."""
    p = jnp.asarray([1.0, 1.0, -3.5, 256.0, 0.0078125], jnp.bfloat16)
    t = jnp.asarray([1.0078125, 0.99609375, -3.5, 1.0078125, -0.0001], jnp.bfloat16)
    update, landed = R.reach(p, t)
    assert update.dtype == jnp.bfloat16
    assert np.array_equal(_bits(p + update), _bits(landed))
    assert np.array_equal(_bits(landed)[:3], _bits(t)[:3])
    assert not R.same_bits(landed, t)[3] and float(landed[3]) == 1.0


# ---------------------------------------------------------------- block codes


@pytest.mark.parametrize("code", ["signed", "positive"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_log_codes_hold_values_to_their_level_spacing(code, rounding):
    """Each value comes back within one level (a factor r = 2**(1/8)) of itself while
    above the code's last level; to nearest in value, within the midpoint's factors
    ``2 / (1 + r)`` and ``2r / (1 + r)``."""
    rng = np.random.default_rng(2)
    x = np.exp(rng.uniform(-8, 0, 5000)).astype(np.float32)
    if code == "signed":
        x = x * rng.choice([-1, 1], x.size).astype(np.float32)
    bits = None
    if rounding == "stochastic":
        bits = R.random_bits(R.step_key(0, 2, jnp.uint32(0)), 0, Q.padded_shape(x.shape))
    q = Q.quantize(jnp.asarray(x), code, jnp.uint8, bits)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == Q.padded_shape(x.shape)
    back = np.asarray(Q.dequantize(q))
    absmax = np.repeat(np.asarray(q.absmax), Q.BLOCK)[: x.size]
    floor = absmax * 2.0 ** (-(126 if code == "signed" else 254) / 8)
    above = np.abs(x) > floor
    ratio = np.abs(back[above] / x[above])
    r = 2.0 ** (1 / 8)
    lo, hi = (1 / r, r) if rounding == "stochastic" else (2 / (1 + r), 2 * r / (1 + r))
    assert (ratio <= hi * 1.0001).all() and (ratio >= lo / 1.0001).all()
    assert (np.sign(back[above]) == np.sign(x[above])).all()


def test_the_positive_code_never_rounds_a_positive_value_to_zero():
    """A second moment's tiny values become the code's smallest level, never zero (adam
    divides by its square root); zeros stay zero, and so does an all-zero block."""
    x = np.zeros(512, np.float32)
    x[0] = 1.0
    x[1:200] = 1e-30  # far below 2**-31.75 of the absmax
    for rounding_bits in (None, R.random_bits(jnp.uint32(5), 0, Q.padded_shape(x.shape))):
        back = np.asarray(
            Q.dequantize(Q.quantize(jnp.asarray(x), "positive", jnp.uint8, rounding_bits))
        )
        assert (back[1:200] > 0).all() and back[0] == 1.0
        assert (back[200:] == 0).all()
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        back = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(x), "positive", dtype, None)))
        assert (back[1:200] > 0).all() and (back[200:] == 0).all()


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_blocks_scale_each_block_to_the_format(dtype):
    """Each block's absmax comes back (to float32's rounding of the scale), and the rest
    within the format's relative spacing; a block of huge values and one of tiny values
    both survive."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=1024).astype(np.float32)
    x[:256] *= 1e6
    x[256:512] *= 1e-6
    q = Q.quantize(jnp.asarray(x), "signed", dtype, None)
    back = np.asarray(Q.dequantize(q))
    mantissa = 3 if dtype == jnp.float8_e4m3fn else 2
    big = np.abs(x) > np.repeat(np.asarray(q.absmax), 256) * 2.0**-5
    assert np.allclose(back[big], x[big], rtol=2.0 ** -(mantissa + 1) * 1.01)
    for b in range(4):
        i = b * 256 + np.argmax(np.abs(x[b * 256 : (b + 1) * 256]))
        assert back[i] == pytest.approx(x[i], rel=2.0**-22)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("code", ["signed", "positive"])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_blocks_of_tiny_values_are_not_flushed(dtype, code, jit):
    """A block of normal float32 values whose largest is 1e-36 (or 1e-34): its absmax
    over the format's largest is a float32 subnormal, which XLA:CPU flushes to zero, and
    the block decoded as zeros (eagerly, and under jit, where XLA folds that factor out
    of any decoding order). Every value comes back nonzero, within the format's spacing;
    a block large enough for its own scale, its largest to float32's rounding."""
    rng = np.random.default_rng(4)
    roundtrip = lambda x: Q.dequantize(Q.quantize(x, code, dtype, None))  # noqa: E731
    roundtrip = jax.jit(roundtrip) if jit else roundtrip
    mantissa = 3 if dtype == jnp.float8_e4m3fn else 2
    for largest in (1e-36, 1e-34, 1e-30):
        x = (largest * rng.uniform(0.05, 1.0, 512)).astype(np.float32)
        if code == "signed":
            x = x * rng.choice([-1, 1], x.size).astype(np.float32)
        back = np.asarray(roundtrip(jnp.asarray(x)))
        assert (back != 0).all() and (np.sign(back) == np.sign(x)).all(), largest
        np.testing.assert_allclose(back, x, rtol=2.0 ** -(mantissa - 1), atol=0)
    i = np.argmax(np.abs(x))  # 1e-30: its block's own scale
    assert back[i] == pytest.approx(x[i], rel=2.0**-22)


def test_e4m3_holds_a_second_moment_as_its_root_e5m2_as_it_is():
    """e4m3fn reaches 2**-17.8 of a block's largest, too few octaves for squares of
    gradients: it holds a second moment's square root (to nearest, within 2**-4 of it,
    so the moment within (17/16)**2), down to 2**-29.6 of the absmax in its normals.
    e5m2 reaches 2**-31.8 and holds the moment itself (within 2**-3 in its normals)."""
    rng = np.random.default_rng(5)
    x = (2.0 ** rng.uniform(-29.5, 0, 4096)).astype(np.float32)
    x[::256] = 1.0  # each block's absmax
    for dtype, code, (lo, hi) in (
        (jnp.float8_e4m3fn, "float8-root", ((15 / 16) ** 2, (17 / 16) ** 2)),
        (jnp.float8_e5m2, "float8-positive", (7 / 8, 9 / 8)),
    ):
        q = Q.quantize(jnp.asarray(x), "positive", dtype, None)
        assert q.code == code
        ratio = np.asarray(Q.dequantize(q)) / x
        assert ratio.max() <= hi * (1 + 2**-20) and ratio.min() >= lo * (1 - 2**-20)


def test_the_root_code_rounds_unbiased_in_the_square():
    """Rounding a root unbiased would bias its square up by the variance (adam's nu would
    creep up by it every step: 0.35% at a midpoint, where ``1 - b2`` is 0.1%); the root
    code rounds so that the square, the moment adam reads, is right on average. Each
    block holds its absmax and 255 copies of a value whose root sits halfway between two
    e4m3 levels, the random numbers a grid of ``[0, 1)``: the mean of the decoded
    copies is the value to the grid's resolution."""
    mids = np.array([272.0, 17.0, 0.53125, 2.0**-7 + 2.0**-10])  # halfway between levels
    values = ((mids / 448.0) ** 2).astype(np.float32)
    x = np.repeat(values, 256)
    x[::256] = 1.0
    grid = (np.arange(256, dtype=np.uint32) << np.uint32(24)) + np.uint32(1 << 23)
    bits = jnp.asarray(np.tile(grid, (len(values), 1)))
    q = Q.quantize(jnp.asarray(x), "positive", jnp.float8_e4m3fn, bits)
    back = np.asarray(Q.dequantize(q)).reshape(len(values), 256)[:, 1:]
    np.testing.assert_allclose(back.mean(1), values, rtol=2e-3, atol=0)
