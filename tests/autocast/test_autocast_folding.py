"""The constants autocast computes when it traces ``fun``, in NumPy (``autocast/folding.py``).

An equation of constants alone (an attention mask's arithmetic, a position's ``iota``) is
computed when ``fun`` is traced, so that the constant rule sees its value. jax computed
each as a program of its own, one compile per primitive, shape and dtype: 33 compiles
before its own step's when a user jits ``jamp.autocast`` of transformers' Flax GPT-2
(1.36 against 0.52 s of lowering, jax 0.10.2). NumPy computes the exact ones: each
primitive of the table bit for bit as jax does, on the values that can reach it, the
inexact ones left to jax; the step's program the same.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp._src import jaxprs
from jamp._src.autocast import folding
from tests.realmodels._models import gpt2

lax = jax.lax
F32 = np.float32
SPECIALS = np.array([0.0, -0.0, 1.5, -2.5, 3.0, np.inf, -np.inf, np.nan, 7.25, -1e30], F32)
INTS = np.array([0, 1, -1, 2**31 - 1, -(2**31), 5, -7, 12], np.int32)
BOOLS = np.array([True, False, True, True, False, False, True, False])


def _cases():
    """(name, primitive, operands, params): every table entry, on the values that test its
    edges (NaN, infinities, signed zeros, integer wrap-around, int32's extremes)."""
    p = lax
    grid = SPECIALS.reshape(2, 5)
    out = [
        (
            "broadcast",
            p.broadcast_in_dim_p,
            [grid],
            dict(shape=(3, 2, 5), broadcast_dimensions=(1, 2), sharding=None),
        ),
        (
            "broadcast scalar",
            p.broadcast_in_dim_p,
            [np.asarray(INTS[3])],
            dict(shape=(2, 3), broadcast_dimensions=(), sharding=None),
        ),
        ("reshape", p.reshape_p, [grid], dict(new_sizes=(5, 2), dimensions=None, sharding=None)),
        ("squeeze", p.squeeze_p, [grid.reshape(2, 1, 5)], dict(dimensions=(1,))),
        ("transpose", p.transpose_p, [grid], dict(permutation=(1, 0))),
        ("rev", p.rev_p, [grid], dict(dimensions=(1,))),
        ("concatenate", p.concatenate_p, [grid, grid[:, :2]], dict(dimension=1)),
        (
            "slice",
            p.slice_p,
            [grid],
            dict(start_indices=(0, 1), limit_indices=(2, 5), strides=(1, 2)),
        ),
        (
            "slice unit",
            p.slice_p,
            [grid],
            dict(start_indices=(1, 0), limit_indices=(2, 3), strides=None),
        ),
        ("iota", p.iota_p, [], dict(dtype=np.int32, shape=(4, 3), dimension=1, sharding=None)),
        ("iota f32", p.iota_p, [], dict(dtype=F32, shape=(6,), dimension=0, sharding=None)),
        ("copy", p.copy_p, [grid], {}),
        ("select bool", p.select_n_p, [BOOLS, SPECIALS[:8], -SPECIALS[:8]], {}),
        (
            "select int",
            p.select_n_p,
            [np.array([0, 1, 2, 1], np.int32), *(INTS[:4] + k for k in range(3))],
            {},
        ),
        ("neg", p.neg_p, [SPECIALS], {}),
        ("neg int", p.neg_p, [INTS], {}),
    ]
    for name in ("eq", "ne", "lt", "le", "gt", "ge"):
        prim = getattr(p, f"{name}_p")
        out += [
            (name, prim, [SPECIALS, SPECIALS[::-1].copy()], {}),
            (name + " int", prim, [INTS, INTS[::-1].copy()], {}),
        ]
    for name in ("and", "or", "xor"):
        prim = getattr(p, f"{name}_p")
        out += [
            (name, prim, [BOOLS, BOOLS[::-1].copy()], {}),
            (name + " int", prim, [INTS, INTS[::-1].copy()], {}),
        ]
    out += [("not", p.not_p, [BOOLS], {}), ("not int", p.not_p, [INTS], {})]
    for name in ("add", "sub", "mul", "max", "min"):
        prim = getattr(p, f"{name}_p")
        out.append((name + " int", prim, [INTS, INTS[::-1].copy()], {}))  # wraps
    small = np.array([1.5, -2.25, 3e30, 1e-20, 0.1, -0.0, 7.0, 1e38], F32)
    for name in ("add", "sub", "mul"):
        prim = getattr(p, f"{name}_p")
        out.append((name + " f32", prim, [small, small[::-1].copy()], {}))
    for dtype in (np.int8, np.int32, np.uint32, np.bool_, F32):
        out.append(
            (
                f"convert int32 to {np.dtype(dtype).name}",
                p.convert_element_type_p,
                [INTS],
                dict(new_dtype=dtype, weak_type=False, sharding=None),
            )
        )
    out += [
        ("convert bool to f32", p.convert_element_type_p, [BOOLS], dict(
            new_dtype=F32, weak_type=False, sharding=None)),
        ("convert f32 to int32", p.convert_element_type_p, [np.array(
            [-2.75, -0.5, 0.0, 0.99, 3.5, 2.0**31 - 128, -(2.0**31)], F32)], dict(
            new_dtype=np.int32, weak_type=False, sharding=None)),
    ]  # fmt: skip
    return out


CASES = _cases()


@pytest.mark.parametrize("name,primitive,operands,params", CASES, ids=[c[0] for c in CASES])
def test_numpy_computes_what_jax_computes_bit_for_bit(name, primitive, operands, params):
    want = jaxprs.bind(primitive, [jnp.asarray(x) for x in operands], params)[0]
    aval = jax.core.ShapedArray(want.shape, want.dtype)
    got = folding.fold(primitive, operands, params, [aval])
    assert got is not None, name
    (got,) = got
    assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8))


