"""One process of the two-process test in test_distributed.py (not a test module).

Usage: python _multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and
``JAX_PLATFORMS=cpu``. The process joins JAX's distributed runtime with gloo
CPU collectives, trains a tiny data-parallel linear model over a global mesh of
every process's devices with ``jamp.loss_scaling(optax.sgd(...))``, and at
step ``BAD_STEP`` only process 0's local batch holds an input that overflows
float16. It prints one line ``JAMP_RESULT <json>`` on stdout: per-step flags,
scale and counters, and the parameters after every step as float hex strings,
so the test can compare the two processes bit for bit.
"""

import json
import sys

import jax

# Before any backend starts: cross-process collectives on CPU.
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jamp

STEPS = 5
BAD_STEP = 2
FEATURES = 3
ROWS_PER_DEVICE = 2


def hexes(x):
    """A replicated array's value as float hex strings, after checking that
    every device of this process holds the same bits."""
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    assert len(shards) == jax.local_device_count()
    assert all(s.tobytes() == shards[0].tobytes() for s in shards), shards
    return [float(v).hex() for v in shards[0].astype(np.float32).reshape(-1)]


def per_device(x, kind):
    """A scalar as each device of this process holds it."""
    return [kind(np.asarray(s.data)) for s in x.addressable_shards]


def local_batch(step, pid, n_local_devices):
    """This process's rows; identical on every run, different per process."""
    rng = np.random.default_rng(1000 * step + pid)
    rows = ROWS_PER_DEVICE * n_local_devices
    x = rng.uniform(-1.0, 1.0, (rows, FEATURES)).astype(np.float32)
    y = rng.uniform(-1.0, 1.0, (rows,)).astype(np.float32)
    if step == BAD_STEP and pid == 0:
        x[0, 0] = 1.0e5  # finite in float32, inf once the model casts it to float16
    return x, y


def loss_fn(params, x, y):
    # float16 compute, float32 loss: the usual mixed-precision forward pass.
    pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16) + params["b"].astype(jnp.float16)
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - y))


def main():
    pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=pid,
        initialization_timeout=90,
    )
    assert jax.process_index() == pid and jax.process_count() == nproc
    n_local = jax.local_device_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("data"))

    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(2.0**10, growth_interval=2))
    init_params = {
        "w": np.array([0.5, -0.25, 0.125], np.float32),
        "b": np.array(0.0625, np.float32),
    }
    params = jax.tree.map(
        lambda a: jax.make_array_from_callback(a.shape, replicated, lambda idx: a[idx]),
        init_params,
    )
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        ls = jamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: jamp.scale(ls, loss_fn(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params, opt_state = jax.lax.with_sharding_constraint((params, opt_state), replicated)
        return params, opt_state, jax.lax.with_sharding_constraint(loss, replicated)

    steps = []
    for step in range(STEPS):
        x_local, y_local = local_batch(step, pid, n_local)
        x = jax.make_array_from_process_local_data(batch_sharding, x_local)
        y = jax.make_array_from_process_local_data(batch_sharding, y_local)
        assert x.shape == (ROWS_PER_DEVICE * jax.device_count(), FEATURES)
        params, opt_state, scaled_loss = train_step(params, opt_state, x, y)
        ls = jamp.get_loss_scale(opt_state)
        steps.append(
            {
                "step": step,
                "local_overflow": bool(np.any(np.abs(x_local) > np.finfo(np.float16).max)),
                # one entry per device of this process
                "last_finite": per_device(opt_state.last_finite, bool),
                "skipped_steps": per_device(opt_state.skipped_steps, int),
                "scale": hexes(ls.scale)[0],
                "growth_tracker": int(ls.growth_tracker),
                "scaled_loss": hexes(scaled_loss)[0],
                "w": hexes(params["w"]),
                "b": hexes(params["b"]),
            }
        )

    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": n_local,
        "collectives": jax.config.jax_cpu_collectives_implementation,
        "steps": steps,
    }
    print("JAMP_RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
