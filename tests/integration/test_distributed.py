"""Loss scaling across devices and processes: every replica takes the same skip decision.

* ``jit`` with ``NamedSharding`` on a mesh of the 8 virtual CPU devices,
  data-parallel and FSDP-style, with an overflow in one shard's rows only;
* ``jax.shard_map`` and ``jax.pmap`` with per-replica gradients (no ``pmean``)
  and ``loss_scaling(..., axis_name="data")``, and the same steps without
  ``axis_name`` to show the replicas would otherwise disagree;
* two processes on JAX's distributed runtime with gloo CPU collectives
  (``tests/integration/_multiprocess_worker.py``), compared bit for bit: a
  data-parallel model, and an FSDP-sharded one with ``master_weights`` and loss
  scaling that also bit-matches the one-process run of the same program.
"""

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _steps import make_step
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jamp

N_DEV = 8
ROWS_PER_DEV = 2
BATCH = N_DEV * ROWS_PER_DEV
FEATURES = 3
HIDDEN = 4
BAD_DEV = 5  # the one device (shard / replica) whose rows overflow
BAD_ROW = BAD_DEV * ROWS_PER_DEV + 1  # a row of BAD_DEV's shard of the batch
HUGE = 1.0e5  # finite in float32, inf once the model casts it to float16
INIT_SCALE = 2.0**8
WORKER = Path(__file__).with_name("_multiprocess_worker.py")


