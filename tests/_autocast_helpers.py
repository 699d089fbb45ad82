"""Jaxpr walking and tolerances shared by the autocast tests (not a test module)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

F16, BF16, F32 = jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
HALF = (F16, BF16)
# Relative error of one rounding, used to size tolerances.
EPS = {F16: 2.0**-11, BF16: 2.0**-8}


def walk(jaxpr):
    """Every equation of ``jaxpr`` and of its sub-jaxprs, recursively."""
    if isinstance(jaxpr, jex_core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
                    yield from walk(sub)


def eqns_named(jaxpr, *names):
    return [e for e in walk(jaxpr) if e.primitive.name in names]


def in_dtypes(eqn):
    return [
        jnp.dtype(v.aval.dtype) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)
    ]


def is_scale(eqn):
    """A division by a scalar (a constant or a parameter): a scale, which follows its input."""
    return eqn.primitive.name == "div" and eqn.invars[1].aval.size == 1


def randn(seed, *shape, scale=1.0):
    """Float32 normal samples from NumPy: no XLA compilation, unlike jax.random."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def tree_dtypes(tree):
    return jax.tree_util.tree_map(lambda x: jnp.dtype(x.dtype), tree)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_close_tree(got, want, tol):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert jnp.dtype(g.dtype) == jnp.dtype(w.dtype)
        assert rel_err(g, w) < tol, (rel_err(g, w), tol)
