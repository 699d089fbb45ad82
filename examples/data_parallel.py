"""Data-parallel training over all devices, with sharded batches and one skip decision.

PyTorch's "working with multiple GPUs" example: with
``DistributedDataParallel``, one process per GPU, autocast and
``GradScaler`` are used exactly as on one GPU; gradients are all-reduced
during ``backward`` and every rank's scaler sees the same ``found_inf``.

In JAX one ``jit``-compiled step runs on every device: the batch is sharded
along a ``"data"`` mesh axis with ``NamedSharding``, the parameters and the
optimizer state (loss scale included) are replicated, XLA inserts the
all-reduce of the gradients, and the finite check inside
``jamp.loss_scaling`` is a reduction over the *global* gradients, so every
device takes the same skip decision, the gradients summed across devices in
float32 (``reduce_dtype``). No ``axis_name`` is needed under
``jit``; with ``shard_map``/``pmap`` pass ``loss_scaling(..., axis_name=...)``,
which agrees on skipping but does not average the gradients (under ``pmap``,
``lax.pmean`` them yourself): ``docs/data-parallel.md`` has a tested recipe
for each style.

Runs on however many devices there are (1 included). On a CPU, try
``XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/data_parallel.py``.
``--nan-at-step`` puts a NaN into one device's shard of one batch: the step
is skipped everywhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jamp


def loss_fn(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"][None, :])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--per-device-batch", type=int, default=16)
    parser.add_argument(
        "--global-batch",
        type=int,
        default=0,
        help="global batch size (default: per-device batch x devices)",
    )
    parser.add_argument("--devices", type=int, default=0, help="devices to use (default: all)")
    parser.add_argument("--nan-at-step", type=int, default=-1)
    args = parser.parse_args(argv)

    devices = jax.devices()[: args.devices or None]
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    batch_sharding = NamedSharding(mesh, P("data"))  # split the batch over devices
    replicated = NamedSharding(mesh, P())  # every device holds all of it
    batch = args.global_batch or args.per_device_batch * len(devices)
    if batch % len(devices):
        parser.error(f"the global batch {batch} must divide evenly over {len(devices)} devices")

    k1, k2, kx, kw = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {
        "w1": jax.random.normal(k1, (16, 64)) / 4.0,
        "b1": jnp.zeros((64,)),
        "w2": jax.random.normal(k2, (64, 1)) / 8.0,
    }
    x_all = jax.random.normal(kx, (args.steps * batch, 16))
    y_all = jnp.tanh(x_all @ jax.random.normal(kw, (16, 1)) / 4.0)

    tx = jamp.loss_scaling(optax.sgd(0.03, momentum=0.9))
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    # Gradients summed in float32: what jamp does by default when the step is sharded
    # over several devices, asked for here so that one device computes the same gradients
    # (by default it keeps the float16 product's own transpose: docs/scaling-out.md).
    loss_f16 = jamp.autocast(loss_fn, jnp.float16, reduce_dtype=jnp.float32)

    @jax.jit
    def train_step(params, opt_state, x, y):
        ls = jamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: jamp.scale(ls, loss_f16(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / ls.scale

    losses, skipped_at = [], []
    for step in range(args.steps):
        x = x_all[step * batch : (step + 1) * batch]
        if step == args.nan_at_step:  # poison the last device's shard only
            x = x.at[-1, 0].set(jnp.nan)
        x = jax.device_put(x, batch_sharding)
        y = jax.device_put(y_all[step * batch : (step + 1) * batch], batch_sharding)
        params, opt_state, loss = train_step(params, opt_state, x, y)
        losses.append(float(loss))
        if not bool(opt_state.last_finite):
            skipped_at.append(step)
    m = {k: float(v) for k, v in jax.device_get(jamp.metrics(opt_state)).items()}
    print(
        f"{len(devices)} device(s), global batch {batch} ({x.sharding.spec}): "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; skipped at {skipped_at}; {m}"
    )
    return {
        "losses": losses,
        "skipped_at": skipped_at,
        "params": params,
        "opt_state": opt_state,
        "batch_sharding": x.sharding,
        "devices": len(devices),
    }


if __name__ == "__main__":
    main()
