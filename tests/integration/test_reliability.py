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
3. Bad input: no ``assert`` guards user input in ``jamp/``. That every
   invalid argument is a ValueError/TypeError naming it, raised by jamp itself
   before anything is traced, is checked by each module's ``BAD_INPUT`` table
   (``tests/test_<module>.py``) through ``tests/_bad_input.py``.
4. Long-run counters saturate instead of wrapping.

Figures for docs/reliability.md: ``pytest tests/integration/test_reliability.py -s``
prints them (lines starting with ``RELIABILITY``).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
import time

import _golden
import _reliability_helpers as H
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp._src import loss_scale as ls

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/<folder>/this file

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
        assert isinstance(s, jamp.ScaledOptimizerState)
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
    # The checkpoints really were taken mid-burst (57 faults in: backed off to the floor,
    # skips counted; hysteresis 1 keeps no overflow streak) and mid-interval (tracker
    # part-way).
    assert seen[mid_burst][0] == MIN_SCALE and seen[mid_burst][2] == 0
    assert seen[mid_burst][3] >= 57
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
