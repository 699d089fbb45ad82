"""Compile time (CPU seconds of lower().compile()) of the MLP step's parts (FINDINGS 7, 12).

python -m benchmarks.experiments.compile_parts [MLP|GPT] [repeats]
"""

import statistics
import sys

import jax
import jax.numpy as jnp
import optax
from jax import lax

import jamp
from benchmarks import hlo, models, steps
from jamp._src import loss_scale as ls


def fast_only_step(state, tx, grads, opt_state, params):
    """jamp.GradScaler.step with the fast sum only (no exact fallback): not sound."""
    inv = ls.inverse_scale(state)
    total = sum(jnp.sum(x, dtype=jnp.float32) for x in jax.tree.leaves(grads))
    finite = jnp.isfinite(total) & (inv <= 1)

    def apply():
        updates, new_opt = tx.update(ls.unscale(state, grads), opt_state, params)
        return optax.apply_updates(params, updates), new_opt

    new_params, new_opt = lax.cond(finite, apply, lambda: (params, opt_state))
    return new_params, new_opt, ~finite


def plain_under_cond(model, update_scale=False):
    """The plain step with its optimizer update under a ``lax.cond`` (on a finite loss),
    and, with ``update_scale``, a ``jamp.GradScaler`` scale update: no check."""
    scaler = jamp.GradScaler(init_scale=steps.INIT_SCALE)
    tx = optax.adamw(steps.LR)
    params = steps.fresh(model.params)

    def step(state, batch):
        params, opt_state, sc = state
        loss, grads = jax.value_and_grad(model.loss)(params, batch)
        finite = jnp.isfinite(loss)

        def apply():
            updates, new_opt = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt

        params, opt_state = lax.cond(finite, apply, lambda: (params, opt_state))
        return params, opt_state, scaler.update(sc, ~finite) if update_scale else sc

    return (params, tx.init(params), scaler.init()), step


if __name__ == "__main__":
    m = {"MLP": models.mlp, "GPT": models.gpt}[sys.argv[1] if len(sys.argv) > 1 else "MLP"]()
    variants = {
        "plain": steps.plain,
        "plain, update under a cond": plain_under_cond,
        "plain, update under a cond, scale update": lambda mm: plain_under_cond(mm, True),
        "jamp.GradScaler.step": steps.jamp_grad_scaler,
        "GradScaler.step, fast sum only": lambda mm: steps.jamp_grad_scaler(
            mm, step_fn=fast_only_step
        ),
        "jamp.loss_scaling": steps.jamp_loss_scaling,
    }

    def lower(build):
        state, step = build(m)
        jitted, leaves = steps.make_flat_jit(step, state)
        return jitted.lower(leaves, m.batch)

    times = hlo.compile_times(
        {name: lambda _, b=build: lower(b) for name, build in variants.items()},
        int(sys.argv[2]) if len(sys.argv) > 2 else 5,
    )
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        print(f"{name:42s} {statistics.median(ts):.3f} s CPU, {statistics.median(ts) / base:.2f}x")
