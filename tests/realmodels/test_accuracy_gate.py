"""The real-model accuracy gate (issue #42 part 3): models written by others, held to the table.

transformers' Flax GPT-2, BERT and T5; Flax linen and NNX layers composed as users compose
them (LayerNorm with the fast variance, BatchNorm over an ``axis_name`` under ``vmap``,
causal attention, ``nn.RNN`` with GRU and LSTM cells, ``nnx.scan`` over layers, a Dense
into a LayerNorm of mean-8 features); Equinox's MLP, CNN and scanned GRU; optax's softmax
cross-entropy head over 50 draws. Each runs under ``jax.jit`` as float32, under
``jamp.autocast`` in bfloat16 and float16, and built with its own ``dtype=`` where it has
one, from the same parameters and batch (``measure.py`` defines the figures).

The gate holds jamp's variants (``measure.GATED``); the ``dtype=`` figures are the anchor the
table records beside them, written by the command line, not re-measured here.

A figure fails when it is worse than ``accuracy_table.json``'s gate (its column for the
running jax minor version, or the worst column for a jax the table lacks) by more than 10%
of it plus an absolute slack (1e-6 for the errors); improvements pass.
``python -m tests.realmodels.measure --write`` re-measures this jax version's column; the
table changes only in a commit that says why.
"""

import pytest
from realmodels import measure

pytestmark = pytest.mark.realmodels

TABLE = measure.load()


@pytest.mark.parametrize("name", measure.NAMES)
def test_no_figure_is_worse_than_the_table(name):
    measured = measure.measure(name, anchors=False)
    failures = measure.regressions(name, measured, TABLE, anchors=False)
    assert not failures, "\n".join(failures)


def test_the_table_has_a_row_for_each_model():
    assert list(TABLE["rows"]) == list(measure.NAMES)
    assert TABLE["tolerance"] == {"relative": measure.RELATIVE, "absolute": measure.ABSOLUTE}


def test_the_tolerance_fails_a_worse_figure_and_passes_a_better_one():
    def table(value, column="jax 0.10"):
        return {"rows": {"m": {"variants": {"v": {"grad_rel_err": {column: value}}}}}}

    def fails(value, gate, key="jax 0.10", column="jax 0.10"):
        measured = {"v": {"grad_rel_err": value}}
        return bool(measure.regressions("m", measured, table(gate, column), key))

    assert not fails(1.0999e-2, 1e-2) and fails(1.1002e-2, 1e-2)  # 10% of the gate
    assert not fails(1e-9, 1e-2)  # an improvement
    assert not fails(1.2e-6, 2e-7) and fails(1.3e-6, 2e-7)  # a tiny figure: 1e-6 of slack
    assert fails(float("nan"), 1e-2)
    # A jax version the table lacks is held to the worst column.
    assert not fails(1.1e-2, 1e-2, key="jax 0.99") and fails(1.2e-2, 1e-2, key="jax 0.99")
    columns = {"jax 0.10": 1.0, "jax 0.12": 2.0}
    two = {"rows": {"m": {"variants": {"v": {"grad_rel_err": columns}}}}}
    for key, passes in (("jax 0.10", False), ("jax 0.12", True), ("jax 0.99", True)):
        assert (not measure.regressions("m", {"v": {"grad_rel_err": 1.5}}, two, key)) is passes
    missing = measure.regressions("m", {"v": {"loss_rel_err": 1e-3}}, table(1e-2), "jax 0.10")
    assert missing and "not in the table" in missing[0]
    gone = measure.regressions("m", {}, table(1e-2), "jax 0.10")
    assert gone and "no longer measured" in gone[0]
    # The gate measures jamp's variants only: an anchor's figure is not asked for, jamp's is.
    anchor = {
        "rows": {
            "m": {
                "variants": {
                    "dtype= bfloat16": {"grad_rel_err": {"jax 0.10": 1.0}},
                    "autocast bfloat16": {"grad_rel_err": {"jax 0.10": 1.0}},
                }
            }
        }
    }
    gone = measure.regressions("m", {}, anchor, "jax 0.10", anchors=False)
    assert len(gone) == 1 and gone[0].startswith("m / autocast bfloat16 / grad_rel_err")


# The two regressions of issue #42 part 1, fixed: their targets.


def test_the_jitted_cross_entropy_head_is_never_negative():
    assert measure.figures(measure.CE_HEAD, "autocast bfloat16")["negative_losses"] == 0


def test_layernorm_of_mean8_features_is_as_accurate_as_flax_dtype():
    name = "dense_layernorm_mean8"
    ours = measure.figures(name, "autocast bfloat16")["grad_rel_err"]
    flax = measure.figures(name, "dtype= bfloat16")["grad_rel_err"]
    assert ours <= flax, (ours, flax)
