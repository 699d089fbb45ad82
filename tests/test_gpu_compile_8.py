"""The compiled 8-GPU program: the collectives of jamp's steps under FSDP (issue #45).

Compiled here with no GPU for 8 described H200s on one host (topology ``1x1x8``,
``benchmarks/xla_gpu.py``), the model and steps of ``python -m benchmarks collectives``
(``benchmarks/collectives.py``) at a small size: an MLP of 3 layers 256 wide, batch 256,
parameters ``P("data", None)``, batch sharded, adamw, donated. The partitioned program
is per device: its collectives (kind, element dtype, elements), bytes and temp memory
are deterministic, and asserted on. A Flax GPT block (attention, gelu MLP) under
``autocast(bf16)`` checks the precision of its sums.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from benchmarks import collectives as C
from benchmarks import xla_gpu

pytestmark = pytest.mark.usefixtures("gpu_compiler")  # conftest: skips, or fails in CI

WIDTH, LAYERS, BATCH = 256, 3, 256
SHARD = WIDTH * WIDTH // C.DEVICES  # a parameter's elements on one device


HALVES = {
    "autocast(bf16)": ("bfloat16", "bf16"),
    "autocast(f16) + loss_scaling": ("float16", "f16"),
    "bf16 params (master_weights)": ("bfloat16", "bf16"),
}


@pytest.fixture(scope="module")
def programs():
    """Each step of the benchmark compiled once, read into its collectives and figures; the
    half-precision ones also with ``reduce_dtype`` the half dtype (``name, reduce``)."""
    out = {name: C.measure(name, WIDTH, LAYERS, BATCH) for name in C.STEPS}
    for name, (dtype, _) in HALVES.items():
        out[name, "reduce"] = C.measure(name, WIDTH, LAYERS, BATCH, reduce_dtype=dtype)
    return out


def _of(result, kind, dtype=None):
    return [c for c in result["collectives"] if c.kind == kind and dtype in (None, c.dtype)]


# ---------------------------------------------------------------- the reader itself


def test_the_reader_lists_a_psum_with_its_dtype_and_elements():
    mesh = xla_gpu.mesh(xla_gpu.TARGETS["H200"], 8, "data")

    def f(x):
        return jax.lax.psum(x * 2, "data")

    g = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())
    x = xla_gpu.placed(jax.ShapeDtypeStruct((8 * 1024,), jnp.bfloat16), mesh, lambda a: P("data"))
    text = xla_gpu.compile_lowered(jax.jit(g).lower(x)).as_text()
    (c,) = xla_gpu.collectives(text)
    assert (c.kind, c.elements, c.operands) == ("all-reduce", 1024, 1)
    assert c.dtype in ("bf16", "f32")  # XLA:GPU may widen a bfloat16 all-reduce's sum
    assert xla_gpu.describe_collectives(text) == f"all-reduce {c.dtype} x1"


def test_the_one_device_mesh_is_unchanged():
    # The suite's one-GPU programs compile on the same one-device mesh as before.
    m = xla_gpu.mesh(xla_gpu.TARGETS["H200"])
    assert m.axis_names == ("x",) and m.devices.size == 1
    assert xla_gpu.mesh(xla_gpu.TARGETS["H200"], 8, "data").devices.size == 8


# ---------------------------------------------------------------- the FSDP steps


GATHERED = {  # step: the dtype its parameters are gathered in
    "float32": "f32",
    "autocast(bf16)": "bf16",
    "autocast(f16) + loss_scaling": "f16",
    "bf16 params (master_weights)": "bf16",
    "autocast(float8)": "f8e4m3fn",
}


def test_the_mlp_steps_under_fsdp(programs):
    """The MLP's eight programs (a module fixture, compiled at its setup) in one test: tests
    of one fixture spread over the two xdist workers compiled all eight on both."""
    checks = [(_each_parameter_is_gathered_once_in_the_compute_dtype, n) for n in GATHERED]
    checks += [(_gradients_are_reduced_across_devices_in_float32_by_default, n)
               for n in [*HALVES, "autocast(float8)"]]  # fmt: skip
    checks += [(_reduce_dtype_sums_in_half_precision_for_half_the_bytes, n) for n in HALVES]
    checks += [(_the_float32_step_reduces_its_gradients_in_float32, None),
               (_the_finite_check_of_a_sharded_gradient_is_one_scalar_all_reduce, None),
               (_the_float8_steps_small_all_reduces_are_the_amaxes_of_sharded_activations, None),
               (_bytes_and_temp_per_device_against_the_float32_step, None)]  # fmt: skip
    for check, name in checks:
        try:
            check(programs) if name is None else check(programs, name)
        except AssertionError as e:
            raise AssertionError(f"{check.__name__}({name}): {e}") from e


def _each_parameter_is_gathered_once_in_the_compute_dtype(programs, name):
    gathered = GATHERED[name]
    # XLA moves autocast's cast (float8: the quantisation) before the gather: the half (or
    # float8) weight crosses the wire, not the float32 master; once per parameter per step
    # (XLA may combine the gathers of small parameters into one collective).
    gathers = _of(programs[name], "all-gather")
    assert {c.dtype for c in gathers} == {gathered}
    assert sum(c.operands for c in gathers) == LAYERS
    assert sum(c.elements for c in gathers) == LAYERS * SHARD


def _the_float32_step_reduces_its_gradients_in_float32(programs):
    r = programs["float32"]
    assert {c.dtype for c in _of(r, "reduce-scatter")} == {"f32"}
    assert sum(c.elements for c in _of(r, "reduce-scatter")) == LAYERS * WIDTH * WIDTH
    assert not _of(r, "all-reduce")


def _gradients_are_reduced_across_devices_in_float32_by_default(programs, name):
    # autocast's weight-gradient products accumulate into float32 (bfloat16 parameters: the
    # sum is rounded to bfloat16 once, after the reduce-scatter): every gradient's sum across
    # devices is float32, PyTorch FSDP2's reduce_dtype=float32.
    r = programs[name]
    scatters = _of(r, "reduce-scatter")
    assert {c.dtype for c in scatters} == {"f32"}
    assert sum(c.elements for c in scatters) == LAYERS * WIDTH * WIDTH
    # the all-reduces are of statistics (a few scalars: the finite check, float8's amaxes)
    assert all(c.elements < 2 * LAYERS for c in _of(r, "all-reduce"))


def _reduce_dtype_sums_in_half_precision_for_half_the_bytes(programs, name):
    wire = HALVES[name][1]
    default, option = programs[name], programs[name, "reduce"]
    scatters = _of(option, "reduce-scatter")
    assert {c.dtype for c in scatters} == {wire}
    assert sum(c.elements for c in scatters) == LAYERS * WIDTH * WIDTH
    assert _of(option, "all-gather") == _of(default, "all-gather")  # the gathers unchanged
    # what float32 reduction costs per device: the full-size partial gradients in float32
    # (written by the product, read by the reduce-scatter), and their buffer in temp
    assert option["bytes"] < default["bytes"] < programs["float32"]["bytes"]
    assert option["temp"] < default["temp"] <= programs["float32"]["temp"]


def _the_finite_check_of_a_sharded_gradient_is_one_scalar_all_reduce(programs):
    # Loss scaling under FSDP: every device skips together, from one f32 scalar.
    (check,) = _of(programs["autocast(f16) + loss_scaling"], "all-reduce")
    assert (check.dtype, check.elements) == ("f32", 1)


def _the_float8_steps_small_all_reduces_are_the_amaxes_of_sharded_activations(programs):
    # Current scaling: each scale is the amax of a batch-sharded tensor, a max over the
    # devices (exact in bfloat16): the 2 hidden activations' in the forward pass, the 3
    # output gradients' in the backward pass. No gradient is reduced in bfloat16.
    r = programs["autocast(float8)"]
    small = _of(r, "all-reduce", "bf16")
    assert len(small) == 2 * LAYERS - 1
    assert all(c.elements == 1 and c.op_name.endswith("reduce_max") for c in small)
    assert {c.dtype for c in _of(r, "reduce-scatter")} == {"f32"}


def _bytes_and_temp_per_device_against_the_float32_step(programs):
    # At this small size the gradients and the optimizer state dominate: float32 reduction
    # keeps the bytes below the float32 step's (jax 0.10.2's XLA: 0.82x; 0.12.1's: 0.97x),
    # the half reduction well below (0.62-0.78x).
    f32 = programs["float32"]
    for name in HALVES:
        r, option = programs[name], programs[name, "reduce"]
        assert r["bytes"] < f32["bytes"], (name, r["bytes"] / f32["bytes"])
        assert r["temp"] < f32["temp"], (name, r["temp"], f32["temp"])
        assert option["bytes"] < 0.8 * f32["bytes"], (name, option["bytes"] / f32["bytes"])


# ---------------------------------------------------------------- a GPT block

GPT_STEPS = {  # step: the dtype the kernels are gathered in
    "autocast(bf16)": "bf16",
    "autocast(f16) + loss_scaling": "f16",
    "bf16 params (master_weights)": "bf16",
    "autocast(float8)": "f8e4m3fn",
}
TOKENS, D = 8 * 16, 64


@pytest.fixture(scope="module")
def gpt():
    """One Flax GPT block (attention, gelu MLP), d 64, 2 heads, batch 8x16, FSDP where a
    kernel's first axis divides over 8 (the attention's output kernel, (2, 32, 64), and
    the biases stay replicated: their gradients are all-reduced, as under data
    parallelism), the steps of ``collectives.MODEL_STEPS``. ``gpt(step, reduce_dtype)``
    compiles a program on first use (each costs seconds) and keeps it for the module:
    ``{"collectives", "bytes", "temp", "sharded"}``, ``sharded`` the FSDP kernels' sizes."""
    import functools

    from benchmarks import models

    model = models.gpt_stack(64, 2, 1, 8, 16)
    sharded = [a.size for a in jax.tree.leaves(model.params) if C.fsdp_spec(a) != P()]

    @functools.cache
    def compile_(step, reduce=None):
        with jax.numpy_rank_promotion("allow"):  # the benchmarks' models broadcast
            compiled = C.compile_model(model, step=step, reduce_dtype=reduce)
        p = xla_gpu.analyse(compiled)
        return {"collectives": xla_gpu.collectives(p.text), "bytes": p.bytes,
                "temp": p.temp_bytes, "sharded": sharded}  # fmt: skip

    return compile_


