"""Smoke test of the optimizer-memory benchmark (issue #33): the tiny GPT's memory and
convergence tables and the tiny optimizer step compiled for an H200, in this process; no
timing assertion."""

import jax
import pytest

from benchmarks import cli, optimizer_memory

REF = optimizer_memory.REF


def _run(*args):
    with jax.numpy_rank_promotion("allow"):
        return cli.main(["optimizer-memory", "--tiny", *args])


def rows(text, name):
    return [line for line in text.splitlines() if line.startswith(f"| {name} |")]


def cells(line):
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.standard_promotion  # optax's adamw
def test_tiny_run_reports_memory_convergence_and_targets(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# jamp benchmark results\n\nearlier sections\n")
    # Two of jamp's recipes train (compiling each takes seconds); the memory table has all.
    out = _run("--parts", "gpt", "--recipes", "exact,stochastic",
               "--out", str(tmp_path / "section.md"), "--results", str(results))  # fmt: skip
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


@pytest.mark.usefixtures("gpu_compiler")  # conftest: skips without jax's CUDA plugin
@pytest.mark.standard_promotion
def test_tiny_optimizer_step_on_the_gpu_compile():
    out = _run("--parts", "gpu-compile")
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
