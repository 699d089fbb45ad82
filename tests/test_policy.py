"""Tests for jamp.Policy, jamp.compat.get_policy and the dtype parser."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _bad_input import assert_clear_error
from hypothesis import given, settings
from hypothesis import strategies as st

import jamp

F16, BF16, F32, F64 = (jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
NAMES = {"f16": F16, "bf16": BF16, "f32": F32, "float16": F16, "bfloat16": BF16, "float32": F32}


def test_policy_is_frozen_hashable_and_normalised():
    p = jamp.Policy(jnp.float32, "bf16", np.float32)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F32, BF16, F32)
    assert all(isinstance(d, np.dtype) for d in dataclasses.astuple(p)[:3])
    assert p.reduce_dtype is None  # issue #45's field, after the three dtypes
    assert jamp.Policy(F32, BF16, F32, reduce_dtype="bf16").reduce_dtype == BF16
    assert jamp.Policy(F32, BF16, F32, reduce_dtype="bf16") != p
    assert p == jamp.Policy("f32", jnp.bfloat16, "float32")
    assert hash(p) == hash(jamp.Policy(F32, BF16, F32))
    assert len({p, jamp.Policy(F32, BF16, F32)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = F16  # type: ignore[misc]
    assert str(p) == "p=float32,c=bfloat16,o=float32"
    assert jamp.compat.get_policy(str(p)) == p


def test_policy_is_a_valid_static_argument():
    p = jamp.compat.get_policy("mixed_float16")
    f = jax.jit(lambda x, policy: policy.cast_to_compute(x), static_argnums=1)
    assert f(jnp.ones(2), p).dtype == F16


def test_casts_touch_floating_arrays_only():
    p = jamp.Policy(F32, BF16, F16)
    tree = {
        "w": jnp.ones(2, F32),
        "h": jnp.ones(2, F16),
        "np": np.ones(2, np.float32),
        "step": jnp.int32(3),
        "mask": jnp.array([True, False]),
        "none": None,
        "py": 1.5,
        "c": jnp.ones(2, jnp.complex64),
    }
    for cast, want in ((p.cast_to_param, F32), (p.cast_to_compute, BF16), (p.cast_to_output, F16)):
        out = cast(tree)
        assert out["w"].dtype == want and out["h"].dtype == want and out["np"].dtype == want
        assert isinstance(out["np"], np.ndarray)
        assert out["step"].dtype == jnp.int32 and out["mask"].dtype == jnp.bool_
        assert out["none"] is None and out["py"] == 1.5 and out["c"].dtype == jnp.complex64
    same = p.cast_to_param(tree)
    assert same["w"] is tree["w"]  # no copy when already in the dtype
    jitted = jax.jit(p.cast_to_compute)(tree)
    assert jitted["w"].dtype == BF16


def test_with_output_dtype():
    p = jamp.compat.get_policy("p=f32,c=bf16,o=bf16")
    q = p.with_output_dtype(jnp.float32)
    assert q == jamp.Policy(F32, BF16, F32) and p.output_dtype == BF16
    with pytest.raises(TypeError, match=r"Expected a floating dtype for `output_dtype`.*int8"):
        p.with_output_dtype(jnp.int8)


@pytest.mark.parametrize(
    "spec, want",
    [
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("param=f32,c=f16", (F32, F16, F16)),
        (" P = F32 , C = BF16 ", (F32, BF16, BF16)),
        ("c=f16", (F32, F16, F16)),  # jmp: params default f32, output follows compute
        ("p=bf16", (BF16, BF16, BF16)),  # compute follows params
        ("o=f16", (F32, F32, F16)),
        ("p=f64,c=f32", (F64, F32, F32)),
        ("bf16", (BF16, BF16, BF16)),
        ("float16", (F16, F16, F16)),
        ("full", (F32, F32, F32)),
        ("half", (F16, F16, F16)),  # CPU: float16 (bfloat16 only on TPU)
        ("c=half,o=full", (F32, F16, F32)),
        ("mixed_float16", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
    ],
)
def test_get_policy_grammar(spec, want):
    assert dataclasses.astuple(jamp.compat.get_policy(spec)) == (*want, None)


def test_get_policy_passes_a_policy_through_and_half_dtype():
    p = jamp.Policy(F32, F16, F32)
    assert jamp.compat.get_policy(p) is p
    assert jamp.compat.half_dtype() == (BF16 if jax.default_backend() == "tpu" else F16)


def test_parse_dtype():
    assert jamp.compat.parse_dtype("BF16") == BF16
    assert jamp.compat.parse_dtype(" float64 ") == F64
    assert jamp.compat.parse_dtype(jnp.float16) == F16
    with pytest.raises(TypeError, match=r"Expected a floating dtype for `dtype`.*got int32"):
        jamp.compat.parse_dtype(jnp.int32)


# One rule everywhere: not a dtype, or a non-floating dtype -> TypeError; a
# name that is no dtype, or an unsupported floating dtype -> ValueError.
SAME_ERROR = [
    ("fp8", ValueError), ("f4", ValueError), ("float8_e5m2", ValueError),
    (jnp.float8_e4m3fn, ValueError), ("int32", TypeError), (jnp.int8, TypeError),
    ("complex64", TypeError), ("bool", TypeError),
]  # fmt: skip


@pytest.mark.parametrize("bad, error", SAME_ERROR, ids=lambda v: getattr(v, "__name__", str(v)))
def test_the_same_bad_dtype_raises_the_same_error_everywhere(bad, error):
    name = bad if isinstance(bad, str) else jnp.dtype(bad).name
    calls = [
        lambda: jamp.compat.parse_dtype(bad),
        lambda: jamp.Policy(F32, bad, F32),
        lambda: jamp.compat.get_policy(jamp.Policy(F32, F16, F32)).with_output_dtype(bad),
        lambda: jamp.autocast(jnp.sin, bad),
        lambda: jamp.debug.autocast_report(jnp.sin, jnp.ones(2), dtype=bad),
    ]
    if isinstance(bad, str):
        calls += [lambda: jamp.compat.get_policy(f"c={bad}"), lambda: jamp.compat.get_policy(bad)]
    for call in calls:
        with pytest.raises(error, match=name) as info:
            call()
        assert type(info.value) is error


dtypes = st.sampled_from([F16, BF16, F32])


@given(param=dtypes, compute=dtypes, output=dtypes)
def test_string_round_trip_and_cast_dtypes(param, compute, output):
    p = jamp.Policy(param, compute, output)
    assert jamp.compat.get_policy(str(p)) == p
    tree = {"a": np.ones(3, np.float32), "i": np.arange(3)}
    assert p.cast_to_compute(tree)["a"].dtype == compute
    assert p.cast_to_output(tree)["i"].dtype == tree["i"].dtype


# ---------------------------------------------------------------- bad input


def _policy(**kwargs):
    args = {"param_dtype": F32, "compute_dtype": BF16, "output_dtype": F32, **kwargs}
    return lambda: jamp.Policy(**args)


# Every invalid policy string and Policy argument: id -> (call, exception, match).
BAD_INPUT = {
    # get_policy's grammar
    "get_policy('mixed')": (
        lambda: jamp.compat.get_policy("mixed"),
        ValueError,
        r"Expected a policy string .*\['mixed_bfloat16', 'mixed_float16'\].*'bf16'.*"
        r"got 'mixed' instead",
    ),
    "get_policy('q=f16')": (
        lambda: jamp.compat.get_policy("q=f16"),
        ValueError,
        r"Expected a policy key, one of \['c', 'compute', 'o', 'output', 'p', 'param', "
        r"'params'\].*got 'q' instead",
    ),
    "get_policy('c=f8')": (
        lambda: jamp.compat.get_policy("c=f8"),
        ValueError,
        r"Expected a dtype name for compute_dtype in policy 'c=f8', one of \[.*'bf16'.*\] "
        r"\(or a dtype such as jnp.bfloat16\), got 'f8' instead",
    ),
    "get_policy('c=int32')": (
        lambda: jamp.compat.get_policy("c=int32"),
        TypeError,
        r"Expected a floating dtype for compute_dtype in policy 'c=int32'.*got int32 instead",
    ),
    "get_policy('o=float8_e5m2')": (
        lambda: jamp.compat.get_policy("o=float8_e5m2"),
        ValueError,
        r"Expected one of float16, bfloat16, float32, float64 for output_dtype in policy "
        r"'o=float8_e5m2', got float8_e5m2 instead",
    ),
    "get_policy('p')": (  # not NumPy's code
        lambda: jamp.compat.get_policy("p"),
        ValueError,
        r"Expected a policy string .*got 'p' instead",
    ),
    "get_policy('bf16,o=f32')": (
        lambda: jamp.compat.get_policy("bf16,o=f32"),
        ValueError,
        r"Expected 'key=dtype' parts.*got 'bf16' instead",
    ),
    "get_policy('c=f16,c=bf16')": (
        lambda: jamp.compat.get_policy("c=f16,c=bf16"),
        ValueError,
        r"at most once.*got compute twice instead",
    ),
    "get_policy('')": (
        lambda: jamp.compat.get_policy(""),
        ValueError,
        r"Expected a non-empty policy string",
    ),
    "get_policy(3)": (
        lambda: jamp.compat.get_policy(3),
        TypeError,
        r"Expected a policy string .* for `spec`, got 3 \(type int\) instead",
    ),
    # the Policy constructor
    "Policy(param_dtype=int32)": (
        _policy(param_dtype=jnp.int32),
        TypeError,
        r"Expected a floating dtype for `param_dtype`.*got int32 instead",
    ),
    "Policy(compute_dtype=bool)": (
        _policy(compute_dtype=jnp.bool_),
        TypeError,
        r"Expected a floating dtype for `compute_dtype`.*got bool instead",
    ),
    "Policy(output_dtype=complex64)": (
        _policy(output_dtype=jnp.complex64),
        TypeError,
        r"`output_dtype`.*got complex64 instead",
    ),
    "Policy(compute_dtype=None)": (
        _policy(compute_dtype=None),
        TypeError,
        r"`compute_dtype`.*got None \(type NoneType\) instead",
    ),
    "Policy(compute_dtype='foo')": (
        _policy(compute_dtype="foo"),
        ValueError,
        r"Expected a dtype name for `compute_dtype`.*got 'foo' instead",
    ),
    "Policy(param_dtype=float8_e4m3fn)": (
        _policy(param_dtype=jnp.float8_e4m3fn),
        ValueError,
        r"Expected one of float16, bfloat16, float32, float64 for `param_dtype`.*float8_e4m3fn",
    ),
    # issue #26: strings NumPy parses as code, dicts and arrays are jamp's errors
    "parse_dtype(',')": (
        lambda: jamp.compat.parse_dtype(","),
        ValueError,
        r"Expected a dtype name for `dtype`.*got ','",
    ),
    "parse_dtype('i4,f4')": (
        lambda: jamp.compat.parse_dtype("i4,f4"),
        ValueError,
        r"Expected a dtype name for `dtype`.*got 'i4,f4'",
    ),
    "parse_dtype({'a': 1})": (
        lambda: jamp.compat.parse_dtype({"a": 1}),
        TypeError,
        r"Expected a floating dtype for `dtype`.*\{'a': 1\} \(type dict\)",
    ),
    "parse_dtype([('a', 'f4')])": (
        lambda: jamp.compat.parse_dtype([("a", "f4")]),
        TypeError,
        r"floating dtype for `dtype`",
    ),
    "Policy(',', f32, f32)": (
        lambda: jamp.Policy(",", jnp.float32, jnp.float32),
        ValueError,
        r"dtype name for `param_dtype`.*got ','",
    ),
    "Policy(array, f32, f32)": (
        lambda: jamp.Policy(jnp.ones(2), jnp.float32, jnp.float32),
        TypeError,
        r"floating dtype for `param_dtype`.*an array of dtype float32 and shape \(2,\).*x.dtype",
    ),
    "Policy(np.float32(1.0), ...)": (
        lambda: jamp.Policy(F32, np.float32(1.0), F32),
        TypeError,
        r"`compute_dtype`.*an array of dtype float32",
    ),
    "autocast(f, ',')": (
        lambda: jamp.autocast(lambda x: x, ","),
        ValueError,
        r"dtype name for `dtype`.*got ','",
    ),
    "autocast(f, policy='')": (
        lambda: jamp.autocast(lambda x: x, policy=""),
        ValueError,
        r"Expected a non-empty policy string for `policy`",
    ),
    "autocast(f, policy='q=f16')": (
        lambda: jamp.autocast(lambda x: x, policy="q=f16"),
        ValueError,
        r"policy key.*\(`policy`\), got 'q'",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(text=st.text(alphabet=",=:[]()<>|'\" fiubcSUVOMmf0123456789", max_size=8))
def test_every_dtype_string_is_a_dtype_or_an_error_naming_the_argument(text):
    """54 of 6,000 random strings were NumPy SyntaxErrors (issue #26); now each is a
    supported dtype or jamp's ValueError/TypeError naming `dtype`."""
    try:
        dtype = jamp.compat.parse_dtype(text)
    except (TypeError, ValueError) as e:
        assert type(e) in (TypeError, ValueError) and "`dtype`" in str(e)
    else:
        assert dtype in {np.dtype(d) for d in (jnp.float16, jnp.bfloat16, F32, jnp.float64)}
