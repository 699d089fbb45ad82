"""Per-kernel time of GPT step variants, from a JAX profiler trace (FINDINGS 5).

python -m benchmarks.experiments.gpt_profile plain select_check cond_check

Variants: ``plain`` (the plain Optax step) and, from ``skip_dependency``, the
same step with the update selected (``select_*``) or run under ``lax.cond``
(``cond_*``), predicated on ``jamp.all_finite(grads)`` (``*_check``) or on
``isfinite(loss)`` (``*_loss``). Prints each kernel family's time per step.
"""

import collections
import glob
import gzip
import json
import re
import sys

import jax

from benchmarks import models, steps
from benchmarks.experiments.skip_dependency import variant

STEPS = 5


def profile(name: str, model) -> collections.Counter:
    build = steps.plain if name == "plain" else variant(name)
    state, step = build(model)
    run = steps.make_jit(step)
    for _ in range(3):
        state = jax.block_until_ready(run(state, model.batch))
    out = f"/tmp/jamp_profile_{name}"
    with jax.profiler.trace(out, create_perfetto_trace=True):
        for _ in range(STEPS):
            state = jax.block_until_ready(run(state, model.batch))
    (path,) = glob.glob(f"{out}/**/perfetto_trace.json.gz", recursive=True)[-1:]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    per_kind: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e["name"].startswith(("ThunkExecutor", "$", "Pjit", "Slinky")):
            continue
        per_kind[re.sub(r"\.\d+$", "", e["name"])] += e["dur"] / 1000 / STEPS
    return per_kind


if __name__ == "__main__":
    m = models.gpt()
    for name in sys.argv[1:] or ["plain", "select_check", "cond_check"]:
        kinds = profile(name, m)
        print(f"== {name}: kernels {sum(kinds.values()):.1f} ms per step")
        for k, ms in kinds.most_common(8):
            print(f"   {ms:7.2f} ms  {k}")
