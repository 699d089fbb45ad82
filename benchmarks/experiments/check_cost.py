"""What does the MLP step pay for: the skip, or the check? (FINDINGS 7)

python -m benchmarks.experiments.check_cost [MLP|GPT] [rounds]

plain; plain that also computes jamp.all_finite (no skip); the update under a
lax.cond on isfinite(loss) (a skip, no gradient check); under a lax.cond on
jamp.all_finite(grads); and jamp.GradScaler.step (adds scaling and unscaling).
"""

import sys

import jax
import jax.numpy as jnp
import optax

import jamp
from benchmarks import models, steps
from benchmarks.experiments.skip_dependency import variant
from benchmarks.experiments.step_variants import run


def plain_plus_check(model):
    tx = optax.adamw(steps.LR)
    params = steps.fresh(model.params)

    def step(state, batch):
        params, opt_state, _ = state
        grads = jax.grad(model.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jamp.all_finite(grads)

    return (params, tx.init(params), jnp.bool_(True)), step


if __name__ == "__main__":
    m = {"MLP": models.mlp, "GPT": models.gpt}[sys.argv[1] if len(sys.argv) > 1 else "MLP"]()
    run(
        m,
        {
            "plain": steps.plain,
            "plain + check (no skip)": plain_plus_check,
            "cond on loss (no check)": variant("cond_loss"),
            "cond on check": variant("cond_check"),
            "jamp.GradScaler.step": steps.jamp_grad_scaler,
        },
        int(sys.argv[2]) if len(sys.argv) > 2 else 8,
    )
