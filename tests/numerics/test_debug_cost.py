"""``jamp.debug``'s cost on a real model (issue #44, 6): transformers' Flax GPT-2 under
float16 with a planted overflow in one MLP, located and reported by programs whose size
is the step's own, not the step's times a check per operation (which XLA compiled for
minutes). No timing is asserted: ``python -m benchmarks debug-cost`` measures the wall
times (docs/debugging-precision.md has them)."""

import re

import jax
import jax.numpy as jnp
import pytest
from _source import line_of as _line_of

import jamp
from jamp._src.numerics import report as report_module
from jamp._src.numerics.locate import nonfinite_counts, search, step_program
from jamp._src.numerics.program import CHUNK, Chunked
from tests.realmodels._models import gpt2

DEAD = 4  # operations no output reads: the unchecked program drops them, the checks keep them


def _count(lowered, op):
    return len(re.findall(rf"\bstablehlo\.{op}\b", lowered.as_text()))


@pytest.fixture(scope="module")
def planted():
    """GPT-2 under float16 autocast, its first block's ``mlp.c_fc`` kernel scaled by 3e5:
    the kernel holds in float16 (its largest entries near 2e4), its product with the
    layer-normed activations does not."""
    case = gpt2()
    params = jax.tree_util.tree_map(lambda x: x, case.params)
    fc = params["transformer"]["h"]["0"]["mlp"]["c_fc"]
    fc["kernel"] = fc["kernel"] * 3e5
    return case.loss, jamp.autocast(case.loss, jnp.float16), params, case.batch


@pytest.mark.standard_promotion  # transformers' code mixes dtypes
def test_gpt2_float16_overflow_is_located_by_one_program_of_the_step_s_size(planted):
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxConv1D

    _, loss, params, batch = planted
    with jax.numpy_rank_promotion("allow"):
        program, flat, paths = step_program(loss, (params, batch), 0, False)
        chunked = Chunked(program, observe=nonfinite_counts, maxima=1)
        site = search(program, flat, paths, chunked)
        step = Chunked(program).lower_first(flat)  # the step, unchecked
    assert site is not None and site.primitive == "dot_general" and not site.backward, site
    assert site.path.endswith("mlp/c_fc"), site.path
    assert site.line.startswith(_line_of(FlaxConv1D.__call__, "lax.dot_general(") + " ")
    assert site.inf > 0 and 1e4 < site.operands[1].max_abs < 65504  # the scaled kernel, held
    # The bound: the whole step is one chunk, whose program reduces what the unchecked
    # step does (and the few reductions of operations no output reads, which the unchecked
    # program drops and the checks keep) and nothing more: every value's counts and largest
    # magnitude are one segmented sum and one segmented maximum, two scatters. Its compile
    # is about the step's, not the step's plus a reduction per operation (700 here).
    assert len(program.ops) < CHUNK and list(chunked.lowered) == [0]
    checked = chunked.lowered[0]
    assert _count(checked, "reduce") <= _count(step, "reduce") + DEAD
    assert _count(checked, "scatter") <= _count(step, "scatter") + 2 + DEAD


@pytest.mark.standard_promotion
def test_gpt2_float16_overflow_tops_the_report_of_a_program_of_the_step_s_size(
    planted, monkeypatch
):
    f32_loss, loss, params, batch = planted
    made = []

    class Recording(Chunked):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(report_module, "Chunked", Recording)
    with jax.numpy_rank_promotion("allow"):
        report = jamp.debug.precision_report(f32_loss, params, batch, dtype="float16")
    (chunked,) = made
    top = report.rows[0]
    assert top.primitive == "dot_general" and not top.backward and top.overflow > 0
    assert "c_fc" in top.path or "mlp" in top.path
    # The paired program: each operation at most three times (as it is, widened, and in
    # float32 on its inputs), and no reduction of its own for the figures (summed on the
    # host from the values it returns).
    (lowered,) = chunked.lowered.values()
    with jax.numpy_rank_promotion("allow"):
        program, flat, _ = step_program(loss, (params, batch), 0, False)
        step = Chunked(program).lower_first(flat)
    assert _count(lowered, "reduce") <= 3 * (_count(step, "reduce") + DEAD)
    assert _count(lowered, "scatter") <= 3 * (_count(step, "scatter") + DEAD)


def test_the_tools_compile_with_the_elemental_emitters_where_xla_has_them(monkeypatch):
    """jaxlib 0.10's XLA:CPU has both kernel emitters, and the tools' programs compile in
    about a third of the time with its elemental ones (GPT-2's paired program: 4.2 against
    1.4 s); jaxlib 0.12 has only the fusion emitters and refuses the option. A choice the
    user made in XLA_FLAGS holds (the suite's conftest makes one on 0.10)."""
    from importlib.metadata import version

    from jamp._src.numerics import program

    has_them = tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11)
    try:
        program.compiler_options.cache_clear()
        monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        options = program.compiler_options()
        assert options.pop("xla_cpu_use_fusion_emitters", None) is (False if has_them else None)
        assert options == program.COMPILER_OPTIONS
        program.compiler_options.cache_clear()
        monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=true")
        assert program.compiler_options() == program.COMPILER_OPTIONS
    finally:
        program.compiler_options.cache_clear()