def test_a_gpt_block_under_fsdp(gpt):
    """The GPT block's five programs in one test (each compiles in seconds, and tests
    of one program spread over the two xdist workers compiled it on both): the gradient
    sums with and without the option, then for each step its gathers and its sums, then
    bytes and temp side by side."""
    _summed_in_float32_by_default(gpt)
    for step in GPT_STEPS:
        try:
            _kernels_are_gathered_once_in_the_compute_dtype(gpt, step)
            _gradient_sums_are_float32(gpt, step)
        except AssertionError as e:
            raise AssertionError(f"{step}: {e}") from e
    _bytes_and_temp_per_device(gpt)


def _summed_in_float32_by_default(gpt):
    # What is asserted here is the sums; the gathers below.
    default = gpt("autocast(bf16)")["collectives"]
    option = gpt("autocast(bf16)", "bfloat16")["collectives"]
    assert {c.dtype for c in default if c.kind == "all-gather"} == {"bf16"}
    assert {c.dtype for c in default if c.kind == "reduce-scatter"} == {"f32"}
    assert {c.dtype for c in default if c.kind == "all-reduce"} == {"f32"}
    # the option: the sharded kernels' reduce-scatter and the replicated kernel's
    # all-reduce (2 * 32 * 64 elements) in bfloat16; the biases' and norms' sums, which
    # autocast makes in float32 anyway (autocast.sums), stay float32
    assert {c.dtype for c in option if c.kind == "reduce-scatter"} == {"bf16"}
    assert [c.elements for c in option if c.kind == "all-reduce" and c.dtype == "bf16"] == [4096]
    scattered = sum(c.elements for c in default if c.kind == "reduce-scatter")
    assert scattered == sum(c.elements for c in option if c.kind == "reduce-scatter")


