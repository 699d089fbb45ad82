"""Reliability: nothing a user trains is ever lost.

1. Fault-injection soak: a jitted Flax MLP trained with
   ``jamp.loss_scaling(optax.adamw(...))`` for 5,000 steps while a seeded
   schedule injects +inf, -inf and NaN into gradient leaves and into the loss,
   in bursts of up to 200 steps; and a data-parallel soak on 8 devices
   (``jax.shard_map``) with faults in single replicas, before and after the
   all-reduce. Every faulty step is skipped, no clean step is, the state stays
   finite, the scale stays in bounds and recovers, and the final parameters
   are bit-identical to a run that never saw the faulty steps.
2. Checkpoints: Orbax mid-burst and mid-run, ``GradScaler.state_dict`` through
   JSON, and dicts written by PyTorch's GradScaler: every resumed run is
   bit-identical to the uninterrupted one.
3. Bad input: every invalid argument is a ValueError/TypeError naming it,
   raised by jamp itself before anything is traced; no ``assert`` guards user
   input in ``jamp/``.
4. Long-run counters saturate instead of wrapping.

Figures for docs/reliability.md: ``pytest tests/test_reliability.py -s``
prints them (lines starting with ``RELIABILITY``).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import pathlib
import time
import traceback

import _golden
import _reliability_helpers as H
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp._src import loss_scale as ls

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The soak's loss scale: powers of two only, bounds tight enough that a
# 200-step burst pins the scale at min_scale for ~190 steps, and a growth
# interval small enough that recovery from the floor (20 doublings) fits in
# the fault-free tail.
MIN_SCALE, MAX_SCALE, INIT_SCALE, GROWTH_INTERVAL = 1.0, 2.0**20, 2.0**12, 8
N_STEPS, CHUNK, FAULT_END = 5000, 1000, 4000
DP_STEPS, DP_FAULT_END, N_DEV = 1000, 800, 8
DP_KIND_NAMES = {
    H.GRAD: "one replica's gradient leaf, before the all-reduce",
    H.LOSS: "one replica's loss",
    H.REDUCED: "one replica's copy of the averaged gradients",
}


def soak_loss_scale():
    return jamp.dynamic_loss_scale(
        INIT_SCALE, growth_interval=GROWTH_INTERVAL, min_scale=MIN_SCALE, max_scale=MAX_SCALE
    )


def report(name, **figures):
    print(f"\nRELIABILITY {name} " + json.dumps(figures, sort_keys=False))


# ================================================================ 1. the soak


@pytest.fixture(scope="module")
def soak():
    """The 5,000-step run with faults, and its two fault-free references.

    * ``faulty``: every step, faults injected;
    * ``omitted``: the same compiled program, fed only the clean steps (the
      faulty ones are exact no-ops), so it never sees a fault and its scale
      never backs off;
    * ``clean``: every step, nothing injected (the fault-free scale).
    """
    with jax.numpy_dtype_promotion("standard"):  # optax.adamw's bias correction
        params0 = H.init_params()
        sched = H.fault_schedule(0, N_STEPS, FAULT_END, [H.GRAD, H.LOSS], H.n_leaves(params0))
        tx = jamp.loss_scaling(optax.adamw(1e-3, weight_decay=1e-4), soak_loss_scale())
        run = H.make_chunk_runner(tx)
        state0 = tx.init(params0)
        out = dict(sched=sched, tx=tx, run=run, params0=params0, state0=state0)
        start = time.perf_counter()
        p, s, rec = H.run_chunks(run, params0, state0, sched.arrays(), CHUNK)
        jax.block_until_ready((p, s))
        out["seconds"] = time.perf_counter() - start
        out["faulty"] = (p, s, rec)
        args = sched.arrays(omit=sched.faulty, faults=False)
        out["omitted"] = H.run_chunks(run, params0, state0, args, CHUNK)
        out["clean"] = H.run_chunks(run, params0, state0, sched.arrays(faults=False), CHUNK)
    return out


@pytest.mark.standard_promotion
def test_soak_every_faulty_step_skipped_and_no_clean_step(soak):
    sched, (_, s, rec) = soak["sched"], soak["faulty"]
    faulty = sched.faulty
    assert max(length for _, length in sched.bursts) == 200
    assert {H.GRAD, H.LOSS} <= set(np.unique(sched.kind))
    for name in ("+inf", "-inf", "nan"):
        assert any(k.endswith(name) for k in sched.counts()), name
    wrong = np.flatnonzero(rec["applied"] == faulty)
    assert wrong.size == 0, (
        f"steps {wrong[:10]} were {'applied' if faulty[wrong[0]] else 'skipped'}"
    )
    assert int(s.skipped_steps) == int(faulty.sum())
    assert int(s.inner_state[0].count) == int((~faulty).sum())  # Adam's count: clean steps only
    bad = np.flatnonzero(~rec["state_finite"])
    assert bad.size == 0, f"params/optimizer state not finite after steps {bad[:10]}"
    report(
        "soak",
        steps=N_STEPS,
        faulty_steps=int(faulty.sum()),
        faults_by_kind=sched.counts(),
        bursts=len(sched.bursts),
        longest_burst=max(length for _, length in sched.bursts),
        skipped=int(s.skipped_steps),
        clean_steps_skipped=int(np.sum(~rec["applied"] & ~faulty)),
        faulty_steps_applied=int(np.sum(rec["applied"] & faulty)),
        seconds_5000_steps_incl_compile=round(soak["seconds"], 2),
    )


@pytest.mark.standard_promotion
def test_soak_scale_stays_in_bounds_and_recovers(soak):
    sched, (_, s, rec) = soak["sched"], soak["faulty"]
    clean_scale = soak["clean"][2]["scale"]
    scale = rec["scale"]
    assert np.all((scale >= MIN_SCALE) & (scale <= MAX_SCALE)), (scale.min(), scale.max())
    assert np.all(H.is_power_of_two(scale))  # so scaling and unscaling are exact
    assert scale.min() == MIN_SCALE  # the 200-step burst pins it at the floor
    ls_state = jamp.get_loss_scale(s)
    assert (ls_state.min_scale, ls_state.max_scale) == (MIN_SCALE, MAX_SCALE)

    # After the last fault, the scale climbs back to within one growth factor
    # of the fault-free run's and stays there; from the floor that takes at
    # most log2(max/min) growth intervals.
    last_fault = int(np.flatnonzero(sched.faulty)[-1])
    tail = slice(last_fault + 1, None)
    close = np.array(
        [
            H.within_one_factor(a, b, 2.0)
            for a, b in zip(scale[tail], clean_scale[tail], strict=True)
        ]
    )
    assert close[-1], (scale[-1], clean_scale[-1])
    recovered = int(np.flatnonzero(~close)[-1] + 1) if not close.all() else 0
    bound = H.log2_span(MIN_SCALE, MAX_SCALE) * GROWTH_INTERVAL
    assert recovered <= bound, (recovered, bound)
    # Recovery also after every burst, not just the last one.
    worst = 0
    for start, length in sched.bursts:
        end = start + length
        nxt = [b for b, _ in sched.bursts if b > start]
        stop = nxt[0] if nxt else N_STEPS
        ok = [
            H.within_one_factor(a, b, 2.0)
            for a, b in zip(scale[end:stop], clean_scale[end:stop], strict=True)
        ]
        if ok and ok[-1] and stop - end > bound:
            worst = max(worst, int(np.flatnonzero(~np.array(ok))[-1] + 1) if not all(ok) else 0)
        elif stop - end > bound:
            pytest.fail(f"no recovery between steps {end} and {stop}")
    assert worst <= bound
    report(
        "recovery",
        last_fault_step=last_fault,
        steps_to_recover_after_last_fault=recovered,
        worst_steps_to_recover_after_a_burst=worst,
        bound=bound,
        final_scale=float(scale[-1]),
        fault_free_final_scale=float(clean_scale[-1]),
        scale_range=[float(scale.min()), float(scale.max())],
    )


@pytest.mark.standard_promotion
def test_soak_final_state_bit_identical_to_run_without_the_faulty_steps(soak):
    p, s, rec = soak["faulty"]
    p_ref, s_ref, rec_ref = soak["omitted"]
    # The reference never backs off, so its scale trajectory differs; every
    # scale is a power of two in [1, 2**20] and nothing over- or underflows,
    # so the unscaled gradients (and hence everything else) are the same bits.
    assert not np.array_equal(
        rec["scale"][~soak["sched"].faulty], rec_ref["scale"][~soak["sched"].faulty]
    )
    assert H.tree_same_bits(p, p_ref), H.first_difference(p, p_ref)
    assert H.tree_same_bits(s.inner_state, s_ref.inner_state), H.first_difference(
        s.inner_state, s_ref.inner_state
    )
    assert int(s_ref.skipped_steps) == 0
    # And the faults really were there: the same schedule without skipping
    # would have destroyed the run (a NaN gradient poisons Adam forever).
    assert not all(np.all(np.isfinite(x)) for x in jax.tree.leaves(poisoned_without_skipping(soak)))
    report("bit_identical", final_params_equal_bits=True, data_lost=0)


def test_soak_with_select_skipping_drops_every_faulty_step_exactly(soak):
    """``skip="select"`` computes the update on faulty steps too and drops it.

    Faulty steps are still exact no-ops (the run ends in the same bits as the
    select run fed only the clean steps), and every skip decision and scale
    equals the ``lax.cond`` run's. XLA fuses the two programs differently
    (the unscale multiply lands in other fusions), so after 5,000 Adam steps
    the parameters agree with the ``cond`` run to float32 rounding, not bits.
    """
    sched = soak["sched"]
    with jax.numpy_dtype_promotion("standard"):
        tx = jamp.loss_scaling(
            optax.adamw(1e-3, weight_decay=1e-4), soak_loss_scale(), skip="select"
        )
        run, state0 = H.make_chunk_runner(tx), tx.init(soak["params0"])
        p, s, rec = H.run_chunks(run, soak["params0"], state0, sched.arrays(), CHUNK)
        omitted = sched.arrays(omit=sched.faulty, faults=False)
        p_om, s_om, _ = H.run_chunks(run, soak["params0"], state0, omitted, CHUNK)
    assert H.tree_same_bits(p, p_om), H.first_difference(p, p_om)
    assert H.tree_same_bits(s.inner_state, s_om.inner_state)
    p_cond, s_cond, rec_cond = soak["faulty"]
    assert np.array_equal(rec["scale"], rec_cond["scale"])
    assert int(s.skipped_steps) == int(s_cond.skipped_steps) == int(sched.faulty.sum())
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(p_cond), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def poisoned_without_skipping(soak):
    """One faulty step through plain adamw (no jamp) from the soak's start."""
    sched, p0 = soak["sched"], soak["params0"]
    t = int(np.flatnonzero(sched.kind == H.GRAD)[0])
    inner = optax.adamw(1e-3, weight_decay=1e-4)

    @jax.jit
    def plain_step(p, leaf, elem, poison):
        x, y = H.batch(jnp.int32(t))
        g = H.inject(jax.grad(H.loss_fn)(p, x, y), jnp.bool_(True), leaf, elem, poison)
        u, _ = inner.update(g, inner.init(p), p)
        return optax.apply_updates(p, u)

    with jax.numpy_dtype_promotion("standard"):
        return plain_step(p0, sched.leaf[t], sched.elem[t], sched.poison[t])


