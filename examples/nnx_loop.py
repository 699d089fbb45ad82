"""A Flax NNX loop with loss scaling: ``nnx.Optimizer`` takes ``jamp.loss_scaling``.

``nnx.Optimizer(model, jamp.loss_scaling(optax.sgd(...)), wrt=nnx.Param)``
holds the loss-scale state with the rest of the optimizer state;
``jamp.get_loss_scale(optimizer)`` finds it (NNX variables are unwrapped)
and ``optimizer.update(model, grads)`` unscales, checks, skips and updates
the scale. The forward pass runs its matrix products in float16 through
``jamp.autocast`` on the model's ``nnx.split`` state.
``python examples/nnx_loop.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jamp


class MLP(nnx.Module):
    def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(features, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def forward_f16(model: nnx.Module, x: jax.Array) -> jax.Array:
    """``model(x)`` with its matrix products in float16."""
    graphdef, state = nnx.split(model)
    return jamp.autocast(lambda s, x: nnx.merge(graphdef, s)(x), jnp.float16)(state, x)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)

    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x_all = jax.random.normal(kx, (args.steps * args.batch_size, 8))
    y_all = jnp.tanh(x_all @ jax.random.normal(kw, (8, 1)) / jnp.sqrt(8.0))
    model = MLP(8, 64, rngs=nnx.Rngs(0))
    tx = jamp.loss_scaling(optax.sgd(0.05, momentum=0.9))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        ls = jamp.get_loss_scale(optimizer)

        def scaled_loss(model):
            loss = jnp.mean((forward_f16(model, x) - y) ** 2)
            return jamp.scale(ls, loss), loss

        (_, loss), grads = nnx.value_and_grad(scaled_loss, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss

    losses, logs = [], []
    for step in range(args.steps):
        sl = slice(step * args.batch_size, (step + 1) * args.batch_size)
        losses.append(train_step(model, optimizer, x_all[sl], y_all[sl]))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            m = {k: float(v) for k, v in jax.device_get(jamp.metrics(optimizer)).items()}
            logs.append(m)
            print(f"step {step + 1}: loss {float(losses[-1]):.4f} {m}")
    losses = [float(v) for v in jax.device_get(losses)]
    return {"losses": losses, "logs": logs, "model": model, "optimizer": optimizer}


if __name__ == "__main__":
    main()