def _kernels_are_gathered_once_in_the_compute_dtype(gpt, step):
    # The 5 FSDP kernels (the MLP's two, query, key, value) are gathered in one combined
    # all-gather in the forward pass, in the compute dtype (float8: the e4m3 quantised
    # weight; its scale is the amax of the float32 shard, a scalar all-reduce), and never
    # again. The backward pass's other gathers in the compute dtype (float8: e5m2, the
    # gradients' format) are of activations, resharded for the weight-gradient products:
    # the MLP's input and hidden output, (tokens, 64) and (tokens, 256).
    r = gpt(step)
    wire, sharded = GPT_STEPS[step], r["sharded"]
    gathers = [c for c in r["collectives"] if c.kind == "all-gather"]
    kernels = [c for c in gathers if c.operands == len(sharded)]
    assert [(c.dtype, c.elements, c.out_elements) for c in kernels] == [
        (wire, sum(sharded) // C.DEVICES, sum(sharded))
    ]
    backward = [c for c in gathers if c not in kernels and "transpose(" in c.op_name]
    others = [c for c in gathers if c not in kernels and c not in backward]
    if step != "autocast(f16) + loss_scaling":
        assert {c.dtype for c in backward} <= {wire, "f8e5m2"}
        assert sorted(c.out_elements for c in backward) == [TOKENS * D, TOKENS * 4 * D]
        assert not others, others
        return
    # loss scaling: XLA combines the hidden activation's gather with one of the finite
    # check's (Dense_0's bias, 4 * D): the check unscales each replicated leaf's gradient
    # on a slice of the devices and gathers a bfloat16 flag per element (0, or NaN where
    # not finite) before its reduction. Likewise it updates the replicated leaves (the
    # attention's output kernel (2, 32, 64) and the q/k/v biases (2, 32): 2 does not
    # divide over 8) on slices and gathers each back in float32 with its two moments
    # (12 arrays). Neither is a gather of an FSDP kernel.
    assert sorted(c.out_elements for c in backward) == [TOKENS * D, TOKENS * 4 * D + 4 * D]
    assert {c.dtype for c in others} == {"f32", "bf16"}
    assert all(c.operands == 12 for c in others if c.dtype == "f32")


def _gradient_sums_are_float32(gpt, step):
    # reduce_dtype=None: every reduce-scatter, and every all-reduce of a gradient (the
    # replicated leaves': the output kernel's 4096 elements and biases), is float32. The
    # remaining all-reduces are statistics of at most a few elements: the finite check
    # of loss scaling (a predicate and a float32 scalar) and float8's amaxes (scalar
    # maxes, exact in bfloat16).
    r = gpt(step)["collectives"]
    assert {c.dtype for c in r if c.kind == "reduce-scatter"} == {"f32"}
    reduces = [c for c in r if c.kind == "all-reduce"]
    assert {c.dtype for c in reduces if c.elements >= 64} == {"f32"}
    assert max(c.elements for c in reduces) >= 2 * 32 * 64  # the output kernel's, with biases
    stats = [c for c in reduces if c.elements < 64]
    assert all(c.elements <= 8 for c in stats), stats
    if step == "autocast(float8)":
        assert {c.dtype for c in stats} <= {"bf16", "f32"}
    elif step == "autocast(f16) + loss_scaling":
        assert sorted((c.dtype, c.elements) for c in stats) == [("f32", 1), ("pred", 1)]
    else:
        assert not stats


def _bytes_and_temp_per_device(gpt):
    # Side by side (docs/scaling-out.md has the figures): bfloat16 parameters move less
    # than float32 ones under the same autocast; the half reduction less than float32's.
    bf16 = gpt("autocast(bf16)")
    assert gpt("bf16 params (master_weights)")["bytes"] < bf16["bytes"]
    assert gpt("autocast(bf16)", "bfloat16")["bytes"] < bf16["bytes"]


# ---------------------------------------------------------------- a CNN (data parallel)


@pytest.fixture(scope="module")
def cnn():
    """The benchmarks' Flax CNN (two 3x3 convs with GroupNorm, a Dense head), batch 8 of
    8x8x3 images, under ``autocast(bf16)``, with ``reduce_dtype`` None and bfloat16: two
    compiles. The conv kernels ((3, 3, 3, 8), (3, 3, 8, 16)) stay replicated (3 does not
    divide over 8): data parallelism, their gradients all-reduced; the Dense kernel is
    FSDP (``collectives.fsdp_spec``)."""
    from benchmarks import models

    model = models.cnn((8, 16), 4, 8, 8)
    kernels = [a.size for a in jax.tree.leaves(model.params) if a.ndim == 4]
    out = {}
    for reduce in (None, "bfloat16"):
        with jax.numpy_rank_promotion("allow"):  # the benchmarks' models broadcast
            p = xla_gpu.analyse(C.compile_model(model, reduce_dtype=reduce))
        out[reduce] = {"collectives": xla_gpu.collectives(p.text), "bytes": p.bytes}
    return out, sum(kernels)


def test_a_cnns_conv_kernel_gradients_are_all_reduced_in_float32_by_default(cnn):
    # autocast's conv kernel gradients are transposed convs accumulated into float32 in a
    # sharded program (autocast.sums): the all-reduce of the kernels' gradients is float32
    # (XLA combines it with the biases' and norms', float32 anyway); with
    # reduce_dtype=bfloat16 it is bfloat16, the conv kernels' elements exactly.
    out, kernels = cnn
    default, option = out[None]["collectives"], out["bfloat16"]["collectives"]
    reduces = [c for c in default if c.kind in ("all-reduce", "reduce-scatter")]
    assert {c.dtype for c in reduces} == {"f32"}
    assert sum(c.elements for c in default if c.kind == "all-reduce") > kernels
    assert [c.elements for c in option if c.kind == "all-reduce" and c.dtype == "bf16"] == [kernels]
    assert {c.dtype for c in option if c.kind == "reduce-scatter"} == {"bf16"}  # the Dense's
    assert out["bfloat16"]["bytes"] < out[None]["bytes"]
