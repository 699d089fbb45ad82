"""Loss scaling's cost per training step: each loss-scaled step against a plain one (a spoke).

Every variant runs in one process, interleaved round by round in a fresh seeded order;
each ratio is the median over rounds of the per-round ratio to the plain float32
``optax.adamw`` step, so load from other processes hits all variants alike. The report
(``--out``, the whole file) has the step tables, torch's ``GradScaler``, the finite-check
table (``finite_checks``, joined by the command line) and the targets, each judged from
this run's numbers with the reason of a miss (``FINDINGS.md``'s, on XLA:CPU).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import models, steps, timing
from benchmarks.report import fmt, header, replace_head, target_row

HERE = os.path.dirname(os.path.abspath(__file__))

# The rows of the step tables, plain first. The Optax form and GradScaler pin the
# skip to "cond" (what "auto" picks on a CPU), so a row runs the same form everywhere.
VARIANTS: dict[str, Callable] = {
    "plain (f32 optax.adamw)": steps.plain,
    "jamp.loss_scaling": functools.partial(steps.loss_scaling, skip="cond"),
    "jamp.loss_scaling(report_nonfinite=True)": functools.partial(
        steps.loss_scaling, skip="cond", report_nonfinite=True
    ),
    "jamp.loss_scaling(skip='select')": functools.partial(steps.loss_scaling, skip="select"),
    "jamp.GradScaler.step": functools.partial(steps.grad_scaler, skip="cond"),
    "jamp.GradScaler(skip='select').step": functools.partial(steps.grad_scaler, skip="select"),
    "jmp DynamicLossScale + select_tree": steps.jmp_dynamic,
    "flax DynamicScale + where": steps.flax_dynamic_scale,
    "optax.apply_if_finite (no scaling)": steps.apply_if_finite,
}

# rounds x per_round timed steps per variant; compile_reps compiles timed (the first also
# serves the runs); guard = steps run under the transfer guard (and counted for retraces)
# before timing; torch rounds.
CONFIGS = {
    "tiny": dict(rounds=3, per_round=1, compile_reps=1, guard=20, trounds=2),
    "quick": dict(rounds=6, per_round=2, compile_reps=1, guard=10, trounds=6),
    "full": dict(rounds=30, per_round=3, compile_reps=3, guard=20, trounds=30),
}


# ------------------------------------------------------------------ targets (constants)

# A jamp step's time, ratio to the plain step of the same round.
STEP_LIMIT = {"MLP": 1.03, "MLP-undonated": 1.03, "GPT": 1.02}
STEP_LIMIT_OTHER = 1.03
# A jamp step's compile time (CPU seconds), ratio to plain's.
COMPILE_LIMIT = 1.3
# Names of the rows whose skip is a select over the state (jamp's select forms and peers).
SELECT_FORMS = ("select", "jmp ", "flax ")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_const", dest="mode", const="quick", help="~2-3 minutes")
    g.add_argument("--tiny", action="store_const", dest="mode", const="tiny", help="a smoke test")
    ap.set_defaults(mode="full")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"),
                    help="markdown report path (the whole file)")  # fmt: skip
    ap.add_argument("--models", default="MLP,GPT", help="comma-separated subset of MLP,GPT")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")


# ------------------------------------------------------------------ steps


def _temp_bytes(compiled: Any) -> float:
    """XLA's temporary allocation: allocated on every call, every branch's included."""
    try:
        return float(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # a backend without memory analysis
        return float("nan")


def hlo_stats(compiled: Any) -> dict[str, float]:
    """Fusions, conditionals, bytes accessed and temp memory of a compiled step."""
    text = compiled.as_text()
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {
        "fusions_total": len(re.findall(r"= [^\n]*? fusion\(", text)),
        "conditionals": len(re.findall(r" conditional\(", text)),
        "bytes_accessed": float(ca.get("bytes accessed", float("nan"))),
        "temp_bytes": _temp_bytes(compiled),
    }


class _Step:
    """A variant's step, jitted with its state donated (or not), the state, and its traces."""

    def __init__(self, builder: Callable, model: models.Model, donate: bool = True):
        self.state, self._step = builder(model)
        self.traces: list[int] = []
        self._donate = (0,) if donate else ()
        self.run = jax.jit(self._fresh(self.traces), donate_argnums=self._donate)

    def _fresh(self, counter: list) -> Callable:
        step = self._step

        def counted(state, batch):  # a new function object: no trace or compile cache hit
            counter.append(1)
            return step(state, batch)

        return counted

    def advance(self, batch) -> object:
        """One step: the state becomes the next."""
        self.state = self.run(self.state, batch)
        return self.state

    def compile_time(self, batch, reuse: bool) -> tuple[float, float, dict]:
        """Wall and CPU seconds of ``lower(...).compile()``: of ``self.run`` with ``reuse`` (its
        later calls reuse this trace: the one counted), else of a fresh jit (for repeats)."""
        j = self.run if reuse else jax.jit(self._fresh([]), donate_argnums=self._donate)
        c0, t0 = time.process_time(), time.perf_counter()
        compiled = j.lower(self.state, batch).compile()
        t1, c1 = time.perf_counter(), time.process_time()
        return t1 - t0, c1 - c0, hlo_stats(compiled)