# ------------------------------------------------------------------ helpers


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def tree_same_bits(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(same_bits(x, y) for x, y in zip(la, lb, strict=True))


def host(tree):
    return jax.tree.map(np.asarray, tree)


def mesh8():
    devices = jax.devices()
    assert len(devices) == N_DEV, f"conftest should give {N_DEV} CPU devices, got {devices}"
    return Mesh(np.array(devices), ("data",))


def put(tree, sharding):
    return jax.tree.map(lambda a: jax.device_put(a, sharding), tree)


def batch(seed, bad):
    """``(x, y)`` with BATCH rows; with ``bad``, row BAD_ROW overflows in float16."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, (BATCH, FEATURES)).astype(np.float32)
    y = rng.uniform(-1.0, 1.0, (BATCH,)).astype(np.float32)
    if bad:
        x[BAD_ROW, 0] = HUGE
    return x, y


def dense_params():
    rng = np.random.default_rng(0)
    return {
        "w1": rng.uniform(-1.0, 1.0, (FEATURES, HIDDEN)).astype(np.float32),
        "b1": rng.uniform(-0.1, 0.1, (HIDDEN,)).astype(np.float32),
        "w2": rng.uniform(-1.0, 1.0, (HIDDEN,)).astype(np.float32),
    }


def dense_loss(params, x, y):
    """A tiny MLP in float16 with float32 master weights and a float32 loss."""
    p16 = jax.tree.map(lambda a: a.astype(jnp.float16), params)
    h = jnp.tanh(jnp.asarray(x).astype(jnp.float16) @ p16["w1"] + p16["b1"][None, :])
    pred = h @ p16["w2"]
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - y))


def global_batch(parts, sharding):
    """The processes' local batches ``[(x, y), ...]`` as one global ``(x, y)``, in process
    order, sharded as the processes' global arrays are."""
    return tuple(jax.device_put(np.concatenate([p[i] for p in parts]), sharding) for i in (0, 1))


def assert_shards_unchanged(new, old):
    """Every addressable shard of every leaf of ``new`` equals ``old`` bit for bit."""
    for (path, n), o in zip(
        jax.tree_util.tree_flatten_with_path(new)[0], jax.tree.leaves(old), strict=True
    ):
        o = np.asarray(o)
        shards = n.addressable_shards
        assert len({s.device for s in shards}) == N_DEV, jax.tree_util.keystr(path)
        for s in shards:
            assert same_bits(s.data, o[s.index]), (
                f"{jax.tree_util.keystr(path)} changed on {s.device} (shard {s.index})"
            )


def assert_shards_changed(new, old):
    """Every addressable shard of every leaf of ``new`` differs from ``old`` everywhere."""
    for (path, n), o in zip(
        jax.tree_util.tree_flatten_with_path(new)[0], jax.tree.leaves(old), strict=True
    ):
        o = np.asarray(o)
        for s in n.addressable_shards:
            d = np.asarray(s.data)
            assert np.all(np.isfinite(d)), f"{jax.tree_util.keystr(path)} on {s.device}"
            assert np.all(d != o[s.index]), (
                f"{jax.tree_util.keystr(path)} not updated on {s.device} (shard {s.index})"
            )


def assert_overflow_in_one_shard(x):
    """The injected overflow really lives in the rows of exactly one device's shard."""
    bad = []
    for s in x.addressable_shards:
        if np.any(np.abs(np.asarray(s.data)) > np.finfo(np.float16).max):
            bad.append(s.index[0])
    assert bad == [slice(BAD_DEV * ROWS_PER_DEV, (BAD_DEV + 1) * ROWS_PER_DEV)], bad


def adam_count(opt_state):
    return int(opt_state.inner_state[0].count)


def check_sharded_training(params, sharding_of, step, tx):
    """clean step, overflow in one shard (skipped everywhere), clean step."""
    mesh = mesh8()
    batch_sh = NamedSharding(mesh, P("data"))
    params = {k: jax.device_put(v, sharding_of(k)) for k, v in params.items()}
    opt_state = jax.jit(tx.init)(params)

    x, y = put(batch(1, bad=False), batch_sh)
    params, opt_state = step(params, opt_state, x, y)
    assert bool(opt_state.last_finite) and int(opt_state.skipped_steps) == 0
    assert adam_count(opt_state) == 1
    for k, v in params.items():
        assert v.sharding.is_equivalent_to(sharding_of(k), v.ndim), (k, v.sharding)

    # The overflow: one row of one shard. The same step without it is finite.
    x_bad, y_bad = put(batch(2, bad=True), batch_sh)
    assert_overflow_in_one_shard(x_bad)
    x_ok, y_ok = put(batch(2, bad=False), batch_sh)
    _, probe = step(params, opt_state, x_ok, y_ok)
    assert bool(probe.last_finite), "the step must overflow only because of the injected row"

    before_params, before_inner = host(params), host(opt_state.inner_state)
    params, opt_state = step(params, opt_state, x_bad, y_bad)
    assert not bool(opt_state.last_finite)
    assert int(opt_state.skipped_steps) == 1
    assert float(jamp.get_loss_scale(opt_state).scale) == INIT_SCALE / 2
    assert adam_count(opt_state) == 1
    assert tree_same_bits(host(opt_state.inner_state), before_inner)
    assert_shards_unchanged(params, before_params)
    assert_shards_unchanged(opt_state.inner_state[0].mu, before_inner[0].mu)
    for k, v in params.items():
        assert v.sharding.is_equivalent_to(sharding_of(k), v.ndim), (k, v.sharding)

    # A clean step afterwards applies on every device.
    x, y = put(batch(3, bad=False), batch_sh)
    before_params = host(params)
    params, opt_state = step(params, opt_state, x, y)
    assert bool(opt_state.last_finite) and int(opt_state.skipped_steps) == 1
    assert adam_count(opt_state) == 2
    assert float(jamp.get_loss_scale(opt_state).scale) == INIT_SCALE / 2
    assert_shards_changed(params, before_params)


# ------------------------------------------------------ 1. jit + NamedSharding


@pytest.mark.standard_promotion  # optax.adam's `decay ** count` is rejected by strict promotion
def test_jit_data_parallel_one_shard_overflows_every_device_skips():
    mesh = mesh8()
    tx = jamp.loss_scaling(optax.adam(1e-2), jamp.dynamic_loss_scale(INIT_SCALE))
    replicated = NamedSharding(mesh, P())
    check_sharded_training(dense_params(), lambda k: replicated, make_step(tx, dense_loss), tx)


def embedding_loss(params, x, y):
    """Row b of the batch reads row b of the table, so each device's rows of
    the gradient come from its own rows of the batch: the overflow makes only
    BAD_DEV's shard of the table's gradient non-finite."""
    t16 = params["table"].astype(jnp.float16)
    ids = jnp.arange(BATCH, dtype=jnp.int32)
    pred = jnp.sum(t16[ids] * jnp.asarray(x).astype(jnp.float16), axis=-1) + params["b"].astype(
        jnp.float16
    )
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - y))


