"""Smoke test of the real-models benchmark: flax NNX's built-in layers at tiny shapes.

In this process (no subprocess: the benchmark counts no compiles), under the standard
dtype promotion a user's program runs with: Flax's bfloat16 modules promote inside.
"""

import jax

from benchmarks import cli


def test_nnx_builtins_autocast_keeps_no_more_than_flax_dtype(tmp_path):
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
