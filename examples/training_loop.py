"""The typical mixed-precision training loop, with ``jamp.GradScaler``.

PyTorch's "typical mixed precision training" example::

    model = Net().cuda()
    optimizer = optim.SGD(model.parameters(), ...)
    scaler = torch.amp.GradScaler()
    for epoch in epochs:
        for input, target in data:
            optimizer.zero_grad()
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                output = model(input)
                loss = loss_fn(output, target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

ported line by line: the scaler is an immutable configuration, its state is
passed in and returned, and the whole iteration is one jitted function (no
host sync: the skip decision is taken on device). The scaler's ``state_dict``
is saved at the end of every epoch and restored, as a checkpoint would be.
``python examples/training_loop.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp


def net(params, x):
    """A three-layer MLP."""
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"][None, :])
    return x @ params[-1]["w"] + params[-1]["b"][None, :]


def init(key, sizes):
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for k, (m, n) in zip(keys, zip(sizes[:-1], sizes[1:], strict=True), strict=True):
        params.append({"w": jax.random.normal(k, (m, n)) * np.sqrt(2.0 / m), "b": jnp.zeros((n,))})
    return params


def loss_fn(output, target):
    return jnp.mean((output - target) ** 2)


def make_data(key, n, features):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, features))
    w = jax.random.normal(kw, (features, 1))
    return x, jnp.tanh(x @ w) + 0.1 * jnp.cos(3 * x[:, :1])


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batches", type=int, default=40, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--init-scale", type=float, default=2.0**16)
    parser.add_argument("--growth-interval", type=int, default=2000)
    args = parser.parse_args(argv)

    x, y = make_data(jax.random.PRNGKey(0), args.batches * args.batch_size, args.features)
    params = init(jax.random.PRNGKey(1), (args.features, 64, 64, 1))
    optimizer = optax.sgd(0.05, momentum=0.9)
    opt_state = optimizer.init(params)
    scaler = jamp.GradScaler(init_scale=args.init_scale, growth_interval=args.growth_interval)
    state = scaler.init()

    @jax.jit
    def iteration(state, params, opt_state, input, target):
        def scaled_loss(params):
            output = jamp.autocast(net, jnp.float16)(params, input)  # with torch.autocast(...)
            loss = loss_fn(output, target)
            return scaler.scale(state, loss), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)  # .backward()
        params, opt_state, state = scaler.step(state, optimizer, grads, opt_state, params)
        found_inf = scaler.found_inf(state)  # not in torch: was the step skipped?
        state = scaler.update(state)
        return state, params, opt_state, loss, found_inf

    epoch_losses, checkpoints = [], []
    skipped = jnp.zeros((), jnp.int32)  # counted on device: no sync per step
    for epoch in range(args.epochs):
        total = jnp.zeros(())
        for b in range(args.batches):
            sl = slice(b * args.batch_size, (b + 1) * args.batch_size)
            state, params, opt_state, loss, found_inf = iteration(
                state, params, opt_state, x[sl], y[sl]
            )
            total = total + loss
            skipped = skipped + found_inf.astype(jnp.int32)
        epoch_losses.append(float(total) / args.batches)
        checkpoint = scaler.state_dict(state)  # {"scale": ..., "_growth_tracker": ...}
        checkpoints.append(checkpoint)
        state = scaler.load_state_dict(checkpoint)  # resumes exactly where it was
        print(f"epoch {epoch}: loss {epoch_losses[-1]:.5f}  scaler {checkpoint}")
    print(f"skipped steps: {int(skipped)}")
    return {"epoch_losses": epoch_losses, "skipped": int(skipped), "checkpoints": checkpoints}


if __name__ == "__main__":
    main()
