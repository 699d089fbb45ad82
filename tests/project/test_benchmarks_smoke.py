"""Smoke test of the loss-scaling benchmark and its report: a tiny MLP, a few steps, in this
process (``python -m benchmarks loss-scaling --tiny`` runs both models); no timed assertion."""

import pathlib
import re
import subprocess
import types

import jax
import pytest

from benchmarks import cli, finite_checks, loss_scaling, report

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.standard_promotion  # optax's adamw and the peers' steps
def test_loss_scaling_tiny_writes_every_table(tmp_path):
    out = tmp_path / "results.md"
    with jax.numpy_rank_promotion("allow"):
        text = cli.main(["loss-scaling", "--tiny", "--models", "MLP", "--no-torch",
                         "--finite-dtypes", "float32", "--out", str(out)])  # fmt: skip
    assert out.read_text() == text
    assert "- command: `python -m benchmarks loss-scaling --tiny --models MLP" in text
    for heading in (
        "# jamp benchmark results",
        "## Training step: MLP",
        "### Compile, traces, transfers, HLO (MLP)",
        "state **not** donated",
        "### Compile, traces, transfers, HLO (MLP-undonated)",
        "## PyTorch\n\ntorch is not importable here",  # --no-torch
        "## Finite check alone",
        "## Targets",
    ):
        assert heading in text, heading
    for name in loss_scaling.VARIANTS:
        assert f"| {name} |" in text, name
    for name in finite_checks.JAMP_CHECKS:
        assert f"| {name} | yes |" in text, name  # sound on every dtype measured
    assert "| check | sound | 0.0M float32 |" in text
    # The header says what ran where, read from JAX (JAX_PLATFORMS=cpu here), never assumed.
    assert "- ran on: JAX backend `cpu`" in text
    assert "ran on one device, `cpu:0`" in text
    assert "FINDINGS " not in text  # no section numbers: the report is part of the docs
    assert "| page faults per step |" in text
    # Every jamp step traces once in 20 steps, with no host transfer: 5 on the MLP, 4 on
    # the MLP without donation.
    jamp_rows = [
        line for line in text.splitlines() if line.startswith("| jamp.") and "| ok / ok |" in line
    ]
    assert len(jamp_rows) == 9, jamp_rows
    for line in jamp_rows:
        assert "| 1 | ok / ok |" in line, line
    targets = text.split("## Targets")[1]
    assert len(re.findall(r"\| (yes|\*\*no\*\*) \|", targets)) == 5 * 3 + 1 + 1 + 2


def test_the_loss_scaling_report_keeps_the_other_sections(tmp_path):
    out = tmp_path / "RESULTS.md"
    section = "<!-- float8:start -->\nfloat8 figures\n\n<!-- float8:end -->\n"
    out.write_text("# old report\n\n" + section)
    report.replace_head(str(out), "# new report\n")
    assert out.read_text() == "# new report\n\n" + section
    report.replace_head(str(tmp_path / "new.md"), "# report\n")
    assert (tmp_path / "new.md").read_text() == "# report\n"


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
    names = list(loss_scaling.VARIANTS)  # plain first
    rows = [_step_row(n, 1.0 if i == 0 else 0.9 + 0.05 * i, 1.1) for i, n in enumerate(names)]
    model = types.SimpleNamespace(name="GPT", n_params=3_000_000)
    med = {k: 1e-3 for k in (*finite_checks.CHECKS, *finite_checks.READS)}
    finite = [
        dict(n=n, dtype=dt, med=med, ratio=dict.fromkeys(med, 1.5), ok={}, floor="read: max")
        for n in (1_000_000, 10_000_000)
        for dt in ("float32", "float16", "bfloat16")
    ]

    def table(backend):
        return "\n".join(
            loss_scaling.targets([(model, rows)], 20, backend)
            + finite_checks.targets(finite, backend)
        )

    for backend in ("cpu", "gpu"):
        text = table(backend)
        assert "**no**" in text and "| yes |" in text
        assert not re.search(r"FINDINGS \d|~\d", text), text  # no section numbers, no estimates
        limits = (loss_scaling.STEP_LIMIT["GPT"], loss_scaling.COMPILE_LIMIT)
        for limit in (*limits, finite_checks.FINITE_LIMIT):
            assert f"{limit}x" in text
    assert "XLA:CPU" in table("cpu")
    assert "XLA:CPU cannot" not in table("gpu")


def _options(experiment):
    sub = next(a for a in cli.parser()._actions if a.dest == "experiment")
    return {s for a in sub.choices[experiment]._actions for s in a.option_strings}


def test_gpu_sh_parses_and_uses_only_real_flags():
    """benchmarks/gpu.sh is valid bash, and every flag it passes to an experiment exists."""
    script = pathlib.Path(ROOT, "benchmarks", "gpu.sh")
    subprocess.run(["bash", "-n", script], check=True)
    # Each experiment, the lines of gpu.sh that call it (its own flag arrays and
    # continuation lines included), and the flags it must see there.
    experiments = {
        "loss-scaling": (("MODE=", "benchmarks loss-scaling"),
                         {"--quick", "--tiny", "--finite-sizes", "--no-torch"}),
        "float8": (("FLOAT8=", "benchmarks float8"), {"--step-time", "--step-config"}),
        "autocast-memory": (("AUTOCAST=", "benchmarks autocast-memory"),
                            {"--step-time", "--step-config"}),
    }  # fmt: skip
    lines = {name: [] for name in experiments}
    owner = None
    for line in script.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if not (owner and lines[owner] and lines[owner][-1].rstrip().endswith("\\")):
            keys = {n: k for n, (k, _) in experiments.items()}
            owner = next((n for n, k in keys.items() if any(x in line for x in k)), None)
        if owner:
            lines[owner].append(line)

    def flags(text):
        return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", "\n".join(text)))

    for name, (_, expected) in experiments.items():
        found = flags(lines[name])
        assert expected <= found, (name, expected - found)
        assert found <= _options(name), (name, found - _options(name))


def test_no_lab_notebooks_in_the_tree():
    """Experiment scripts live in the history (benchmarks/FINDINGS.md cites each), not in HEAD."""

    assert not pathlib.Path(ROOT, "benchmarks", "experiments").exists()
