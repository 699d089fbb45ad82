"""Gradient reduction across devices in float32 (issue #45): ``reduce_dtype``.

Under ``jamp.autocast`` a float32 parameter read by a half product gets its gradient from
the transposed product accumulated into float32 (``autocast.sums``), so XLA sums the
per-device partial gradients of an FSDP or data-parallel step in float32;
``reduce_dtype=<the half dtype>`` keeps the half product's own transpose. The CPU backend
widens half-precision collectives, so the half wire is simulated here (a 64-way sum in
bfloat16 against float32's); the GPU programs' collectives are in
``tests/test_gpu_compile_8.py``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jamp

BF16 = jnp.bfloat16


def _mlp(params, x, y):
    h = x
    for w in params:
        h = jax.nn.relu(h @ w)
    return jnp.mean(jnp.square(h.astype(jnp.float32) - y))


def _problem(width=64, layers=3, batch=64, seed=0):
    rng = np.random.default_rng(seed)
    params = [
        jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width), jnp.float32)
        for _ in range(layers)
    ]
    x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    return params, x, y


def _eqns(closed, name):
    """Every equation of primitive ``name`` in a closed jaxpr, its sub-jaxprs included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == name:
                found.append(eqn)
            for v in eqn.params.values():
                for j in v if isinstance(v, (list, tuple)) else [v]:
                    inner = getattr(j, "jaxpr", j)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return found


def _all_dots(closed):
    """Every dot_general of a closed jaxpr, its sub-jaxprs included: (operand dtypes, out)."""
    return [
        (tuple(str(v.aval.dtype) for v in e.invars), str(e.outvars[0].aval.dtype))
        for e in _eqns(closed, "dot_general")
    ]


# ---------------------------------------------------------------- the option


F32_PRODUCT = (("bfloat16", "bfloat16"), "float32")  # half operands, float32 accumulation


def test_a_parameters_gradient_comes_from_a_float32_product_of_half_operands():
    params, x, y = _problem(16, 2, 8)
    wide = jamp.autocast(_mlp, BF16, reduce_dtype=jnp.float32)
    dots = _all_dots(jax.make_jaxpr(jax.grad(wide))(params, x, y))
    # the weight gradients (and the float32 input's, unused) accumulate into float32 from
    # bfloat16 operands; the forward products and the hidden activation's gradient are
    # bfloat16 products
    assert dots.count(F32_PRODUCT) >= 2, dots
    assert (("bfloat16", "bfloat16"), "bfloat16") in dots
    assert all(ins == ("bfloat16", "bfloat16") for ins, _ in dots), dots
    half = jax.make_jaxpr(jax.grad(jamp.autocast(_mlp, BF16, reduce_dtype=BF16)))(params, x, y)
    assert all(out == "bfloat16" for _, out in _all_dots(half)), _all_dots(half)


def test_the_default_is_float32_in_a_sharded_program_only():
    # One device: the half product's own transpose (the suite's one-GPU programs are
    # unchanged). Arguments on a mesh of 8 devices: float32 weight-gradient products.
    params, x, y = _problem(16, 2, 8)
    grad = jax.grad(jamp.autocast(_mlp, BF16))
    assert F32_PRODUCT not in _all_dots(jax.make_jaxpr(grad)(params, x, y))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    on_mesh = jax.device_put((params, x, y), NamedSharding(mesh, P("data", None)))
    assert F32_PRODUCT in _all_dots(jax.jit(grad).trace(*on_mesh).jaxpr)
    replicated = jax.device_put((params, x, y), NamedSharding(mesh, P()))  # data parallel
    assert F32_PRODUCT in _all_dots(jax.jit(grad).trace(*replicated).jaxpr)


def test_forward_values_are_unchanged_and_gradients_closer_to_float32():
    params, x, y = _problem()
    wide = jamp.autocast(_mlp, BF16, reduce_dtype=jnp.float32)
    halfway = jamp.autocast(_mlp, BF16)  # one device: the half product's transpose
    assert wide(params, x, y) == halfway(params, x, y)  # bit for bit
    ref = jax.grad(_mlp)(params, x, y)
    for g in (jax.grad(wide)(params, x, y), jax.grad(halfway)(params, x, y)):
        assert all(a.dtype == jnp.float32 for a in g)

    def err(g):
        return sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(g, ref, strict=True))

    assert err(jax.grad(wide)(params, x, y)) < err(jax.grad(halfway)(params, x, y))