def test_unscaled_gradients_are_scale_independent_for_powers_of_two():
    """The premise of the bit-for-bit comparison, checked at every scale the soak uses."""
    p0 = H.init_params()
    x, y = H.batch(jnp.int32(7))
    ref = jax.jit(jax.grad(H.loss_fn))(p0, x, y)

    @jax.jit
    def unscaled(state, p):
        return jamp.unscale(state, jax.grad(lambda q: jamp.scale(state, H.loss_fn(q, x, y)))(p))

    for k in range(H.log2_span(MIN_SCALE, MAX_SCALE) + 1):
        g = unscaled(jamp.dynamic_loss_scale(MIN_SCALE * 2.0**k, min_scale=MIN_SCALE), p0)
        assert H.tree_same_bits(g, ref), (k, H.first_difference(g, ref))


# ------------------------------------------------- the data-parallel soak


@pytest.mark.standard_promotion
def test_data_parallel_soak_8_devices_faults_in_single_replicas():
    params0 = H.init_params()
    sched = H.fault_schedule(
        1,
        DP_STEPS,
        DP_FAULT_END,
        [H.GRAD, H.LOSS, H.REDUCED],
        H.n_leaves(params0),
        n_replicas=N_DEV,
    )
    assert max(length for _, length in sched.bursts) == 200
    tx = jamp.loss_scaling(
        optax.adamw(1e-3, weight_decay=1e-4), soak_loss_scale(), axis_name="data"
    )
    run = H.make_dp_runner(tx, N_DEV)
    p_rep, s_rep = H.stack(params0, N_DEV), H.stack(tx.init(params0), N_DEV)

    start = time.perf_counter()
    p, s, rec = run(p_rep, s_rep, sched.arrays())
    jax.block_until_ready(p)
    seconds = time.perf_counter() - start
    rec = jax.tree.map(np.asarray, rec)  # [replica, step]
    faulty = sched.faulty

    for r in range(N_DEV):
        wrong = np.flatnonzero(rec["applied"][r] == faulty)
        assert wrong.size == 0, f"replica {r}: steps {wrong[:10]} decided wrongly"
    assert rec["state_finite"].all()
    assert np.all((rec["scale"] >= MIN_SCALE) & (rec["scale"] <= MAX_SCALE))
    assert (rec["scale"] == rec["scale"][0]).all()  # every replica, every step, the same scale
    host = jax.tree.map(np.asarray, (p, s))
    replicas = [jax.tree.map(lambda a, r=r: a[r], host) for r in range(N_DEV)]
    for r in range(1, N_DEV):  # the replicas never diverge
        assert H.tree_same_bits(replicas[r], replicas[0]), r

    # Bit-identical to the same program fed only the clean steps.
    p_ref, s_ref, _ = run(p_rep, s_rep, sched.arrays(omit=faulty, faults=False))
    assert H.tree_same_bits(p, p_ref), H.first_difference(p, p_ref)
    assert H.tree_same_bits(s.inner_state, s_ref.inner_state)
    assert np.all(np.asarray(s.skipped_steps) == faulty.sum())

    # Control: without axis_name, a fault in one replica's copy of the
    # averaged gradients makes that replica alone skip, and the replicas
    # drift apart. (This is what the assertions above would catch.)
    tx_blind = jamp.loss_scaling(optax.adamw(1e-3, weight_decay=1e-4), soak_loss_scale())
    first = int(np.flatnonzero(sched.kind == H.REDUCED)[0])
    n = 50
    part = {k: v[first : first + n] for k, v in sched.arrays().items()}
    p_b, _, rec_b = H.make_dp_runner(tx_blind, N_DEV)(
        p_rep, H.stack(tx_blind.init(params0), N_DEV), part
    )
    applied = np.asarray(rec_b["applied"])
    assert not (applied == applied[0]).all()
    p_b = jax.tree.map(np.asarray, p_b)
    bad_replica = int(sched.replica[first])
    other = (bad_replica + 1) % N_DEV
    assert not H.tree_same_bits(
        jax.tree.map(lambda a: a[bad_replica], p_b), jax.tree.map(lambda a: a[other], p_b)
    )

    report(
        "data_parallel",
        devices=N_DEV,
        steps=DP_STEPS,
        faulty_steps=int(faulty.sum()),
        faults_by_kind=sched.counts(DP_KIND_NAMES),
        longest_burst=max(length for _, length in sched.bursts),
        replica_disagreements=0,
        seconds_incl_compile=round(seconds, 2),
    )