def _guarded(f: _Step, batch, n: int) -> str:
    """Runs ``n`` steps under ``transfer_guard('disallow')``: ``ok``, or how a host transfer
    failed (and the steps run unguarded)."""
    try:
        with jax.transfer_guard("disallow"):
            for _ in range(n):
                f.advance(batch)
            jax.block_until_ready(f.state)
        return "ok"
    except Exception as e:  # a host value copied in
        for _ in range(n):
            f.advance(batch)
        return "fails: " + str(e).splitlines()[0][:60]


def bench_steps(
    model: models.Model, variants: dict[str, Callable], cfg: dict, log, donate: bool = True
) -> list[dict]:
    jitted = {name: _Step(b, model, donate) for name, b in variants.items()}
    rows = {name: dict(name=name, compile_wall=[], compile_cpu=[]) for name in jitted}
    for rep in range(cfg["compile_reps"]):
        for name, f in jitted.items():
            w, c, rows[name]["hlo"] = f.compile_time(model.batch, reuse=rep == 0)
            rows[name]["compile_wall"].append(w)
            rows[name]["compile_cpu"].append(c)
    for name, f in jitted.items():
        # One trace came from lowering for the compile timing; the calls reuse it
        # unless the state's types change between steps (a retrace).
        first, rest = _guarded(f, model.batch, 1), _guarded(f, model.batch, cfg["guard"] - 1)
        rows[name].update(traces=len(f.traces), guard_first=first, guard_steps=rest)
    log(f"  {model.name}: compiled and warmed {len(jitted)} variants")
    runners = {k: timing.Runner(lambda f=f: f.advance(model.batch)) for k, f in jitted.items()}
    with jax.transfer_guard("disallow"):
        timing.interleave(runners, cfg["rounds"], cfg["per_round"])
    b, p, k = runners[next(iter(runners))], rows[next(iter(rows))], cfg["per_round"]
    for name, r in runners.items():
        row, med = rows[name], statistics.median
        row["ratio"], row["ratio_q1"], row["ratio_q3"] = timing.ratio_stats(r.times, b.times, k)
        row.update(ms=timing.median(r.times) * 1e3, faults=timing.median(r.faults),
                   cpu_ratio=timing.ratio_stats(r.cpu, b.cpu, k)[0], steps=len(r.times),
                   compile_ratio=med(row["compile_wall"]) / med(p["compile_wall"]),
                   compile_cpu_ratio=med(row["compile_cpu"]) / med(p["compile_cpu"]))  # fmt: skip
        row["bytes_ratio"] = row["hlo"]["bytes_accessed"] / p["hlo"]["bytes_accessed"]
    return list(rows.values())


