"""Two models, two losses, two optimizers, one scaler.

PyTorch's "multiple models, losses and optimizers" example::

    scaler = torch.amp.GradScaler()
    with torch.autocast("cuda", dtype=torch.float16):
        output0, output1 = model0(x), model1(x)
        loss0 = loss_fn(2 * output0 + 3 * output1, y)
        loss1 = loss_fn(3 * output0 - 5 * output1, y)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    scaler.unscale_(optimizer0)      # e.g. to inspect or clip model0's gradients
    scaler.step(optimizer0)
    scaler.step(optimizer1)
    scaler.update()

Two ``backward`` calls accumulate into ``.grad``; in JAX that is the
gradient of the sum of the scaled losses. ``scaler.scale`` takes any pytree,
so the losses can be scaled one by one and summed (``--form sum``), or
scaled together as a list (``--form list``) or a dict (``--form dict``,
which PyTorch turns into a ``map`` over the keys). All three give the same
gradients. The state records one inf check per optimizer (the unscaled
gradients of ``optimizer0`` are not unscaled again by its ``step``), and one
``update`` backs the scale off once if either optimizer saw an inf/NaN.
``python examples/multiple_losses.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

import jamp

FORMS = ("sum", "list", "dict")


def model(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def init(key, features, hidden):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (features, hidden)) / jnp.sqrt(float(features)),
        "w2": jax.random.normal(k2, (hidden, 1)) / jnp.sqrt(float(hidden)),
    }


def losses(params, x, y):
    out0, out1 = model(params[0], x), model(params[1], x)
    loss0 = jnp.mean((2 * out0 + 3 * out1 - y) ** 2)
    loss1 = jnp.mean((3 * out0 - 5 * out1 - y) ** 2)
    return loss0, loss1


def total_scaled_loss(scaler, state, params, x, y, form):
    loss0, loss1 = jamp.autocast(losses, jnp.float16)(params, x, y)
    if form == "sum":  # scaler.scale(loss0).backward(); scaler.scale(loss1).backward()
        return scaler.scale(state, loss0) + scaler.scale(state, loss1)
    if form == "list":
        scaled = scaler.scale(state, [loss0, loss1])
        return scaled[0] + scaled[1]
    scaled = scaler.scale(state, {"loss0": loss0, "loss1": loss1})
    return scaled["loss0"] + scaled["loss1"]


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--form", choices=FORMS, default="sum")
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    args = parser.parse_args(argv)

    kx, k0, k1 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (128, args.features))
    y = jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    p0, p1 = init(k0, args.features, args.hidden), init(k1, args.features, args.hidden)
    tx0, tx1 = optax.sgd(0.005, momentum=0.9), optax.sgd(0.01)
    o0, o1 = tx0.init(p0), tx1.init(p1)
    scaler = jamp.GradScaler()
    state = scaler.init()

    @jax.jit
    def iteration(state, p0, p1, o0, o1):
        g0, g1 = jax.grad(lambda ps: total_scaled_loss(scaler, state, ps, x, y, args.form))(
            (p0, p1)
        )
        g0, state = scaler.unscale(state, g0)  # scaler.unscale_(optimizer0)
        p0, o0, state = scaler.step(state, tx0, g0, o0, p0)  # scaler.step(optimizer0)
        p1, o1, state = scaler.step(state, tx1, g1, o1, p1)  # scaler.step(optimizer1)
        state = scaler.update(state)  # scaler.update()
        return state, p0, p1, o0, o1

    history = []
    for _ in range(args.steps):
        history.append([float(v) for v in losses((p0, p1), x, y)])
        state, p0, p1, o0, o1 = iteration(state, p0, p1, o0, o1)
    history.append([float(v) for v in losses((p0, p1), x, y)])
    print(
        f"form={args.form}: loss0 {history[0][0]:.4f} -> {history[-1][0]:.4f}, "
        f"loss1 {history[0][1]:.4f} -> {history[-1][1]:.4f}; "
        f"scale {float(scaler.get_scale(state)):g}"
    )
    return {"history": history, "params": (p0, p1), "state": state}


if __name__ == "__main__":
    main()