@pytest.mark.standard_promotion  # optax.adam, as above
def test_jit_fsdp_params_sharded_one_shard_overflows_every_device_skips():
    mesh = mesh8()
    rng = np.random.default_rng(4)
    params = {
        "table": rng.uniform(-1.0, 1.0, (BATCH, FEATURES)).astype(np.float32),
        "b": np.array([0.25], np.float32),
    }
    shardings = {"table": NamedSharding(mesh, P("data", None)), "b": NamedSharding(mesh, P())}
    tx = jamp.loss_scaling(optax.adam(1e-2), jamp.dynamic_loss_scale(INIT_SCALE))

    # The premise: only BAD_DEV's rows of the table's (scaled) gradient overflow.
    x_bad, y_bad = batch(2, bad=True)
    g = jax.grad(embedding_loss)({k: jnp.asarray(v) for k, v in params.items()}, x_bad, y_bad)
    bad_rows = np.flatnonzero(~np.all(np.isfinite(np.asarray(g["table"])), axis=1))
    assert bad_rows.tolist() == [BAD_ROW]

    check_sharded_training(params, shardings.__getitem__, make_step(tx, embedding_loss), tx)


# ------------------------------------------- 2. shard_map and pmap, axis_name


def replica_step(tx, params, opt_state, x, y):
    """One replica's step on its own rows: gradients NOT averaged across replicas."""
    ls = jamp.get_loss_scale(opt_state)
    grads = jax.grad(lambda p: jamp.scale(ls, dense_loss(p, x, y)))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return new_params, {
        "last_finite": opt_state.last_finite,
        "skipped_steps": opt_state.skipped_steps,
        "scale": jamp.get_loss_scale(opt_state).scale,
        "trace": opt_state.inner_state[0].trace,
    }


def make_tx(axis_name):
    # SGD with momentum (strict dtype promotion holds throughout): the momentum
    # trace is the inner state a skipped replica must leave untouched.
    return jamp.loss_scaling(
        optax.sgd(1e-2, momentum=0.9), jamp.dynamic_loss_scale(INIT_SCALE), axis_name=axis_name
    )


def shard_map_step(axis_name, own_copy=True, check_vma=True):
    """Each replica steps on its own rows and returns its results stacked on "data".

    With ``own_copy`` every replica holds its own copy of the parameters
    (in_specs ``P("data")``, as under ``pmap``), so its gradients are its own.
    Otherwise (in_specs ``P()``) the parameters are invariant across "data"
    and JAX transposes the implicit ``pvary`` into a ``psum``: the gradients
    are already summed.
    """
    mesh = mesh8()
    tx = make_tx(axis_name)

    def per_replica(params, x, y):
        if own_copy:
            params = jax.tree.map(lambda a: jnp.squeeze(a, 0), params)
        opt_state = tx.init(params)
        new_params, info = replica_step(tx, params, opt_state, x, y)
        return jax.tree.map(lambda a: jnp.expand_dims(a, 0), (new_params, info))

    mapped = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P("data") if own_copy else P(), P("data"), P("data")),
            out_specs=P("data"),
            check_vma=check_vma,
        )
    )

    def run(params, x, y):
        if own_copy:
            params = jax.tree.map(lambda a: np.broadcast_to(a, (N_DEV, *a.shape)), params)
        return mapped(params, x, y)

    return run


def pmap_step(axis_name):
    tx = make_tx(axis_name)

    def per_replica(params, x, y):
        return replica_step(tx, params, tx.init(params), x, y)

    mapped = jax.pmap(per_replica, axis_name="data", in_axes=(None, 0, 0))

    def run(params, x, y):
        return mapped(
            params,
            x.reshape(N_DEV, ROWS_PER_DEV, FEATURES),
            y.reshape(N_DEV, ROWS_PER_DEV),
        )

    return run


MAPPERS = [
    pytest.param(functools.partial(shard_map_step, check_vma=False), id="shard_map_no_vma"),
    pytest.param(pmap_step, id="pmap"),
]


def check_replicas(new_params, info, params, skipped):
    """Replica r skipped iff ``skipped[r]``; its params are then bit-identical."""
    skipped = np.asarray(skipped)
    np.testing.assert_array_equal(np.asarray(info["last_finite"]), ~skipped)
    np.testing.assert_array_equal(np.asarray(info["skipped_steps"]), skipped.astype(np.int32))
    np.testing.assert_array_equal(
        np.asarray(info["scale"]), np.where(skipped, INIT_SCALE / 2, INIT_SCALE).astype(np.float32)
    )
    for k, p in params.items():
        stacked = np.asarray(new_params[k])
        trace = np.asarray(info["trace"][k])
        assert stacked.shape == trace.shape == (N_DEV, *p.shape), k
        for r in range(N_DEV):
            if skipped[r]:
                assert same_bits(stacked[r], p), f"{k} changed on skipping replica {r}"
                assert same_bits(trace[r], np.zeros_like(p)), f"{k}'s momentum moved on {r}"
            else:
                assert np.all(np.isfinite(trace[r])) and np.all(trace[r] != 0), (k, r)
                assert np.all(np.isfinite(stacked[r])) and np.all(stacked[r] != p), (
                    f"{k} not updated on replica {r}"
                )


