"""Near-zero gradients: values float16 cannot hold survive only with loss scaling.

float16's smallest subnormal is about 6e-8 (``jnp.finfo(jnp.float16).smallest_subnormal``)
and its smallest normal number 6.1e-5. Gradients below that flush to zero in the
float16 backward pass: not an error, not a NaN, just no learning. Loss scaling
multiplies the loss (and so every gradient on the way back) by ``S`` before the
backward pass and divides the float32 result by ``S`` after, so the same
values pass through float16 as ``S`` times larger numbers.

Here a float16 layer's loss is multiplied by ``--loss-weight`` (1e-6, like an
auxiliary loss with a small weight or a loss normalised by a large token
count). The script computes the gradient three ways, in float32, in float16
without scaling, and in float16 with ``jamp.static_loss_scale(2**16)``, and
reports how many entries are nonzero and how close each is to float32.
``python examples/near_zero_gradients.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp

import jamp


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--loss-weight", type=float, default=1e-6)
    parser.add_argument("--scale", type=float, default=2.0**16)
    args = parser.parse_args(argv)

    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (32, args.size))
    w = jax.random.normal(kw, (args.size, args.size)) / jnp.sqrt(float(args.size))

    def loss_fn(w, x):
        h = jnp.tanh(x @ w)  # the matmul and its backward run in float16 under autocast
        return args.loss_weight * jnp.mean(h**2)

    reference = jax.grad(loss_fn)(w, x)
    loss_f16 = jamp.autocast(loss_fn, jnp.float16)
    unscaled = jax.grad(loss_f16)(w, x)
    state = jamp.static_loss_scale(args.scale)
    scaled = jax.grad(lambda w: jamp.scale(state, loss_f16(w, x)))(w)
    grads, finite = jamp.unscale_and_check(state, scaled)

    def summary(g):
        nonzero = float(jnp.mean(g != 0))
        rel = float(jnp.linalg.norm(g - reference) / jnp.linalg.norm(reference))
        return {"nonzero": nonzero, "relative_error": rel}

    out = {
        "float32": summary(reference),
        "float16": summary(unscaled),
        "float16+scaling": summary(grads),
        "finite": bool(finite),
        "max_abs_float32_grad": float(jnp.max(jnp.abs(reference))),
    }
    print(f"largest float32 gradient entry: {out['max_abs_float32_grad']:.3g}")
    for name in ("float32", "float16", "float16+scaling"):
        s = out[name]
        print(
            f"{name:<16} nonzero {s['nonzero']:6.1%}   error vs float32 {s['relative_error']:.2e}"
        )
    return out


if __name__ == "__main__":
    main()
