"""jamp.select_tree; the rest of skip is reached via loss_scaling/GradScaler (tested there)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp


def test_select_tree():
    a = {"x": jnp.ones(3), "n": None, "i": jnp.int32(1)}
    b = {"x": jnp.zeros(3), "n": None, "i": jnp.int32(2)}
    out = jax.jit(jamp.select_tree)(jnp.bool_(True), a, b)
    assert np.array_equal(out["x"], np.ones(3)) and int(out["i"]) == 1 and out["n"] is None
    out = jamp.select_tree(jnp.bool_(False), a, b)
    assert np.array_equal(out["x"], np.zeros(3)) and int(out["i"]) == 2


@pytest.mark.parametrize(
    "pred,t,f,exc,match",
    [
        (
            jnp.ones(2, bool),
            {"a": jnp.ones(2)},
            {"a": jnp.ones(2)},
            ValueError,
            r"`pred` to be a scalar",
        ),
        (
            jnp.float32(1),
            {"a": jnp.ones(2)},
            {"a": jnp.ones(2)},
            TypeError,
            r"`pred` to be a boolean scalar",
        ),
        (
            jnp.bool_(True),
            {"a": jnp.ones(2)},
            {"b": jnp.ones(2)},
            ValueError,
            r"same tree structure",
        ),
        (
            jnp.bool_(True),
            {"a": jnp.ones(2)},
            {"a": jnp.ones(3)},
            TypeError,
            r"matching leaves at path \['a'\]",
        ),
        (jnp.bool_(True), {"a": "x"}, {"a": "y"}, TypeError, r"non-array leaves"),
    ],
)
def test_select_tree_errors(pred, t, f, exc, match):
    with pytest.raises(exc, match=match):
        jamp.select_tree(pred, t, f)