TINY = np.float32(1e-40)  # a float32 subnormal: XLA:CPU reads and writes it as zero
LEFT_TO_JAX = [
    ("sqrt", lax.sqrt_p, [np.array([2.0], F32)], dict(accuracy=None), F32),
    ("div", lax.div_p, [np.array([1.0], F32), np.array([3.0], F32)], {}, F32),
    ("float max", lax.max_p, [np.array([0.0], F32), np.array([-0.0], F32)], {}, F32),
    ("bfloat16 add", lax.add_p, [np.ones(2, jnp.bfloat16)] * 2, {}, jnp.bfloat16),
    ("a subnormal operand", lax.lt_p, [np.array([TINY]), np.zeros(1, F32)], {}, np.bool_),
    ("a subnormal sum", lax.sub_p, [np.array([2e-38], F32), np.array([1.5e-38], F32)], {}, F32),
    ("f32 to bfloat16", lax.convert_element_type_p, [np.ones(2, F32)], dict(
        new_dtype=jnp.bfloat16, weak_type=False, sharding=None), jnp.bfloat16),
    ("f32 to bool", lax.convert_element_type_p, [np.ones(2, F32)], dict(
        new_dtype=np.bool_, weak_type=False, sharding=None), np.bool_),
    ("NaN to int32", lax.convert_element_type_p, [np.array([np.nan], F32)], dict(
        new_dtype=np.int32, weak_type=False, sharding=None), np.int32),
    ("2**31 to int32", lax.convert_element_type_p, [np.array([2.0**31], F32)], dict(
        new_dtype=np.int32, weak_type=False, sharding=None), np.int32),
    ("int32 to bfloat16", lax.convert_element_type_p, [INTS], dict(
        new_dtype=jnp.bfloat16, weak_type=False, sharding=None), jnp.bfloat16),
    ("a weak result", lax.convert_element_type_p, [INTS], dict(
        new_dtype=F32, weak_type=True, sharding=None), F32),
]  # fmt: skip


@pytest.mark.parametrize(
    "name,primitive,operands,params,dtype", LEFT_TO_JAX, ids=[c[0] for c in LEFT_TO_JAX]
)
def test_what_numpy_may_compute_otherwise_is_left_to_jax(name, primitive, operands, params, dtype):
    shape = np.broadcast_shapes(*(np.shape(x) for x in operands))
    aval = jax.core.ShapedArray(shape, dtype, weak_type=params.get("weak_type", False))
    assert folding.fold(primitive, operands, params, [aval]) is None, name


