"""Every finite check and read floor on one tree.

python -m benchmarks.experiments.finite_quick N dtype [rounds]

Shuffled order each round and one untimed call per function (see timing.orders).
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import finite_checks as fc
from benchmarks import hlo, timing

n = int(float(sys.argv[1]))
dt = jnp.dtype(sys.argv[2])
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 10
tree = fc.make_tree(n, dt)
fns = {**fc.CHECKS, **fc.READS}
jf = {}
for k, f in fns.items():
    j = jax.jit(f)
    c = j.lower(tree).compile()
    st = hlo.stats(c)
    jf[k] = j
    jax.block_until_ready(j(tree))
    ok = fc.verify(jax.jit(f), dt) if k in fc.CHECKS else None
    print(
        f"{k:40s} ok={ok} fusions={st['fusions_entry']} bytes={st['bytes_accessed'] / 1e6:.1f}MB",
        flush=True,
    )
T = {k: [] for k in jf}
C = {k: [] for k in jf}
for order in timing.orders(list(jf), rounds):
    for k in order:
        j = jf[k]
        jax.block_until_ready(j(tree))
        for _ in range(3):
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(j(tree))
            T[k].append(time.perf_counter() - t0)
            C[k].append(time.process_time() - c0)
floor = min(np.median(T[k]) for k in fc.READS)
floorc = min(np.median(C[k]) for k in fc.READS)
for k in jf:
    print(
        f"{k:40s} wall {np.median(T[k]) * 1e3:8.2f} ms x{np.median(T[k]) / floor:5.2f}"
        f" | cpu {np.median(C[k]) * 1e3:8.2f} x{np.median(C[k]) / floorc:5.2f}"
    )
