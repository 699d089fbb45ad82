"""Does the check run faster after the whole backward pass? (FINDINGS 9)

python -m benchmarks.experiments.check_after_backward [rounds]

jamp.GradScaler.step on the MLP with jamp's CPU-only optimization barrier
before the check (as landed), without it (patched out while tracing), and with
a barrier on the whole gradient tree outside jamp.
"""

import sys

import numpy as np
import optax
from jax import lax

from benchmarks import models, steps, timing
from jamp._src import finite as fin
from jamp._src import loss_scale as ls
from jamp._src import transform

m = models.mlp()
orig = fin._after_all


def outer_barrier_step(state, tx, grads, opt_state, params):
    g2 = lax.optimization_barrier(grads)
    finite = fin.check_unscaled(state, g2)

    def apply():
        u, o = tx.update(ls.unscale(state, grads), opt_state, params)
        return optax.apply_updates(params, u), o

    p, o = transform.cond_or_keep(finite, apply, lambda _: (params, opt_state))
    return p, o, ~finite


runners = {}
for name, build, patch in [
    ("plain", steps.plain, False),
    ("no barrier", steps.jamp_grad_scaler, True),
    ("inner barrier (jamp now)", steps.jamp_grad_scaler, False),
    (
        "outer barrier on grads tree",
        lambda mm: steps.jamp_grad_scaler(mm, step_fn=outer_barrier_step),
        True,
    ),
]:
    fin._after_all = (lambda leaves: leaves) if patch else orig
    s, f = build(m)
    r = timing.Runner(steps.make_jit(f), s, m.batch)
    r.warm()
    runners[name] = r
fin._after_all = orig
R, per = int(sys.argv[1]) if len(sys.argv) > 1 else 20, 2
timing.interleave(runners, R, per)
base = runners["plain"]
for n, r in runners.items():
    wall = timing.ratio_stats(r.times, base.times, per)[0]
    cpu = timing.ratio_stats(r.cpu, base.cpu, per)[0]
    print(f"{n:32s} {np.median(r.times) * 1e3:6.1f} ms ratio {wall:.3f} cpu {cpu:.3f}")
