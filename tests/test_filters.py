"""The ``filter=`` argument of scale, unscale, all_finite, unscale_and_check, select_tree,
nonfinite_report and log_nonfinite: trees holding non-array leaves (an Equinox module's
activation function, a string, a Python flag) when asked to, strict by default.

Equinox is not needed here: ``is_inexact_array`` below is ``eqx.is_inexact_array``.
"""

import ast
import logging
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jamp
from jamp._src.leaves import combine, partition


def is_inexact_array(x):
    """Equinox's ``eqx.is_inexact_array``."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
        x.dtype, jnp.inexact
    )


def identity(x):
    return x


INDEX = np.arange(3)


def module_like(w=None):
    """What an ``eqx.nn.MLP`` flattens to: arrays, its activation functions, and
    the Python values of fields that are not static."""
    return {
        "layers": [
            {"weight": jnp.ones((2, 3)) if w is None else w, "bias": jnp.zeros(2)},
            {"weight": jnp.full((1, 2), 2.0, jnp.bfloat16), "bias": jnp.zeros(1, jnp.bfloat16)},
        ],
        "activation": jax.nn.relu,  # a custom_jvp: not a valid JAX type
        "final_activation": identity,
        "axis_name": "batch",
        "inference": False,
        "eps": 1e-5,  # a Python float the module does not differentiate
        "index": INDEX,  # an integer array
    }


STATE = jamp.static_loss_scale(4.0)
STRICT = [
    ("scale", lambda t, **kw: jamp.scale(STATE, t, **kw)),
    ("unscale", lambda t, **kw: jamp.unscale(STATE, t, **kw)),
    ("all_finite", lambda t, **kw: jamp.all_finite(t, **kw)),
    ("unscale_and_check", lambda t, **kw: jamp.unscale_and_check(STATE, t, **kw)),
    ("debug.nonfinite_report", lambda t, **kw: jamp.debug.nonfinite_report(t, **kw)),
    ("debug.log_nonfinite", lambda t, **kw: jamp.debug.log_nonfinite(t, **kw)),
]


@pytest.mark.parametrize("name,fn", STRICT, ids=[n for n, _ in STRICT])
def test_default_stays_strict_and_names_the_fix(name, fn):
    with pytest.raises(
        TypeError,
        match=rf"`jamp\.{re.escape(name)}` expected a pytree of arrays.*"
        r"custom_jvp at path \['activation'\].*filter=eqx\.is_inexact_array",
    ):
        fn(module_like())


@pytest.mark.parametrize("name,fn", STRICT, ids=[n for n, _ in STRICT])
def test_a_filter_that_is_not_callable_is_refused(name, fn):
    with pytest.raises(
        TypeError, match=rf"`jamp\.{re.escape(name)}` expected `filter` to be a function"
    ):
        fn({"w": jnp.ones(2)}, filter=True)


def test_select_tree_refuses_a_filter_that_is_not_callable():
    with pytest.raises(TypeError, match=r"`jamp\.compat\.select_tree` expected `filter`"):
        jamp.compat.select_tree(jnp.bool_(True), {}, {}, filter="arrays")


def untouched(before, after):
    """Every leaf the filter leaves out is the very same object after."""
    out = [
        a is b
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
        if not is_inexact_array(a)
    ]
    return out and all(out)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_scale_and_unscale_leave_the_other_leaves_untouched(jit):
    tree = module_like()

    def run(w):
        t = module_like(w)
        return jamp.scale(STATE, t, filter=is_inexact_array), jamp.unscale(
            STATE, t, filter=is_inexact_array
        )

    if jit:
        # The non-array leaves cannot cross jit: check the arrays that come out.
        scaled_w, unscaled_w = jax.jit(lambda w: tuple(t["layers"][0]["weight"] for t in run(w)))(
            tree["layers"][0]["weight"]
        )
        assert float(scaled_w[0, 0]) == 4.0 and float(unscaled_w[0, 0]) == 0.25
        return
    scaled, unscaled = run(tree["layers"][0]["weight"])
    assert untouched(tree, scaled) and untouched(tree, unscaled)
    assert scaled["layers"][1]["weight"].dtype == jnp.bfloat16
    assert float(scaled["layers"][1]["weight"][0, 0]) == 8.0
    assert float(unscaled["layers"][1]["weight"][0, 0]) == 0.5
    assert scaled["eps"] == 1e-5 and isinstance(scaled["eps"], float)  # not an array
    assert scaled["index"] is tree["index"]


def test_a_disabled_state_still_validates_only_what_the_filter_selects():
    tree = module_like()
    assert jamp.scale(jamp.no_loss_scale(), tree, filter=is_inexact_array) is tree
    assert jamp.unscale(jamp.no_loss_scale(), tree, filter=is_inexact_array) is tree
    with pytest.raises(TypeError, match="custom_jvp"):
        jamp.scale(jamp.no_loss_scale(), tree)


def test_the_filter_decides_which_floating_leaves_are_touched():
    tree = {"f32": jnp.ones(2), "bf16": jnp.ones(2, jnp.bfloat16)}
    only_f32 = lambda x: x.dtype == jnp.float32  # noqa: E731
    out = jamp.unscale(STATE, tree, filter=only_f32)
    assert float(out["f32"][0]) == 0.25 and out["bf16"] is tree["bf16"]
    bad = {"f32": jnp.ones(2), "bf16": jnp.full(2, jnp.inf, jnp.bfloat16)}
    assert bool(jamp.all_finite(bad, filter=only_f32))
    assert not bool(jamp.all_finite(bad))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_all_finite_and_unscale_and_check_see_only_the_selected_leaves(jit):
    def check(w):
        t = module_like(w)
        g, finite = jamp.unscale_and_check(STATE, t, filter=is_inexact_array)
        return jamp.all_finite(t, filter=is_inexact_array), finite, g["layers"][0]["weight"]

    run = jax.jit(check) if jit else check
    ok, ok2, g = run(jnp.ones((2, 3)))
    assert bool(ok) and bool(ok2) and float(g[0, 0]) == 0.25
    bad, bad2, _ = run(jnp.ones((2, 3)).at[1, 1].set(jnp.nan))
    assert not bool(bad) and not bool(bad2)


def test_unscale_and_check_returns_the_other_leaves_untouched():
    tree = module_like()
    g, finite = jamp.unscale_and_check(STATE, tree, filter=is_inexact_array)
    assert bool(finite) and untouched(tree, g)


def test_a_filter_that_selects_a_function_still_names_it():
    with pytest.raises(TypeError, match=r"custom_jvp at path \['activation'\]"):
        jamp.all_finite(module_like(), filter=lambda x: True)


# ---------------------------------------------------------------- select_tree


def test_select_tree_selects_what_the_filter_selects_and_passes_the_rest():
    old = module_like()
    new = dict(old, layers=[dict(old["layers"][0], weight=jnp.zeros((2, 3))), old["layers"][1]])
    for pred, expect in ((True, 0.0), (False, 1.0)):
        out = jamp.compat.select_tree(jnp.bool_(pred), new, old, filter=is_inexact_array)
        assert float(out["layers"][0]["weight"][0, 0]) == expect
        assert out["activation"] is old["activation"] and out["index"] is old["index"]


def test_select_tree_refuses_different_leaves_the_filter_leaves_out():
    old = module_like()
    new = dict(old, index=jnp.asarray(old["index"]) + 1)  # an int array the filter leaves out
    with pytest.raises(TypeError, match=r"different leaves at path \['index'\], which `filter`"):
        jamp.compat.select_tree(jnp.bool_(False), new, old, filter=is_inexact_array)
    # Without the filter, the int array is selected, and the function passes through.
    out = jamp.compat.select_tree(jnp.bool_(False), new, old)
    assert bool(jnp.array_equal(out["index"], old["index"]))
    with pytest.raises(TypeError, match=r"different leaves at path \['eps'\]"):
        jamp.compat.select_tree(jnp.bool_(True), dict(old, eps=1.0), old, filter=is_inexact_array)


def test_select_tree_with_a_filter_under_jit():
    fn = jax.nn.relu

    @jax.jit
    def step(pred, w_new, w_old, idx):
        new = {"w": w_new, "act": fn, "idx": idx}
        old = {"w": w_old, "act": fn, "idx": idx}
        return jamp.compat.select_tree(pred, new, old, filter=is_inexact_array)["w"]

    args = (jnp.ones(2), jnp.zeros(2), jnp.arange(2))
    assert float(step(jnp.bool_(True), *args)[0]) == 1.0
    assert float(step(jnp.bool_(False), *args)[0]) == 0.0


# ---------------------------------------------------------------- report and log


def test_nonfinite_report_counts_the_selected_leaves_and_drops_the_rest():
    tree = module_like(jnp.ones((2, 3)).at[0].set(jnp.inf))
    report = jamp.debug.nonfinite_report(tree, filter=is_inexact_array)
    assert int(report["layers"][0]["weight"].inf) == 3
    assert int(report["layers"][1]["bias"].nan) == 0
    for key in ("activation", "final_activation", "axis_name", "inference", "eps", "index"):
        assert report[key] is None, key
    counts = jax.tree.leaves(report, is_leaf=lambda x: isinstance(x, jamp.debug.NonfiniteCount))
    assert len(counts) == 4


def test_log_nonfinite_with_a_filter_names_only_array_leaves(caplog):
    @jax.jit
    def step(w):
        return jamp.debug.log_nonfinite(module_like(w), prefix="model: ", filter=is_inexact_array)

    with caplog.at_level(logging.WARNING, logger="jamp"):
        assert bool(step(jnp.ones((2, 3))))
        finite = step(jnp.ones((2, 3)).at[1, 2].set(jnp.nan))
        jax.effects_barrier()
    assert not bool(finite)
    assert [r.getMessage() for r in caplog.records] == [
        "model: non-finite values in layers/0/weight: 0 inf, 1 nan"
    ]


# ---------------------------------------------------------------- partition / combine


def test_partition_and_combine_round_trip():
    tree = module_like()
    arrays, rest = partition(tree, is_inexact_array)
    assert arrays["activation"] is None and rest["layers"][0]["weight"] is None
    back = combine(arrays, rest)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True))


KINDS = st.sampled_from(["f32", "bf16", "f16", "i32", "fn", "str", "bool", "float"])


def make_leaf(kind, value):
    return {
        "f32": lambda: jnp.full((2,), value, jnp.float32),
        "bf16": lambda: jnp.full((2,), value, jnp.bfloat16),
        "f16": lambda: jnp.full((2,), value, jnp.float16),
        "i32": lambda: jnp.full((2,), int(value), jnp.int32),
        "fn": lambda: jnp.tanh,
        "str": lambda: "name",
        "bool": lambda: True,
        "float": lambda: float(value),
    }[kind]()


@settings(deadline=None, max_examples=30)
@given(
    kinds=st.lists(KINDS, min_size=1, max_size=6),
    exponent=st.integers(-8, 8),
    value=st.sampled_from([0.0, 1.5, -3.0, 0.125]),
)
def test_unscale_of_scale_is_the_identity_on_selected_leaves_and_leaves_the_rest(
    kinds, exponent, value
):
    state = jamp.static_loss_scale(2.0**exponent)
    tree = [make_leaf(k, value) for k in kinds]
    out = jamp.unscale(
        state, jamp.scale(state, tree, filter=is_inexact_array), filter=is_inexact_array
    )
    for before, after in zip(tree, out, strict=True):
        if is_inexact_array(before):
            assert after.dtype == before.dtype
            assert bool(jnp.array_equal(after, before))
        else:
            assert after is before
    assert bool(jamp.all_finite(out, filter=is_inexact_array))


# ---------------------------------------------------------------- equinox stays optional


def test_jamp_never_imports_equinox():
    """Equinox is an optional extra: jamp works with its modules by a filter argument and
    duck typing, and imports without it."""
    root = pathlib.Path(jamp.__file__).resolve().parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "equinox" for n in names), path
    code = (
        "import sys; sys.modules['equinox'] = None; import jamp, jax.numpy as jnp; "
        "out = jamp.filter_value_and_grad(lambda m: jnp.sum(m['w']))("
        "jamp.dynamic_loss_scale(), {'w': jnp.ones(2), 'f': len}); "
        "assert out.grads['f'] is None and sys.modules['equinox'] is None"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(root.parent), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