# ================================================================ 2. checkpoints


def run_with_stops(run, params, opt_state, sched: dict, stops, at_stop):
    """Run ``sched`` in CHUNK-step calls of the one compiled ``run``, stopping
    before each step in ``stops`` to call ``at_stop(step, params, opt_state)``,
    which returns the (restored) state to continue from.

    A stop inside a chunk runs that chunk twice, with the steps on the other
    side of the stop omitted (exact no-ops), so nothing is recompiled.
    """
    n = len(sched["t"])
    bounds = sorted(set(range(0, n + 1, CHUNK)) | set(stops))
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if a in stops:
            params, opt_state = at_stop(a, params, opt_state)
        c = a // CHUNK * CHUNK
        part = {k: v[c : c + CHUNK] for k, v in sched.items()}
        idx = np.arange(c, c + CHUNK)
        part["omit"] = part["omit"] | (idx < a) | (idx >= b)
        params, opt_state, _ = run(params, opt_state, part)
    return params, opt_state


@pytest.mark.standard_promotion
def test_orbax_checkpoint_mid_burst_and_mid_run_resumes_bit_identically(soak, tmp_path):
    import orbax.checkpoint as ocp

    sched = soak["sched"]
    start, length = next((a, n) for a, n in sched.bursts if n == 200)
    mid_burst = start + 57
    # A clean stretch where the growth tracker is part-way through an interval.
    clean_steps = np.flatnonzero(~sched.faulty[:-1] & ~sched.faulty[1:])
    mid_clean = int(clean_steps[len(clean_steps) // 2]) + 1
    stops = sorted({mid_burst, mid_clean, 3 * CHUNK})
    seen = {}

    def save_and_restore(step, params, opt_state):
        path = tmp_path / f"step_{step}"
        state = {"params": params, "opt_state": opt_state}
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, state)
        del state, params, opt_state
        abstract = jax.tree.map(
            ocp.utils.to_shape_dtype_struct,
            {"params": soak["params0"], "opt_state": soak["state0"]},
        )
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path, abstract)
        s = restored["opt_state"]
        assert isinstance(s, jamp.LossScalingState)
        ls_state = jamp.get_loss_scale(s)
        assert (ls_state.min_scale, ls_state.max_scale, ls_state.growth_interval) == (
            MIN_SCALE,
            MAX_SCALE,
            GROWTH_INTERVAL,
        )
        seen[step] = (
            float(ls_state.scale),
            int(ls_state.growth_tracker),
            int(ls_state.overflow_streak),
            int(s.skipped_steps),
        )
        return restored["params"], s

    with jax.numpy_dtype_promotion("standard"):
        p, s = run_with_stops(
            soak["run"], soak["params0"], soak["state0"], sched.arrays(), stops, save_and_restore
        )
    p_ref, s_ref, _ = soak["faulty"]
    assert H.tree_same_bits((p, s), (p_ref, s_ref)), H.first_difference((p, s), (p_ref, s_ref))
    # The checkpoints really were taken mid-burst (backed off, streak set) and
    # mid-interval (tracker part-way), with skips already counted.
    assert seen[mid_burst][2] == 1 and seen[mid_burst][3] > 0
    assert 0 < seen[mid_clean][1] < GROWTH_INTERVAL or seen[mid_clean][0] == MAX_SCALE
    report("orbax", checkpoints=len(stops), states_at_stops=seen, resumed_equal_bits=True)


