"""jamp benchmarks: loss-scaled training steps vs a plain Optax step, and finite checks.

    python -m benchmarks            # full run (~8-10 min on 2 cores)
    python -m benchmarks --quick    # ~2-3 min: every peer on the MLP, a subset on the GPT
    python -m benchmarks --tiny     # seconds: smoke test (tiny models, few steps)
    python benchmarks/run.py --out PATH

Everything runs in one process; variants are interleaved round by round (a
fresh seeded shuffle of the order each round) and every ratio is the median over rounds of the
per-round ratio to the plain float32 ``optax.adamw`` step, so load from other
processes hits all variants alike. Writes a markdown report (``--out``,
default ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

if __package__ in (None, ""):  # `python benchmarks/run.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "benchmarks"  # noqa: A001

import jax
import jax.numpy as jnp

from benchmarks import finite_checks, hlo, models, steps, timing

HERE = os.path.dirname(os.path.abspath(__file__))

# The GPT variants --quick compiles (the other peers cost 10-18 s of compile each
# on 2 cores); jmp's select_tree stands for the select-based peers. --all-peers
# restores them all.
QUICK_GPT = (
    "plain (f32 optax.adamw)",
    "jamp.loss_scaling",
    "jamp.loss_scaling(skip='select')",
    "jamp.GradScaler.step",
    "jamp.GradScaler(skip='select').step",
    "jmp DynamicLossScale + select_tree",
)

CONFIGS = {
    # rounds x per_round timed steps per variant; compile_reps compiles timed (the
    # first also serves the runs); guard = steps run under the transfer guard
    # (and counted for retraces) before timing; finite-check sizes and rounds;
    # torch rounds; gpt = the GPT variants kept (None: all).
    "tiny": dict(
        rounds=3,
        per_round=1,
        compile_reps=1,
        guard=20,
        sizes=(20_000,),
        frounds=1,
        trounds=2,
        gpt=QUICK_GPT,
    ),
    "quick": dict(
        rounds=6,
        per_round=2,
        compile_reps=1,
        guard=10,
        sizes=(1_000_000, 10_000_000),
        frounds=5,
        trounds=6,
        gpt=QUICK_GPT,
    ),
    "full": dict(
        rounds=30,
        per_round=3,
        compile_reps=3,
        guard=20,
        sizes=(1_000_000, 10_000_000, 50_000_000),
        frounds=8,
        trounds=30,
        gpt=None,
    ),
}


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
            reps = 3
            times = timing.time_calls(
                jf, (tree,), rounds, reps=reps, seed=len(results), settle=True
            )
            med = {k: timing.median(v) for k, v in times.items()}
            floor_name = min(finite_checks.READS, key=lambda k: med[k])
            # Per-round ratio to the floor read, median over rounds.
            fl = times[floor_name]
            ratio = {k: timing.ratio_stats(v, fl, reps)[0] for k, v in times.items()}
            results.append(
                dict(n=nel, dtype=jnp.dtype(dt).name, med=med, ratio=ratio, ok=ok, floor=floor_name)
            )
            del tree
            log(
                f"  finite: {nel / 1e6:.1f}M {jnp.dtype(dt).name} floor {floor_name} "
                f"{med[floor_name] * 1e3:.2f} ms"
            )
    return results


# ------------------------------------------------------------------ report


def _machine() -> list[str]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    vers = []
    for mod in ("jax", "jaxlib", "optax", "flax", "jmp", "numpy"):
        try:
            vers.append(f"{mod} {__import__(mod).__version__}")
        except Exception:
            vers.append(f"{mod} (not installed)")
    import jamp

    vers.insert(0, f"jamp {jamp.__version__}")
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return [
        f"- machine: {os.cpu_count()} CPUs (`nproc`), {cpu}; backend {jax.default_backend()}, "
        f"devices {jax.devices()}",
        f"- load average at the end of the run: {load} (other processes share the cores)",
        f"- python {platform.python_version()}; " + ", ".join(vers),
    ]


def _fmt(x: float, nd: int = 3) -> str:
    return "n/a" if x != x else f"{x:.{nd}f}"


def _step_table(rows: list[dict]) -> list[str]:
    L = [
        "| variant | median step (ms) | ratio to plain [q1, q3] | CPU-time ratio | "
        "page faults per step | steps |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        L.append(
            f"| {r['name']} | {r['ms']:.1f} | {_fmt(r['ratio'])} [{_fmt(r['ratio_q1'], 2)}, "
            f"{_fmt(r['ratio_q3'], 2)}] | {_fmt(r['cpu_ratio'])} | {r['faults']:.0f} | "
            f"{r['steps']} |"
        )
    L.append("")
    return L


def report(args, cfg, step_results, torch_res, finite_res, elapsed) -> str:
    L: list[str] = []
    L.append("# jamp benchmark results\n")
    L.append(f"- command: `{' '.join(['python -m benchmarks'] + args.argv)}`")
    L.append(
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}; "
        f"wall time of the run {elapsed:.0f} s"
    )
    L.extend(_machine())
    L.append(
        f"- settings: {args.mode}: {cfg['rounds']} rounds x {cfg['per_round']} steps per variant, "
        "variants interleaved (a fresh seeded shuffle of the order every round), state donated "
        "(`donate_argnums`) except in the MLP section marked **not** donated, every step "
        "`block_until_ready`; timed steps run under "
        "`jax.transfer_guard('disallow')`."
    )
    L.append(
        "- ratio = median over rounds of (median step time of the variant in that round / "
        "median plain step time in that round); [q1, q3] its quartiles over rounds; CPU ratio is "
        "the same with process CPU time (all threads), which is less sensitive to other "
        "processes taking the cores."
    )
    L.append(
        "- GPU: not run in this session (no GPU lent); `benchmarks/gpu.sh` is the prepared script."
    )
    if cfg["gpt"] is not None and not args.all_peers:
        L.append(
            f"- {args.mode}: the GPT runs only {', '.join(f'`{v}`' for v in cfg['gpt'])} "
            "(the other peers add ~1 min of compile; `--all-peers` or a full run adds them)."
        )
    L.append(
        "- the experiments and the HLO reading behind jamp's check and skip are in "
        "`benchmarks/FINDINGS.md`.\n"
    )

    for model, rows in step_results:
        L.append(f"## Training step: {model.describe}\n")
        if model.name.endswith("-half"):
            L.append(
                f"{model.n_params / 1e6:.2f}M parameters in {model.n_leaves} leaves, "
                "`optax.adamw(1e-3)`, "
                "float32 parameters and optimizer. The `plain (f32 ...)` row computes in float32; "
                "the "
                "other rows cast parameters and activations to the named dtype for the matrix "
                "products (`models.py`, `compute_dtype`), so a ratio below 1 is the half-precision "
                "speed-up, with or without jamp's loss scaling.\n"
            )
        else:
            cd = jnp.dtype(args.compute_dtype).name
            what = "compute" if cd == "float32" else f"optimizer, {cd} matrix products"
            L.append(
                f"{model.n_params / 1e6:.2f}M parameters in {model.n_leaves} leaves, "
                "`optax.adamw(1e-3)`, "
                f"float32 parameters and {what} (the loss-scaling overhead is what is measured).\n"
            )
        L.extend(_step_table(rows))
        L.append(f"### Compile, traces, transfers, HLO ({model.name})\n")
        L.append(
            "| variant | compile (s) | compile ratio (wall / CPU) | "
            f"traces in {cfg['guard']} steps | "
            f"transfer guard: first call / steps 2-{cfg['guard']} | XLA bytes accessed ratio | "
            "temp memory (MB) | fusions | conditionals |"
        )
        L.append("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
        for r in rows:
            h = r["hlo"]
            L.append(
                f"| {r['name']} | {statistics.median(r['compile_wall']):.2f} | "
                f"{_fmt(r['compile_ratio'], 2)} / {_fmt(r['compile_cpu_ratio'], 2)} | "
                f"{r['traces']} | "
                f"{r['guard_first']} / {r['guard_steps']} | {_fmt(r['bytes_ratio'])} | "
                f"{h['temp_bytes'] / 1e6:.1f} | {h['fusions_total']} | {h['conditionals']} |"
            )
        L.append("")

    if torch_res:
        L.append(
            f"## PyTorch {torch_res['version']} (same MLP, AdamW, CPU, float32, subnormals "
            "flushed to zero as XLA:CPU does)\n"
        )
        L.append("| variant | median step (ms) | ratio to torch plain |")
        L.append("| --- | ---: | ---: |")
        for r in torch_res["rows"]:
            L.append(f"| {r['name']} | {r['ms']:.1f} | {_fmt(r['ratio'])} |")
        L.append("")
    else:
        L.append("## PyTorch\n\ntorch is not importable here: row skipped.\n")

    if finite_res:
        L.append("## Finite check alone\n")
        L.append(
            "Each check maps a gradient-like tree (leaves of varied 2-D/1-D shapes) to one bool. "
            f"{cfg['frounds']} rounds, each in a shuffled order; per function one untimed call, "
            "then 3 timed. Entries: median time in ms, and in parentheses the ratio to the floor, "
            "the fastest "
            "of the plain one-pass reductions (`read:` rows: each reads every byte once and "
            "computes nothing a check needs; XLA cannot read all bytes faster than its fastest "
            "full reduction). `sound` = flags NaN/inf in a large leaf and passes a finite tree "
            "whose sum overflows, for every dtype. `jamp.all_finite` is jamp's current check "
            "(on a CPU: large float32 leaves reduced to row sums by a matrix-vector product "
            "with `2**-40` weights, those rows and the small leaves checked element by element "
            "as one vector, float16 leaves by their non-finite flags, and an exact fallback under "
            "`lax.cond` only for a scale below 1 or a non-finite sum of other leaves); the "
            "`unscale_and_check flag` row is the check jamp's training steps run "
            "(`check_unscaled`: the unscaled values checked from one read of the scaled tree).\n"
        )
        cols = [(r["n"], r["dtype"]) for r in finite_res]
        head = " | ".join(f"{n / 1e6:.1f}M {d}" for n, d in cols)
        L.append(f"| check | sound | {head} |")
        L.append("| --- | --- | " + " | ".join("---:" for _ in cols) + " |")
        names = list(finite_checks.CHECKS) + list(finite_checks.READS)
        for k in names:
            sound = (
                ("yes" if all(r["ok"][k] for r in finite_res) else "**no**")
                if k in finite_checks.CHECKS
                else ""
            )
            cells = " | ".join(f"{r['med'][k] * 1e3:.2f} ({r['ratio'][k]:.2f})" for r in finite_res)
            L.append(f"| {k} | {sound} | {cells} |")
        L.append(
            "| *floor is* |  | "
            + " | ".join(r["floor"].replace("read: ", "") for r in finite_res)
            + " |"
        )
        L.append("")

    L.append("## Targets\n")
    L.extend(_targets(step_results, finite_res, cfg["guard"]))
    L.append("")
    return "\n".join(L) + "\n"


# Why a target is missed: the evidence is in FINDINGS.md (HLO, bytes, profiles).
_WHY = {
    "step:jamp.loss_scaling": (
        "Optax form: the updates are written at the `cond` boundary and re-read by "
        "`optax.apply_updates` (not fused into Adam's pass), plus the check's read of the "
        "gradients; XLA bytes accessed {bytes:.3f}x plain (FINDINGS 2); on a CPU each step "
        "also page-faults through its temp arena, larger than plain's (see the page-fault "
        "column and the caching-allocator section; FINDINGS 11, 12)"
    ),
    "step:jamp.loss_scaling(report_nonfinite=True)": (
        "as `jamp.loss_scaling`, plus: the host callback in the skip branch makes JAX drop its "
        "C++ dispatch fast path for the whole executable (`pxla.create_cpp_call` returns None "
        "when `has_host_callbacks`): a fixed ~0.4 ms of Python dispatch and runtime-token "
        "handling on every step, clean or not (FINDINGS 4)"
    ),
    "step:jamp.GradScaler.step": (
        "one extra read of every gradient for the check (XLA bytes {bytes:.3f}x plain, the "
        "size of the gradients); XLA:CPU cannot fuse it into the matmuls that produce them, "
        "and jamp reads them in its matrix kernels, as fast as it reads anything "
        "(FINDINGS 2, 10)"
    ),
    "step:jamp.loss_scaling(skip='select')": (
        "`select` with a donated state: XLA fuses the moment update into the parameter "
        "fusion, which reads the old moments after the in-place moment fusion overwrote them, "
        "so it copies every moment first (FINDINGS 2); `cond` is the fast form here"
    ),
    "step:jamp.GradScaler(skip='select').step": (
        "`select` with a donated state: XLA copies every moment before its in-place update "
        "(FINDINGS 2); `cond` (`jamp.GradScaler.step`) is the fast form here"
    ),
    "peer:below-plain": (
        "the best peer, {peer_name}, runs faster than *plain* ({peer:.3f}x): every `select` "
        "form does on the GPT, from where XLA places the backward pass's temporaries, not "
        "from less work (profile in FINDINGS 5: the same 31 backward kernels take ~20 ms in "
        "`select` forms and ~45 ms in plain and `cond` forms)"
    ),
    "peer": (
        "the best peer, {peer_name}, has the same Optax-form `cond` but no loss scale to "
        "unscale: XLA bytes {peer_bytes:.3f}x vs jamp's {bytes:.3f}x (FINDINGS 2)"
    ),
    "compile": (
        "XLA:CPU compiles each kernel at a near-fixed 7-13 ms (FINDINGS 12); the check adds a "
        "few (a product per large leaf, which compiles to none; one reduction over every small "
        "leaf and row; `max|x|` per large leaf in its exact branch), the skip the rest ({fus} "
        "fusions vs {pfus} plain; in the Optax form `optax.apply_updates` is a kernel per leaf "
        "of its own, outside the `cond`), next to plain's {pc:.2f} s (one compile per variant "
        "in --quick: noisy)"
    ),
    "compile:report": (
        "the skip branch also holds `log_nonfinite`'s per-leaf counts ({fus} fusions)"
    ),
    "finite:float16": (
        "no native float16 arithmetic on this CPU: jamp checks float16 leaves with a uint8 "
        "max of their non-finite flags (no conversion; {f32:.2f}x the time of the "
        "float32-sum read); the floor is a float16 `max`, which is no sound check (drops NaN) "
        "(FINDINGS 1, 6, 10)"
    ),
    "finite:small": (
        "1M elements: ~0.3 ms, dispatch and the per-leaf reductions' fixed cost dominate"
    ),
    "finite": (
        "float32: on a CPU jamp reduces large float32 leaves to row sums by a matrix-vector "
        "product, which runs up to ~1.4x a plain sum in this table (the other checks' "
        "temporaries evict the tree between calls) and several times faster than one inside "
        "a training step, where XLA:CPU tiles the sums (FINDINGS 10); bfloat16 at ~1 ms: the "
        "same reduction as `read: sum f32`, so the gap is timing noise of a few short rounds "
        "(FINDINGS 1)"
    ),
}


def _judge(ratio: float, limit: float, best_peer: float) -> tuple[bool, bool, str]:
    """Whether a step ratio is over ``limit``, not ahead of the best peer, and by how much."""
    over, behind = ratio > limit, ratio >= best_peer
    miss = "; ".join(
        ([f"+{ratio - limit:.3f} over {limit}x"] if over else [])
        + ([f"{ratio - best_peer:+.3f} vs best peer"] if behind else [])
    )
    return over, behind, miss


def _targets(step_results, finite_res, guard: int) -> list[str]:
    out = [
        "| target | measured | met | miss by | why (when missed) |",
        "| --- | --- | --- | --- | --- |",
    ]

    def row(target, measured, met, miss="", why=""):
        out.append(
            f"| {target} | {measured} | {'yes' if met else '**no**'} | "
            f"{'' if met else miss} | {'' if met else why} |"
        )

    lim = {"MLP": 1.03, "MLP-undonated": 1.03, "MLP-caching-allocator": 1.03, "GPT": 1.02}
    for model, rows in step_results:
        if model.name.endswith("-half"):
            continue
        undonated = model.name.endswith("-undonated")
        # The same programs as the MLP section's: their compile rows would repeat.
        same_programs = model.name.endswith("-caching-allocator")
        by = {r["name"]: r for r in rows}
        plain = rows[0]
        peers = [r for r in rows if not r["name"].startswith(("plain", "jamp"))]
        best_peer = min((r["ratio"] for r in peers), default=float("nan"))
        jamps = [n for n in by if n.startswith("jamp")]
        L = lim.get(model.name, 1.03)
        for name in [] if undonated else jamps:
            r = by[name]
            over, behind, miss = _judge(r["ratio"], L, best_peer)
            bp = min(peers, key=lambda p: p["ratio"]) if peers else None
            peer_why = ""
            if behind and bp is not None:
                peer_why = _WHY["peer:below-plain" if best_peer < 1 else "peer"].format(
                    peer_name=f"`{bp['name']}`",
                    peer=best_peer,
                    peer_bytes=bp["bytes_ratio"],
                    bytes=r["bytes_ratio"],
                )
            why = "; ".join(
                ([_WHY.get("step:" + name, "").format(bytes=r["bytes_ratio"])] if over else [])
                + ([peer_why] if peer_why else [])
            )
            row(
                f"{model.name}: {name} <= {L}x plain and ahead of every peer measured (best peer "
                f"{_fmt(best_peer)}x, {len(peers)} peer{'' if len(peers) == 1 else 's'})",
                f"{_fmt(r['ratio'])}x (CPU {_fmt(r['cpu_ratio'])}x)",
                not over and not behind,
                miss,
                why,
            )
        forms = [by[n] for n in jamps if "report" not in n]
        if forms:
            best = min(forms, key=lambda r: r["ratio"])
            over, behind, miss = _judge(best["ratio"], L, best_peer)
            row(
                f"{model.name}: jamp's fastest form <= {L}x plain and ahead of every peer "
                f"(best peer {_fmt(best_peer)}x)",
                f"`{best['name']}` {_fmt(best['ratio'])}x (CPU {_fmt(best['cpu_ratio'])}x)",
                not over and not behind,
                miss,
                (
                    f"without donation: XLA bytes accessed {best['bytes_ratio']:.3f}x plain (the "
                    "check's read of the gradients, and the select's pass over the state)"
                    if undonated
                    else "see the row of that form above"
                ),
            )
        for name in [] if undonated or same_programs else jamps:
            r = by[name]
            kind = "compile:report" if "report" in name else "compile"
            why = _WHY["compile"] + (
                "; " + _WHY["compile:report"] if kind == "compile:report" else ""
            )
            row(
                f"{model.name}: {name} compile <= 1.3x plain",
                f"{_fmt(r['compile_ratio'], 2)}x wall, {_fmt(r['compile_cpu_ratio'], 2)}x CPU",
                r["compile_cpu_ratio"] <= 1.3,
                f"+{r['compile_cpu_ratio'] - 1.3:.2f}x (CPU)",
                why.format(
                    fus=r["hlo"]["fusions_total"],
                    pfus=plain["hlo"]["fusions_total"],
                    pc=statistics.median(plain["compile_wall"]),
                ),
            )
            ok = r["traces"] == 1 and r["guard_first"] == "ok" and r["guard_steps"] == "ok"
            row(
                f"{model.name}: {name} 1 trace in {guard} steps, 0 host transfers",
                f"{r['traces']} trace(s), guard {r['guard_first']}/{r['guard_steps']}",
                ok,
                "retrace or transfer",
                "",
            )
    if finite_res:
        for k in finite_checks.JAMP_CHECKS:
            worst = max(finite_res, key=lambda r: r["ratio"][k])
            misses = [r for r in finite_res if r["ratio"][k] > 1.2]
            why = []
            f16 = [r for r in misses if r["dtype"] == "float16"]
            if f16:
                w = max(f16, key=lambda r: r["ratio"][k])
                why.append(
                    _WHY["finite:float16"].format(f32=w["med"][k] / w["med"]["read: sum f32"])
                )
            if any(r["n"] < 2_000_000 and r["dtype"] != "float16" for r in misses):
                why.append(_WHY["finite:small"])
            if any(r["dtype"] != "float16" and r["n"] >= 2_000_000 for r in misses):
                why.append(_WHY["finite"])
            cells = ", ".join(
                f"{r['n'] / 1e6:.0f}M {r['dtype']} {r['ratio'][k]:.2f}x" for r in misses
            )
            row(
                f"finite check `{k}` within 1.2x of the read floor, every size and dtype",
                f"worst {worst['ratio'][k]:.2f}x ({worst['n'] / 1e6:.1f}M {worst['dtype']})",
                not misses,
                f"over 1.2x: {cells}",
                "; ".join(why),
            )
    return out


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", dest="mode", const="quick", help="~2-3 minutes")
    g.add_argument(
        "--tiny", action="store_const", dest="mode", const="tiny", help="seconds; smoke test"
    )
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"), help="markdown report path")
    ap.add_argument("--models", default="MLP,GPT", help="comma-separated subset of MLP,GPT")
    ap.add_argument("--no-finite", action="store_true", help="skip the finite-check section")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    ap.add_argument(
        "--all-peers",
        action="store_true",
        help="--quick: compile every variant on the GPT too (adds ~1 min on 2 cores)",
    )
    ap.add_argument(
        "--finite-sizes",
        default="",
        help="comma-separated element counts of the finite-check trees, e.g. 1e6,5e7",
    )
    ap.add_argument(
        "--compute-dtype",
        default="float32",
        help="compute dtype of the models' matmuls (GPU half-precision check)",
    )
    ap.add_argument(
        "--no-undonated",
        action="store_true",
        help="skip the MLP steps without buffer donation",
    )
    ap.add_argument(
        "--half-speedup",
        action="store_true",
        help="also time the GPT step with float16/bfloat16 matmuls vs float32 (for GPUs)",
    )
    ap.add_argument(
        "--variants", default="", help="comma-separated name prefixes to keep (plain always kept)"
    )
    ap.add_argument(
        "--caching-allocator",
        choices=("auto", "off"),
        default="auto",
        help="auto (not with --tiny): rerun the MLP steps in a child process under jemalloc "
        "keeping freed memory, if libjemalloc is installed",
    )
    ap.add_argument("--json", default="", help="also write the step rows as JSON to this path")
    args = ap.parse_args(argv)
    args.mode = args.mode or "full"
    args.argv = list(argv if argv is not None else sys.argv[1:])
    cfg = dict(CONFIGS[args.mode])
    if args.finite_sizes:
        cfg["sizes"] = tuple(int(float(x)) for x in args.finite_sizes.split(","))
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    variants = dict(steps.VARIANTS)
    if args.variants:
        keep = [p.strip() for p in args.variants.split(",")]
        variants = {
            k: v
            for i, (k, v) in enumerate(variants.items())
            if i == 0 or any(k.startswith(p) for p in keep)
        }
    cd = jnp.dtype(args.compute_dtype)
    tiny = args.mode == "tiny"
    builders = {
        "MLP": (models.tiny_mlp if tiny else functools.partial(models.mlp, compute_dtype=cd)),
        "GPT": (models.tiny_gpt if tiny else functools.partial(models.gpt, compute_dtype=cd)),
    }
    step_results = []
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    quick_subset = cfg["gpt"] is not None and not args.all_peers

    def kept(vs: dict) -> dict:
        """--quick: plain, jamp's forms and jmp (standing for the select-based peers)."""
        if not quick_subset:
            return vs
        return {k: v for i, (k, v) in enumerate(vs.items()) if i == 0 or k in cfg["gpt"]}

    def add_rows(model: models.Model, rows: list[dict]) -> None:
        step_results.append((model, rows))
        for r in rows:
            log(
                f"    {r['name']:55s} {r['ms']:8.1f} ms  x{r['ratio']:.3f}"
                f"  cpu x{r['cpu_ratio']:.3f}"
            )

    def run_model(model: models.Model, vs: dict, donate: bool = True) -> None:
        add_rows(model, bench_steps(model, vs, cfg, log, donate=donate))

    for name in names:
        model = builders[name]()
        log(f"{model.describe}: {model.n_params / 1e6:.2f}M params, {model.n_leaves} leaves")
        run_model(model, kept(variants) if name == "GPT" else variants)
    if "MLP" in names and not args.no_undonated:
        # The same MLP steps with the state not donated (a jax.jit without
        # donate_argnums, as many training loops are written): XLA's choices flip.
        model = builders["MLP"]()
        model = dataclasses.replace(
            model,
            name="MLP-undonated",
            describe=model.describe + ", state **not** donated",
        )
        log(f"{model.describe}")
        vs = {k: v for k, v in variants.items() if "report_nonfinite" not in k}
        run_model(model, kept(vs), donate=False)
    if "MLP" in names and args.caching_allocator == "auto" and not tiny:
        rows = caching_allocator_rows(args, log)
        if rows:
            model = builders["MLP"]()
            model = dataclasses.replace(
                model,
                name="MLP-caching-allocator",
                describe=model.describe + ", under a caching allocator (jemalloc, freed memory "
                "kept)",
            )
            add_rows(model, rows)
    if args.half_speedup:
        base = builders["GPT"]() if tiny else models.gpt()
        half = {}
        for dt in ("float16", "bfloat16"):
            m = models.tiny_gpt() if tiny else models.gpt(compute_dtype=jnp.dtype(dt))
            m = dataclasses.replace(base, loss=m.loss)
            half[f"jamp.GradScaler.step, {dt} matmuls"] = functools.partial(
                lambda mm, _m: steps.jamp_grad_scaler(mm), m
            )
            half[f"plain, {dt} matmuls (no scaling)"] = functools.partial(
                lambda mm, _m: steps.plain(mm), m
            )
        variants_h = {"plain (f32 optax.adamw)": steps.plain, **half}
        log("half-precision GPT step speed-up")
        rows = bench_steps(base, variants_h, cfg, log)
        base = dataclasses.replace(
            base, name="GPT-half", describe=base.describe + ", float16/bfloat16 matmuls vs float32"
        )
        step_results.append((base, rows))
    torch_res = None
    if not args.no_torch:
        sizes = (16, 32, 10) if tiny else (784, 2048, 2048, 2048, 1024, 10)
        torch_res = bench_torch(sizes, 4 if tiny else 128, cfg["trounds"], cfg["per_round"])
        log(
            f"torch: {torch_res and [(r['name'], round(r['ratio'], 3)) for r in torch_res['rows']]}"
        )
    finite_res = []
    if not args.no_finite:
        finite_res = bench_finite(
            cfg["sizes"], (jnp.float32, jnp.float16, jnp.bfloat16), cfg["frounds"], log
        )
    if args.json:
        with open(args.json, "w") as fh:
            dump = [dict(model=m.name, rows=rows) for m, rows in step_results]
            json.dump(dump, fh, default=float)
    text = report(args, cfg, step_results, torch_res, finite_res, time.perf_counter() - t_start)
    with open(args.out, "w") as fh:
        fh.write(text)
    log(f"wrote {args.out}")
    return text


if __name__ == "__main__":
    main()
