"""A CNN with cross-entropy and gradient clipping after unscaling.

PyTorch's "working with unscaled gradients" example::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                                   # grads are now unscaled
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # so clip them
    scaler.step(optimizer)                                       # does not unscale again
    scaler.update()

Clipping the *scaled* gradients would clip the true gradients at
``max_norm / scale``: nearly every step, to a norm 65536 times too small (a
common bug). jamp offers the same loop with ``jamp.GradScaler``
(``--style grad-scaler``: ``unscale``, ``optax.clip_by_global_norm``, then
``step`` with the state ``unscale`` returned, which does not unscale again)
and the Optax way (``--style optax``: clipping
inside the chain that ``jamp.loss_scaling`` wraps, which always sees
unscaled gradients). Both compute the same update. The model is a small Flax
CNN in float16 (``jamp.autocast``) on scikit-learn's 8x8 digits.
``python examples/cnn_clipping.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from sklearn.datasets import load_digits

import jamp


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--style", choices=("grad-scaler", "optax"), default="grad-scaler")
    args = parser.parse_args(argv)

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    y = digits.target.astype(np.int32)
    model = CNN()
    params = model.init(jax.random.PRNGKey(0), x[:1])
    apply = jamp.autocast(model.apply, jnp.float16)

    def loss_fn(params, xb, yb):
        logits = apply(params, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    scaler = jamp.GradScaler()
    sgd = optax.sgd(0.1, momentum=0.9)
    clip = optax.clip_by_global_norm(args.max_norm)
    if args.style == "grad-scaler":
        tx = sgd
    else:
        tx = scaler.as_optax(optax.chain(clip, sgd))
    opt_state = tx.init(params)
    state = scaler.init()

    @jax.jit
    def iteration(state, params, opt_state, xb, yb):
        scale = state if args.style == "grad-scaler" else jamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: scaler.scale(scale, loss_fn(p, xb, yb)))(params)
        if args.style == "grad-scaler":
            grads, state = scaler.unscale(state, grads)  # scaler.unscale_(optimizer)
            norm = optax.tree.norm(grads)
            grads, _ = clip.update(grads, clip.init(grads))  # clip_grad_norm_(..., max_norm)
            clipped_norm = optax.tree.norm(grads)
            params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)
            found_inf = scaler.found_inf(state)  # not in torch: was the step skipped?
            state = scaler.update(state)  # scaler.update()
        else:
            norm = optax.tree.norm(jamp.unscale(scale, grads))
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            clipped_norm = jnp.minimum(norm, args.max_norm)  # what the chain's clip produced
            found_inf = jnp.logical_not(opt_state.last_finite)
        return state, params, opt_state, loss / scale.scale, norm, clipped_norm, found_inf

    rng = np.random.default_rng(0)
    losses, norms, clipped, skipped = [], [], [], 0
    for _ in range(args.steps):
        idx = rng.integers(0, len(x), args.batch_size)
        state, params, opt_state, loss, norm, cnorm, found_inf = iteration(
            state, params, opt_state, x[idx], y[idx]
        )
        if not bool(found_inf):  # the norms of a skipped step are inf/NaN
            losses.append(float(loss))
            norms.append(float(norm))
            clipped.append(float(cnorm))
        skipped += int(found_inf)
    accuracy = float(jnp.mean(jnp.argmax(model.apply(params, x), -1) == y))
    print(
        f"style={args.style}: loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}, "
        f"accuracy {accuracy:.3f}, skipped {skipped}, "
        f"unscaled grad norm up to {max(norms):.2f}, clipped to <= {max(clipped):.2f}"
    )
    return {
        "losses": losses,
        "norms": norms,
        "clipped_norms": clipped,
        "skipped": skipped,
        "accuracy": accuracy,
        "params": params,
    }


if __name__ == "__main__":
    main()