def gradscaler_problem():
    params0 = H.init_params()
    sched = H.fault_schedule(2, 400, 360, [H.GRAD, H.LOSS], H.n_leaves(params0), max_burst=40)
    scaler = jamp.GradScaler(init_scale=2.0**10, growth_interval=4)
    tx = optax.sgd(1e-2, momentum=0.9)

    @jax.jit
    def step(state, params, opt_state, s):
        x, y = H.batch(s["t"])
        mult = jnp.where(s["kind"] == H.LOSS, s["poison"], jnp.float32(1.0))
        grads = jax.grad(lambda p: scaler.scale(state, H.loss_fn(p, x, y) * mult))(params)
        grads = H.inject(grads, s["kind"] == H.GRAD, s["leaf"], s["elem"], s["poison"])
        params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)
        found_inf = scaler.found_inf(state)
        return scaler.update(state), params, opt_state, found_inf

    return params0, sched, scaler, tx, step


def test_gradscaler_state_dict_json_round_trip_mid_run_is_bit_identical():
    params0, sched, scaler, tx, step = gradscaler_problem()
    args = sched.arrays()
    one = lambda i: {k: v[i] for k, v in args.items()}  # noqa: E731

    state, params, opt_state = scaler.init(), params0, tx.init(params0)
    found = []
    for i in range(sched.n):
        state, params, opt_state, f = step(state, params, opt_state, one(i))
        found.append(bool(f))
    np.testing.assert_array_equal(found, sched.faulty)

    state2, params2, opt_state2 = scaler.init(), params0, tx.init(params0)
    other = jamp.GradScaler(growth_interval=1000)  # the dict carries the configuration
    round_trips = 0
    for i in range(sched.n):
        if i % 7 == 3:  # mid-burst and mid-interval, many times
            d = json.loads(json.dumps(scaler.state_dict(state2)))
            state2 = other.load_state_dict(d)
            assert state2.growth_interval == 4 and other.state_dict(state2) == d
            round_trips += 1
        state2, params2, opt_state2, _ = step(state2, params2, opt_state2, one(i))
    assert H.tree_same_bits((params2, opt_state2), (params, opt_state))
    assert H.same_bits(state2.scale, state.scale)
    assert H.same_bits(state2.growth_tracker, state.growth_tracker)
    report(
        "gradscaler_json",
        steps=sched.n,
        faulty_steps=int(sched.faulty.sum()),
        round_trips=round_trips,
    )


TORCH_SCENARIOS = [
    n for n in _golden.scenario_names() if _golden.scenario(n)["scaler_ctor"]["enabled"]
]


def torch_dict(d):
    return {
        k: (v if k in ("_growth_tracker", "growth_interval") else _golden.scalar(v))
        for k, v in d.items()
    }


def in_bounds(d):
    return ls.MIN_SCALE <= d["scale"] <= ls.MAX_SCALE


def new_scale_value(call):
    ns = call["new_scale"]
    if ns is None:
        return None
    if "float" in ns:
        return _golden.scalar(ns["float"])
    return np.asarray(_golden.array(ns["tensor"])).reshape(())


