"""Which part of a select-based skip makes the GPT step faster than plain? (FINDINGS 5)

python -m benchmarks.experiments.skip_dependency GPT [rounds] [variants]

Each variant runs the plain adamw step and then keeps or drops it, by select
or lax.cond, predicated on a check of all gradients (``*_check``) or only on
the loss (``*_loss``, a predicate that does not wait for the gradients).
"""

import sys

import jax
import jax.numpy as jnp
import optax
from jax import lax

import jamp
from benchmarks import models, steps
from benchmarks.experiments.step_variants import run


def variant(kind: str):
    skip, on = kind.split("_")

    def build(model):
        tx = optax.adamw(steps.LR)
        params = steps.fresh(model.params)

        def step(state, batch):
            params, opt_state = state
            loss, grads = jax.value_and_grad(model.loss)(params, batch)

            def apply():
                updates, new_opt = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), new_opt

            pred = jnp.isfinite(loss) if on == "loss" else jamp.all_finite(grads)
            if skip == "cond":
                return lax.cond(pred, apply, lambda: (params, opt_state))
            return jamp.select_tree(pred, apply(), (params, opt_state))

        return (params, tx.init(params)), step

    return build


if __name__ == "__main__":
    m = {"MLP": models.mlp, "GPT": models.gpt}[sys.argv[1]]()
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    kinds = (
        sys.argv[3].split(",")
        if len(sys.argv) > 3
        else ["cond_loss", "cond_check", "select_check", "select_loss"]
    )
    run(m, {"plain": steps.plain, **{k: variant(k) for k in kinds}}, rounds)