def test_the_option_on_the_policy_and_its_refusals():
    params, x, y = _problem(16, 2, 8)
    policy = jamp.Policy(jnp.float32, BF16, jnp.float32, reduce_dtype=BF16)
    assert str(policy) == "p=float32,c=bfloat16,o=float32,r=bfloat16"
    assert str(jamp.Policy(jnp.float32, BF16, jnp.float32)) == "p=float32,c=bfloat16,o=float32"
    by_policy = jax.make_jaxpr(jax.grad(jamp.autocast(_mlp, policy=policy)))(params, x, y)
    assert all(out == "bfloat16" for _, out in _all_dots(by_policy))
    f32 = jamp.autocast(_mlp, policy=policy, reduce_dtype=jnp.float32)  # the argument wins
    assert F32_PRODUCT in _all_dots(jax.make_jaxpr(jax.grad(f32))(params, x, y))
    with pytest.raises(ValueError, match="reduce_dtype"):
        jamp.autocast(_mlp, BF16, reduce_dtype=jnp.float16)
    with pytest.raises(TypeError, match="reduce_dtype"):
        jamp.autocast(_mlp, BF16, reduce_dtype=jnp.int32)
    deco = jamp.autocast(reduce_dtype="bf16")(_mlp)  # the decorator form keeps it
    assert all(
        out == "bfloat16" for _, out in _all_dots(jax.make_jaxpr(jax.grad(deco))(params, x, y))
    )


# ---------------------------------------------------------------- numerics on 8 devices


def test_the_sharded_gradient_equals_one_devices_within_float32_reduction():
    # FSDP on the 8 CPU devices: parameters P("data", None), the batch sharded; jit.
    params, x, y = _problem(64, 3, 64)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    shard = NamedSharding(mesh, P("data", None))
    f = jax.jit(jax.grad(jamp.autocast(_mlp, BF16)))  # float32 reduction: sharded
    one = jax.jit(jax.grad(jamp.autocast(_mlp, BF16, reduce_dtype=jnp.float32)))(params, x, y)
    sharded = f(*jax.device_put((params, x, y), shard))
    for a, b in zip(sharded, one, strict=True):
        assert a.dtype == jnp.float32
        # the same float32 products, summed in another order: float32's rounding only
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_a_64_way_bfloat16_sum_against_float32s():
    # The wire of 64 devices, simulated: each device's partial weight gradient (autocast,
    # a 64th of the batch) summed across devices in ring order, each partial sum rounded
    # to the wire's dtype. float32 (the default) stays at float32's rounding; bfloat16
    # (reduce_dtype=bfloat16: the partials rounded to bfloat16 and summed in it) loses
    # about 2 significant digits against the exact sum.
    n, width = 64, 32
    params, x, y = _problem(width, 2, 4 * n, seed=1)
    xs, ys = x.reshape(n, -1, width), y.reshape(n, -1, width)

    def partials(reduce_dtype):
        loss = jamp.autocast(_mlp, BF16, reduce_dtype=reduce_dtype)
        scaled = lambda p, x, y: loss(p, x, y) / n  # noqa: E731 - the global mean
        return jax.vmap(jax.grad(scaled), in_axes=(None, 0, 0))(params, xs, ys)[0]

    def ring(parts, dtype):
        total = parts[0].astype(dtype)
        for p in parts[1:]:
            total = (total + p.astype(dtype)).astype(dtype)
        return np.asarray(total, np.float64)

    exact = np.sum(np.asarray(partials(jnp.float32), np.float64), axis=0)
    f32 = ring(partials(jnp.float32), jnp.float32)
    bf16 = ring(partials(BF16), BF16)
    rel = lambda a: np.linalg.norm(a - exact) / np.linalg.norm(exact)  # noqa: E731
    assert rel(f32) < 1e-6, rel(f32)
    assert rel(bf16) > 100 * rel(f32) and 1e-3 < rel(bf16) < 5e-2, (rel(bf16), rel(f32))


@pytest.mark.parametrize("spec", [P(None, None), P("data", None)], ids=["replicated", "fsdp"])
def test_an_explicit_mesh_gets_float32_gradients_sharded_as_the_parameters(spec):
    # Explicit axes: the float32 weight-gradient product is sharded as its parameter (jax
    # asks for the sharding of a product that contracts sharded axes).
    params, x, y = _problem(64, 2, 64)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    grad = jax.jit(jax.grad(jamp.autocast(_mlp, BF16)))
    one = jax.jit(jax.grad(jamp.autocast(_mlp, BF16, reduce_dtype=jnp.float32)))(params, x, y)
    with jax.set_mesh(mesh):
        on_mesh = jax.device_put(params, spec), jax.device_put((x, y), P("data", None))
        assert F32_PRODUCT in _all_dots(grad.trace(on_mesh[0], *on_mesh[1]).jaxpr)
        got = grad(on_mesh[0], *on_mesh[1])
    for a, b in zip(got, one, strict=True):
        assert a.dtype == jnp.float32 and a.sharding.spec == spec
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(b))))


