"""The scorecard: each target, what this run measured for it, and why a miss happens."""

from __future__ import annotations

import statistics

from benchmarks import finite_checks
from benchmarks.render import fmt

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


def table(step_results, finite_res, guard: int) -> list[str]:
    """The targets table's markdown lines, judged from this run's rows."""
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
                f"{fmt(best_peer)}x, {len(peers)} peer{'' if len(peers) == 1 else 's'})",
                f"{fmt(r['ratio'])}x (CPU {fmt(r['cpu_ratio'])}x)",
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
                f"(best peer {fmt(best_peer)}x)",
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
            kind = "compile:report" if "report" in name else "compile"
            why = _WHY["compile"] + (
                "; " + _WHY["compile:report"] if kind == "compile:report" else ""
            )
            row(
                f"{model.name}: {name} compile <= 1.3x plain",
                f"{fmt(r['compile_ratio'], 2)}x wall, {fmt(r['compile_cpu_ratio'], 2)}x CPU",
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
