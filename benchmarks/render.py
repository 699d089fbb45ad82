"""The markdown report: a header that says what ran where, then one table per measurement."""

from __future__ import annotations

import collections
import datetime
import os
import platform
import statistics

import jax
import jax.numpy as jnp

from benchmarks import finite_checks


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
        f"- machine: {os.cpu_count()} CPUs (`nproc`), {cpu}",
        f"- load average at the end of the run: {load} (other processes share the cores)",
        f"- python {platform.python_version()}; " + ", ".join(vers),
    ]


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


def fmt(x: float, nd: int = 3) -> str:
    return "n/a" if x != x else f"{x:.{nd}f}"


def _step_table(rows: list[dict]) -> list[str]:
    L = [
        "| variant | median step (ms) | ratio to plain [q1, q3] | CPU-time ratio | "
        "page faults per step | steps |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        L.append(
            f"| {r['name']} | {r['ms']:.1f} | {fmt(r['ratio'])} [{fmt(r['ratio_q1'], 2)}, "
            f"{fmt(r['ratio_q3'], 2)}] | {fmt(r['cpu_ratio'])} | {r['faults']:.0f} | "
            f"{r['steps']} |"
        )
    L.append("")
    return L


def report(args, cfg, step_results, torch_res, finite_res, elapsed, scorecard) -> str:
    """The markdown report; ``scorecard`` is the targets table (``targets.table``)."""
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
    L.append(where_ran(bool(torch_res)))
    gpt_rows = [rows for model, rows in step_results if model.name == "GPT"]
    if cfg["gpt"] is not None and not args.all_peers and gpt_rows:
        ran = ", ".join(f"`{r['name']}`" for r in gpt_rows[0])
        L.append(
            f"- {args.mode}: the GPT runs only {ran} "
            "(`--all-peers` or a full run adds the other peers)."
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
                f"{fmt(r['compile_ratio'], 2)} / {fmt(r['compile_cpu_ratio'], 2)} | "
                f"{r['traces']} | "
                f"{r['guard_first']} / {r['guard_steps']} | {fmt(r['bytes_ratio'])} | "
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
            L.append(f"| {r['name']} | {r['ms']:.1f} | {fmt(r['ratio'])} |")
        L.append("")
    else:
        L.append("## PyTorch\n\ntorch is not importable here: row skipped.\n")

    if finite_res:
        L.append("## Finite check alone\n")
        L.append(
            "Each check maps a gradient-like tree (leaves of varied 2-D/1-D shapes) to one bool. "
            f"{cfg['frounds']} rounds, each in a shuffled order; per function one untimed call, "
            f"then {finite_res[0]['reps']} timed. Entries: median time in ms, and in parentheses "
            "the ratio to the floor, the fastest "
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
    L.extend(scorecard)
    L.append("")
    return "\n".join(L) + "\n"
