"""The tiny linear problem the front-end tests share (not a test module)."""

import jax
import jax.numpy as jnp
import numpy as np

import jamp


def params0():
    return {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]], jnp.float32), "b": jnp.array([0.1, -0.2])}


def loss_fn(p, x):
    return jnp.mean((x @ p["w"] + p["b"][None, :]) ** 2)


X = jnp.array([[1.0, 2.0], [3.0, -1.0]])


def scaled_grads(opt_state, p, x=X):
    ls = jamp.get_loss_scale(opt_state)
    return jax.grad(lambda q: jamp.scale(ls, loss_fn(q, x)))(p)


def poison(tree, value=jnp.inf):
    return jax.tree_util.tree_map(lambda g: g.at[(0,) * g.ndim].set(value), tree)


def assert_trees_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_trees_close(a, b, rtol=2e-7):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=0)


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
