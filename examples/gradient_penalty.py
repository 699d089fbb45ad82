"""A gradient penalty with loss scaling: the gradient of a gradient.

PyTorch's "gradient penalty" example::

    with torch.autocast(device_type="cuda", dtype=torch.float16):
        loss = loss_fn(model(input), target)
    # The penalty's own gradients, of the *scaled* loss (create_graph: differentiable)
    scaled_grad_params = torch.autograd.grad(
        outputs=scaler.scale(loss), inputs=model.parameters(), create_graph=True
    )
    inv_scale = 1.0 / scaler.get_scale()  # not scaler.unscale_: no optimizer owns them
    grad_params = [p * inv_scale for p in scaled_grad_params]
    with torch.autocast(device_type="cuda", dtype=torch.float16):
        grad_norm = torch.sqrt(sum(g.pow(2).sum() for g in grad_params))
        loss = loss + grad_norm
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

In JAX the inner ``torch.autograd.grad(..., create_graph=True)`` is a
``jax.grad`` inside the loss: every ``jax.grad`` is differentiable. The inner
gradients are of the scaled loss, so float16 keeps them, and are unscaled
with ``jamp.unscale`` (``p * inv_scale``) before the penalty; the outer
gradient is of the scaled penalised loss, and ``GradScaler.step`` unscales,
checks and skips it as usual. An overflow in the inner gradients makes the
penalty, and so the outer gradients, non-finite: that step is skipped and
the scale backs off (``--inject-inf-at``). ``python
examples/gradient_penalty.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

import jamp


def model(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def loss_fn(params, x, y):
    return jnp.mean((model(params, x) - y) ** 2)


loss_f16 = jamp.autocast(loss_fn, jnp.float16)  # with torch.autocast("cuda", torch.float16)


def penalised_loss(scaler, state, params, x, y):
    """``loss + ||d loss / d params||``, the inner gradient taken of the scaled loss."""
    scaled_grads = jax.grad(lambda p: scaler.scale(state, loss_f16(p, x, y)))(params)
    grads = jamp.unscale(state, scaled_grads)  # grad_params = [p * inv_scale ...]
    grad_norm = optax.tree.norm(grads)
    return loss_f16(params, x, y) + grad_norm


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--features", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument(
        "--inject-inf-at", type=int, default=-1, help="step whose input is inf (-1: none)"
    )
    args = parser.parse_args(argv)

    k1, k2, kx = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {
        "w1": jax.random.normal(k1, (args.features, args.hidden)) / jnp.sqrt(args.features),
        "w2": jax.random.normal(k2, (args.hidden, 1)) / jnp.sqrt(args.hidden),
    }
    x = jax.random.normal(kx, (128, args.features))
    y = jnp.sin(x[:, :1]) - 0.5 * x[:, 1:2]
    scaler = jamp.GradScaler()
    tx = optax.sgd(0.05, momentum=0.9)
    state, opt_state = scaler.init(), tx.init(params)

    @jax.jit
    def iteration(state, params, opt_state, x):
        def scaled(p):  # scaler.scale(loss).backward()
            return scaler.scale(state, penalised_loss(scaler, state, p, x, y))

        grads = jax.grad(scaled)(params)
        params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)
        found_inf = scaler.found_inf(state)
        return scaler.update(state), params, opt_state, found_inf

    @jax.jit
    def loss_and_penalty(params):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return loss, optax.tree.norm(grads)

    history = []
    for step in range(args.steps):
        xb = jnp.full_like(x, jnp.inf) if step == args.inject_inf_at else x
        state, params, opt_state, found_inf = iteration(state, params, opt_state, xb)
        loss, penalty = loss_and_penalty(params)
        history.append(
            {
                "loss": float(loss),
                "penalty": float(penalty),
                "skipped": bool(found_inf),
                "scale": float(scaler.get_scale(state)),
            }
        )
    first, last = history[0], history[-1]
    print(
        f"loss {first['loss']:.4f} -> {last['loss']:.4f}, penalty {first['penalty']:.4f} -> "
        f"{last['penalty']:.4f}; skipped {sum(h['skipped'] for h in history)}, scale "
        f"{last['scale']:g}"
    )
    return {"history": history, "params": params}


if __name__ == "__main__":
    main()