def bench_torch(sizes, batch: int, rounds: int, per_round: int) -> dict | None:
    """torch's ``GradScaler`` step against a plain AdamW step on the MLP, or None."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    x, y = torch.randn(batch, sizes[0]), torch.randint(0, sizes[-1], (batch,))
    lossf = torch.nn.CrossEntropyLoss()
    net_p, net_s = models.torch_mlp(sizes), models.torch_mlp(sizes)
    opt_p, opt_s = (torch.optim.AdamW(n.parameters(), lr=1e-3) for n in (net_p, net_s))
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
    # XLA:CPU flushes subnormals to zero; torch does not by default, and after
    # ~50 steps on one batch its GradScaler step ran 4x slower on subnormal
    # arithmetic (FINDINGS 8). Flush in torch too, so both sides compute alike.
    torch.set_flush_denormal(True)
    try:
        for f in (plain, plain, scaled, scaled):  # warm up
            f()
        times = timing.time_calls(fns, (), rounds, reps=per_round)
    finally:
        torch.set_flush_denormal(False)  # torch's default
    rows = [dict(name=k, ms=timing.median(v) * 1e3, ratio=timing.ratio_stats(
        v, times["torch plain (AdamW)"], per_round)[0]) for k, v in times.items()]  # fmt: skip
    return {"version": torch.__version__, "rows": rows}


# ------------------------------------------------------------------ report


def where_ran(torch_ran: bool) -> str:
    """What ran where, read from JAX at the end of the run (never assumed)."""
    devices = jax.devices()
    kinds = collections.Counter(d.device_kind for d in devices)
    used = sorted(jnp.zeros(()).devices(), key=lambda d: d.id)[0]  # where jit puts a step
    version = getattr(used.client, "platform_version", "") or ""
    version = f", {version}" if version and version != used.platform else ""
    line = (
        f"- ran on: JAX backend `{jax.default_backend()}`{version}; {len(devices)} "
        f"device{'' if len(devices) == 1 else 's'} ("
        + ", ".join(f"{n} x {k}" for k, n in kinds.items())
        + f"); every JAX step and check ran on one device, `{used.platform}:{used.id}`"
        + ("" if used.device_kind == used.platform else f" ({used.device_kind})")
    )
    if torch_ran:
        line += "; the PyTorch rows ran on the host CPU"
    if jax.default_backend() == "cpu":
        line += " (no GPU here: `benchmarks/gpu.sh` runs this suite on one)"
    return line + "."


def report(args, cfg, step_results, torch_res, finite_lines, elapsed, scorecard) -> str:
    """The markdown report; ``scorecard`` is the targets table's rows (:func:`targets`)."""
    packages = ("jamp", "jax", "jaxlib", "optax", "flax", "jmp", "numpy")
    L = [
        "# jamp benchmark results\n",
        *header(" ".join(["python -m benchmarks", *args.argv]), elapsed, packages),
        f"- settings: {args.mode}: {cfg['rounds']} rounds x {cfg['per_round']} steps per variant, "
        "variants interleaved (a fresh seeded shuffle of the order every round), state donated "
        "(`donate_argnums`) except in the MLP section marked **not** donated, every step "
        "`block_until_ready`; timed steps run under `jax.transfer_guard('disallow')`.",
        "- ratio = median over rounds of (median step time of the variant in that round / "
        "median plain step time in that round); [q1, q3] its quartiles over rounds; CPU ratio is "
        "the same with process CPU time (all threads), which is less sensitive to other "
        "processes taking the cores.",
        where_ran(bool(torch_res)),
        "- the experiments and the HLO reading behind jamp's check and skip are in "
        "`benchmarks/FINDINGS.md`.\n",
    ]
    for model, rows in step_results:
        L += [
            f"## Training step: {model.describe}\n",
            f"{model.n_params / 1e6:.2f}M parameters in {model.n_leaves} leaves, "
            "`optax.adamw(1e-3)`, float32 parameters and compute (the loss-scaling overhead is "
            "what is measured).\n",
            "| variant | median step (ms) | ratio to plain [q1, q3] | CPU-time ratio | "
            "page faults per step | steps |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        L += [
            f"| {r['name']} | {r['ms']:.1f} | {fmt(r['ratio'])} [{fmt(r['ratio_q1'], 2)}, "
            f"{fmt(r['ratio_q3'], 2)}] | {fmt(r['cpu_ratio'])} | {r['faults']:.0f} | "
            f"{r['steps']} |"
            for r in rows
        ]
        L += [
            "",
            f"### Compile, traces, transfers, HLO ({model.name})\n",
            "| variant | compile (s) | compile ratio (wall / CPU) | "
            f"traces in {cfg['guard']} steps | "
            f"transfer guard: first call / steps 2-{cfg['guard']} | XLA bytes accessed ratio | "
            "temp memory (MB) | fusions | conditionals |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
        ]
        L += [
            f"| {r['name']} | {statistics.median(r['compile_wall']):.2f} | "
            f"{fmt(r['compile_ratio'], 2)} / {fmt(r['compile_cpu_ratio'], 2)} | {r['traces']} | "
            f"{r['guard_first']} / {r['guard_steps']} | {fmt(r['bytes_ratio'])} | "
            f"{r['hlo']['temp_bytes'] / 1e6:.1f} | {r['hlo']['fusions_total']} | "
            f"{r['hlo']['conditionals']} |"
            for r in rows
        ]
        L.append("")
    if torch_res:
        L += [
            f"## PyTorch {torch_res['version']} (same MLP, AdamW, CPU, float32, subnormals "
            "flushed to zero as XLA:CPU does)\n",
            "| variant | median step (ms) | ratio to torch plain |",
            "| --- | ---: | ---: |",
            *(f"| {r['name']} | {r['ms']:.1f} | {fmt(r['ratio'])} |" for r in torch_res["rows"]),
            "",
        ]
    else:
        L.append("## PyTorch\n\ntorch is not importable here: row skipped.\n")
    head = "| target | measured | met | miss by | why (when missed) |"
    L += [*finite_lines, "## Targets\n", head, "| --- | --- | --- | --- | --- |", *scorecard, ""]
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------ targets