@pytest.mark.parametrize("name", TORCH_SCENARIOS)
def test_resume_from_every_pytorch_state_dict_and_continue_like_torch(name):
    """Load the dict PyTorch wrote after step k, replay steps k+1.. with jamp,
    and match PyTorch's dict after every later step (while torch's scale is
    inside jamp's bounds; beyond them jamp deliberately differs)."""
    steps = _golden.scenario(name)["steps"]
    scaler = jamp.GradScaler()
    update = jax.jit(lambda state, found: jamp.update(state, jnp.logical_not(found)))
    resumed = 0
    for k, rec in enumerate(steps):
        d = torch_dict(rec["state_dict_after"])
        if not in_bounds(d):
            continue
        state = scaler.load_state_dict(json.loads(json.dumps(d)))
        resumed += 1
        for later in steps[k + 1 :]:
            want = torch_dict(later["state_dict_after"])
            if not in_bounds(want):
                break
            ns = new_scale_value(later["update_call"])
            if ns is not None:
                state = scaler.update(state, new_scale=ns)
            else:
                found = _golden.scalar(later["found_inf_combined"]) != 0.0
                state = update(state, jnp.bool_(found))
            assert scaler.state_dict(state) == want, (name, k, later["index"])
    assert resumed > 0


# ================================================================ 3. bad input


def _lss():
    return jamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})


def valid_state_dict(**changes):
    """A valid PyTorch GradScaler state dict, with ``changes``."""
    d = dict(scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=10)
    return {**d, "_growth_tracker": 0, **changes}