def check_mapped_skip(mapper):
    params = dense_params()
    x, y = batch(2, bad=True)

    # The premise: the replicas' gradients differ, and only BAD_DEV's overflow.
    grads = [
        jax.grad(dense_loss)(
            params,
            x[r * ROWS_PER_DEV : (r + 1) * ROWS_PER_DEV],
            y[r * ROWS_PER_DEV : (r + 1) * ROWS_PER_DEV],
        )
        for r in range(N_DEV)
    ]
    finite = [bool(jamp.all_finite(g)) for g in grads]
    assert finite == [r != BAD_DEV for r in range(N_DEV)]
    assert not same_bits(grads[0]["w1"], grads[1]["w1"])

    # With axis_name every replica skips...
    new_params, info = mapper("data")(params, x, y)
    check_replicas(new_params, info, params, skipped=[True] * N_DEV)

    # ...without it, only the replica that overflowed does: they disagree.
    new_params, info = mapper(None)(params, x, y)
    check_replicas(new_params, info, params, skipped=[r == BAD_DEV for r in range(N_DEV)])

    # A clean step applies on every replica, with axis_name.
    x, y = batch(3, bad=False)
    new_params, info = mapper("data")(params, x, y)
    check_replicas(new_params, info, params, skipped=[False] * N_DEV)


@pytest.mark.parametrize("mapper", MAPPERS)
def test_mapped_axis_name_every_replica_skips_when_one_overflows(mapper):
    check_mapped_skip(mapper)


def test_shard_map_replicated_params_grads_already_summed():
    """Contrast: with parameters invariant across "data" (in_specs P()), the
    gradients are psum'd by JAX's transpose, so even without axis_name every
    replica sees the overflow. This is why the test above gives each replica
    its own copy: only then do the replicas' gradients really differ."""
    params = dense_params()
    x, y = batch(2, bad=True)
    new_params, info = shard_map_step(None, own_copy=False)(params, x, y)
    check_replicas(new_params, info, params, skipped=[True] * N_DEV)
    x, y = batch(3, bad=False)
    new_params, info = shard_map_step(None, own_copy=False)(params, x, y)
    check_replicas(new_params, info, params, skipped=[False] * N_DEV)


# ------------------------------------------ 3. two processes, gloo collectives


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(num_processes=2, timeout=120):
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # replaces conftest's 8
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(num_processes), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(num_processes)
    ]
    outputs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for i, (rc, out, err) in enumerate(outputs):
        assert rc == 0, f"worker {i} exited with {rc}:\n{err[-4000:]}"
        lines = [ln for ln in out.splitlines() if ln.startswith("JAMP_RESULT ")]
        assert len(lines) == 1, f"worker {i} printed no result:\n{out[-2000:]}\n{err[-2000:]}"
        results.append(json.loads(lines[0][len("JAMP_RESULT ") :]))
    return results


def reference_run(worker):
    """The same training in this process, on its 8 devices, from both processes' data."""
    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(2.0**10, growth_interval=2))
    params = {
        "w": jnp.array([0.5, -0.25, 0.125], jnp.float32),
        "b": jnp.array(0.0625, jnp.float32),
    }
    batch_sh = NamedSharding(mesh8(), P("data"))
    params = put(params, NamedSharding(mesh8(), P()))
    opt_state = tx.init(params)
    step = make_step(tx, worker.loss_fn)
    out = []
    for s in range(worker.STEPS):
        x, y = global_batch([worker.local_batch(s, pid, 4) for pid in range(2)], batch_sh)
        params, opt_state = step(params, opt_state, x, y)
        scale = float(jamp.get_loss_scale(opt_state).scale).hex()
        out.append((bool(opt_state.last_finite), scale, host(params)))
    return out


@pytest.fixture(scope="module")
def workers():
    """Both workers' results: one launch serves the two tests below."""
    return run_workers()


