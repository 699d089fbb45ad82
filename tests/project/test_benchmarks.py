"""Smoke tests of the benchmarks: each experiment run tiny in this process (one parametrised
test, ``test_tiny_run``, a case per experiment), the report's pieces, ``gpu.sh``'s flags; no
timing assertion. ``python -m benchmarks <experiment> --tiny`` runs the same.

In this process, not a subprocess (the benchmarks count no compiles here), under the dtype
promotion each case names: Flax's bfloat16 modules and optax's adam promote inside.
"""

import pathlib
import re
import subprocess
import types

import jax
import numpy as np
import pytest
from conftest import require_gpu_compiler

from benchmarks import (
    batchnorm,
    cli,
    collectives,
    finite_checks,
    float8,
    loss_scaling,
    optimizer_memory,
    report,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF = optimizer_memory.REF
AUTOCAST_VARIANTS = ("float32", "jamp.autocast bfloat16", "Flax dtype=bfloat16",
                     "jmp policy bfloat16", "jamp.autocast float16", "Flax dtype=float16",
                     "jmp policy float16")  # fmt: skip
FLOAT8_VARIANTS = (
    "float32",
    "bfloat16",
    "float8 current",
    "float8 delayed",
    "float8 delayed, first step",
    "float8 delayed (unmeasured='current'), first step",
    "per-tensor reference",
)
FLOAT8_MODES = ("float32", "bfloat16", "float8 current", "float8 delayed", "per-tensor reference")


def _standard(argv):
    """``cli.main(argv)`` under the standard promotion and rank promotion allowed."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        return cli.main(argv)


def _ranks(argv):
    """``cli.main(argv)`` with rank promotion allowed (the benchmarks' models broadcast)."""
    with jax.numpy_rank_promotion("allow"):
        return cli.main(argv)


def rows(text, name):
    return [line for line in text.splitlines() if line.startswith(f"| {name} |")]


def cells(line):
    return [c.strip() for c in line.strip("|").split("|")]


# ---------------------------------------------------------------- one case per experiment


def _loss_scaling(tmp_path):
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


def _autocast_memory(tmp_path):
    # One of the four models (the dropout block): see CASES.
    models = ("Attention+dropout",)
    results = tmp_path / "RESULTS.md"
    results.write_text("# jamp benchmark results\n\nearlier sections\n")
    out = _standard(["autocast-memory", "--tiny", "--no-torch", "--no-gpu-compile",
                     "--models", "Dropout", "--out", str(tmp_path / "section.md"),
                     "--results", str(results)])  # fmt: skip
    section = (tmp_path / "section.md").read_text()
    assert section.strip() == out.strip()
    assert section.startswith("<!-- autocast-memory:start -->")
    assert section.rstrip().endswith("<!-- autocast-memory:end -->")
    assert "- command: `python -m benchmarks autocast-memory --tiny`" in section
    for model in models:
        assert f"### {model}:" in section, model
    assert "### GPT:" not in section and "### CNN:" not in section
    residuals, gpu = section.split("### On the GPU compile")
    for name in AUTOCAST_VARIANTS:
        rows = [line for line in residuals.splitlines() if line.startswith(f"| {name} |")]
        assert len(rows) == len(models), name  # one per model
        for row in rows:  # residuals, ratio, temp, temp ratio, cosine, loss
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert len(cells) == 7 and float(cells[2]) > 0 and float(cells[4]) > 0, row
    float32_rows = [line for line in residuals.splitlines() if line.startswith("| float32 |")]
    assert all("| 1.000 |" in line for line in float32_rows)
    assert "Not measured here: left out (--no-gpu-compile)." in gpu
    # The targets the benchmark judges itself, with the ratios they compare.
    targets = section.split("### Targets (issues #17, #25)")[1]
    for model in models:
        for dtype in ("bfloat16", "float16"):
            start = f"| {model}: jamp.autocast {dtype} residual ratio <= Flax"
            line = next(t for t in targets.splitlines() if t.startswith(start))
            assert re.search(r"\| \d\.\d{3} vs \d\.\d{3} \| (yes|\*\*no\*\*) \|", line), line
            assert f"| {model}: jamp.autocast {dtype} gradient cosine >= 0.999 |" in targets
    # --results appended the section after what the file had (report.splice, whose
    # replacing of an existing section the float8 case runs).
    text = results.read_text()
    assert text.startswith("# jamp benchmark results\n\nearlier sections\n")
    assert text.count("<!-- autocast-memory:start -->") == 1


def _autocast_memory_step_time(tmp_path):
    del tmp_path
    out = _standard(["autocast-memory", "--tiny", "--step-time", "--step-rounds", "1",
                    "--step-reps", "1"])  # fmt: skip
    assert "### GPT step time:" in out
    for name in ("float32", "jamp.autocast bfloat16", "jamp.autocast float16",
                 "Flax dtype=bfloat16", "Flax dtype=float16"):  # fmt: skip
        assert sum(line.startswith(f"| {name} |") for line in out.splitlines()) == 1, name


def _float8(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# jamp benchmark results\n\nearlier sections\n")
    # The MLP's error tables (the GPT's variants compile in the float8-step-time case) and
    # the digits curves (the regression's are the same code on an MLP).
    out = _standard(["float8", "--tiny", "--models", "MLP", "--curves", "digits",
                     "--out", str(tmp_path / "section.md"), "--results", str(results)])  # fmt: skip
    section = (tmp_path / "section.md").read_text()
    assert section.strip() == out.strip()
    assert section.startswith("<!-- float8:start -->")
    assert section.rstrip().endswith("<!-- float8:end -->")
    models = re.findall(r"^### (MLP, inputs ~\S+|GPT .*)$", section, re.M)
    assert len(models) == 3
    for name in FLOAT8_VARIANTS:  # output error, grad cosine [worst], loss error: one row per model
        found = rows(section, name)
        assert len(found) >= 3, name
        cells = [c.strip() for c in found[0].strip("|").split("|")]
        assert len(cells) == 4 and 0 <= float(cells[1]) and -1 <= float(cells[2].split()[0]) <= 1
    assert all("| 0.0000 | 1.00000 [1.0000] |" in line for line in rows(section, "float32")[:3])
    assert "### Training: digits CNN" in section and "### Training: regression" not in section
    for name in FLOAT8_MODES:  # a curve per mode: losses at steps, final, ratio, test accuracy
        assert len(rows(section, name)) == 3 + 1, name
    targets = section.split("### Targets (issue #18)")[1]
    assert len(re.findall(r"\| (yes|\*\*no\*\*) \|", targets)) == 6
    text = results.read_text()
    assert text.startswith("# jamp benchmark results\n\nearlier sections\n")
    assert text.count("<!-- float8:start -->") == 1
    # Another run replaces the section instead of appending another.
    report.splice(str(results), "<!-- float8:start -->\nnew\n<!-- float8:end -->", float8.START,
                  float8.END)  # fmt: skip
    text = results.read_text()
    assert text.count("<!-- float8:start -->") == 1 and "### Training" not in text
    assert "\nnew\n" in text and "earlier sections" in text


def _float8_step_time(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("<!-- float8:start -->\nerrors\n<!-- float8:end -->\n")
    out = _standard(["float8", "--tiny", "--step-time", "--step-rounds", "1", "--step-reps", "1",
                     "--results", str(results)])  # fmt: skip
    # Its own section: the error section stays.
    text = results.read_text()
    assert "\nerrors\n" in text and text.count("<!-- float8-step-time:start -->") == 1
    assert "### GPT step time:" in text.split("<!-- float8-step-time:start -->")[1]
    assert "### GPT step time:" in out
    for name in ("bfloat16", "float8 current", "float8, attention in bfloat16", "float8 delayed",
                 "float8 delayed, unmeasured='current'"):  # fmt: skip
        assert len(rows(out, name)) == 1, name
    assert "float8 GEMMs in the compiled float8-current step:" in out


def _optimizer_memory(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# jamp benchmark results\n\nearlier sections\n")
    # Two of jamp's recipes train (compiling each takes seconds); the memory table has all.
    out = _ranks(["optimizer-memory", "--tiny", "--parts", "gpt", "--recipes",
                  "exact,stochastic", "--out", str(tmp_path / "section.md"),
                  "--results", str(results)])  # fmt: skip
    section = (tmp_path / "section.md").read_text()
    assert section.strip() == out.strip()
    assert section.startswith(optimizer_memory.START)
    assert section.rstrip().endswith(optimizer_memory.END)
    assert ("- command: `python -m benchmarks optimizer-memory --tiny --parts gpt --recipes "
            "exact,stochastic`") in section  # fmt: skip
    memory, rest = section.split("### GPT: character-level GPT")
    gpt, targets = rest.split("### Targets (issue #33)")
    chosen, left_out = optimizer_memory.recipes()
    assert not left_out and chosen == optimizer_memory.RECIPES  # jamp has issue #33's API
    for name in chosen:  # a row in the memory table
        assert len(rows(memory, name)) == 1, name
    trained = [k for k in chosen if k == REF or k.startswith(("exact", "stochastic"))]
    for name in [*trained, optimizer_memory.NOISE]:  # and in the GPT's, if trained
        assert len(rows(gpt, name)) == 1, name
    assert not rows(gpt, "kahan, bf16 moments") and not rows(gpt, "nearest, f32 moments")
    # adamw over float32 parameters: 4 + 4 + 4 bytes per parameter (the counters are noise)
    assert cells(rows(memory, REF)[0])[1:5] == ["4.00", "8.00", "12.00", "1.000"]
    assert cells(rows(memory, "optax adamw(mu_dtype=bf16)")[0])[1:4] == ["4.00", "6.00", "10.00"]
    # bf16 params, int16 low bits, float32 moments; bf16 params and moments (and counters)
    assert cells(rows(memory, "exact, f32 moments")[0])[1:4] == ["2.00", "10.00", "12.00"]
    assert cells(rows(memory, "stochastic, bf16 moments")[0])[1:4] == ["2.00", "4.00", "6.00"]
    assert "derived from the documented layout" in rows(memory, "TE FusedAdam, remainders + bf16 "
                                                         "moments")[0]  # fmt: skip
    ref = cells(rows(gpt, REF)[0])  # train, vs ref, validation, vs ref, max |Δ|, CPU s
    assert ref[2] == ref[4] == "+0.00%" and ref[5] == "0" and 0 < float(ref[1]) < 6
    for name in trained:  # every recipe trains: a finite loss near the reference's
        c = cells(rows(gpt, name)[0])
        assert abs(float(c[3]) - float(ref[3])) < 0.5, name
    exact = rows(targets, "exact: bit-identical to the reference (every step's loss)")
    assert len(exact) == 1 and "after the second step" in exact[0]
    # kahan and nearest were not trained: their targets say so
    kahan = rows(targets, "kahan, bf16 moments: train and validation loss within 0.5% of the "
                          "reference's")  # fmt: skip
    assert kahan[0].endswith("| not measured | **no** |  | left out (see above) |")
    assert sum(t.startswith("| ") for t in targets.splitlines()[4:]) == 5  # GPU compile left out
    assert "Not measured here: left out." in section
    text = results.read_text()
    assert text.startswith("# jamp benchmark results\n\nearlier sections\n")
    assert text.count(optimizer_memory.START) == 1


def _batchnorm(tmp_path):
    out = tmp_path / "section.md"
    text = cli.main(["batchnorm", "--tiny", "--models", "resnet18", "--out", str(out)])
    assert out.read_text() == text + "\n"
    assert text.startswith(batchnorm.START) and text.endswith(batchnorm.END)
    assert "`python -m benchmarks batchnorm --tiny --models resnet18" in text
    (row,) = [line for line in text.splitlines() if line.startswith("| resnet18 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "2"  # --tiny: two initialisations
    ours, flax = float(cells[2]), float(cells[3])
    assert 0.9 < ours <= 1 and 0.9 < flax <= 1
    diff = float(re.match(r"([+-][0-9.]+) ±", cells[4]).group(1))
    assert np.isclose(diff, ours - flax, atol=2e-5)


def _real_models(tmp_path):
    # lm1b's source comes from a checkout of flax's examples/, which the suite does not
    # have: the benchmark skips it and says why.
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n\nearlier sections\n")
    with jax.numpy_dtype_promotion("standard"):
        out = cli.main(["real-models", "--tiny", "--models", "nnx,lm1b", "--results", str(results)])
    assert out.startswith("<!-- real-models:start -->")
    assert out.rstrip().endswith("<!-- real-models:end -->")
    assert results.read_text().startswith("# results\n\nearlier sections\n\n<!-- real-models")
    assert "- lm1b: no `lm1b/models.py` under --flax-examples (not given)" in out
    row = next(line for line in out.splitlines() if line.startswith("| NNX built-ins |"))
    _, ours, flax, _, met = (c.strip() for c in row.strip("|").split("|")[1:])
    assert float(ours) <= float(flax) and met == "yes", row  # issue #25 section 2
    table = out.split("### NNX built-ins:")[1].split("Autocast keeps")[0]
    for variant in ("float32", "jamp.autocast bfloat16", "Flax dtype=bfloat16"):
        line = next(t for t in table.splitlines() if t.startswith(f"| {variant} |"))
        cosine = float(line.split("|")[4].split("[")[0])
        assert cosine > 0.999, line
    assert "Autocast's largest float32 residuals" in out


# The cases, and the marker of those that run optax's adam or Flax's bfloat16 BatchNorm
# (standard promotion inside: tests/conftest.py's `standard_promotion`).
STANDARD = pytest.mark.standard_promotion


def _debug_cost(tmp_path):
    # One model, tiny: the Equinox MLP (the others take seconds each).
    out = cli.main(["debug-cost", "--tiny", "--models", "eqx", "--dtypes", "bfloat16",
                    "--out", str(tmp_path / "section.md")])  # fmt: skip
    assert out.startswith("<!-- debug-cost:start -->")
    assert out.rstrip().endswith("<!-- debug-cost:end -->")
    assert (
        "- command: `python -m benchmarks debug-cost --tiny --models eqx --dtypes bfloat16`" in out
    )
    row = cells(rows(out, "Equinox nn.MLP")[0])
    assert len(row) == 5 and row[1].endswith(" s")
    assert "(exp, forward)" in row[3]  # the planted overflow, named
    assert all(re.search(r"\d s \(\d+\.\dx\)", c) for c in row[2:])


def test_debug_cost_runs_give_medians_and_each_run_s_own_ratio():
    """``--runs N``: each time's median, and the median of the runs' ratios (each tool
    against its own run's step), with their range; over the target is marked."""
    from benchmarks import debug_cost

    runs = [
        {"step": 1.0, "locate": 2.0, "bfloat16": 6.0, "site": "exp, forward", "describe": "m"},
        {"step": 2.0, "locate": 3.0, "bfloat16": 9.0, "site": "exp, forward", "describe": "m"},
        {"step": 1.5, "locate": 2.5, "bfloat16": 9.9, "site": "exp, forward", "describe": "m"},
    ]
    row = debug_cost._median_row(runs)
    assert (row["step"], row["locate"], row["bfloat16"]) == (1.5, 2.5, 9.0)
    assert row["ratios"]["locate"] == [2.0, 1.5, 2.5 / 1.5]
    cell = debug_cost._cell(row["locate"], row["step"], 0, row["ratios"]["locate"])
    assert cell == "2.50 s (1.7x; 1.5-2.0x)"
    cell = debug_cost._cell(row["bfloat16"], row["step"], 0, row["ratios"]["bfloat16"])
    assert cell == "9.00 s (6.0x; 4.5-6.6x) **over**"
    assert debug_cost._cell(2.0, 1.0, 0) == "2.00 s (2.0x)"


def _collectives(tmp_path):
    require_gpu_compiler()  # the 8-GPU compile: skips, or fails in CI, as the fixture does
    out = tmp_path / "section.md"
    text = cli.main(["collectives", "--tiny", "--out", str(out)])
    assert out.read_text() == text + "\n"
    assert text.startswith(collectives.START) and text.rstrip().endswith(collectives.END)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "GB" in line]
    assert len(rows) >= len(collectives.STEPS)
    assert rows[0].startswith("| float32 | all-gather f32 x")
    assert "all-gather f8e4m3fn" in text and "reduce_max" in text  # the amaxes, named


CASES = {
    "loss-scaling": (_loss_scaling, STANDARD),  # optax's adamw and the peers' steps
    # One of the four models (the dropout block): the GPT's builder runs in the step-time
    # case; the GPU-compile rows are rendered from the programs of
    # tests/autocast/test_autocast_gpu_compile.py, which compiles the GPT, the CNN and both
    # attention blocks.
    "autocast-memory": (_autocast_memory, ()),
    "autocast-memory-step-time": (_autocast_memory_step_time, ()),
    "float8": (_float8, STANDARD),  # optax's adam in the training curves
    "float8-step-time": (_float8_step_time, ()),
    "optimizer-memory": (_optimizer_memory, STANDARD),  # optax's adamw
    "batchnorm": (_batchnorm, STANDARD),  # Flax's BatchNorm(dtype=bfloat16) promotes inside
    "real-models": (_real_models, ()),
    "debug-cost": (_debug_cost, ()),
    "collectives": (_collectives, ()),  # the 8-GPU compile; optax's adamw promotes inside
}


@pytest.mark.parametrize(
    "run", [pytest.param(run, marks=marks, id=name) for name, (run, marks) in CASES.items()]
)
def test_tiny_run(run, tmp_path):
    run(tmp_path)


# ---------------------------------------------------------------- on the GPU compile


@pytest.mark.usefixtures("gpu_compiler")  # conftest: skips without jax's CUDA plugin
@pytest.mark.standard_promotion
def test_tiny_optimizer_step_on_the_gpu_compile():
    out = _ranks(["optimizer-memory", "--tiny", "--parts", "gpu-compile"])
    gpu = out.split("the optimizer step alone")[1]
    chosen, _ = optimizer_memory.recipes()
    for name in chosen:
        assert len(rows(gpu, name)) == 1, name
    # plain adamw reads p, g, m, v and writes p, m, v: 28 bytes per float32 parameter
    plain = cells(rows(gpu, REF)[0])
    assert plain[1] == "float32" and plain[3] == "28.00" and plain[4] == "1.0000"
    # bf16 params, grads and moments: p, g, m, v read and p, m, v written at 2 bytes each
    assert cells(rows(gpu, "stochastic, bf16 moments")[0])[1:5] == [
        "bfloat16", "0.5", "14.00", "0.5000"]  # fmt: skip
    assert "| GPU step: no recipe launches more kernels than plain adamw" in out


# ---------------------------------------------------------------- the pieces


def test_the_models_are_flax_imagenet_resnets():
    import jax
    import jax.numpy as jnp

    for key, blocks in (("resnet18", 8), ("resnet50", 16)):
        stages, block = batchnorm.MODELS[key]
        model = batchnorm.ResNet(stages, block, filters=4)
        x = jnp.zeros((2, 16, 16, 3))
        shapes = jax.eval_shape(
            jax.vmap(model.init, in_axes=(None, 0), axis_name="batch"),
            jax.random.key(0), x[None],
        )  # fmt: skip
        names = [n for n in shapes["params"] if n.startswith(("_Basic", "_Bottleneck"))]
        assert len(names) == blocks and sum(stages) == blocks


def test_every_section_starts_with_the_one_header():
    """The command, the date, ``git describe`` and the machine, written by ``report.header``
    alone: every experiment that writes a section calls it, and no other module writes a
    ``- command:`` line."""
    command, commit, machine, versions = report.header("python -m benchmarks x --tiny", 12.3)
    assert re.fullmatch(r"- command: `python -m benchmarks x --tiny`; date 20\S+; 12 s", command)
    assert re.fullmatch(r"- commit: `\S+`", commit) or commit == "- commit: `not a git checkout`"
    assert machine.startswith("- machine: ") and "CPUs (`nproc`)" in machine
    assert "JAX backend `cpu`" in machine and "load average" in machine
    assert versions.startswith("- python ") and f"jax {jax.__version__}" in versions
    writers = ("loss_scaling", "autocast_memory", "float8", "gpu_compile", "real_models",
               "optimizer_memory", "batchnorm")  # fmt: skip
    for path in sorted(pathlib.Path(ROOT, "benchmarks").rglob("*.py")):
        text = path.read_text()
        if path.stem in writers:
            assert "header(" in text, path
        if path.stem != "report":
            assert '"- command:' not in text and 'f"- command:' not in text, path


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
