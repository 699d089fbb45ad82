"""Measuring: training steps interleaved against the plain step, the finite checks
alone, PyTorch's GradScaler, and the MLP steps rerun under a caching allocator.

Every function returns plain rows (dicts of numbers and strings); ``render`` turns
them into the report and ``targets`` judges them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks import finite_checks, hlo, models, timing

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------ steps


class _Flat:
    """A variant's step as a jitted function over the flat list of its state leaves.

    Working on flat leaves lets every variant be lowered the same way (jmp's
    ``DynamicLossScale`` cannot be rebuilt from the placeholder leaves that
    lowering a tree state uses).
    """

    def __init__(self, name: str, builder: Callable, model: models.Model, donate: bool = True):
        self.name = name
        state, self._step = builder(model)
        self.leaves, self._treedef = jax.tree_util.tree_flatten(state)
        self.traces: list[int] = []
        self._donate = (0,) if donate else ()
        self.run = jax.jit(self._fresh(self.traces), donate_argnums=self._donate)

    def _fresh(self, counter: list) -> Callable:
        step, treedef = self._step, self._treedef

        def flat(leaves, batch):  # a new function object: no trace or compile cache hit
            counter.append(1)
            return jax.tree_util.tree_leaves(
                step(jax.tree_util.tree_unflatten(treedef, leaves), batch)
            )

        return flat

    def compile_time(self, batch, reuse: bool) -> tuple[float, float, dict]:
        """Wall and CPU seconds of ``jax.jit(step).lower(...).compile()``.

        With ``reuse`` it lowers ``self.run`` (whose later calls then reuse this
        trace and executable: the one trace counted); otherwise a fresh jit of a
        fresh function (for repeats).
        """
        j = self.run if reuse else jax.jit(self._fresh([]), donate_argnums=self._donate)
        c0, t0 = time.process_time(), time.perf_counter()
        compiled = j.lower(self.leaves, batch).compile()
        t1, c1 = time.perf_counter(), time.process_time()
        return t1 - t0, c1 - c0, hlo.stats(compiled)


def _guarded_steps(f: _Flat, batch, n: int) -> tuple[str, str]:
    """Run ``n`` steps under transfer_guard('disallow'); report first call and the rest."""
    first = "ok"
    try:
        with jax.transfer_guard("disallow"):
            f.leaves = f.run(f.leaves, batch)
    except Exception as e:  # a host value copied in on the first call
        first = "fails: " + str(e).splitlines()[0][:60]
        f.leaves = f.run(f.leaves, batch)
    rest = "ok"
    try:
        with jax.transfer_guard("disallow"):
            for _ in range(n - 1):
                f.leaves = f.run(f.leaves, batch)
            jax.block_until_ready(f.leaves)
    except Exception as e:
        rest = "fails: " + str(e).splitlines()[0][:60]
        for _ in range(n - 1):
            f.leaves = f.run(f.leaves, batch)
    return first, rest


def bench_steps(
    model: models.Model, variants: dict[str, Callable], cfg: dict, log, donate: bool = True
) -> list[dict]:
    flats = {name: _Flat(name, b, model, donate) for name, b in variants.items()}
    rows = {name: dict(name=name, compile_wall=[], compile_cpu=[]) for name in flats}
    for rep in range(cfg["compile_reps"]):
        for name, f in flats.items():
            w, c, st = f.compile_time(model.batch, reuse=rep == 0)
            rows[name]["compile_wall"].append(w)
            rows[name]["compile_cpu"].append(c)
            rows[name]["hlo"] = st
    for name, f in flats.items():
        first, rest = _guarded_steps(f, model.batch, cfg["guard"])
        # One trace came from lowering for the compile timing; the calls reuse it
        # unless the state's types change between steps (a retrace).
        rows[name].update(traces=len(f.traces), guard_first=first, guard_steps=rest)
    log(f"  {model.name}: compiled and warmed {len(flats)} variants")
    runners = {}
    for name, f in flats.items():
        r = timing.Runner(f.run, f.leaves, model.batch)
        runners[name] = r
    with jax.transfer_guard("disallow"):
        timing.interleave(runners, cfg["rounds"], cfg["per_round"])
    base = next(iter(runners))
    b = runners[base]
    out = []
    for name, r in runners.items():
        row = rows[name]
        row["ms"] = timing.median(r.times) * 1e3
        row["ratio"], row["ratio_q1"], row["ratio_q3"] = timing.ratio_stats(
            r.times, b.times, cfg["per_round"]
        )
        row["cpu_ratio"] = timing.ratio_stats(r.cpu, b.cpu, cfg["per_round"])[0]
        row["faults"] = timing.median(r.faults)
        row["steps"] = len(r.times)
        out.append(row)
    p = out[0]
    for row in out:
        row["compile_ratio"] = statistics.median(row["compile_wall"]) / statistics.median(
            p["compile_wall"]
        )
        row["compile_cpu_ratio"] = statistics.median(row["compile_cpu"]) / statistics.median(
            p["compile_cpu"]
        )
        row["bytes_ratio"] = row["hlo"]["bytes_accessed"] / p["hlo"]["bytes_accessed"]
    return out


# ------------------------------------------------------------------ allocator

# XLA:CPU allocates each call's temporaries afresh, and glibc serves buffers this
# large with new pages, so every step page-faults through its whole temp arena: a
# cost proportional to temp memory that a GPU's caching allocator does not have
# (FINDINGS 11). A child process rerunning the MLP under jemalloc told to keep
# freed memory shows the steps without it.
JEMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)
KEEP_FREED = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def caching_allocator_rows(args, log) -> list[dict] | None:
    """The MLP step rows from a child process run under jemalloc, or None."""
    lib = next((p for p in JEMALLOC if os.path.exists(p)), None)
    if lib is None:
        log("caching allocator: no libjemalloc found (apt install libjemalloc2); section skipped")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "benchmarks", "--models", "MLP", "--no-finite"]
        cmd += ["--no-torch", "--no-undonated", "--caching-allocator", "off"]
        cmd += ["--json", out, "--out", os.path.join(tmp, "RESULTS.md")]
        cmd += [] if args.mode == "full" else [f"--{args.mode}"]
        cmd += ["--variants", args.variants] if args.variants else []
        env = dict(os.environ, LD_PRELOAD=lib, MALLOC_CONF=KEEP_FREED)
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
        log(f"caching allocator: rerunning the MLP under {lib} ({KEEP_FREED})")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            log(f"caching allocator: child failed: {proc.stderr[-2000:]}")
            return None
        with open(out) as fh:
            return json.load(fh)[0]["rows"]


# ------------------------------------------------------------------ torch


def bench_torch(sizes, batch: int, rounds: int, per_round: int) -> dict | None:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    # XLA:CPU flushes subnormals to zero; torch does not by default, and after
    # ~50 steps on one batch its GradScaler step ran 4x slower on subnormal
    # arithmetic (FINDINGS 8). Flush in torch too, so both sides compute alike.
    torch.set_flush_denormal(True)
    try:
        return _bench_torch(torch, sizes, batch, rounds, per_round)
    finally:
        torch.set_flush_denormal(False)  # torch's default


def _bench_torch(torch, sizes, batch: int, rounds: int, per_round: int) -> dict:
    torch.manual_seed(0)

    def make():
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(torch.nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(torch.nn.ReLU())
        net = torch.nn.Sequential(*layers)
        return net, torch.optim.AdamW(net.parameters(), lr=1e-3)

    x = torch.randn(batch, sizes[0])
    y = torch.randint(0, sizes[-1], (batch,))
    lossf = torch.nn.CrossEntropyLoss()
    net_p, opt_p = make()
    net_s, opt_s = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15)

    def plain():
        opt_p.zero_grad(set_to_none=True)
        lossf(net_p(x), y).backward()
        opt_p.step()

    def scaled():
        opt_s.zero_grad(set_to_none=True)
        scaler.scale(lossf(net_s(x), y)).backward()
        scaler.step(opt_s)
        scaler.update()

    fns = {"torch plain (AdamW)": plain, "torch.amp.GradScaler": scaled}
    for f in fns.values():
        for _ in range(2):
            f()
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]
        for k in order:
            for _ in range(per_round):
                t0 = time.perf_counter()
                fns[k]()
                times[k].append(time.perf_counter() - t0)
    base = times[names[0]]
    return {
        "version": torch.__version__,
        "rows": [
            dict(name=k, ms=timing.median(v) * 1e3, ratio=timing.ratio_stats(v, base, per_round)[0])
            for k, v in times.items()
        ],
    }


# ------------------------------------------------------------------ finite checks


FINITE_REPS = 3  # timed calls of each finite check per round


def bench_finite(sizes, dtypes, rounds: int, log) -> list[dict]:
    fns = {**finite_checks.CHECKS, **finite_checks.READS}
    results = []
    sound = {
        jnp.dtype(dt).name: {
            k: finite_checks.verify(jax.jit(f), dt) for k, f in finite_checks.CHECKS.items()
        }
        for dt in dtypes
    }
    for n in sizes:
        for dt in dtypes:
            tree = finite_checks.make_tree(n, dt)
            nel = sum(x.size for x in jax.tree_util.tree_leaves(tree))
            jf = {}
            for k, f in fns.items():
                jf[k] = jax.jit(f)
                jax.block_until_ready(jf[k](tree))
            ok = sound[jnp.dtype(dt).name]
            reps = FINITE_REPS
            times = timing.time_calls(
                jf, (tree,), rounds, reps=reps, seed=len(results), settle=True
            )
            med = {k: timing.median(v) for k, v in times.items()}
            floor_name = min(finite_checks.READS, key=lambda k: med[k])
            # Per-round ratio to the floor read, median over rounds.
            fl = times[floor_name]
            ratio = {k: timing.ratio_stats(v, fl, reps)[0] for k, v in times.items()}
            results.append(
                dict(
                    n=nel,
                    dtype=jnp.dtype(dt).name,
                    med=med,
                    ratio=ratio,
                    ok=ok,
                    floor=floor_name,
                    reps=reps,
                )
            )
            del tree
            log(
                f"  finite: {nel / 1e6:.1f}M {jnp.dtype(dt).name} floor {floor_name} "
                f"{med[floor_name] * 1e3:.2f} ms"
            )
    return results
