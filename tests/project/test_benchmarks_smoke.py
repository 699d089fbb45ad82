"""Smoke test of the benchmark entry point: tiny sizes, a few steps, no timed assertions."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]  # tests/<folder>/this file


def test_benchmarks_tiny_writes_every_table(tmp_path):
    out = tmp_path / "results.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # A fresh interpreter: the benchmark must not inherit the test session's
    # strict dtype promotion or its 8 virtual devices.
    # Less LLVM optimisation: compiles dominate a tiny run (timings are not checked).
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--tiny", "--no-torch", "--out", str(out)]
        + ["--json", str(tmp_path / "rows.json")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
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
