"""Restarts of ``jamp.master_weights(rounding="exact")`` on a small MLP (issue #42).

Each step, the elements where the parameters ``optax.apply_updates`` gives are not the
rounding of the master's float32 step (the wrapper's master restarts there). The MLP is
64-256-8 with 18,432 bfloat16 weights and float32 biases, trained by adamw (peak rate
1e-3, 100 steps of warmup, cosine decay) for 3,000 steps on 512 random samples.

    python benchmarks/experiments/mlp_restarts.py standard   # JAX's default promotion
    python benchmarks/experiments/mlp_restarts.py strict     # strict dtype promotion

It runs against any jamp with ``master_weights`` (the commit before issue #42's fix
too, to measure bfloat16 updates under standard promotion).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp
from jamp._src.optimizer.rounding import merge, split

mode = sys.argv[1] if len(sys.argv) > 1 else "standard"
jax.config.update("jax_numpy_dtype_promotion", mode)
BF16, STEPS = jnp.bfloat16, 3000
k = jax.random.split(jax.random.key(0), 4)
params = {
    "w1": (jax.random.normal(k[0], (64, 256)) / 8).astype(BF16),
    "b1": jnp.zeros(256),
    "w2": (jax.random.normal(k[1], (256, 8)) / 16).astype(BF16),
    "b2": jnp.zeros(8),
}
x = jax.random.normal(k[2], (512, 64))
y = jnp.sin(x[:, :8] * 2.0) + 0.1 * jax.random.normal(k[3], (512, 8))
LOW = ("w1", "w2")


def loss(p, xb, yb):
    h = jax.nn.relu(xb @ p["w1"].astype(jnp.float32) + p["b1"])
    return jnp.mean((h @ p["w2"].astype(jnp.float32) + p["b2"] - yb) ** 2)


adamw = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, STEPS), weight_decay=1e-4)


def standard(update):  # optax's adam needs standard promotion inside (its int32 count)
    def run(*args, **kwargs):
        with jax.numpy_dtype_promotion("standard"):
            return update(*args, **kwargs)

    return run


inner = optax.GradientTransformation(adamw.init, standard(adamw.update))
tx = jamp.master_weights(inner, rounding="exact")


@jax.jit
def step(p, s, i):
    idx = jax.random.randint(jax.random.fold_in(jax.random.key(9), i), (128,), 0, 512)
    value, g = jax.value_and_grad(loss)(p, x[idx], y[idx])
    # The float32 step the wrapper takes, to find where the add misses its rounding.
    masters = {n: merge(p[n], s.residual[n]) if n in LOW else p[n] for n in p}
    deltas, _ = inner.update({n: g[n].astype(jnp.float32) for n in g}, s.optimizer_state, masters)
    u, s = tx.update(g, s, p)
    new = optax.apply_updates(p, u)
    missed = sum(jnp.sum(new[n] != split(masters[n] + deltas[n])[0]) for n in LOW)
    return new, s, value, missed, u["w1"].dtype == jnp.float32


state, misses = tx.init(params), []
for i in range(STEPS):
    params, state, value, missed, wide = step(params, state, i)
    misses.append(int(missed))
misses = np.asarray(misses)
print(
    f"promotion {mode}, float32 updates {bool(wide)}: {misses.sum()} restarts in {STEPS} steps "
    f"({misses[:500].sum()} in the first 500), in {(misses > 0).sum()} steps; "
    f"final batch loss {float(value):.6f}"
)