def test_two_processes_gloo_skip_together_and_stay_identical(workers):
    r0, r1 = workers
    for i, r in enumerate((r0, r1)):
        assert r["process_index"] == i
        assert (r["process_count"], r["device_count"], r["local_device_count"]) == (2, 8, 4)
        assert r["collectives"] == "gloo"

    import _multiprocess_worker as worker

    # The overflow was in process 0's local data only, at BAD_STEP only.
    for pid, r in enumerate((r0, r1)):
        want = [pid == 0 and s == worker.BAD_STEP for s in range(worker.STEPS)]
        assert [s.pop("local_overflow") for s in r["steps"]] == want

    # Every device of both processes skipped that step, and only that one.
    for r in (r0, r1):
        for s, rec in enumerate(r["steps"]):
            assert rec["last_finite"] == [s != worker.BAD_STEP] * 4, (r["process_index"], rec)
            assert rec["skipped_steps"] == [int(s >= worker.BAD_STEP)] * 4, rec

    # Bit-identical histories: flags, counters, scale and parameters after every step.
    assert r0["steps"] == r1["steps"]
    steps = r0["steps"]
    bad = steps[worker.BAD_STEP]
    prev = steps[worker.BAD_STEP - 1]
    assert bad["scaled_loss"] == "inf"
    assert (bad["w"], bad["b"]) == (prev["w"], prev["b"]), "the skipped step changed params"
    assert float.fromhex(bad["scale"]) == float.fromhex(prev["scale"]) / 2
    for s in range(1, worker.STEPS):
        if s != worker.BAD_STEP:
            assert steps[s]["w"] != steps[s - 1]["w"], f"clean step {s} did not apply"

    # And they agree with a one-process run over the same global batches: the
    # same decisions and scales exactly; the parameters up to float16 rounding
    # (the partial sums of the float16 forward/backward pass are grouped
    # differently across gloo's 2x4 devices than on one process's 8).
    ref = reference_run(worker)
    assert [(f, sc) for f, sc, _ in ref] == [(s["last_finite"][0], s["scale"]) for s in steps]
    for (_, _, p), s in zip(ref, steps, strict=True):
        got = {k: np.array([float.fromhex(h) for h in s[k]], np.float32) for k in ("w", "b")}
        np.testing.assert_allclose(got["w"], p["w"], rtol=0, atol=5e-4)
        np.testing.assert_allclose(got["b"], p["b"].reshape(-1), rtol=0, atol=5e-4)


def fsdp_reference(worker):
    """The workers' FSDP training in this process, on its 8 devices, from both processes'
    rows: the same program on the same 8-device mesh, with in-process collectives."""
    mesh = mesh8()
    specs = worker.fsdp_specs()
    params = {
        k: jax.device_put(a, NamedSharding(mesh, specs[k])) for k, a in worker.fsdp_init().items()
    }
    tx = worker.fsdp_tx()
    opt_state = jax.jit(tx.init)(params)
    step = worker.fsdp_step(tx)
    batch_sh = NamedSharding(mesh, P("data"))
    out = []
    for s in range(worker.FSDP_STEPS):
        x, y = global_batch([worker.fsdp_batch(s, pid, 4) for pid in range(2)], batch_sh)
        params, opt_state = step(params, opt_state, x, y)
        assert params["w"].sharding.is_equivalent_to(NamedSharding(mesh, specs["w"]), 2)
        out.append(
            {
                "last_finite": bool(opt_state.last_finite),
                "scale": float(jamp.get_loss_scale(opt_state).scale).hex(),
                "params": host(params),
                "opt_state": host(opt_state),
            }
        )
    return out


