"""``jamp.debug.precision_report``: each operation of an autocast step against the same
step in float32, checked against a hand computation, on the demo's float16 underflow,
and recipe beside recipe."""

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp._src.numerics.program import compiler_options

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tiny(w, x):
    return jnp.sum(x @ w)


X = np.array([[1 + 2.0**-12, 1e-8, 3.0, 5.0]], np.float32)  # float16: 1, 0, 3, 5


def test_the_figures_match_a_hand_computation():
    """float16 rounds 1 + 2**-12 to 1 and flushes 1e-8 to zero; 3 and 5 are exact. The
    cast of x, the product, the loss and the weight gradient carry exactly those
    errors, and a quarter of x's nonzero values underflow."""
    w, x = jnp.ones((4, 1)), jnp.asarray(X)
    report = jamp.debug.precision_report(_tiny, w, x, dtype=jnp.float16)
    lost = np.array([2.0**-12, 1e-8, 0, 0])
    rel = np.linalg.norm(lost) / np.linalg.norm(X.astype(np.float64))
    cast = next(
        r
        for r in report.rows
        if r.primitive == "convert_element_type"
        and r.dtype == "float16"
        and not r.backward
        and r.underflow > 0
    )
    assert cast.underflow == 0.25 and cast.overflow == 0
    assert cast.added == pytest.approx(rel, rel=1e-6) and cast.error == pytest.approx(rel, rel=1e-6)
    product = next(r for r in report.rows if r.primitive == "dot_general" and not r.backward)
    exact = 9 + 2.0**-12 + 1e-8
    assert product.error == pytest.approx((exact - 9) / exact, rel=1e-4)
    assert product.dtype == "float16"
    recipe = report.recipes[0]
    assert recipe.loss == 9.0 and recipe.loss_float32 == pytest.approx(exact, rel=1e-7)
    (leaf,) = report.gradients
    assert leaf.path == "argument 0" and leaf.underflow == 0.25 and leaf.nonzero == 4
    assert leaf.error == pytest.approx(rel, rel=1e-6)
    weight_grad = next(r for r in report.rows if r.primitive == "dot_general" and r.backward)
    assert weight_grad.role.startswith("weight gradient argument 0 of the product at")


def test_backward_products_are_named_by_operand_and_parameter():
    """A two-layer MLP under bfloat16: each backward product says whether it is an input
    or a weight gradient, and names the weight's parameter."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (8, 16)), "w2": jax.random.normal(k2, (16, 4))}
    x = jax.random.normal(k3, (32, 8))

    def loss(p, x):
        h = jnp.tanh(x @ p["w1"])
        return jnp.mean((h @ p["w2"]) ** 2)

    report = jamp.debug.precision_report(loss, params, x)
    roles = sorted(
        r.role.split(" of ")[0] for r in report.rows if r.primitive == "dot_general" and r.backward
    )
    assert roles == ["input gradient", "weight gradient ['w1']", "weight gradient ['w2']"]
    assert {g.path for g in report.gradients} == {"['w1']", "['w2']"}
    assert all(0 < g.error < 0.05 for g in report.gradients)
    # The widened program is the float32 step: its loss is float32's.
    assert report.recipes[0].loss_float32 == pytest.approx(float(loss(params, x)), rel=1e-6)
    # Both steps' temp memory, compiled beside the report's own work (in a thread): the
    # figures of the same programs compiled here.
    options = compiler_options()

    def temp(fun):
        lowered = jax.jit(jax.value_and_grad(fun)).lower(params, x)
        return lowered.compile(options).memory_analysis().temp_size_in_bytes

    float32, low = temp(loss), temp(jamp.autocast(loss, jnp.bfloat16))
    assert (report.float32_temp_bytes, report.recipes[0].temp_bytes) == (float32, low)
    assert float32 > 0 and low > 0


def _demo():
    spec = importlib.util.spec_from_file_location(
        "train_digits_demo", ROOT / "examples" / "train_digits.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_report_finds_the_demos_float16_underflow_in_its_layers():
    """The digits demo's float16 run without loss scaling: the report's gradient leaves
    lose the fraction of nonzero gradients the demo plots (its ``underflow_probe``,
    recomputed here), and its worst operations are the backward products of the
    network's layers, flushing most of their values."""
    demo = _demo()
    x_train, y_train, _, _ = demo.load_data(0)
    x, y = jnp.asarray(x_train[:64]), jnp.asarray(y_train[:64])
    model = demo.CNN()
    params = model.init(jax.random.PRNGKey(0), x[:1])

    def loss(p, x, y):
        return demo.loss_fn(model.apply, p, x, y)

    report = jamp.debug.precision_report(loss, params, x, y, dtype=jnp.float16)
    lost = sum(g.underflow * g.nonzero for g in report.gradients)
    nonzero = sum(g.nonzero for g in report.gradients)

    # The demo's probe, as train_digits.underflow_probe computes it (one jitted program).
    @jax.jit
    def underflow_probe(params, x, y):
        grads = jax.grad(lambda p: demo.loss_fn(jamp.autocast(model.apply, jnp.float16), p, x, y))(
            params
        )
        reference = jax.grad(loss)(params, x, y)
        return sum(
            jnp.sum((g == 0) & (r != 0))
            for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True)
        ) / sum(jnp.sum(r != 0) for r in jax.tree.leaves(reference))

    probe = underflow_probe(params, x, y)
    assert lost / nonzero == pytest.approx(float(probe), abs=0.01)
    assert lost / nonzero > 0.5
    worst = report.rows[:4]
    assert all(r.backward and r.underflow > 0.5 for r in worst)
    assert {r.path.split("/")[-1] for r in worst} & {"Dense_0", "Dense_1", "Conv_0", "Conv_1"}
    assert "float16: the 12 worst operations" in str(report)