DYN = jamp.dynamic_loss_scale
BAD_INPUT = {
    # dynamic_loss_scale
    "init_scale=0": (lambda: DYN(0.0), ValueError, r"`init_scale`.*init_scale=0\.0"),
    "init_scale=-1": (lambda: DYN(-1.0), ValueError, r"`init_scale`.*init_scale=-1\.0"),
    "init_scale=inf": (lambda: DYN(math.inf), ValueError, r"`init_scale`.*init_scale=inf"),
    "init_scale=nan": (lambda: DYN(math.nan), ValueError, r"`init_scale`.*init_scale=nan"),
    "init_scale=1e39": (
        lambda: DYN(1e39),
        ValueError,
        r"`init_scale` within \[min_scale, max_scale\]",
    ),
    "init_scale>max_scale": (
        lambda: DYN(2.0**20, max_scale=2.0**10),
        ValueError,
        r"`init_scale` within",
    ),
    "init_scale<min_scale": (lambda: DYN(1.0, min_scale=2.0), ValueError, r"`init_scale` within"),
    "init_scale=str": (lambda: DYN("1024"), TypeError, r"`init_scale` to be a real number"),
    "init_scale=None": (lambda: DYN(None), TypeError, r"`init_scale` to be a real number"),
    "init_scale=True": (lambda: DYN(True), TypeError, r"`init_scale` to be a real number"),
    "init_scale=complex": (lambda: DYN(1 + 1j), TypeError, r"`init_scale` to be a real number"),
    "init_scale=float16": (
        lambda: DYN(jnp.float16(1024)),
        TypeError,
        r"`init_scale`.*dtype float16",
    ),
    "init_scale=bfloat16": (
        lambda: DYN(jnp.asarray(1024, jnp.bfloat16)),
        TypeError,
        r"`init_scale`.*dtype bfloat16",
    ),
    "init_scale=np.float16": (
        lambda: DYN(np.float16(1024)),
        TypeError,
        r"`init_scale`.*dtype float16",
    ),
    "init_scale=vector": (
        lambda: DYN(jnp.ones(2)),
        ValueError,
        r"`init_scale` to be a scalar.*\(2,\)",
    ),
    "init_scale=bool array": (
        lambda: DYN(jnp.asarray(True)),
        TypeError,
        r"`init_scale`.*dtype bool",
    ),
    "growth_factor=1": (
        lambda: DYN(growth_factor=1.0),
        ValueError,
        r"`growth_factor` > 1.*growth_factor=1\.0",
    ),
    "growth_factor=0.5": (lambda: DYN(growth_factor=0.5), ValueError, r"growth_factor=0\.5"),
    "growth_factor=inf": (lambda: DYN(growth_factor=math.inf), ValueError, r"growth_factor=inf"),
    "growth_factor=nan": (lambda: DYN(growth_factor=math.nan), ValueError, r"growth_factor=nan"),
    "growth_factor=str": (
        lambda: DYN(growth_factor="2"),
        TypeError,
        r"`growth_factor` to be a real number",
    ),
    "backoff_factor=0": (
        lambda: DYN(backoff_factor=0.0),
        ValueError,
        r"`backoff_factor`.*backoff_factor=0\.0",
    ),
    "backoff_factor=1": (lambda: DYN(backoff_factor=1.0), ValueError, r"backoff_factor=1\.0"),
    "backoff_factor=-0.5": (lambda: DYN(backoff_factor=-0.5), ValueError, r"backoff_factor=-0\.5"),
    "backoff_factor=nan": (lambda: DYN(backoff_factor=math.nan), ValueError, r"backoff_factor=nan"),
    "growth_interval=0": (
        lambda: DYN(growth_interval=0),
        ValueError,
        r"`growth_interval`.*growth_interval=0",
    ),
    "growth_interval=-5": (lambda: DYN(growth_interval=-5), ValueError, r"growth_interval=-5"),
    "growth_interval=2**31": (
        lambda: DYN(growth_interval=2**31),
        ValueError,
        r"growth_interval=2147483648",
    ),
    "growth_interval=2.0": (lambda: DYN(growth_interval=2.0), TypeError, r"growth_interval=2\.0"),
    "growth_interval=True": (
        lambda: DYN(growth_interval=True),
        TypeError,
        r"growth_interval=True",
    ),
    "hysteresis=0": (lambda: DYN(hysteresis=0), ValueError, r"`hysteresis`.*hysteresis=0"),
    "hysteresis=1.5": (lambda: DYN(hysteresis=1.5), TypeError, r"hysteresis=1\.5"),
    "min_scale=0": (lambda: DYN(min_scale=0.0), ValueError, r"`min_scale`.*min_scale=0\.0"),
    "max_scale=inf": (lambda: DYN(max_scale=math.inf), ValueError, r"`max_scale`.*max_scale=inf"),
    "max_scale=2**127": (lambda: DYN(max_scale=2.0**127), ValueError, r"`max_scale`"),
    "min_scale>max_scale": (
        lambda: DYN(min_scale=4.0, max_scale=2.0),
        ValueError,
        r"min_scale=4\.0 > max_scale=2\.0",
    ),
    "min_scale=str": (lambda: DYN(min_scale="x"), TypeError, r"`min_scale` to be a real number"),
    # static_loss_scale
    "static scale=0": (lambda: jamp.static_loss_scale(0.0), ValueError, r"`scale`.*scale=0\.0"),
    "static scale=-1": (lambda: jamp.static_loss_scale(-1.0), ValueError, r"scale=-1\.0"),
    "static scale=nan": (lambda: jamp.static_loss_scale(math.nan), ValueError, r"scale=nan"),
    "static scale=2**127": (
        lambda: jamp.static_loss_scale(2.0**127),
        ValueError,
        r"`scale` within",
    ),
    "static scale=str": (
        lambda: jamp.static_loss_scale("1"),
        TypeError,
        r"`scale` to be a real number",
    ),
    "static scale=float16": (
        lambda: jamp.static_loss_scale(jnp.float16(8)),
        TypeError,
        r"`scale`.*dtype float16",
    ),
    "static scale=bfloat16": (
        lambda: jamp.static_loss_scale(jnp.asarray(8, jnp.bfloat16)),
        TypeError,
        r"`scale`.*dtype bfloat16",
    ),
    # GradScaler
    "GradScaler init_scale=0": (
        lambda: jamp.GradScaler(init_scale=0.0),
        ValueError,
        r"init_scale=0\.0",
    ),
    "GradScaler init_scale=bfloat16": (
        lambda: jamp.GradScaler(init_scale=jnp.asarray(8, jnp.bfloat16)),
        TypeError,
        r"`init_scale`.*bfloat16",
    ),
    "GradScaler growth_factor=0.5": (
        lambda: jamp.GradScaler(growth_factor=0.5),
        ValueError,
        r"growth_factor=0\.5",
    ),
    "GradScaler backoff_factor=0": (
        lambda: jamp.GradScaler(backoff_factor=0.0),
        ValueError,
        r"backoff_factor=0\.0",
    ),
    "GradScaler growth_interval=0": (
        lambda: jamp.GradScaler(growth_interval=0),
        ValueError,
        r"growth_interval=0",
    ),
    "GradScaler enabled=1": (
        lambda: jamp.GradScaler(enabled=1),
        TypeError,
        r"`enabled` to be a bool, got 1",
    ),
    "GradScaler set_growth_interval(0)": (
        lambda: jamp.GradScaler().set_growth_interval(jamp.GradScaler().init(), 0),
        ValueError,
        r"growth_interval=0",
    ),
    "GradScaler update(no inf check)": (
        lambda: jamp.GradScaler().update(jamp.GradScaler().init()),
        RuntimeError,
        r"No inf checks were recorded prior to update.*`new_scale`",
    ),
    "GradScaler update(new_scale=0)": (
        lambda: jamp.GradScaler().update(jamp.GradScaler().init(), new_scale=0.0),
        ValueError,
        r"`new_scale`.*new_scale=0\.0",
    ),
    "GradScaler update(found_inf)": (
        lambda: jamp.GradScaler().update(jamp.GradScaler().init(), jnp.bool_(False)),
        TypeError,
        r"takes no `found_inf`",
    ),
    "GradScaler update([found_inf0, found_inf1])": (
        lambda: jamp.GradScaler().update(jamp.GradScaler().init(), []),
        TypeError,
        r"takes no `found_inf`",
    ),
    "GradScaler load_state_dict({})": (
        lambda: jamp.GradScaler().load_state_dict({}),
        ValueError,
        r"state dict is empty",
    ),
    "GradScaler load_state_dict(list)": (
        lambda: jamp.GradScaler().load_state_dict([("scale", 1.0)]),
        TypeError,
        r"`state_dict` to be a mapping",
    ),
    "GradScaler load_state_dict(scale=0)": (
        lambda: jamp.GradScaler().load_state_dict(valid_state_dict(scale=0.0)),
        ValueError,
        r"state_dict\['scale'\]",
    ),
    "GradScaler load_state_dict(scale='inf')": (
        lambda: jamp.GradScaler().load_state_dict(valid_state_dict(scale="inf")),
        TypeError,
        r"state_dict\['scale'\]",
    ),
    "GradScaler load_state_dict(tracker=-1)": (
        lambda: jamp.GradScaler().load_state_dict(valid_state_dict(_growth_tracker=-1)),
        ValueError,
        r"_growth_tracker",
    ),
    # loss_scaling
    "loss_scaling inner=function": (
        lambda: jamp.loss_scaling(optax.sgd),
        TypeError,
        r"`inner` to be an optax.GradientTransformation",
    ),
    "loss_scaling inner=None": (lambda: jamp.loss_scaling(None), TypeError, r"`inner`"),
    "loss_scaling loss_scale=float": (
        lambda: jamp.loss_scaling(optax.sgd(0.1), 1024.0),
        TypeError,
        r"`loss_scale` to be a jamp.LossScaleState.*got float",
    ),
    "loss_scaling loss_scale=GradScaler": (
        lambda: jamp.loss_scaling(optax.sgd(0.1), jamp.GradScaler()),
        TypeError,
        r"`loss_scale`.*got GradScaler",
    ),
    "loss_scaling update(state=dict)": (
        lambda: jamp.loss_scaling(optax.sgd(0.1)).update({"w": jnp.ones(2)}, {}, None),
        TypeError,
        r"`state` to be the LossScalingState.*got dict",
    ),
    "value_and_grad fun=3": (lambda: jamp.value_and_grad(3), TypeError, r"`fun` to be callable"),
    "value_and_grad argnums='a'": (
        lambda: jamp.value_and_grad(jnp.sum, argnums="a"),
        TypeError,
        r"`argnums`",
    ),
    # update's finite flag
    "update finite=int32": (
        lambda: jamp.update(DYN(), jnp.int32(1)),
        TypeError,
        r"`finite` to be a boolean scalar, got dtype int32",
    ),
    "update finite=float32": (
        lambda: jamp.update(DYN(), jnp.float32(1.0)),
        TypeError,
        r"`finite`.*dtype float32",
    ),
    "update finite=vector": (
        lambda: jamp.update(DYN(), jnp.ones(2, bool)),
        ValueError,
        r"`finite` to be a scalar.*\(2,\)",
    ),
    "update finite=np [True]": (
        lambda: jamp.update(DYN(), np.array([True])),
        ValueError,
        r"`finite` to be a scalar.*\(1,\)",
    ),
    "update finite=1": (lambda: jamp.update(DYN(), 1), TypeError, r"`finite`.*got int"),
    "update finite=None": (lambda: jamp.update(DYN(), None), TypeError, r"`finite`.*got NoneType"),
    # a state of another structure
    "unscale state=LossScalingState": (
        lambda: jamp.unscale(_lss(), {"w": jnp.ones(2)}),
        TypeError,
        r"jamp\.unscale` expected `state` to be a LossScaleState.*got LossScalingState",
    ),
    "unscale state=dict": (
        lambda: jamp.unscale({"scale": jnp.float32(2.0)}, {"w": jnp.ones(2)}),
        TypeError,
        r"jamp\.unscale` expected `state` to be a LossScaleState.*got dict",
    ),
    "scale state=float": (
        lambda: jamp.scale(2.0, jnp.ones(2)),
        TypeError,
        r"jamp\.scale` expected `state` to be a LossScaleState.*got float",
    ),
    "update state=LossScalingState": (
        lambda: jamp.update(_lss(), jnp.bool_(True)),
        TypeError,
        r"jamp\.update` expected `state` to be a LossScaleState.*got LossScalingState",
    ),
    "unscale_and_check state=dict": (
        lambda: jamp.unscale_and_check({}, {"w": jnp.ones(2)}),
        TypeError,
        r"expected `state` to be a LossScaleState.*got dict",
    ),
    "value_and_grad state=GradScaler": (
        lambda: jamp.value_and_grad(jnp.sum)(jamp.GradScaler(), jnp.ones(2)),
        TypeError,
        r"loss-scale state as its first argument, got GradScaler",
    ),
    # trees with strings, objects, mismatched structures
    "scale leaf=str": (
        lambda: jamp.scale(DYN(), {"a": jnp.ones(2), "b": "x"}),
        TypeError,
        r"jamp\.scale` expected a pytree of arrays.*str at path \['b'\]",
    ),
    "unscale leaf=object": (
        lambda: jamp.unscale(DYN(), {"a": [jnp.ones(2), object()]}),
        TypeError,
        r"object at path \['a'\]\[1\]",
    ),
    "all_finite leaf=str": (
        lambda: jamp.all_finite({"s": "text"}),
        TypeError,
        r"jamp\.all_finite`.*str at path \['s'\]",
    ),
    "unscale_and_check leaf=str": (
        lambda: jamp.unscale_and_check(DYN(), ("x",)),
        TypeError,
        r"str at path \[0\]",
    ),
    "select_tree structures": (
        lambda: jamp.select_tree(jnp.bool_(True), {"a": jnp.ones(2)}, {"b": jnp.ones(2)}),
        ValueError,
        r"`on_true` and `on_false` to have the same tree structure",
    ),
    "select_tree shapes": (
        lambda: jamp.select_tree(jnp.bool_(True), {"a": jnp.ones(2)}, {"a": jnp.ones(3)}),
        TypeError,
        r"matching leaves at path \['a'\].*float32\[2\] and float32\[3\]",
    ),
    "select_tree dtypes": (
        lambda: jamp.select_tree(jnp.bool_(True), [jnp.ones(2)], [jnp.ones(2, jnp.float16)]),
        TypeError,
        r"float32\[2\] and float16\[2\]",
    ),
    "select_tree strings": (
        lambda: jamp.select_tree(jnp.bool_(True), {"a": "x"}, {"a": "y"}),
        TypeError,
        r"non-array leaves 'x' and 'y' at path \['a'\]",
    ),
    "select_tree objects": (
        lambda: jamp.select_tree(jnp.bool_(True), {"a": object()}, {"a": object()}),
        TypeError,
        r"non-array leaves.*at path \['a'\]",
    ),
    "select_tree pred=int": (
        lambda: jamp.select_tree(jnp.int32(1), jnp.ones(2), jnp.ones(2)),
        TypeError,
        r"`pred` to be a boolean scalar",
    ),
    "select_tree pred=vector": (
        lambda: jamp.select_tree(jnp.ones(2, bool), jnp.ones(2), jnp.ones(2)),
        ValueError,
        r"`pred` to be a scalar",
    ),
    # get_loss_scale without one
    "get_loss_scale(plain optax)": (
        lambda: jamp.get_loss_scale(optax.sgd(0.1).init({"w": jnp.ones(2)})),
        ValueError,
        r"`opt_state` to contain a jamp loss-scale state, found none",
    ),
    "get_loss_scale({})": (
        lambda: jamp.get_loss_scale({}),
        ValueError,
        r"`opt_state`.*found none in dict",
    ),
    "get_loss_scale(two)": (
        lambda: jamp.get_loss_scale((_lss(), _lss())),
        ValueError,
        r"exactly one loss-scale state in `opt_state`, found 2",
    ),
    # autocast
    "autocast dtype=int32": (
        lambda: jamp.autocast(jnp.sin, dtype=jnp.int32),
        TypeError,
        r"floating dtype for `dtype`.*int32",
    ),
    "autocast dtype=int8": (
        lambda: jamp.autocast(jnp.sin, dtype=np.int8),
        TypeError,
        r"floating dtype for `dtype`.*int8",
    ),
    "autocast dtype='int32'": (
        lambda: jamp.autocast(jnp.sin, dtype="int32"),
        TypeError,
        r"`dtype`.*int32",
    ),
    "autocast dtype=bool": (lambda: jamp.autocast(jnp.sin, dtype=jnp.bool_), TypeError, r"`dtype`"),
    "autocast fun=3": (lambda: jamp.autocast(3), TypeError, r"`fun`"),
}

