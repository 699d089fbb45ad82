"""Smoke test of the float8 benchmark: the tiny MLP's error tables, both training curves and
the GPT's step-time table, in this process; no timing assertion."""

import re

import jax
import pytest

from benchmarks import cli, float8, report

VARIANTS = (
    "float32",
    "bfloat16",
    "float8 current",
    "float8 delayed",
    "float8 delayed, first step",
    "float8 delayed (unmeasured='current'), first step",
    "per-tensor reference",
)
MODES = ("float32", "bfloat16", "float8 current", "float8 delayed", "per-tensor reference")


def _run(*args):
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        return cli.main(["float8", "--tiny", *args])


def rows(text, name):
    return [line for line in text.splitlines() if line.startswith(f"| {name} |")]


@pytest.mark.standard_promotion  # optax's adam in the training curves
def test_tiny_run_reports_errors_curves_and_targets(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# jamp benchmark results\n\nearlier sections\n")
    # The MLP's error tables (the GPT's variants compile in test_tiny_step_time_table) and
    # the digits curves (the regression's are the same code on an MLP).
    out = _run("--models", "MLP", "--curves", "digits",
               "--out", str(tmp_path / "section.md"), "--results", str(results))  # fmt: skip
    section = (tmp_path / "section.md").read_text()
    assert section.strip() == out.strip()
    assert section.startswith("<!-- float8:start -->")
    assert section.rstrip().endswith("<!-- float8:end -->")
    models = re.findall(r"^### (MLP, inputs ~\S+|GPT .*)$", section, re.M)
    assert len(models) == 3
    for name in VARIANTS:  # output error, grad cosine [worst], loss error: one row per model
        found = rows(section, name)
        assert len(found) >= 3, name
        cells = [c.strip() for c in found[0].strip("|").split("|")]
        assert len(cells) == 4 and 0 <= float(cells[1]) and -1 <= float(cells[2].split()[0]) <= 1
    assert all("| 0.0000 | 1.00000 [1.0000] |" in line for line in rows(section, "float32")[:3])
    assert "### Training: digits CNN" in section and "### Training: regression" not in section
    for name in MODES:  # a curve per mode: losses at steps, final, ratio, test accuracy
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


def test_tiny_step_time_table(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("<!-- float8:start -->\nerrors\n<!-- float8:end -->\n")
    out = _run("--step-time", "--step-rounds", "1", "--step-reps", "1", "--results", str(results))
    # Its own section: the error section stays.
    text = results.read_text()
    assert "\nerrors\n" in text and text.count("<!-- float8-step-time:start -->") == 1
    assert "### GPT step time:" in text.split("<!-- float8-step-time:start -->")[1]
    assert "### GPT step time:" in out
    for name in ("bfloat16", "float8 current", "float8, attention in bfloat16", "float8 delayed",
                 "float8 delayed, unmeasured='current'"):  # fmt: skip
        assert len(rows(out, name)) == 1, name
    assert "float8 GEMMs in the compiled float8-current step:" in out
