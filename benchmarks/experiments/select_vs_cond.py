"""Skip with lax.cond (jamp) or select, with and without donation; plain with a barrier.

python -m benchmarks.experiments.select_vs_cond MLP|GPT [rounds] [nodonate]

Why do select-skipping peers beat the plain step on the GPT? The variants:
plain; plain with an optimization_barrier on the gradients (all gradients
done before any optimizer op); jamp.GradScaler.step (cond); the same check
(jamp.unscale_and_check) with the step applied unconditionally and
jamp.select_tree picking new or old params and state.
"""

import sys

import jax
import optax

import jamp
from benchmarks import models, steps
from benchmarks.experiments.step_variants import run


def plain_barrier(model):
    tx = optax.adamw(steps.LR)
    params = steps.fresh(model.params)

    def step(state, batch):
        params, opt_state = state
        grads = jax.grad(model.loss)(params, batch)
        grads, params, opt_state = jax.lax.optimization_barrier((grads, params, opt_state))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return (params, tx.init(params)), step


def select_step(state, tx, grads, opt_state, params):
    grads, finite = jamp.unscale_and_check(state, grads)
    updates, new_opt = tx.update(grads, opt_state, params)
    new = (optax.apply_updates(params, updates), new_opt)
    p, o = jamp.select_tree(finite, new, (params, opt_state))
    return p, o, ~finite


V = {
    "plain": steps.plain,
    "plain + barrier on grads": plain_barrier,
    "jamp.GradScaler.step (cond)": steps.jamp_grad_scaler,
    "GradScaler-style step, select_tree": lambda m: steps.jamp_grad_scaler(m, step_fn=select_step),
    "jamp.loss_scaling (cond)": steps.jamp_loss_scaling,
}

if __name__ == "__main__":
    m = {"MLP": models.mlp, "GPT": models.gpt}[sys.argv[1]]()
    run(
        m,
        V,
        int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 8,
        donate="nodonate" not in sys.argv,
    )