def _step_why(name: str, r: dict, plain: dict, by: dict, n_params: int, cpu: bool) -> str:
    """Why the jamp step ``name`` is over its time limit, with this run's numbers."""
    bytes_ = f"XLA bytes accessed {r['bytes_ratio']:.3f}x plain"
    temp = (f"temp memory {r['hlo']['temp_bytes'] / 1e6:.1f} MB vs plain's "
            f"{plain['hlo']['temp_bytes'] / 1e6:.1f} MB")  # fmt: skip
    faults = (f"; on a CPU a step page-faults through its whole temp arena ({r['faults']:.0f} "
              f"faults per step vs plain's {plain['faults']:.0f})") if cpu else ""  # fmt: skip
    if name == "jamp.loss_scaling":
        return (
            "Optax form: the updates are written at the `cond` boundary and re-read by "
            "`optax.apply_updates` (not fused into Adam's pass), plus the check's read of the "
            f"gradients; {bytes_}, {temp}{faults}"
        )
    if name == "jamp.loss_scaling(report_nonfinite=True)":
        base = by.get("jamp.loss_scaling")
        extra = base and (f" ({r['ms'] - base['ms']:+.2f} ms a step vs `jamp.loss_scaling` "
                          "in this run)")  # fmt: skip
        return (
            "as `jamp.loss_scaling`, plus: the host callback in the skip branch makes JAX drop "
            "its C++ dispatch fast path for the whole executable (`pxla.create_cpp_call` returns "
            "None when `has_host_callbacks`): Python dispatch and runtime-token handling on "
            f"every step, clean or not{extra or ''}"
        )
    if name == "jamp.GradScaler.step":
        extra = (r["hlo"]["bytes_accessed"] - plain["hlo"]["bytes_accessed"]) / 1e6
        cpu_why = ("; XLA:CPU cannot fuse it into the matmuls that produce them, and jamp reads "
                   "them in its matrix kernels") if cpu else ""  # fmt: skip
        return (
            f"one extra read of every gradient for the check ({bytes_}: {extra:+.1f} MB, where "
            f"the float32 gradients are {4 * n_params / 1e6:.1f} MB){cpu_why}"
        )
    if name == "jamp.loss_scaling(skip='select')":
        return (
            "`select` with a donated state: XLA fuses the moment update into the parameter "
            "fusion, which reads the old moments after the in-place moment fusion overwrote "
            f"them, so it copies every moment first ({temp}); `cond` is the fast form here"
        )
    if name == "jamp.GradScaler(skip='select').step":
        return (
            "`select` with a donated state: XLA copies every moment before its in-place update "
            f"({temp}); `cond` (`jamp.GradScaler.step`) is the fast form here"
        )
    return ""


_PEER_FORM = {
    "optax.apply_if_finite": "the same Optax-form `cond` as `jamp.loss_scaling`, no loss scale",
    "jmp ": "the update computed, then `select_tree` with the old state",
    "flax ": "the update computed, then `jnp.where` with the old state",
}


