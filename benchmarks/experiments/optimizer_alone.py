"""The optimizer update alone, given gradients: in the entry, in a lax.cond, selected.

python -m benchmarks.experiments.optimizer_alone GPT|MLP   (FINDINGS 5)
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jamp
from benchmarks import models, steps

m = {"MLP": models.mlp, "GPT": models.gpt}[sys.argv[1]]()
tx = optax.adamw(steps.LR)
grads = jax.grad(m.loss)(m.params, m.batch)


def update(p, o, g):
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o


forms = {
    "entry (plain)": lambda p, o, g, pred: update(p, o, g),
    "inside lax.cond": lambda p, o, g, pred: lax.cond(
        pred, lambda: update(p, o, g), lambda: (p, o)
    ),
    "select": lambda p, o, g, pred: jamp.select_tree(pred, update(p, o, g), (p, o)),
}
fns = {n: jax.jit(f, donate_argnums=(0, 1)) for n, f in forms.items()}
state = {n: (steps.fresh(m.params), tx.init(steps.fresh(m.params))) for n in fns}
pred = jnp.bool_(True)
times: dict = {n: [] for n in fns}
for r in range(31):
    for n, f in fns.items():
        t = time.perf_counter()
        state[n] = jax.block_until_ready(f(*state[n], grads, pred))
        if r:
            times[n].append(time.perf_counter() - t)
for n in fns:
    print(f"{n:16s} {np.median(times[n]) * 1e3:6.2f} ms")