# ---------------------------------------------------------------- convolutions


class _CNN(nn.Module):
    """A Flax conv, then a depthwise one (feature groups: jax's transpose makes them batch
    groups), each kernel (3, 3, ., 8) float32."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))
        return nn.Conv(8, (3, 3), strides=2, feature_group_count=8)(x)


def _cnn_loss(params, x):
    return jnp.mean(jnp.square(_CNN().apply({"params": params}, x).astype(jnp.float32)))


def _all_convs(closed):
    """Every conv_general_dilated of a closed jaxpr: (operand dtypes, preferred type, out)."""
    found = []
    for e in _eqns(closed, "conv_general_dilated"):
        preferred = e.params["preferred_element_type"]
        preferred = None if preferred is None else str(np.dtype(preferred))
        ins = tuple(str(v.aval.dtype) for v in e.invars)
        found.append((ins, preferred, str(e.outvars[0].aval.dtype)))
    return found


F32_CONV = (("bfloat16", "bfloat16"), "float32", "float32")  # half operands, float32 sums
HALF_CONV = (("bfloat16", "bfloat16"), None, "bfloat16")


@pytest.fixture(scope="module")
def cnn():
    """The CNN's parameters and a batch of 16 8x8x4 images, on one device and on the mesh
    of 8 (data parallel: kernels replicated, the batch sharded)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 8, 8, 4)), jnp.float32)
    shapes = {"Conv_0": (3, 3, 4, 8), "Conv_1": (3, 3, 1, 8)}  # what _CNN().init makes
    params = {
        k: {"kernel": jnp.asarray(rng.standard_normal(s) / 3, jnp.float32),
            "bias": jnp.asarray(rng.standard_normal(8) / 8, jnp.float32)}
        for k, s in shapes.items()
    }  # fmt: skip
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    on_mesh = (
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.device_put(x, NamedSharding(mesh, P("data"))),
    )
    return (params, x), on_mesh


def test_a_conv_kernels_gradient_is_a_float32_conv_of_half_operands_when_sharded(cnn):
    one, on_mesh = cnn
    grad = jax.jit(jax.grad(jamp.autocast(_cnn_loss, BF16)))
    # one device: every conv is jax's half conv (the suite's one-GPU programs unchanged)
    assert set(_all_convs(grad.trace(*one).jaxpr)) == {HALF_CONV}
    # sharded: each kernel's gradient (the regular and the depthwise conv's) accumulates
    # into float32 from the bfloat16 input and output cotangent; the forward convs and the
    # hidden activation's cotangent stay half convs
    sharded = _all_convs(grad.trace(*on_mesh).jaxpr)
    assert sharded.count(F32_CONV) == 2 and set(sharded) == {F32_CONV, HALF_CONV}, sharded
    assert sharded.count(HALF_CONV) >= 3, sharded  # 2 forward, 1 the activation's cotangent
    half = jax.jit(jax.grad(jamp.autocast(_cnn_loss, BF16, reduce_dtype=BF16)))
    assert set(_all_convs(half.trace(*on_mesh).jaxpr)) == {HALF_CONV}
    explicit = jax.grad(jamp.autocast(_cnn_loss, BF16, reduce_dtype=jnp.float32))
    assert _all_convs(jax.make_jaxpr(explicit)(*one)).count(F32_CONV) == 2


def test_a_sharded_conv_gradient_equals_one_devices_within_float32_reduction(cnn):
    one, on_mesh = cnn
    loss = jamp.autocast(_cnn_loss, BF16)
    wide = jamp.autocast(_cnn_loss, BF16, reduce_dtype=jnp.float32)
    value, ref = jax.jit(jax.value_and_grad(wide))(*one)
    assert value == jax.jit(loss)(*one)  # forward values bit for bit
    got = jax.jit(jax.grad(loss))(*on_mesh)
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = ref[path[0].key][path[1].key]
        assert a.dtype == jnp.float32
        # the same float32 sums in another order: float32's rounding only (a bias's
        # gradient sums 1,024 positions that cancel, so its bound is wider)
        tol = 1e-6 if path[1].key == "kernel" else 1e-5
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * float(jnp.max(jnp.abs(b))))
