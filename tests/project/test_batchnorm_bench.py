"""The batchnorm spoke (issue #35's ResNet question) runs and reports what it measured;
``python -m benchmarks batchnorm`` writes the figures in benchmarks/RESULTS.md."""

import re

import numpy as np
import pytest

from benchmarks import batchnorm, cli


@pytest.mark.standard_promotion  # Flax's BatchNorm(dtype=bfloat16) promotes internally
def test_tiny_run_reports_each_initialisation_paired(tmp_path):
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
