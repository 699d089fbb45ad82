"""The check's sum on XLA:CPU: plain sums vs jamp's matrix-vector product (FINDINGS 10).

python -m benchmarks.experiments.cpu_sum [MLP|GPT] [rounds]

The same jamp.GradScaler.step and jamp.loss_scaling, traced with the landed
``_cpu_sum32`` (a product with a vector of 2**-40 for large float32 leaves) and
with it patched to a plain float32 sum per leaf; for each, how many
float32 ``reduce-window`` kernels over gradient-sized inputs XLA:CPU compiled
(its tiled split of a large sum),
then the step time, interleaved, as a ratio to plain.
"""

import math
import re
import sys

import jax

from benchmarks import models, steps
from benchmarks.experiments.step_variants import run
from jamp._src import finite as fin

landed = fin._cpu_sum32


def tiled_float_sums(hlo_text: str) -> int:
    """float32 ``reduce-window`` kernels over >= 2**16 elements: XLA:CPU's tiled sums."""
    n = 0
    for m in re.finditer(
        r"= f32\[([\d,]*)\][^=]*reduce-window\(.*?window=\{size=([\dx]+)", hlo_text
    ):
        out = math.prod(int(d) for d in m.group(1).split(",") if d)
        n += out * math.prod(int(w) for w in m.group(2).split("x")) >= 2**16
    return n


def traced_with(build, cpu_sum32):
    """``build`` with ``fin._cpu_sum32`` replaced while its step is traced."""

    def b(model):
        state, step = build(model)

        def patched(s, batch):
            fin._cpu_sum32 = cpu_sum32
            try:
                return step(s, batch)
            finally:
                fin._cpu_sum32 = landed

        return state, patched

    return b


if __name__ == "__main__":
    m = {"MLP": models.mlp, "GPT": models.gpt}[sys.argv[1] if len(sys.argv) > 1 else "MLP"]()
    variants = {
        "plain": steps.plain,
        "GradScaler.step, plain sums": traced_with(steps.jamp_grad_scaler, fin._sum32),
        "GradScaler.step, matrix-vector (landed)": steps.jamp_grad_scaler,
        "loss_scaling, plain sums": traced_with(steps.jamp_loss_scaling, fin._sum32),
        "loss_scaling, matrix-vector (landed)": steps.jamp_loss_scaling,
    }
    for name, build in variants.items():
        state, step = build(m)
        text = jax.jit(step).lower(state, m.batch).compile().as_text()
        print(
            f"{name:45s} float32 reduce-window kernels over >= 2**16 elements: "
            f"{tiled_float_sums(text)}"
        )
    run(m, variants, int(sys.argv[2]) if len(sys.argv) > 2 else 10)
