"""The exact pass's reduction on XLA:CPU: booleans vs uint8 flags (FINDINGS 10).

python -m benchmarks.experiments.exact_pass [elements]

One leaf (rows of 1,000) per dtype; median ms of 40 calls, each jitted alone.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing


def bench(f, x, n=40):
    f = jax.jit(f)
    jax.block_until_ready(f(x))
    return np.median(timing.time_calls({"f": f}, (x,), n, reps=1)["f"]) * 1e3


def flags(x, dtype):
    return jnp.logical_not(jnp.isfinite(x)).astype(dtype)


CHECKS = {
    "all(isfinite)": lambda x: jnp.all(jnp.isfinite(x)),
    "uint8 max of flags (jamp)": lambda x: jnp.max(flags(x, jnp.uint8)) == 0,
    "int8 max of flags": lambda x: jnp.max(flags(x, jnp.int8)) == 0,
    "int32 sum of flags": lambda x: jnp.sum(flags(x, jnp.int32)) == 0,
    "max (unsound floor)": jnp.max,
}

if __name__ == "__main__":
    n = int(float(sys.argv[1])) if len(sys.argv) > 1 else 10_000_000
    for dt in (jnp.float16, jnp.bfloat16, jnp.float32):
        x = jnp.asarray(np.random.default_rng(0).standard_normal(n), dt).reshape(-1, 1000)
        cells = "  ".join(f"{k} {bench(f, x):.2f}" for k, f in CHECKS.items())
        print(f"{jnp.dtype(dt).name:9s} {cells}", flush=True)
