"""Smoke test of the autocast-memory benchmark: one tiny model, in this process; no timing
assertion."""

import re

import jax

from benchmarks import cli

VARIANTS = ("float32", "jamp.autocast bfloat16", "Flax dtype=bfloat16", "jmp policy bfloat16",
            "jamp.autocast float16", "Flax dtype=float16", "jmp policy float16")  # fmt: skip


def _run(*args):
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        return cli.main(["autocast-memory", "--tiny", *args])


def test_tiny_run_prints_every_variant_and_judges_the_targets(tmp_path):
    # One of the four models (the dropout block): the GPT's builder runs in
    # test_tiny_step_time_table; the GPU-compile rows are rendered from the programs of
    # tests/autocast/test_autocast_gpu_compile.py, which compiles the GPT, the CNN and
    # both attention blocks.
    models = ("Attention+dropout",)
    results = tmp_path / "RESULTS.md"
    results.write_text("# jamp benchmark results\n\nearlier sections\n")
    out = _run("--no-torch", "--no-gpu-compile", "--models", "Dropout",
               "--out", str(tmp_path / "section.md"), "--results", str(results))  # fmt: skip
    section = (tmp_path / "section.md").read_text()
    assert section.strip() == out.strip()
    assert section.startswith("<!-- autocast-memory:start -->")
    assert section.rstrip().endswith("<!-- autocast-memory:end -->")
    assert "- command: `python -m benchmarks autocast-memory --tiny`" in section
    for model in models:
        assert f"### {model}:" in section, model
    assert "### GPT:" not in section and "### CNN:" not in section
    residuals, gpu = section.split("### On the GPU compile")
    for name in VARIANTS:
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
    # replacing of an existing section tests/project/test_float8_bench.py runs).
    text = results.read_text()
    assert text.startswith("# jamp benchmark results\n\nearlier sections\n")
    assert text.count("<!-- autocast-memory:start -->") == 1


def test_tiny_step_time_table():
    out = _run("--step-time", "--step-rounds", "1", "--step-reps", "1")
    assert "### GPT step time:" in out
    for name in ("float32", "jamp.autocast bfloat16", "jamp.autocast float16",
                 "Flax dtype=bfloat16", "Flax dtype=float16"):  # fmt: skip
        assert sum(line.startswith(f"| {name} |") for line in out.splitlines()) == 1, name
