"""float16 finite checks on a CPU without float16 arithmetic (FINDINGS 6).

python -m benchmarks.experiments.f16_check
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import timing

x = jnp.asarray(np.random.default_rng(0).standard_normal(10_000_000).astype(np.float16))
checks = {
    "read: max (unsound floor)": lambda x: jnp.max(x),
    "float32 sum (jamp before)": lambda x: jnp.isfinite(jnp.sum(x, dtype=jnp.float32)),
    "all(isfinite) (jamp now)": lambda x: jnp.all(jnp.isfinite(x)),
    "bfloat16 view, sum * 2**7": lambda x: jnp.isfinite(
        jnp.sum(lax.bitcast_convert_type(x, jnp.bfloat16).astype(jnp.float32) * jnp.float32(128))
    ),
}
jitted = {k: jax.jit(f) for k, f in checks.items()}
for f in jitted.values():
    jax.block_until_ready(f(x))
times = timing.time_calls(jitted, (x,), 15, reps=1)
for k in jitted:
    print(f"{k:30s} {np.median(times[k]) * 1e3:.2f} ms")
