"""A first jamp run: a tiny classifier on scikit-learn's 8x8 digits.

Trains the same model in float32 and with float16 compute plus
``jamp.loss_scaling``, and prints the final loss, accuracy, skipped steps and
the loss scale of each. Runs in seconds on a CPU; nothing is downloaded.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jamp


def init_params(key, sizes=(64, 64, 10)):
    params = []
    for k, (m, n) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append({"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros((n,))})
    return params


def forward(params, x, dtype):
    h = x.astype(dtype)
    for i, layer in enumerate(params):
        h = h @ layer["w"].astype(dtype) + layer["b"].astype(dtype)[None, :]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return h.astype(jnp.float32)


def loss_fn(params, x, y, dtype):
    logits = forward(params, x, dtype)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train(mode: str, steps: int, seed: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    dtype = jnp.float16 if mode == "float16+scaling" else jnp.float32
    tx = jamp.loss_scaling(optax.sgd(0.1, momentum=0.9))
    params = init_params(jax.random.PRNGKey(seed))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        ls = jamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: jamp.scale(ls, loss_fn(p, xb, yb, dtype)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / ls.scale

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(x_train), 128)
        params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
    acc = float(jnp.mean(jnp.argmax(forward(params, x_test, dtype), -1) == y_test))
    ls = jamp.get_loss_scale(opt_state)
    return float(loss), acc, int(opt_state.skipped_steps), float(ls.scale)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"{'mode':<18}{'loss':>8}{'accuracy':>10}{'skipped':>9}{'scale':>10}")
    for mode in ("float32", "float16+scaling"):
        loss, acc, skipped, scale = train(mode, args.steps, args.seed)
        print(f"{mode:<18}{loss:>8.4f}{acc:>10.3f}{skipped:>9d}{scale:>10.0f}")


if __name__ == "__main__":
    main()
