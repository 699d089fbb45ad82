"""The check's sum on XLA:CPU: plain sums vs jamp's matrix-vector product (FINDINGS 10).

python -m benchmarks.experiments.cpu_sum [MLP|GPT] [rounds]
python -m benchmarks.experiments.cpu_sum alone [elements]
python -m benchmarks.experiments.cpu_sum table [elements]

The same jamp.GradScaler.step and jamp.loss_scaling, traced with the landed
``_rows`` (a product with a vector of 2**-40 for large float32 leaves) and
with it patched to a plain float32 sum per leaf (not exact: an experiment
only); for each, how many
float32 ``reduce-window`` kernels over gradient-sized inputs XLA:CPU compiled
(its tiled split of a large sum),
then the step time, interleaved, as a ratio to plain. ``alone`` times
``jamp.all_finite`` on a float32 tree passed in as parameters (no tiling
there), both ways, against a plain read, interleaved over 15 rounds. ``table``
runs the benchmark's finite-check table (every check, shuffled) with an extra
``jamp.all_finite, plain sums`` row.
"""

import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jamp
from benchmarks import finite_checks, models, steps, timing
from benchmarks.experiments.step_variants import run
from jamp._src import finite as fin

landed = fin._rows


def plain_sum(x):
    """A large leaf's plain float32 sum, as a one-element part of the gathered vector."""
    return jnp.sum(x, dtype=jnp.float32)[None]


def tiled_float_sums(hlo_text: str) -> int:
    """float32 ``reduce-window`` kernels over >= 2**16 elements: XLA:CPU's tiled sums."""
    n = 0
    for m in re.finditer(
        r"= f32\[([\d,]*)\][^=]*reduce-window\(.*?window=\{size=([\dx]+)", hlo_text
    ):
        out = math.prod(int(d) for d in m.group(1).split(",") if d)
        n += out * math.prod(int(w) for w in m.group(2).split("x")) >= 2**16
    return n


def traced_with(build, rows):
    """``build`` with ``fin._rows`` replaced while its step is traced."""

    def b(model):
        state, step = build(model)

        def patched(s, batch):
            fin._rows = rows
            try:
                return step(s, batch)
            finally:
                fin._rows = landed

        return state, patched

    return b


def alone(n: int) -> None:
    tree = finite_checks.make_tree(n, jnp.float32)
    checks = {
        # Two function objects, so two traces.
        "all_finite, matrix-vector (landed)": jax.jit(lambda t: jamp.all_finite(t)),
        "all_finite, plain sums": jax.jit(lambda t: jamp.all_finite(t)),
        "read: a sum per leaf": jax.jit(lambda t: [jnp.sum(x) for x in jax.tree.leaves(t)]),
    }
    for name, f in checks.items():  # compile each now, the second with plain sums
        fin._rows = plain_sum if "plain sums" in name else landed
        jax.block_until_ready(f(tree))
    fin._rows = landed
    for k, v in timing.time_calls(checks, (tree,), 15).items():
        print(f"{k:40s} {np.median(v) * 1e3:.3f} ms")


def table(n: int) -> None:
    from benchmarks import run as bench

    def plain_sums(tree):
        fin._rows = plain_sum  # while tracing
        try:
            return jamp.all_finite(tree)
        finally:
            fin._rows = landed

    finite_checks.CHECKS["jamp.all_finite, plain sums"] = plain_sums
    out = "/tmp/jamp_cpu_sum_table.md"
    bench.main(["--models", "", "--no-torch", "--finite-sizes", str(n), "--out", out])
    with open(out) as fh:
        print("".join(line for line in fh if line.startswith(("| jamp.all_finite", "| read"))))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "table":
        table(int(float(sys.argv[2])) if len(sys.argv) > 2 else 10_000_000)
        sys.exit()
    if len(sys.argv) > 1 and sys.argv[1] == "alone":
        alone(int(float(sys.argv[2])) if len(sys.argv) > 2 else 10_000_000)
        sys.exit()
    m = {"MLP": models.mlp, "GPT": models.gpt}[sys.argv[1] if len(sys.argv) > 1 else "MLP"]()
    variants = {
        "plain": steps.plain,
        "GradScaler.step, plain sums": traced_with(steps.jamp_grad_scaler, plain_sum),
        "GradScaler.step, matrix-vector (landed)": steps.jamp_grad_scaler,
        "loss_scaling, plain sums": traced_with(steps.jamp_loss_scaling, plain_sum),
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
