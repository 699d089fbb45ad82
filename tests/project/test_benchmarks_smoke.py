"""Smoke test of the benchmark entry point: tiny sizes, a few steps, no timed assertions."""

import json
import pathlib
import subprocess

from _benchmark import ROOT, run_benchmark


def test_benchmarks_tiny_writes_every_table(tmp_path):
    out, rows = tmp_path / "results.md", tmp_path / "rows.json"
    args = ("--tiny", "--no-torch", "--out", str(out), "--json", str(rows))
    run_benchmark("benchmarks", *args, timeout=300)
    text = out.read_text()
    for heading in (
        "# jamp benchmark results",
        "## Training step: MLP",
        "### Compile, traces, transfers, HLO (MLP)",
        "state **not** donated",
        "## Training step: GPT",
        "### Compile, traces, transfers, HLO (GPT)",
        "## Finite check alone",
        "## Targets",
    ):
        assert heading in text, heading
    for row in (
        "| plain (f32 optax.adamw) |",
        "| jamp.loss_scaling |",
        "| jamp.loss_scaling(report_nonfinite=True) |",
        "| jamp.GradScaler.step |",
        "| jamp.loss_scaling(skip='select') |",
        "| jamp.GradScaler(skip='select').step |",
        "| jmp DynamicLossScale + select_tree |",
        "| flax DynamicScale + where |",
        "| optax.apply_if_finite (no scaling) |",
        "| jamp.all_finite |",
        "| jamp.unscale_and_check flag (scale 2^15) |",
        "| peers: all(isfinite) per leaf |",
    ):
        assert row in text, row
    assert "float32" in text and "float16" in text and "bfloat16" in text
    # The header says what ran where, read from JAX (JAX_PLATFORMS=cpu here), never assumed.
    assert "- ran on: JAX backend `cpu`" in text
    assert "ran on one device, `cpu:0`" in text
    assert "not run in this session" not in text
    assert "FINDINGS " not in text  # no section numbers: the report is part of the docs
    assert "| page faults per step |" in text
    # --json: the step rows of each section (what the caching-allocator child sends back).
    dump = json.loads((tmp_path / "rows.json").read_text())
    assert [d["model"] for d in dump] == ["MLP", "GPT", "MLP-undonated"]
    assert all({"name", "ratio", "faults", "hlo"} <= set(r) for d in dump for r in d["rows"])
    assert "candidate" not in text
    # Every jamp step traces once in 20 steps, with no host transfer.
    jamp_rows = [
        line for line in text.splitlines() if line.startswith("| jamp.") and "| ok / ok |" in line
    ]
    # 5 jamp steps on the MLP, 4 on the MLP without donation, 4 on the GPT
    assert len(jamp_rows) == 13, jamp_rows
    for line in jamp_rows:
        assert "| 1 | ok / ok |" in line, line


def _step_row(name, ratio, bytes_ratio=1.0):
    hlo = dict(temp_bytes=5e7, bytes_accessed=8e8 * bytes_ratio, fusions_total=90, conditionals=1)
    return dict(
        name=name, ms=10.0 * ratio, ratio=ratio, ratio_q1=ratio, ratio_q3=ratio, cpu_ratio=ratio,
        faults=1e4, steps=30, hlo=hlo, bytes_ratio=bytes_ratio, compile_wall=[0.5],
        compile_cpu=[0.5], compile_ratio=1.4, compile_cpu_ratio=1.4, traces=1,
        guard_first="ok", guard_steps="ok",
    )  # fmt: skip


def test_targets_print_this_runs_numbers_only():
    """Every number in the scorecard is a target constant or comes from the rows it is given."""
    import re
    import types

    from benchmarks import finite_checks, steps, targets

    names = list(steps.VARIANTS)  # plain first
    rows = [_step_row(n, 1.0 if i == 0 else 0.9 + 0.05 * i, 1.1) for i, n in enumerate(names)]
    model = types.SimpleNamespace(name="GPT", n_params=3_000_000)
    med = {k: 1e-3 for k in (*finite_checks.CHECKS, *finite_checks.READS)}
    finite = [
        dict(n=n, dtype=dt, med=med, ratio=dict.fromkeys(med, 1.5), ok={}, floor="read: max")
        for n in (1_000_000, 10_000_000)
        for dt in ("float32", "float16", "bfloat16")
    ]
    for backend in ("cpu", "gpu"):
        text = "\n".join(targets.table([(model, rows)], finite, 20, backend))
        assert "**no**" in text and "| yes |" in text
        assert not re.search(r"FINDINGS \d|~\d", text), text  # no section numbers, no estimates
        for limit in (targets.STEP_LIMIT["GPT"], targets.COMPILE_LIMIT, targets.FINITE_LIMIT):
            assert f"{limit}x" in text
    assert "XLA:CPU" in "\n".join(targets.table([(model, rows)], finite, 20, "cpu"))
    assert "XLA:CPU cannot" not in "\n".join(targets.table([(model, rows)], finite, 20, "gpu"))


def test_gpu_sh_parses_and_uses_only_real_flags():
    """benchmarks/gpu.sh is valid bash, and every flag it passes to a benchmark exists."""
    import re

    from benchmarks import autocast_memory, cli, float8

    script = pathlib.Path(ROOT, "benchmarks", "gpu.sh")
    subprocess.run(["bash", "-n", script], check=True)
    # Each benchmark module, the lines of gpu.sh that call it (its own flag arrays and
    # continuation lines included), and the flags it must see there.
    modules = {
        "cli": (cli, ("python",), {"--quick", "--tiny", "--half-speedup", "--variants"}),
        "float8": (float8, ("FLOAT8=", "benchmarks.float8"), {"--step-time", "--step-config"}),
        "autocast": (
            autocast_memory,
            ("AUTOCAST=", "benchmarks.autocast_memory"),
            {"--step-time", "--step-config"},
        ),
    }
    lines = {name: [] for name in modules}
    owner = "cli"
    for line in script.read_text().splitlines():
        if line.lstrip().startswith("#") or re.search(r"nvidia-smi|pytest|git |sed ", line):
            continue
        continued = owner != "cli" and lines[owner] and lines[owner][-1].rstrip().endswith("\\")
        if not continued:
            owner = next(
                (
                    n
                    for n, (_, keys, _) in modules.items()
                    if n != "cli" and any(k in line for k in keys)
                ),
                "cli",
            )
        lines[owner].append(line)

    def flags(text):
        return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", "\n".join(text)))

    for name, (module, _, expected) in modules.items():
        options = {s for a in module.parser()._actions for s in a.option_strings}
        found = flags(lines[name])
        assert expected <= found, (name, expected - found)
        assert found <= options, (name, found - options)
    assert "--all-peers" in flags(lines["cli"])


def test_no_lab_notebooks_in_the_tree():
    """Experiment scripts live in the history (benchmarks/FINDINGS.md cites each), not in HEAD."""

    assert not pathlib.Path(ROOT, "benchmarks", "experiments").exists()