def _peer_why(peer: dict, r: dict, rows: list[dict], cpu: bool) -> str:
    """Why the best peer is ahead of the jamp row ``r``."""
    form = next((v for k, v in _PEER_FORM.items() if peer["name"].startswith(k)), "")
    why = (
        f"the best peer, `{peer['name']}`{f' ({form})' if form else ''}, runs at "
        f"{peer['ratio']:.3f}x plain: XLA bytes accessed {peer['bytes_ratio']:.3f}x plain vs "
        f"jamp's {r['bytes_ratio']:.3f}x"
    )
    select_peer = any(s in peer["name"] for s in SELECT_FORMS)
    if peer["ratio"] < 1 <= peer["bytes_ratio"] and select_peer:
        selects = [x["ratio"] for x in rows if any(s in x["name"] for s in SELECT_FORMS)]
        why += (
            "; faster than plain with no fewer bytes, so not from less work (the `select`-based "
            f"rows here run at {min(selects):.3f}-{max(selects):.3f}x plain)"
        )
        if cpu:
            why += (
                "; on a CPU this follows where XLA places the backward pass's temporaries "
                "(per-kernel profile in `benchmarks/FINDINGS.md`)"
            )
    return why


def _compile_why(name: str, r: dict, plain: dict, cpu: bool) -> str:
    n = len(plain["compile_wall"])
    why = (
        f"{r['hlo']['fusions_total']} fusions vs plain's {plain['hlo']['fusions_total']}: the "
        "check adds a few (a product per large leaf, which compiles to none; one reduction over "
        "every small leaf and row; `max|x|` per large leaf in its exact branch), the skip the "
        "rest (in the Optax form `optax.apply_updates` is a kernel per leaf of its own, outside "
        f"the `cond`); plain compiles in {statistics.median(plain['compile_wall']):.2f} s "
        f"(median of {n} compile{'' if n == 1 else 's'} per variant{', noisy' if n == 1 else ''})"
    )
    if cpu:
        why = "XLA:CPU's compile time is mostly per-kernel code generation, " + why
    if "report" in name:
        why += "; the skip branch also holds `log_nonfinite`'s per-leaf counts"
    return why


def _judge(ratio: float, limit: float, best_peer: float) -> tuple[bool, bool, str]:
    """Whether a step ratio is over ``limit``, not ahead of the best peer, and by how much."""
    over, behind = ratio > limit, ratio >= best_peer
    miss = "; ".join(
        ([f"+{ratio - limit:.3f} over {limit}x"] if over else [])
        + ([f"{ratio - best_peer:+.3f} vs best peer"] if behind else [])
    )
    return over, behind, miss


