"""The scorecard: each target, what this run measured for it, and why a miss happens.

Every number the table prints is this run's, except the targets themselves, which are
the constants below. The reasons in the "why" column are the explanations worked out
in ``benchmarks/FINDINGS.md`` (HLO, bytes, profiles, on XLA:CPU); the numbers they
quote are again this run's. On another backend the CPU-specific reasons are left out.
"""

from __future__ import annotations

import statistics

from benchmarks import finite_checks
from benchmarks.render import fmt

# ------------------------------------------------------------------ targets (constants)

# A jamp step's time, ratio to the plain step of the same round.
STEP_LIMIT = {"MLP": 1.03, "MLP-undonated": 1.03, "MLP-caching-allocator": 1.03, "GPT": 1.02}
STEP_LIMIT_OTHER = 1.03
# A jamp step's compile time (CPU seconds), ratio to plain's.
COMPILE_LIMIT = 1.3
# A finite check's time, ratio to the fastest plain read of the same tree.
FINITE_LIMIT = 1.2
# Finite-check trees below this many elements: a call's fixed cost dominates.
SMALL_TREE = 2_000_000

# Names of the rows whose skip is a select over the state (jamp's select forms and peers).
SELECT_FORMS = ("select", "jmp ", "flax ")


# ------------------------------------------------------------------ why a target is missed


def _step_why(name: str, r: dict, plain: dict, by: dict, n_params: int, cpu: bool) -> str:
    """Why the jamp step ``name`` is over its time limit, with this run's numbers."""
    bytes_ = f"XLA bytes accessed {r['bytes_ratio']:.3f}x plain"
    temp = (
        f"temp memory {r['hlo']['temp_bytes'] / 1e6:.1f} MB vs plain's "
        f"{plain['hlo']['temp_bytes'] / 1e6:.1f} MB"
    )
    faults = (
        f"; on a CPU a step page-faults through its whole temp arena ({r['faults']:.0f} faults "
        f"per step vs plain's {plain['faults']:.0f})"
        if cpu
        else ""
    )
    if name == "jamp.loss_scaling":
        return (
            "Optax form: the updates are written at the `cond` boundary and re-read by "
            "`optax.apply_updates` (not fused into Adam's pass), plus the check's read of the "
            f"gradients; {bytes_}, {temp}{faults}"
        )
    if name == "jamp.loss_scaling(report_nonfinite=True)":
        base = by.get("jamp.loss_scaling")
        extra = (
            f" ({r['ms'] - base['ms']:+.2f} ms a step vs `jamp.loss_scaling` in this run)"
            if base
            else ""
        )
        return (
            "as `jamp.loss_scaling`, plus: the host callback in the skip branch makes JAX drop "
            "its C++ dispatch fast path for the whole executable (`pxla.create_cpp_call` returns "
            "None when `has_host_callbacks`): Python dispatch and runtime-token handling on "
            f"every step, clean or not{extra}"
        )
    if name == "jamp.GradScaler.step":
        extra = (r["hlo"]["bytes_accessed"] - plain["hlo"]["bytes_accessed"]) / 1e6
        return (
            f"one extra read of every gradient for the check ({bytes_}: {extra:+.1f} MB, where "
            f"the float32 gradients are {4 * n_params / 1e6:.1f} MB)"
            + (
                "; XLA:CPU cannot fuse it into the matmuls that produce them, and jamp reads "
                "them in its matrix kernels"
                if cpu
                else ""
            )
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


def _finite_why(k: str, misses: list[dict], cpu: bool) -> str:
    """Why the jamp check ``k`` is over ``FINITE_LIMIT`` on the trees in ``misses``."""
    if not cpu:
        return "no explanation recorded for this backend (`benchmarks/FINDINGS.md` is XLA:CPU's)"
    why = []

    def to_sum(r):  # the check's time over the float32-sum read's, on the same tree
        return r["med"][k] / r["med"]["read: sum f32"]

    f16 = [r for r in misses if r["dtype"] == "float16"]
    if f16:
        w = max(f16, key=lambda r: r["ratio"][k])
        why.append(
            "no native float16 arithmetic on this CPU: jamp checks float16 leaves with a uint8 "
            f"max of their non-finite flags (no conversion; {to_sum(w):.2f}x the time of the "
            "float32-sum read); the floor is a float16 `max`, which is no sound check (drops NaN)"
        )
    small = [r for r in misses if r["n"] < SMALL_TREE and r["dtype"] != "float16"]
    if small:
        cells = ", ".join(f"{_m(r['n'])} {r['dtype']} {r['med'][k] * 1e3:.2f} ms" for r in small)
        why.append(
            f"small trees ({cells} a call): dispatch and the per-leaf reductions' fixed cost "
            "dominate"
        )
    large = [r for r in misses if r["n"] >= SMALL_TREE]
    f32 = [r for r in large if r["dtype"] == "float32"]
    if f32:
        w = max(f32, key=to_sum)
        why.append(
            "float32: on a CPU jamp reduces large float32 leaves to row sums by a matrix-vector "
            f"product, which ran at up to {to_sum(w):.2f}x a plain float32 sum in this table "
            "(the other checks' temporaries evict the tree between calls), and faster than the "
            "tiled sums XLA:CPU compiles inside a training step"
        )
    bf16 = [r for r in large if r["dtype"] == "bfloat16"]
    if bf16:
        w = max(bf16, key=to_sum)
        why.append(
            "bfloat16: jamp sums bfloat16 leaves in float32, the same reduction as "
            f"`read: sum f32`, and ran at up to {to_sum(w):.2f}x of it here"
        )
    return "; ".join(why)


# ------------------------------------------------------------------ the table


def _m(n: int) -> str:
    """An element count in millions."""
    return f"{n / 1e6:.1f}M"


def _judge(ratio: float, limit: float, best_peer: float) -> tuple[bool, bool, str]:
    """Whether a step ratio is over ``limit``, not ahead of the best peer, and by how much."""
    over, behind = ratio > limit, ratio >= best_peer
    miss = "; ".join(
        ([f"+{ratio - limit:.3f} over {limit}x"] if over else [])
        + ([f"{ratio - best_peer:+.3f} vs best peer"] if behind else [])
    )
    return over, behind, miss


def table(step_results, finite_res, guard: int, backend: str = "cpu") -> list[str]:
    """The targets table's markdown lines, judged from this run's rows."""
    cpu = backend == "cpu"
    out = [
        "| target | measured | met | miss by | why (when missed) |",
        "| --- | --- | --- | --- | --- |",
    ]

    def row(target, measured, met, miss="", why=""):
        out.append(
            f"| {target} | {measured} | {'yes' if met else '**no**'} | "
            f"{'' if met else miss} | {'' if met else why} |"
        )

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
        for name in [] if undonated or same_programs else jamps:
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
    for k in finite_checks.JAMP_CHECKS if finite_res else ():
        worst = max(finite_res, key=lambda r: r["ratio"][k])
        misses = [r for r in finite_res if r["ratio"][k] > FINITE_LIMIT]
        cells = ", ".join(f"{_m(r['n'])} {r['dtype']} {r['ratio'][k]:.2f}x" for r in misses)
        row(
            f"finite check `{k}` within {FINITE_LIMIT}x of the read floor, every size and dtype",
            f"worst {worst['ratio'][k]:.2f}x ({_m(worst['n'])} {worst['dtype']})",
            not misses,
            f"over {FINITE_LIMIT}x: {cells}",
            _finite_why(k, misses, cpu),
        )
    return out