def test_recipes_side_by_side():
    """float16, bfloat16 and float8 on one function: one report, one table each, a
    summary line each; ``rows`` asks which recipe."""
    k1, k2 = jax.random.split(jax.random.key(1))
    w, x = jax.random.normal(k1, (16, 8)) / 4, jax.random.normal(k2, (32, 16))
    report = jamp.debug.precision_report(_tiny, w, x, dtype=[jnp.float16, jnp.bfloat16, "float8"])
    assert [r.dtype for r in report.recipes] == ["float16", "bfloat16", "float8"]
    text = str(report)
    for name in ("float16", "bfloat16", "float8"):
        assert f"{name}: the" in text
    with pytest.raises(ValueError, match="several recipes"):
        _ = report.rows
    quantised = [r for r in report["float8"].rows if r.scale is not None]
    assert len(quantised) == 3  # x and w forward (e4m3), the gradient backward (e5m2)
    assert all(r.saturated == 0 and r.amax > 0 for r in quantised)
    assert report["bfloat16"].gradients[0].error < report["float8"].gradients[0].error


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="`dtype`"):
        jamp.debug.precision_report(_tiny, jnp.ones((4, 1)), jnp.ones((1, 4)), dtype=jnp.int8)
    with pytest.raises(ValueError, match="`dtype`"):
        jamp.debug.precision_report(_tiny, jnp.ones((4, 1)), jnp.ones((1, 4)), dtype=[])
    with pytest.raises(TypeError, match="`fun`"):
        jamp.debug.precision_report(None, jnp.ones(3))  # type: ignore[arg-type]


def test_a_shard_map_is_one_operation_run_widened_under_its_mesh():
    """A step with ``shard_map`` (its body's collectives need the mesh's axes): the report
    runs the shard_map as one operation, widened under the same shard_map, whose float32
    twin is float32's step (before: a NameError from jax, "unbound axis name")."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))

    def local(w, x):
        return jax.lax.pmean(jnp.mean(jnp.square(jnp.tanh(x @ w))), "b")

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("b")), out_specs=P())
    k1, k2 = jax.random.split(jax.random.key(2))
    w, x = jax.random.normal(k1, (16, 16)) / 4, jax.random.normal(k2, (64, 16))
    recipe = jamp.debug.precision_report(f, w, x)["bfloat16"]
    assert recipe.loss_float32 == pytest.approx(float(jax.jit(f)(w, x)), rel=1e-6)
    maps = [r for r in recipe.rows if r.primitive == "shard_map"]
    assert {r.backward for r in maps} == {False, True}
    assert all(0 < r.error < 0.05 for r in maps if r.dtype == "bfloat16")
    (leaf,) = [g for g in recipe.gradients if g.path == "argument 0"]
    want = jax.jit(jax.grad(f))(w, x)
    assert 0 < leaf.error < 0.05 and np.all(np.isfinite(np.asarray(want)))
