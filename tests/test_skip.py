"""jamp.compat.select_tree; the rest of skip is reached via loss_scaling and GradScaler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _bad_input import assert_clear_error

import jamp


def test_select_tree():
    a = {"x": jnp.ones(3), "n": None, "i": jnp.int32(1)}
    b = {"x": jnp.zeros(3), "n": None, "i": jnp.int32(2)}
    out = jax.jit(jamp.compat.select_tree)(jnp.bool_(True), a, b)
    assert np.array_equal(out["x"], np.ones(3)) and int(out["i"]) == 1 and out["n"] is None
    out = jamp.compat.select_tree(jnp.bool_(False), a, b)
    assert np.array_equal(out["x"], np.zeros(3)) and int(out["i"]) == 2


# Every invalid call of select_tree: id -> (call, exception, match). A tuple of
# patterns: each must match (two tables checked that call).
T, ONE = jnp.bool_(True), {"a": jnp.ones(2)}
SDS = jax.ShapeDtypeStruct((2,), jnp.float32)
BAD_INPUT = {
    "pred=vector": (
        lambda: jamp.compat.select_tree(jnp.ones(2, bool), ONE, ONE),
        ValueError,
        r"`pred` to be a scalar",
    ),
    "pred=vector, array trees": (
        lambda: jamp.compat.select_tree(jnp.ones(2, bool), jnp.ones(2), jnp.ones(2)),
        ValueError,
        r"`pred` to be a scalar",
    ),
    "pred=float32": (
        lambda: jamp.compat.select_tree(jnp.float32(1), ONE, ONE),
        TypeError,
        r"`pred` to be a boolean scalar",
    ),
    "pred=int32": (
        lambda: jamp.compat.select_tree(jnp.int32(1), jnp.ones(2), jnp.ones(2)),
        TypeError,
        r"`pred` to be a boolean scalar",
    ),
    "structures": (
        lambda: jamp.compat.select_tree(T, ONE, {"b": jnp.ones(2)}),
        ValueError,
        (r"same tree structure", r"`on_true` and `on_false` to have the same tree structure"),
    ),
    "shapes": (
        lambda: jamp.compat.select_tree(T, ONE, {"a": jnp.ones(3)}),
        TypeError,
        (
            r"matching leaves at path \['a'\]",
            r"matching leaves at path \['a'\].*float32\[2\] and float32\[3\]",
        ),
    ),
    "dtypes": (
        lambda: jamp.compat.select_tree(T, [jnp.ones(2)], [jnp.ones(2, jnp.float16)]),
        TypeError,
        r"float32\[2\] and float16\[2\]",
    ),
    "strings": (
        lambda: jamp.compat.select_tree(T, {"a": "x"}, {"a": "y"}),
        TypeError,
        (r"non-array leaves", r"non-array leaves 'x' and 'y' at path \['a'\]"),
    ),
    "objects": (
        lambda: jamp.compat.select_tree(T, {"a": object()}, {"a": object()}),
        TypeError,
        r"non-array leaves.*at path \['a'\]",
    ),
    # issue #26: arrays of strings or objects failed inside jax
    "str arrays": (
        lambda: jamp.compat.select_tree(T, {"a": np.array(["x"])}, {"a": np.array(["y"])}),
        TypeError,
        r"`jamp.compat.select_tree` expected numeric array leaves.*<U1 at path \['a'\]",
    ),
    "object arrays": (
        lambda: jamp.compat.select_tree(T, np.array([1.0], object), np.array([2.0], object)),
        TypeError,
        r"numeric array leaves, got an array of dtype object at path <root>",
    ),
    # issue #35: a ShapeDtypeStruct has a dtype and a shape, and no values to select
    "ShapeDtypeStruct leaves": (
        lambda: jamp.compat.select_tree(False, SDS, SDS),
        TypeError,
        (
            r"^`jamp.compat.select_tree` expected `on_true` to hold arrays, got a "
            r"ShapeDtypeStruct .* at path <root>",
            r"jax\.eval_shape",
        ),
    ),
    "a ShapeDtypeStruct in on_false": (
        lambda: jamp.compat.select_tree(T, ONE, {"a": SDS}),
        TypeError,
        r"`on_false` to hold arrays, got a ShapeDtypeStruct .* at path \['a'\]",
    ),
    "filter returning an array": (
        lambda: jamp.compat.select_tree(T, ONE, ONE, filter=lambda x: jnp.ones(2, bool)),
        TypeError,
        r"`filter` to return a bool",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    assert_clear_error(*BAD_INPUT[case])


def test_shape_dtype_struct_leaves_are_named_under_jit():
    """Issue #35: ``select_tree(False, sds, sds)`` failed inside jax (``float()`` of a
    ShapeDtypeStruct)."""
    with pytest.raises(TypeError, match=r"`on_true` to hold arrays, got a ShapeDtypeStruct"):
        jax.jit(lambda pred: jamp.compat.select_tree(pred, SDS, SDS))(jnp.bool_(True))
