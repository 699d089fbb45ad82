"""Gradient accumulation with ``jamp.multi_steps`` around ``jamp.loss_scaling``.

PyTorch's "gradient accumulation" example::

    for i, (input, target) in enumerate(data):
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            loss = loss_fn(model(input), target) / iters_to_accumulate
        scaler.scale(loss).backward()                  # accumulates scaled grads
        if (i + 1) % iters_to_accumulate == 0:
            scaler.step(optimizer)                     # unscale, check, step
            scaler.update()                            # once per effective batch
            optimizer.zero_grad()

In JAX, ``jamp.multi_steps(jamp.loss_scaling(sgd), every_k_schedule=k)``
(``optax.MultiSteps`` with one fix, below) does the bookkeeping: it averages
the scaled gradients of ``k`` micro-batches, so the loss is *not* divided by
``iters_to_accumulate`` (ported, the division would make every step ``k``
times smaller; keep it only with ``use_grad_mean=False``, which sums),
the scale stays the same across them, and at the boundary ``loss_scaling``
unscales, checks the accumulated gradients
(an inf in any micro-batch makes the sum inf, so the whole effective step is
skipped) and updates the scale once. ``--inject-inf-at`` poisons one
micro-batch to show that.

Plain ``optax.MultiSteps`` (0.2.8) clears its accumulator as ``0 * acc``,
which leaves NaN after an inf, so every later step would be skipped too;
``jamp.multi_steps`` starts each accumulation from zeros instead.
``python examples/gradient_accumulation.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

import jamp


def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-steps", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument(
        "--inject-inf-at",
        type=int,
        default=-1,
        help="micro-batch index whose input is set to inf (-1: none)",
    )
    args = parser.parse_args(argv)

    k1, k2, kx, kw = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(k1, (8, 32)) / jnp.sqrt(8.0),
        "w2": jax.random.normal(k2, (32, 1)) / jnp.sqrt(32.0),
    }
    n = args.steps * args.micro_steps * args.micro_batch
    x = jax.random.normal(kx, (n, 8))
    y = jnp.sin(x @ jax.random.normal(kw, (8, 1)))

    tx = jamp.multi_steps(
        jamp.loss_scaling(optax.sgd(0.1, momentum=0.9), jamp.dynamic_loss_scale(2.0**10)),
        every_k_schedule=args.micro_steps,
    )
    opt_state = tx.init(params)
    params0 = params
    loss_f16 = jamp.autocast(loss_fn, jnp.float16)

    @jax.jit
    def micro_step(params, opt_state, xb, yb):
        ls = jamp.get_loss_scale(opt_state)  # the same for every micro-batch of a step
        loss, grads = jax.value_and_grad(lambda p: jamp.scale(ls, loss_f16(p, xb, yb)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / ls.scale

    records = []
    for i in range(args.steps * args.micro_steps):
        sl = slice(i * args.micro_batch, (i + 1) * args.micro_batch)
        xb = x[sl] if i != args.inject_inf_at else jnp.full_like(x[sl], jnp.inf)
        before = params
        params, opt_state, loss = micro_step(params, opt_state, xb, y[sl])
        m = jax.device_get(jamp.metrics(opt_state))
        records.append(
            {
                "micro_step": i,
                "loss": float(loss),
                "params_changed": any(
                    bool(jnp.any(a != b))
                    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True)
                ),
                "scale": float(m["loss_scale"]),
                "skipped_steps": int(m["skipped_steps"]),
            }
        )
    first, last = float(loss_fn(params0, x, y)), float(loss_fn(params, x, y))
    print(
        f"{args.steps} steps of {args.micro_steps} micro-batches: "
        f"loss {first:.4f} -> {last:.4f}, "
        f"skipped {records[-1]['skipped_steps']}, scale {records[-1]['scale']:g}"
    )
    return {"records": records, "params": params, "initial_loss": first, "final_loss": last}


if __name__ == "__main__":
    main()
