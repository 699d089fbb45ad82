"""Float8 operands, specs and a NumPy model of the delayed recipe, shared by the float8
tests (``float8/``, ``autocast/test_autocast_float8.py``, the implementation pins; not a
test module)."""

import jax.numpy as jnp
import numpy as np

from jamp._src.float8 import products

F32 = np.float32
MM = (((1,), (0,)), ((), ()))  # x @ w


def spec(dn=MM, out=jnp.float32, lhs=jnp.float32, rhs=jnp.float32, recipe=None):
    return products.Spec(dn, np.dtype(out), np.dtype(lhs), np.dtype(rhs), None, recipe)


def rng(seed):
    return np.random.default_rng(seed)


DNS = [
    MM,  # x @ w
    (((1,), (1,)), ((), ())),  # x @ w.T
    (((2,), (1,)), ((0,), (0,))),  # batched
    (((0, 2), (2, 0)), ((1,), (1,))),  # two contracting axes, a batch axis in the middle
]


def operands(dn, seed):
    (lc, rc), (lb, rb) = dn
    shapes = {
        MM: ((3, 4), (4, 5)),
        DNS[1]: ((3, 4), (5, 4)),
        DNS[2]: ((2, 3, 4), (2, 4, 5)),
        DNS[3]: ((4, 2, 3), (3, 2, 4)),
    }[dn]
    r = rng(seed)
    return tuple(jnp.asarray(r.standard_normal(s), jnp.float32) for s in shapes)


ROW_MAX = np.array([448.0, 448.0, 57344.0], F32)


def numpy_recipe(history, scale, amaxes, recipe):
    """Transformer Engine's DelayedScaling, in NumPy float32: roll the amaxes in, rescale."""
    history = np.roll(history, -1, axis=-1)
    history[..., 0] = amaxes
    amax = history.max(-1) if recipe.amax_compute_algo == "max" else history[..., 0]
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        new = (ROW_MAX / amax) / F32(2.0**recipe.margin)
    keep = (amax > 0) & np.isfinite(amax) & np.isfinite(new)
    return history, np.where(keep, new, scale).astype(F32)