_TRACING = ("jax/_src/interpreters/", "jax/_src/pjit.py", "jax/_src/api.py", "jax/_src/core.py")


@pytest.mark.parametrize("case", list(BAD_INPUT), ids=list(BAD_INPUT))
def test_bad_input_is_a_clear_error_raised_by_jamp_before_tracing(case):
    fn, exc, match = BAD_INPUT[case]
    with pytest.raises(exc, match=match) as info:
        fn()
    assert type(info.value) is exc  # not a subclass from somewhere deep inside jax
    frames = traceback.extract_tb(info.value.__traceback__)
    raiser = pathlib.Path(frames[-1].filename).resolve()
    assert ROOT / "jamp" in raiser.parents, f"raised by {raiser}, not by jamp's own validation"
    tracing = [
        f.filename for f in frames if any(t in f.filename.replace("\\", "/") for t in _TRACING)
    ]
    assert not tracing, f"raised while tracing: {tracing}"


def test_no_assert_guards_user_input_in_jamp():
    """``assert`` vanishes under ``python -O``; user input needs real exceptions."""
    offenders = []
    for path in sorted((ROOT / "jamp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assert):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if isinstance(node, ast.Raise) and node.exc is not None:
                called = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(called, ast.Name) and called.id == "AssertionError":
                    offenders.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} (raise AssertionError)"
                    )
    assert not offenders, offenders
    assert len(list((ROOT / "jamp").rglob("*.py"))) >= 7  # the scan really saw the package


