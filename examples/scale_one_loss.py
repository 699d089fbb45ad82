"""Scaling one loss: the smallest loss-scaled training step.

PyTorch::

    scaler = torch.amp.GradScaler()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

jamp: the forward pass runs under ``jamp.autocast(..., jnp.float16)``, the
loss is multiplied by the current scale with ``jamp.scale``, and
``jamp.loss_scaling`` around the optimizer unscales, checks, skips a
non-finite step and updates the scale. ``python examples/scale_one_loss.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

import jamp


def predict(params, x):
    return x @ params["w"] + params["b"][None, :]


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x) - y) ** 2)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--features", type=int, default=16)
    args = parser.parse_args(argv)

    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (256, args.features))
    true_w = jax.random.normal(kw, (args.features, 1))
    y = x @ true_w + 0.5

    params = {"w": jnp.zeros((args.features, 1)), "b": jnp.zeros((1,))}
    tx = jamp.loss_scaling(optax.sgd(0.1))  # a dynamic scale with PyTorch's defaults
    opt_state = tx.init(params)
    loss_f16 = jamp.autocast(loss_fn, jnp.float16)  # the matmul runs in float16

    @jax.jit
    def train_step(params, opt_state):
        ls = jamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: jamp.scale(ls, loss_f16(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / ls.scale

    losses = []
    for _ in range(args.steps):
        params, opt_state, loss = train_step(params, opt_state)
        losses.append(float(loss))
    m = {k: float(v) for k, v in jax.device_get(jamp.metrics(opt_state)).items()}
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.6f}; {m}")
    return {"losses": losses, "metrics": m, "params": params, "true_w": true_w}


if __name__ == "__main__":
    main()
