"""Implementation pins: these pin how the current implementation compiles, not what it does.

Jaxpr shapes and primitive counts, HLO text, fusion counts and temp-memory bytes of the
finite check and the report, the StableHLO and the jaxpr of float8 products, and the
jaxpr of a GradScaler step. An honest refactor may change them: update them
deliberately, with the reason (benchmarks/FINDINGS.md records why each shape was
chosen). They are not behaviour; the behaviour is tested in finite/ (test_finite.py,
test_finite_cpu.py, test_finite_default.py, test_report.py), float8/test_float8.py,
autocast/test_autocast_float8.py and grad_scaler/test_grad_scaler.py.
"""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _autocast_helpers import randn
from _float8_helpers import MM, operands, spec
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jamp
from jamp._src.finite import default as finite_default
from jamp._src.finite.check import check_unscaled
from jamp._src.float8 import products
from jamp._src.float8.recipe import init_state

# ---------------------------------------------------------------- the finite check


def _cpu_jaxpr(fn, *args):
    """The CPU branch of the platform switch in ``fn``'s jaxpr, and the other one."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    prims = [e.primitive.name for e in jaxpr.eqns]
    assert prims.count("platform_index") == 1 and prims.count("cond") == 1, prims
    (switch,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    return [b.jaxpr for b in switch.params["branches"]]


def test_clean_path_reads_each_leaf_once():
    # Outside the exact branch: no unscaled copy, and no per-element flags but
    # those of float16 leaves. On a CPU, one product per large float32 leaf,
    # one vector for the small leaves and rows, one sum for the other leaves.
    state = jamp.dynamic_loss_scale()
    g = {
        "rows": jnp.ones((256, 256)),
        "small": jnp.ones((1000,), jnp.bfloat16),
        "other": jnp.ones((100_000, 3)),
        "half": jnp.ones((200, 200), jnp.float16),
    }
    cpu, other = _cpu_jaxpr(check_unscaled, state, g)
    top = [e.primitive.name for e in cpu.eqns]
    # On a CPU the check waits for every gradient first.
    assert top[0] == "optimization_barrier" and top.count("dot_general") == 1, top
    assert top.count("concatenate") == 1 and top.count("reduce_sum") == 1, top
    for e in cpu.eqns:
        if e.primitive.name == "is_finite":
            (v,) = e.invars
            # the scalar sum, the vector of 256 rows and 1000 small values, float16 flags
            assert v.aval.shape in ((), (1256,), (200, 200)), v.aval
        if e.primitive.name == "mul":
            assert all(v.aval.ndim == 0 for v in e.invars), e
    (cond,) = [e for e in cpu.eqns if e.primitive.name == "cond"]
    exact = [x.primitive.name for b in cond.params["branches"] for x in b.jaxpr.eqns]
    # the exact branch: max |x| of the large float32 leaf and of the small
    # bfloat16 values, max and min of the float16 leaf; the other leaf is
    # unscaled and checked element by element
    assert exact.count("abs") == 2 and exact.count("reduce_min") == 1, exact
    for b in cond.params["branches"]:
        for e in b.jaxpr.eqns:
            if e.primitive.name == "mul" and e.invars[0].aval.ndim:
                assert e.invars[0].aval.shape == (100_000, 3), e
    # Elsewhere (GPUs, TPUs): no conditional; a sum per large leaf (over its trailing
    # axes, or whole when they are short: "other", "half"), then a sum per distinct
    # shape of what that leaves: (256,) rows, (1000,) small values, () two totals.
    prims = [e.primitive.name for e in other.eqns]
    assert "dot_general" not in prims and "cond" not in prims, prims
    assert prims.count("reduce_or") == 3 and prims.count("reduce_sum") == 3, prims
    assert "concatenate" not in prims, prims
    # is_finite of each leaf as it is (the one read; no unscaled copy) and of the total
    leaf_shapes = {x.shape for x in g.values()}
    for e in other.eqns:
        if e.primitive.name == "is_finite":
            assert e.invars[0].aval.shape in leaf_shapes | {()}, e


def test_cpu_check_compiles_to_few_kernels():
    # XLA:CPU compiles every kernel at a near-fixed cost (benchmarks/FINDINGS.md,
    # section 12), so the check's kernels must not grow with the small leaves
    # (one reduction covers them all), and a large leaf adds at most its max|x|
    # in the exact branch.
    # XLA:CPU in jax 0.12 also wraps the joining of the short vector (a concatenate) in
    # a kernel of its own, one or two whatever the count of leaves: counted apart.
    state = jamp.dynamic_loss_scale()

    def kernels(n_small, n_large):
        tree = [jnp.ones((1000,)) for _ in range(n_small)]
        tree += [jnp.ones((256, 256)) for _ in range(n_large)]
        compiled = jax.jit(lambda t: check_unscaled(state, t)).lower(tree).compile()
        text = compiled.as_text()
        joins = len(re.findall(r" fusion\([^)]*\), kind=\w+, calls=%wrapped_concatenate", text))
        assert joins <= 2, joins
        return text.count(" fusion(") - joins

    few = kernels(4, 4)
    # 36 more small leaves: no more kernels (XLA:CPU's fusion emitters: 11 against 13),
    # or one (its elemental emitters, the suite's on jax 0.10: 10 against 9)
    assert kernels(40, 4) <= few + 1
    assert kernels(4, 8) <= few + 4
    assert few <= 16, few  # 8 leaves; the per-leaf form compiled 3-5 kernels per leaf


def test_check_adds_no_gradient_sized_temporary():
    # The check must not copy the gradients (e.g. by concatenating them): XLA
    # allocates a branch's temporaries on every step, taken or not. On XLA:CPU
    # the fallback's per-leaf is-finite flags (1 byte per element) remain.
    g = {f"l{i}": jnp.ones((1024, 1024)) for i in range(4)}
    grad_bytes = 4 * 1024 * 1024 * 4
    for fn in (check_unscaled, lambda s, g: jamp.all_finite(g)):
        mem = jax.jit(fn).lower(jamp.dynamic_loss_scale(), g).compile().memory_analysis()
        assert mem.temp_size_in_bytes <= grad_bytes // 4 + 65536, mem.temp_size_in_bytes


@pytest.mark.parametrize("shape", [(128, 128), (3, 40, 1024), (100_003,), (784, 2048), (5000,)])
def test_cpu_all_finite_needs_no_exact_branch(shape):
    # For large float32 leaves (the product's rows) and small ones (gathered),
    # the CPU's one read is exact (test_finite.py), so all_finite needs no
    # exact branch at all.
    (cpu, _) = _cpu_jaxpr(jamp.all_finite, jnp.ones(shape))
    assert "cond" not in [e.primitive.name for e in cpu.eqns]


@pytest.mark.parametrize("spec", [P("data", None), P(None, "data"), P(("data",), None)])
def test_sharded_large_leaf_compiles_without_gathering(spec):
    # The CPU check contracts the last dimension without reshaping, so a leaf
    # sharded along either dimension is checked where it lies: no gathering of
    # gradients, only scalars and per-row totals cross devices.
    mesh = Mesh(np.array(jax.devices()), ("data",))
    x = jax.device_put(jnp.ones((512, 1024), jnp.float32), NamedSharding(mesh, spec))
    hlo = jax.jit(jamp.all_finite).lower(x).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo


def test_other_platforms_get_the_plain_sum():
    # The matrix-vector sum and the barrier are for XLA:CPU only: lowered for a
    # GPU or TPU, the check is one reduction per leaf.
    from jax import export

    x = jnp.ones((256, 256))
    for platform in ("cuda", "rocm", "tpu"):
        text = export.export(jax.jit(jamp.all_finite), platforms=(platform,))(x).mlir_module()
        assert "dot_general" not in text and "optimization_barrier" not in text, platform
    both = export.export(jax.jit(jamp.all_finite), platforms=("cpu", "cuda"))(x)
    assert "dot_general" in both.mlir_module()


def test_default_branch_has_no_conditional_and_one_reduction_per_large_leaf():
    # On a GPU a conditional is a host sync: the branch must decide without one.
    leaves = [jnp.ones((512, 512)), jnp.ones((512,)), jnp.ones((3, 3, 64, 96))]
    jaxpr = jax.make_jaxpr(lambda *x: finite_default.default_finite(*x, inv=jnp.float32(0.5)))(
        *leaves
    )
    prims = [e.primitive.name for e in jaxpr.eqns]
    assert "cond" not in prims and "while" not in prims
    # a reduction per large leaf (its trailing axes), then a sum per distinct shape:
    # (512,) holds the first leaf's rows and the second leaf, (3, 3) the third's rows
    assert prims.count("reduce_or") == 2 and prims.count("reduce_sum") == 2, prims
    assert "concatenate" not in prims, prims


def test_default_branch_joins_many_shapes_into_one_sum():
    # Beyond FEW_SHAPES distinct shapes, the sums are joined into one (its exactness:
    # test_finite_default.py).
    shapes = [(n,) for n in range(10, 10 + finite_default.FEW_SHAPES + 3)]
    leaves = [jnp.ones(s) for s in shapes]
    prims = [e.primitive.name for e in jax.make_jaxpr(finite_default.default_finite)(*leaves).eqns]
    assert prims.count("concatenate") == 1 and prims.count("reduce_sum") == 1, prims


# ---------------------------------------------------------------- the report


def test_report_adds_no_gradient_sized_temporary():
    # XLA allocates a branch's temporaries on every call; counting a whole leaf
    # at once made XLA:CPU copy it as int32 (a step's temp memory doubled).
    g = {f"l{i}": jnp.ones((1024, 1024)) for i in range(4)}
    mem = jax.jit(jamp.debug.log_nonfinite).lower(g).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 4 * 1024 * 1024, mem.temp_size_in_bytes


def test_leaves_past_int32_offsets_are_not_sliced_by_element():
    """A dynamic slice's element offset is an int32: past 2**31 elements a leaf
    is counted by whole chunks (a view) or in one reduction, never by offsets
    that would wrap (traced only: no 2 GB array is made)."""
    for n, chunked in [(2**31, True), (2**31 + 2**17 + 3, False)]:
        jaxpr = jax.make_jaxpr(jamp.debug.nonfinite_report)(
            jax.ShapeDtypeStruct((n,), jnp.float8_e5m2)
        )
        text = str(jaxpr)
        assert ("dynamic_slice" in text) == chunked, n
        if chunked:
            assert "f8_e5m2[32768,65536]" in text


def test_log_under_vmap_has_no_callback_outside_a_cond():
    jaxpr = jax.make_jaxpr(jax.vmap(jamp.debug.log_nonfinite))({"w": jnp.ones((4, 3))})

    def callbacks_outside_cond(j):
        n = 0
        for eqn in j.eqns:
            if eqn.primitive.name == "debug_callback":
                n += 1
            elif eqn.primitive.name != "cond":
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    n += callbacks_outside_cond(sub)
        return n

    assert callbacks_outside_cond(jaxpr.jaxpr) == 0


# ---------------------------------------------------------------- float8 autocast


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_the_stablehlo_is_the_pattern_xla_gpu_rewrites_into_a_float8_gemm(platform):
    """float8 operands converted from float32, a float32 dot_general, a scalar multiply; the
    gradient products chosen at lowering (docs/float8-design.md, "Accumulation"): on CUDA with
    float32 accumulation and no imprecise accumulation, elsewhere DEFAULT."""
    f = jamp.autocast(lambda w, x: jnp.sum(jnp.tanh(x @ w)), "float8")
    w, x = randn(0, 16, 32), randn(1, 8, 16)
    step = jax.jit(jax.grad(f, argnums=(0, 1)))
    text = step.trace(w, x).lower(lowering_platforms=(platform,)).as_text()
    lines = text.splitlines()
    dots = [i for i, line in enumerate(lines) if "stablehlo.dot_general" in line]
    assert len(dots) == 3
    signatures = sorted(lines[i].split(" : ")[-1] for i in dots)
    assert signatures == [
        "(tensor<8x16xf8E4M3FN>, tensor<16x32xf8E4M3FN>) -> tensor<8x32xf32>",
        "(tensor<8x32xf8E5M2>, tensor<16x32xf8E4M3FN>) -> tensor<8x16xf32>",
        "(tensor<8x32xf8E5M2>, tensor<8x16xf8E4M3FN>) -> tensor<32x16xf32>",
    ]
    assert text.count("-> tensor<8x16xf8E4M3FN>") >= 1 and "-> tensor<8x32xf8E5M2>" in text
    precise = (
        "algorithm = <lhs_precision_type = f8E5M2, rhs_precision_type = f8E4M3FN, "
        "accumulation_type = f32, lhs_component_count = 1, rhs_component_count = 1, "
        "num_primitive_operations = 1, allow_imprecise_accumulation = false>"
    )
    # Each product's result is multiplied by a broadcast scalar (the inverse scales): the
    # forward product's directly; a gradient product's (lax.platform_dependent, resolved at
    # lowering) as the result of the one-branch `case` that holds it under jax 0.10, and
    # directly under jax 0.12, which inlines the one branch.
    for i in dots:
        line = lines[i]
        name = line.split("=")[0].strip()
        gradient = "f8E5M2" in line
        assert (precise in line) == (gradient and platform == "cuda"), line
        if '"stablehlo.case"' in lines[i - 1]:
            assert gradient and f"stablehlo.return {name}" in lines[i + 1]
            name = lines[i - 1].split("=")[0].strip()
            after = "\n".join(lines[i + 2 :])
            assert f"stablehlo.multiply {name}," in after
        else:
            after = "\n".join(lines[i + 1 : i + 4])
            assert "stablehlo.broadcast_in_dim" in after and f"stablehlo.multiply {name}" in after
    if platform == "cpu":  # XLA:CPU upcasts float8 operands; the float8 converts stay
        compiled = step.lower(w, x).compile().as_text()
        assert "f8e4m3fn" in compiled and "f8e5m2" in compiled


def test_delayed_scaling_quantises_without_waiting_for_the_operands_amax():
    """With unmeasured="one" the operand's quantisation does not depend on its own amax, so
    XLA can compute the amax in the pass that quantises (with "current" it must wait for
    it). The values: float8/test_float8.py."""
    e4m3 = np.dtype(jnp.float8_e4m3fn)
    lhs, rhs = operands(MM, 9)

    def waits_for_amax(recipe):
        """Whether a float8 convert of the forward pass depends on a reduce_max."""
        fresh = init_state(recipe)
        f = lambda a, b, h, c: products.delayed_dot(a, b, h, c, spec(recipe=recipe))  # noqa: E731
        jaxpr = jax.make_jaxpr(f)(lhs, rhs, *fresh).jaxpr.eqns[0].params["call_jaxpr"].jaxpr
        from_max = set()
        for e in jaxpr.eqns:
            ins = {v for v in e.invars if not isinstance(v, jax.extend.core.Literal)}
            if e.primitive.name == "reduce_max" or ins & from_max:
                from_max.update(e.outvars)
            if e.primitive.name == "convert_element_type" and e.params["new_dtype"] == e4m3:
                if ins & from_max:
                    return True
        return False

    assert not waits_for_amax(jamp.float8.DelayedScaling(amax_history_len=2))
    assert waits_for_amax(jamp.float8.DelayedScaling(amax_history_len=2, unmeasured="current"))


# ---------------------------------------------------------------- GradScaler


def test_the_stage_costs_nothing_in_the_compiled_step():
    """The jaxpr of a GradScaler iteration is the jaxpr of the same step written with
    the pieces it is made of: the stage and its checks leave no trace in it."""
    from jamp._src.skip import apply_or_keep

    scaler = jamp.GradScaler(init_scale=1024.0)
    tx = optax.sgd(0.1, momentum=0.9)
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    opt_state = tx.init(params)
    x = jnp.ones((2, 4))

    def grads_of(state, params):
        loss = lambda p: jnp.sum((x @ p["w"] + p["b"][None, :]) ** 2)  # noqa: E731
        return jax.grad(lambda p: jamp.scale(state, loss(p)))(params)

    def with_scaler(state, params, opt_state, unscale_first):
        grads = grads_of(state, params)
        if unscale_first:
            grads, state = scaler.unscale(state, grads)
        params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)
        return scaler.update(state), params, opt_state

    def by_hand(state, params, opt_state, unscale_first):
        grads = grads_of(state, params)
        found_inf = None
        if unscale_first:  # the old API: grads, found_inf = unscale(...); step(found_inf=...)
            grads, finite = jamp.unscale_and_check(state, grads)
            found_inf = jnp.logical_not(finite)
            finite = jnp.logical_not(found_inf)
            unscaled = lambda: grads  # noqa: E731
        else:
            finite = check_unscaled(state, grads)
            unscaled = lambda: jamp.unscale(state, grads)  # noqa: E731

        def apply():
            updates, new_opt_state = tx.update(unscaled(), opt_state, params)
            return optax.apply_updates(params, updates), new_opt_state

        params, opt_state = apply_or_keep(finite, apply, lambda _: (params, opt_state))
        if found_inf is None:
            found_inf = jnp.logical_not(finite)
        return jamp.update(state, jnp.logical_not(found_inf)), params, opt_state

    for unscale_first in (False, True):
        args = (params, opt_state, unscale_first)
        ours = jax.make_jaxpr(with_scaler, static_argnums=3)(scaler.init(), *args)
        theirs = jax.make_jaxpr(by_hand, static_argnums=3)(jamp.dynamic_loss_scale(1024.0), *args)
        assert str(ours) == str(theirs), unscale_first


# ---------------------------------------------------------------- reduce_dtype


def test_jaxs_conv_kernel_transpose_has_the_signature_autocast_calls():
    """``autocast.sums`` makes a sharded conv's kernel gradient with jax's private
    transpose rule (half operands, ``preferred_element_type=float32``; no public route
    gives that), reading only the undefined kernel's ``aval``: the same on jax 0.10.2 and
    0.12.1. If jax renames or changes it, ``tests/autocast/test_autocast_reduce_dtype.py``
    fails too; mirror the new rule in ``_conv_kernel_cotangent``."""
    import inspect

    from jax._src.lax.convolution import _conv_general_dilated_transpose_rhs as rule

    assert list(inspect.signature(rule).parameters) == [
        "g", "lhs", "rhs", "window_strides", "padding", "lhs_dilation", "rhs_dilation",
        "dimension_numbers", "feature_group_count", "batch_group_count", "precision",
        "preferred_element_type", "out_sharding",
    ]  # fmt: skip
    source = inspect.getsource(rule)
    assert "rhs.aval" in source and "rhs." not in source.replace("rhs.aval", "")
