"""Quick interleaved comparison of step variants.

python -m benchmarks.experiments.step_variants MLP|GPT [rounds]
"""

import sys

import numpy as np

from benchmarks import models, steps, timing


def run(model, variants, rounds=8, per_round=2, donate=True):
    runners = {}
    for name, b in variants.items():
        s, f = b(model)
        r = timing.Runner(steps.make_jit(f, donate=donate), s, model.batch)
        r.warm()
        runners[name] = r
    timing.interleave(runners, rounds, per_round)
    base = runners[next(iter(runners))]
    for n, r in runners.items():
        rw = timing.ratio_stats(r.times, base.times, per_round)[0]
        rc = timing.ratio_stats(r.cpu, base.cpu, per_round)[0]
        print(
            f"{n:45s} wall med {np.median(r.times) * 1e3:7.1f} ms"
            f" p10 {np.percentile(r.times, 10) * 1e3:7.1f} round ratio {rw:.3f}"
            f" | cpu med {np.median(r.cpu) * 1e3:7.1f} round ratio {rc:.3f}",
            flush=True,
        )
    return runners


if __name__ == "__main__":
    m = {"MLP": models.mlp, "GPT": models.gpt}[sys.argv[1]]()
    run(m, steps.VARIANTS, int(sys.argv[2]) if len(sys.argv) > 2 else 8)