def test_two_processes_fsdp_master_weights_loss_scaling_bit_match_one_process(workers):
    """bfloat16 parameters sharded over both processes' devices, float32 masters, float16
    compute and dynamic loss scaling: the overflow in process 0's rows at FSDP_BAD_STEP
    skips the step on all 8 devices of both processes (parameters, masters, counters and
    inner state unchanged, the scale halved), and every step's parameters and optimizer
    state equal, byte for byte, those of the same program run in one process. The sums
    across devices are exact (mean absolute error, inputs multiples of 1/4, a power-of-two
    learning rate, elementwise sgd): only there is the float32 arithmetic the same whatever
    order gloo sums in. (Adam's state would bit-match too only where its sums do: see
    docs/scaling-out.md on why sharded and unsharded adam differ in the last bit.)"""
    import _multiprocess_worker as worker

    r0, r1 = (r["fsdp"] for r in workers)
    assert len(r0) == len(r1) == worker.FSDP_STEPS
    for pid, r in enumerate((r0, r1)):
        for s, rec in enumerate(r):
            assert rec["last_finite"] == [s != worker.FSDP_BAD_STEP] * 4, (pid, s)
            assert rec["skipped_steps"] == [int(s >= worker.FSDP_BAD_STEP)] * 4, (pid, s)
            # FSDP: each process holds its own 4 rows of the bfloat16 kernel, one per device
            assert rec["w_dtype"] == "bfloat16"
            rows = [r for r, _ in rec["params"]["['w']"]]
            assert rows == [[4 * pid + d, 4 * pid + d + 1] for d in range(4)], rows
    assert [(a["scale"], a["last_finite"]) for a in r0] == [
        (b["scale"], b["last_finite"]) for b in r1
    ]

    def assembled(rec, part):
        """Both processes' shards of every leaf, by row range (a replicated leaf: one)."""
        out = {}
        for r in (r0, r1):
            for k, shards in r[rec][part].items():
                for rows, h in shards:
                    assert out.setdefault(k, {}).setdefault(tuple(rows), h) == h, (k, rows)
        return out

    def expected(tree):
        """A host tree cut as the workers report it."""
        out = {}
        for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]:
            v = np.asarray(v)
            key = jax.tree_util.keystr(k)
            if key.endswith("['w']") and v.ndim == 2 and v.shape[0] == worker.FSDP_IN:
                out[key] = {(i, i + 1): v[i : i + 1].tobytes().hex() for i in range(v.shape[0])}
            else:
                out[key] = {(None, None): v.tobytes().hex()}
        return out

    ref = fsdp_reference(worker)
    bad = worker.FSDP_BAD_STEP
    assert assembled(bad, "params") == assembled(bad - 1, "params"), "the skipped step moved"
    inner = {k: v for k, v in assembled(bad, "opt_state").items() if "inner_state" in k}
    assert inner == {k: assembled(bad - 1, "opt_state")[k] for k in inner}, "masters moved"
    assert float.fromhex(r0[bad]["scale"]) == float.fromhex(r0[bad - 1]["scale"]) / 2
    for s in range(1, worker.FSDP_STEPS):
        if s != bad:
            assert assembled(s, "params") != assembled(s - 1, "params"), f"step {s} did not apply"
    for s, want in enumerate(ref):
        got = r0[s]
        assert (got["last_finite"][0], got["scale"]) == (want["last_finite"], want["scale"]), s
        assert assembled(s, "params") == expected(want["params"]), f"step {s}: parameters"
        assert assembled(s, "opt_state") == expected(want["opt_state"]), f"step {s}: state"


# ---------------------------------- shard_map with check_vma (default) on


def test_shard_map_checked_vma_per_replica_grads():
    """As test_mapped_axis_name_..., under shard_map's default check_vma=True,
    where each replica's parameters and gradients are typed as varying over
    "data": the skip branch of loss_scaling's lax.cond must produce values of
    the same (varying) type as the apply branch."""
    check_mapped_skip(shard_map_step)


@pytest.mark.parametrize("skip", ["cond", "select"])
@pytest.mark.parametrize("path", ["loss_scaling", "grad_scaler"])
def test_shard_map_shared_state_per_replica_grads(path, skip):
    """Optimizer state and params passed in shared (P()), gradients differing per
    replica: the kept state of the skip branch must be typed like the updated one."""
    mesh = mesh8()
    scaler = jamp.GradScaler(init_scale=4.0, skip=skip, axis_name="data")
    tx = scaler.as_optax(optax.sgd(0.1, momentum=0.9))
    inner = optax.sgd(0.1, momentum=0.9)
    w = jnp.ones((2,))
    x = np.ones((8, 2), np.float32)
    x[3, 1] = np.inf  # only replica 3

    def local(w, x):
        if path == "loss_scaling":
            st = tx.init(w)
            g = jax.grad(lambda w: jamp.scale(jamp.get_loss_scale(st), jnp.sum(w * x[0])))(w)
            u, st = tx.update(g, st, w)
            return (w + u)[None], st.last_finite[None]
        state, opt_state = scaler.init(), inner.init(w)
        g = jax.grad(lambda w: scaler.scale(state, jnp.sum(w * x[0])))(w)
        g, state = scaler.unscale(state, g)  # agreed over "data" by axis_name
        new_w, _, state = scaler.step(state, inner, g, opt_state, w)
        return new_w[None], jnp.logical_not(scaler.found_inf(state))[None]

    f = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P("data")))
    )
    new_w, finite = f(w, jnp.asarray(x))
    assert not np.asarray(finite).any()
    np.testing.assert_array_equal(np.asarray(new_w), np.ones((8, 2)))
    new_w, finite = f(w, jnp.ones((8, 2)))
    assert np.asarray(finite).all() and not np.array_equal(np.asarray(new_w), np.ones((8, 2)))