def test_a_prng_key_is_left_to_jax():
    keys = jax.random.split(jax.random.key(0), 4)
    params = dict(new_sizes=(2, 2), dimensions=None, sharding=None)
    aval = jax.core.ShapedArray((2, 2), keys.dtype)
    assert folding.fold(lax.reshape_p, [keys], params, [aval]) is None


def test_a_weakly_typed_output_is_left_to_jax():
    aval = jax.core.ShapedArray((2,), np.int32, weak_type=True)
    params = dict(shape=(2,), broadcast_dimensions=(), sharding=None)
    assert folding.fold(lax.broadcast_in_dim_p, [np.int32(3)], params, [aval]) is None


def _computed_by_jax(monkeypatch):
    """The equations autocast computes when tracing that jax ran (a program each)."""
    ran = []
    bind = jaxprs.bind

    def spy(primitive, vals, params):
        if folding.FOLDING.get():
            ran.append(primitive.name)
        return bind(primitive, vals, params)

    monkeypatch.setattr(jaxprs, "bind", spy)
    return ran


def _masked_attention(w, x):
    """Causal attention as transformers' Flax models write its mask: positions from an
    ``iota``, a boolean mask, ``finfo(float32).min`` where it is false, added to the
    scores."""
    n = x.shape[0]
    pos = jnp.arange(n)
    causal = pos[:, None] >= pos[None, :]
    keep = jnp.logical_and(causal, jnp.ones((n, n), bool))
    bias = lax.select(keep, jnp.zeros((n, n)), jnp.full((n, n), jnp.finfo(jnp.float32).min))
    q = x @ w
    scores = q @ x.T + bias
    return jnp.mean(jax.nn.softmax(scores, axis=-1) @ x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_causal_mask_is_computed_without_a_program(monkeypatch, jit):
    w = jax.random.normal(jax.random.key(0), (8, 8)) * 0.3
    x = jax.random.normal(jax.random.key(1), (16, 8))

    def step():  # a new trace each time
        fun = jax.value_and_grad(jamp.autocast(lambda w, x: _masked_attention(w, x), "float16"))
        return jax.block_until_ready((jax.jit(fun) if jit else fun)(w, x))

    with monkeypatch.context() as m:
        m.setattr(folding, "_TABLE", {})  # every constant computed by jax, as before
        ran_all = _computed_by_jax(m)
        before = step()
    ran = _computed_by_jax(monkeypatch)
    after = step()
    assert len(ran_all) >= 6 and ran == [], (ran_all, ran)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _text(lowered):
    return "\n".join(
        line.split(" loc(")[0]
        for line in lowered.as_text().splitlines()
        if not line.startswith("#loc")
    )


@pytest.mark.standard_promotion  # transformers' code mixes dtypes
def test_transformers_gpt2_autocast_program_is_unchanged_with_its_mask_in_numpy(monkeypatch):
    case = gpt2()

    def lowered():  # a new trace each time
        fun = jamp.autocast(lambda p, b: case.loss(p, b), jnp.bfloat16)
        with jax.numpy_rank_promotion("allow"):
            return _text(jax.jit(jax.value_and_grad(fun)).lower(case.params, case.batch))

    with monkeypatch.context() as m:
        m.setattr(folding, "_TABLE", {})
        ran_all = _computed_by_jax(m)
        before = lowered()
    ran = _computed_by_jax(monkeypatch)
    after = lowered()
    assert after == before
    # What jax still runs: the weakly typed scalars (a NumPy array is strongly typed) and a
    # square root (floating arithmetic other than +, -, *).
    assert len(ran_all) >= 30 and len(ran) <= 8, (len(ran_all), ran)
    assert set(ran) <= {"broadcast_in_dim", "sqrt", "lt", "add", "select_n"}, ran
    assert not re.search(r"\bne\b|iota|\band\b|convert_element_type", " ".join(ran))
