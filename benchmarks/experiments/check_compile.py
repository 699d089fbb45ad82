"""Compile time of the check alone, landed vs the per-leaf form it replaced (FINDINGS 12).

python -m benchmarks.experiments.check_compile [MLP|GPT] [repeats]

The CPU check of ``check_unscaled`` on the model's parameter shapes, jitted and compiled
``repeats`` times each (a fresh function name each time, so nothing is cached),
interleaved: the landed CPU check; the form it replaced (a float32 sum or
matrix-vector product per leaf, and an exact branch of per-element flags for
every leaf); and that form's one-read check without its exact branch (not
sound). Prints fusions, temp memory, and the median CPU seconds of
``compile()``.
"""

import functools
import statistics
import sys

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import hlo, models
from jamp._src import finite as fin
from jamp._src import loss_scale as ls


def _per_leaf_sum(x):
    if x.dtype == jnp.float32 and x.size >= 2**14 and x.shape[-1] >= 32:
        return jnp.sum(fin._rows(x))  # the replaced form summed the product's rows
    return fin._sum32(x)


def replaced_fast(leaves, inv):
    """The one read of the replaced CPU form: a sum per leaf, flags for float16."""
    leaves = lax.optimization_barrier(tuple(leaves))
    half = [x for x in leaves if x.dtype == jnp.float16]
    rest = [x for x in leaves if x.dtype != jnp.float16]
    fast = jnp.isfinite(functools.reduce(jnp.add, [_per_leaf_sum(x) for x in rest]))
    return fast & fin._exact(half) & (inv <= 1)


def replaced(leaves, inv):
    """The replaced CPU form: that read, and per-element flags of every unscaled leaf."""
    fast = replaced_fast(leaves, inv)
    unscaled = lambda: [ls._unscale_leaf(x, inv) for x in leaves]  # noqa: E731
    return lax.cond(fast, lambda: fast, lambda: fin._exact(unscaled()))


def landed(leaves, inv):
    return fin._finite(list(leaves), inv)


def fresh(f, name):
    """``f`` under a new name, so jit compiles it afresh."""

    def g(leaves, inv):
        return f(leaves, inv)

    g.__name__ = name
    return g


VARIANTS = {
    "landed": landed,
    "replaced": replaced,
    "replaced, one read only (not sound)": replaced_fast,
}

if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "MLP"
    leaves = jax.tree.leaves({"MLP": models.mlp, "GPT": models.gpt}[name]().params)
    inv = jnp.float32(2.0**-16)
    times = hlo.compile_times(
        {
            k: lambda rnd, k=k, f=f: jax.jit(fresh(f, f"check_{rnd}_{len(k)}")).lower(leaves, inv)
            for k, f in VARIANTS.items()
        },
        int(sys.argv[2]) if len(sys.argv) > 2 else 5,
    )
    for k, ts in times.items():
        print(f"{k:38s} {statistics.median(ts) * 1e3:6.0f} ms CPU")
