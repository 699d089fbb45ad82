"""A Flax ``TrainState`` loop with loss scaling: the optimizer is the only change.

``jamp.loss_scaling`` is an Optax transformation, so it goes in as the
``tx`` of ``flax.training.train_state.TrainState`` and ``apply_gradients``
unscales, checks, skips non-finite steps and updates the scale unchanged.
``jamp.get_loss_scale(state)`` finds the scale inside the ``TrainState`` and
``jamp.metrics(state)`` gives the numbers to log. The model is a flax.linen
MLP whose matrix products run in float16 (``jamp.autocast`` around
``apply_fn``). ``python examples/flax_train_state.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state

import jamp


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(1)(x)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)

    kx, kw, ki = jax.random.split(jax.random.PRNGKey(0), 3)
    x_all = jax.random.normal(kx, (args.steps * args.batch_size, 8))
    y_all = jnp.tanh(x_all @ jax.random.normal(kw, (8, 1)) / jnp.sqrt(8.0))
    model = MLP()
    state = train_state.TrainState.create(
        apply_fn=jamp.autocast(model.apply, jnp.float16),
        params=model.init(ki, x_all[:1]),
        tx=jamp.loss_scaling(optax.sgd(0.05, momentum=0.9)),
    )

    @jax.jit
    def train_step(state, x, y):
        ls = jamp.get_loss_scale(state)

        def scaled_loss(params):
            loss = jnp.mean((state.apply_fn(params, x) - y) ** 2)
            return jamp.scale(ls, loss), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss

    losses, logs = [], []
    for step in range(args.steps):
        sl = slice(step * args.batch_size, (step + 1) * args.batch_size)
        state, loss = train_step(state, x_all[sl], y_all[sl])
        losses.append(loss)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            m = {k: float(v) for k, v in jax.device_get(jamp.metrics(state)).items()}
            logs.append(m)
            print(f"step {step + 1}: loss {float(loss):.4f} {m}")
    losses = [float(v) for v in jax.device_get(losses)]
    return {"losses": losses, "logs": logs, "state": state}


if __name__ == "__main__":
    main()