def targets(step_results, guard: int, backend: str = "cpu") -> list[str]:
    """The targets table's rows for the steps, judged from this run's rows."""
    cpu = backend == "cpu"
    out = []

    def row(*cells):
        out.append(target_row(*cells))

    for model, rows in step_results:
        undonated = model.name.endswith("-undonated")
        by = {r["name"]: r for r in rows}
        plain = rows[0]
        peers = [r for r in rows if not r["name"].startswith(("plain", "jamp"))]
        best_peer = min((r["ratio"] for r in peers), default=float("nan"))
        bp = min(peers, key=lambda p: p["ratio"]) if peers else None
        peers_measured = (
            f"best peer {fmt(best_peer)}x, {len(peers)} peer{'' if len(peers) == 1 else 's'}"
            if peers
            else "no peer measured"
        )
        jamps = [n for n in by if n.startswith("jamp")]
        L = STEP_LIMIT.get(model.name, STEP_LIMIT_OTHER)
        for name in [] if undonated else jamps:
            r = by[name]
            over, behind, miss = _judge(r["ratio"], L, best_peer)
            why = ([_step_why(name, r, plain, by, model.n_params, cpu)] if over else []) + (
                [_peer_why(bp, r, rows, cpu)] if behind and bp is not None else []
            )
            row(
                f"{model.name}: {name} <= {L}x plain and ahead of every peer measured "
                f"({peers_measured})",
                f"{fmt(r['ratio'])}x (CPU {fmt(r['cpu_ratio'])}x)",
                not over and not behind,
                miss,
                "; ".join(w for w in why if w),
            )
        forms = [by[n] for n in jamps if "report" not in n]
        if forms:
            best = min(forms, key=lambda r: r["ratio"])
            over, behind, miss = _judge(best["ratio"], L, best_peer)
            row(
                f"{model.name}: jamp's fastest form <= {L}x plain and ahead of every peer "
                f"({peers_measured})",
                f"`{best['name']}` {fmt(best['ratio'])}x (CPU {fmt(best['cpu_ratio'])}x)",
                not over and not behind,
                miss,
                (
                    f"without donation: XLA bytes accessed {best['bytes_ratio']:.3f}x plain (the "
                    "check's read of the gradients, and the select's pass over the state)"
                    if undonated
                    else "see the row of that form above"
                ),
            )
        for name in [] if undonated else jamps:
            r = by[name]
            row(
                f"{model.name}: {name} compile <= {COMPILE_LIMIT}x plain",
                f"{fmt(r['compile_ratio'], 2)}x wall, {fmt(r['compile_cpu_ratio'], 2)}x CPU",
                r["compile_cpu_ratio"] <= COMPILE_LIMIT,
                f"+{r['compile_cpu_ratio'] - COMPILE_LIMIT:.2f}x (CPU)",
                _compile_why(name, r, plain, cpu),
            )
            ok = r["traces"] == 1 and r["guard_first"] == "ok" and r["guard_steps"] == "ok"
            row(
                f"{model.name}: {name} 1 trace in {guard} steps, 0 host transfers",
                f"{r['traces']} trace(s), guard {r['guard_first']}/{r['guard_steps']}",
                ok,
                "retrace or transfer",
                "",
            )
    return out


# ------------------------------------------------------------------ the run


def run(args: argparse.Namespace, log: Callable[[str], None], finite=None) -> str:
    """Times the steps (and torch's), writes the report to ``--out`` and returns it;
    ``finite()``, run last, gives the finite-check section's lines and its targets' rows."""
    cfg, t_start, tiny = CONFIGS[args.mode], time.perf_counter(), args.mode == "tiny"
    stamp = log
    log = lambda msg: stamp(f"[{time.perf_counter() - t_start:6.1f}s] {msg}")  # noqa: E731
    mlp, gpt = models.mlp, models.gpt
    if tiny:
        mlp, gpt = lambda: models.mlp((16, 32, 10), 4), lambda: models.gpt(64, 16, 1, 2, 8, 2)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    runs = [({"MLP": mlp, "GPT": gpt}[name](), VARIANTS, True) for name in names]
    if "MLP" in names:
        # The same MLP steps with the state not donated (a jax.jit without
        # donate_argnums, as many training loops are written): XLA's choices flip.
        model = mlp()
        describe = model.describe + ", state **not** donated"
        model = dataclasses.replace(model, name="MLP-undonated", describe=describe)
        kept = {k: v for k, v in VARIANTS.items() if "report_nonfinite" not in k}
        runs.append((model, kept, False))
    step_results = []
    for model, variants, donate in runs:
        log(f"{model.describe}: {model.n_params / 1e6:.2f}M params, {model.n_leaves} leaves")
        step_results.append((model, bench_steps(model, variants, cfg, log, donate=donate)))
        for r in step_results[-1][1]:
            log(
                f"    {r['name']:55s} {r['ms']:8.1f} ms x{r['ratio']:.3f} cpu x{r['cpu_ratio']:.3f}"
            )
    torch_res = None
    if not args.no_torch:
        sizes = (16, 32, 10) if tiny else (784, 2048, 2048, 2048, 1024, 10)
        torch_res = bench_torch(sizes, 4 if tiny else 128, cfg["trounds"], cfg["per_round"])
        log(
            f"torch: {torch_res and [(r['name'], round(r['ratio'], 3)) for r in torch_res['rows']]}"
        )
    finite_lines, finite_targets = ((), ()) if finite is None else finite(log)
    scorecard = targets(step_results, cfg["guard"], jax.default_backend()) + list(finite_targets)
    elapsed = time.perf_counter() - t_start
    text = report(args, cfg, step_results, torch_res, list(finite_lines), elapsed, scorecard)
    replace_head(args.out, text)  # the other experiments' sections are kept
    log(f"wrote {args.out}")
    return text
