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

It then trains a second, FSDP-sharded model (``fsdp_*`` below, issue #45): bfloat16
parameters whose kernel is sharded over the global mesh, ``P("data", None)``, one row
per device, float32 masters (``jamp.master_weights``) under ``jamp.loss_scaling``,
float16 compute (``jamp.autocast``), at ``FSDP_BAD_STEP`` an overflow in process 0's
rows only. Its loss is the mean absolute error and its learning rate a power of two,
so every sum across devices is exact (each row adds ``+-x / N``, ``x`` a multiple of
1/4): the float32 arithmetic is the same in whatever order gloo or one process sums,
and the run can be compared bit for bit with a one-process run of the same program
(``fsdp_reference`` in the test). The result's ``"fsdp"`` entry holds, per step, the
flags and the bytes (hex) of this process's shards of the parameters and optimizer state.
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
from _steps import make_step
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


# ------------------------------------------------ the FSDP model (master_weights, loss scaling)

FSDP_STEPS = 4
FSDP_BAD_STEP = 2
FSDP_IN, FSDP_OUT = 8, 4  # the kernel's rows: one per device of the 2 x 4 global mesh
FSDP_LR = 2.0**-4


def fsdp_init():
    """bfloat16 parameters (a kernel and a bias), float32 values exactly representable."""
    rng = np.random.default_rng(45)
    return {
        "w": (rng.integers(-64, 65, (FSDP_IN, FSDP_OUT)) / 128.0).astype(jnp.bfloat16),
        "b": (rng.integers(-8, 9, (FSDP_OUT,)) / 16.0).astype(jnp.bfloat16),
    }


def fsdp_tx():
    return jamp.loss_scaling(
        jamp.master_weights(optax.sgd(FSDP_LR)), jamp.dynamic_loss_scale(2.0**10, growth_interval=2)
    )


def _fsdp_loss(params, x, y):
    # autocast casts both to float16 (strict promotion wants them alike before)
    h = x.astype(jnp.bfloat16) @ params["w"]
    pred = h + params["b"].astype(h.dtype)[None, :]
    return jnp.mean(jnp.abs(pred.astype(jnp.float32) - y))


fsdp_loss = jamp.autocast(_fsdp_loss, jnp.float16)


def fsdp_batch(step, pid, n_local_devices):
    """This process's rows: multiples of 1/4 in [-1, 1] (the sums stay exact)."""
    rng = np.random.default_rng(7000 + 1000 * step + pid)
    rows = ROWS_PER_DEVICE * n_local_devices
    x = (rng.integers(-4, 5, (rows, FSDP_IN)) / 4.0).astype(np.float32)
    y = (rng.integers(-4, 5, (rows, FSDP_OUT)) / 4.0).astype(np.float32)
    if step == FSDP_BAD_STEP and pid == 0:
        x[0, 0] = 1.0e5  # inf in float16
    return x, y


def fsdp_step(tx):
    return make_step(tx, fsdp_loss)


def fsdp_specs():
    return {"w": P("data", None), "b": P()}


def local_shards(tree):
    """Each leaf's shards on this process's devices: ``[row range, bytes as hex]`` by key
    path, one per distinct shard (the test assembles both processes' rows)."""
    out = {}
    for k, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shards = {}
        for sh in leaf.addressable_shards:
            rows = sh.index[0] if sh.index else slice(None)
            key = (rows.start, rows.stop)
            shards[key] = np.asarray(sh.data).tobytes().hex()
        out[jax.tree_util.keystr(k)] = [[list(r), h] for r, h in sorted(shards.items(), key=str)]
    return out


def fsdp_run(mesh, pid, n_local):
    specs = fsdp_specs()
    batch_sharding = NamedSharding(mesh, P("data"))
    params = {
        k: jax.make_array_from_callback(a.shape, NamedSharding(mesh, specs[k]), lambda i, a=a: a[i])
        for k, a in fsdp_init().items()
    }
    tx = fsdp_tx()
    opt_state = jax.jit(tx.init)(params)
    step = fsdp_step(tx)

    steps = []
    for s in range(FSDP_STEPS):
        x_local, y_local = fsdp_batch(s, pid, n_local)
        x = jax.make_array_from_process_local_data(batch_sharding, x_local)
        y = jax.make_array_from_process_local_data(batch_sharding, y_local)
        params, opt_state = step(params, opt_state, x, y)
        steps.append(
            {
                "last_finite": per_device(opt_state.last_finite, bool),
                "skipped_steps": per_device(opt_state.skipped_steps, int),
                "scale": hexes(jamp.get_loss_scale(opt_state).scale)[0],
                "w_dtype": str(params["w"].dtype),
                "params": local_shards(params),
                "opt_state": local_shards(opt_state),
            }
        )
    return steps


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
        "fsdp": fsdp_run(mesh, pid, n_local),
    }
    print("JAMP_RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