@pytest.mark.parametrize("skip", ["cond", "select"])
def test_shard_map_state_carried_through_scan_per_replica(skip):
    """A per-replica optimizer state keeps its varying type through update, so it
    can be a lax.scan carry under shard_map's default check_vma=True."""
    mesh = mesh8()
    tx = jamp.loss_scaling(
        optax.sgd(0.1, momentum=0.9), jamp.dynamic_loss_scale(8.0), axis_name="data", skip=skip
    )
    w = jnp.ones((8, 2))
    state = jax.vmap(tx.init)(w)
    xs = np.ones((3, 8, 2), np.float32)
    xs[1, 4, 0] = np.nan  # step 1, replica 4

    def local(w, state, xs):
        w, state = w[0], jax.tree_util.tree_map(lambda a: a[0], state)

        def body(carry, x):
            w, state = carry
            g = jax.grad(lambda w: jamp.scale(jamp.get_loss_scale(state), jnp.sum(w * x[0])))(w)
            u, state = tx.update(g, state, w)
            return (w + u, state), state.last_finite

        (w, state), finite = jax.lax.scan(body, (w, state), xs)
        return w[None], finite[None]

    f = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P("data"), P("data"), P(None, "data")),
            out_specs=(P("data"), P("data")),
        )
    )
    new_w, finite = f(w, state, jnp.asarray(xs))
    np.testing.assert_array_equal(np.asarray(finite), np.tile([True, False, True], (8, 1)))
    assert len({np.asarray(r).tobytes() for r in np.asarray(new_w)}) == 1  # replicas agree


# ------------------------------------------- 3. explicit sharding (AxisType.Explicit)


def explicit_tree():
    """One leaf of every kind the CPU check sorts by, each sharded its own way."""
    rng = np.random.default_rng(7)

    def u(shape, dtype):
        return rng.uniform(-1.0, 1.0, shape).astype(dtype)

    leaves = {
        "rows_both": (u((256, 128), np.float32), P("a", "b")),
        "rows_cols": (u((128, 256), np.float32), P(None, "b")),
        "rows_3d": (u((4, 64, 64), np.float32), P(None, "b", None)),
        "small": (u((64,), np.float32), P("b")),
        "small_bf16": (u((32, 8), jnp.bfloat16), P()),
        "half": (u((128, 256), np.float16), P("a", None)),
        "narrow": (u((4096, 8), np.float32), P("b", None)),
        "big_bf16": (u((256, 128), jnp.bfloat16), P("a")),
    }
    return {k: v for k, (v, _) in leaves.items()}, {k: s for k, (_, s) in leaves.items()}


def test_explicit_sharding_mode_checks_exactly_and_skips():
    """Under jax.set_mesh with explicit axes, shardings are part of the types, so
    the check may not join or flatten differently sharded parts: a fault in one
    shard of any kind of leaf is found, raw and unscaled, and the step skips."""
    from jax.sharding import AxisType

    from jamp._src.finite.default import default_finite

    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    values, specs = explicit_tree()
    half_state = jamp.dynamic_loss_scale(0.5)  # unscaling doubles: overflow without inf
    with jax.set_mesh(mesh):

        def put_tree(vals):
            return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in vals.items()}

        check = jax.jit(jamp.all_finite)
        check_unscaled = jax.jit(lambda g: jamp.unscale_and_check(half_state, g)[1])
        default_branch = jax.jit(lambda g: default_finite(*jax.tree.leaves(g)))
        assert bool(check(put_tree(values))) and bool(check_unscaled(put_tree(values)))
        assert bool(default_branch(put_tree(values)))
        for name, v in values.items():
            idx = tuple(d - 1 for d in v.shape)  # the last shard along every sharded axis
            huge = float(jnp.finfo(v.dtype).max) * 0.75
            for fault in (np.inf, -np.inf, np.nan, huge):
                bad = dict(values)
                bad[name] = v.copy()
                bad[name][idx] = fault
                tree = put_tree(bad)
                raw_ok = bool(np.isfinite(fault))
                assert bool(check(tree)) == raw_ok, (name, fault)
                assert bool(default_branch(tree)) == raw_ok, (name, fault)
                assert not bool(check_unscaled(tree)), (name, fault)

        tx = jamp.loss_scaling(optax.sgd(0.1, momentum=0.9), jamp.dynamic_loss_scale(INIT_SCALE))
        params = put_tree(values)
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        grads = dict(values)
        grads["rows_3d"] = grads["rows_3d"].copy()
        grads["rows_3d"][3, 63, 63] = np.nan
        new_params, new_state = step(params, opt_state, put_tree(grads))
        assert not bool(new_state.last_finite)
        assert tree_same_bits(host(new_params), host(params))
        assert tree_same_bits(host(new_state.inner_state), host(opt_state.inner_state))
        for k, p in new_params.items():
            assert p.sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), p.ndim), k
        new_params, new_state = step(params, opt_state, put_tree(values))
        assert bool(new_state.last_finite)
        assert not np.array_equal(np.asarray(new_params["half"]), np.asarray(params["half"]))