# ================================================================ 4. counters

INT32_MAX = 2**31 - 1


def test_skipped_steps_saturate_at_int32_max_under_jit():
    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(2.0**8))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)._replace(skipped_steps=jnp.int32(2**31 - 2))
    bad, good = {"w": jnp.array([1.0, jnp.nan, 1.0])}, {"w": jnp.ones(3)}
    update = jax.jit(tx.update)
    counts = []
    for g in (bad, bad, bad, good, bad):
        _, state = update(g, state, params)
        counts.append(int(state.skipped_steps))
    assert counts == [INT32_MAX] * 5
    assert state.skipped_steps.dtype == jnp.int32


def test_growth_tracker_reaches_an_interval_of_int32_max_without_wrapping():
    state = jamp.dynamic_loss_scale(2.0**10, growth_interval=INT32_MAX)
    state = jamp.update(state, jnp.bool_(True))
    state = dataclasses.replace(state, growth_tracker=jnp.int32(INT32_MAX - 2))
    update = jax.jit(jamp.update)
    state = update(state, jnp.bool_(True))
    assert int(state.growth_tracker) == INT32_MAX - 1 and float(state.scale) == 2.0**10
    state = update(state, jnp.bool_(True))  # the interval-th finite step: grow, reset
    assert int(state.growth_tracker) == 0 and float(state.scale) == 2.0**11
    # A GradScaler checkpoint taken near the limit loads and continues.
    scaler = jamp.GradScaler(growth_interval=INT32_MAX)
    d = dict(scaler.state_dict(scaler.init()), _growth_tracker=INT32_MAX - 1)
    state = jamp.update(scaler.load_state_dict(d), jnp.bool_(True))
    assert int(state.growth_tracker) == 0


@pytest.mark.parametrize(
    "how", ["set_growth_interval below the tracker", "load_state_dict with tracker >= interval"]
)
def test_growth_tracker_never_wraps_past_int32_max(how):
    """A tracker at or above the interval (PyTorch allows both routes) must not
    wrap to -2**31 after 2**31 steps: the state would then no longer load
    from its own state_dict."""
    scaler = jamp.GradScaler(growth_interval=INT32_MAX)
    if how.startswith("set"):
        state = scaler.init()
        state = dataclasses.replace(state, growth_tracker=jnp.int32(INT32_MAX - 2))
        state = scaler.set_growth_interval(state, 100)
    else:
        d = dict(
            scaler.state_dict(scaler.init()), growth_interval=100, _growth_tracker=INT32_MAX - 2
        )
        state = scaler.load_state_dict(d)
    update = jax.jit(jamp.update)
    trackers = []
    for _ in range(4):
        state = update(state, jnp.bool_(True))
        trackers.append(int(state.growth_tracker))
    assert all(0 <= t <= INT32_MAX for t in trackers), f"growth_tracker wrapped: {trackers}"
    scaler.load_state_dict(scaler.state_dict(state))  # still a loadable checkpoint