# ------------------------------------------- 4. GradScaler over a mapped axis, axis_name errors


@pytest.mark.parametrize("path", ["step", "unscale then step"])
@pytest.mark.parametrize("axis_name", [None, "data"])
def test_grad_scaler_axis_name_every_replica_skips_when_one_overflows(path, axis_name):
    """Each replica's gradients are its own (not averaged), and only BAD_DEV's
    overflow: with axis_name every replica finds the inf and backs off."""
    mesh = mesh8()
    scaler = jamp.GradScaler(init_scale=INIT_SCALE, axis_name=axis_name)
    tx = optax.sgd(1e-2, momentum=0.9)

    def per_replica(params, x, y):
        state = scaler.init()
        grads = jax.grad(lambda p: scaler.scale(state, dense_loss(p, x, y)))(params)
        opt_state = tx.init(params)
        if path == "unscale then step":
            grads, state = scaler.unscale(state, grads)
        new_params, _, state = scaler.step(state, tx, grads, opt_state, params)
        found_inf = scaler.found_inf(state)
        state = scaler.update(state)
        out = (found_inf, state.scale, new_params["w1"])
        return jax.tree.map(lambda a: jnp.expand_dims(a, 0), out)

    mapped = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=P("data"),
            check_vma=False,
        )
    )
    params = dense_params()
    found_inf, scales, w1 = mapped(params, *batch(2, bad=True))
    bad = np.array([axis_name is not None or r == BAD_DEV for r in range(N_DEV)])
    np.testing.assert_array_equal(np.asarray(found_inf), bad)
    np.testing.assert_array_equal(np.asarray(scales), np.where(bad, INIT_SCALE / 2, INIT_SCALE))
    for r in range(N_DEV):
        assert same_bits(np.asarray(w1)[r], params["w1"]) == bad[r], r


@pytest.mark.parametrize(
    "build",
    [
        lambda a: jamp.loss_scaling(optax.sgd(0.1), axis_name=a),
        lambda a: jamp.value_and_grad(jnp.sum, axis_name=a),
        lambda a: jamp.GradScaler(axis_name=a),
        lambda a: jamp.all_finite({"w": jnp.ones(2)}, axis_name=a),
        lambda a: jamp.unscale_and_check(jamp.dynamic_loss_scale(), jnp.ones(2), axis_name=a),
    ],
    ids=["loss_scaling", "value_and_grad", "GradScaler", "all_finite", "unscale_and_check"],
)
@pytest.mark.parametrize("bad", [3.5, 0, ["data"], ("data", 1), (), {"data"}])
def test_axis_name_of_the_wrong_type_is_refused_where_it_is_given(build, bad):
    with pytest.raises(TypeError, match=r"`axis_name`.*shard_map/pmap axis"):
        build(bad)


def test_an_unbound_axis_name_is_a_clear_error():
    g = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"`axis_name`.*'data' is not.*plain jit"):
        jax.jit(lambda g: jamp.all_finite(g, axis_name="data"))(g)

    def typo(x):
        return jamp.all_finite(x, axis_name=("data", "dtaa"))[None]

    with pytest.raises(ValueError, match=r"'dtaa' is not"):
        jax.shard_map(typo, mesh=mesh8(), in_specs=P("data"), out_specs=P("data"))(jnp.ones(8))


def test_axis_name_given_per_step_is_refused():
    params = {"w": jnp.ones(2)}
    tx = jamp.loss_scaling(optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"jamp\.loss_scaling\(\.\.\., axis_name="):
        tx.update(params, tx.init(params), params, axis_name="data")
    scaler = jamp.GradScaler()
    sgd = optax.sgd(0.1)
    with pytest.raises(TypeError, match=r"jamp\.GradScaler\(\.\.\., axis_name="):
        scaler.step(scaler.init(), sgd, params, sgd.init(params), params, axis_name="data")
