"""The public namespaces: ``jamp`` (at most 25 names, the main paths), ``jamp.float8``,
``jamp.debug`` and ``jamp.compat``; every name that moved still works where it was, with
a DeprecationWarning naming its new home; ``import jamp`` imports neither flax nor equinox."""

import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

import jamp

ROOT = pathlib.Path(__file__).resolve().parent.parent

# old top-level name -> (what to write instead, the object it serves)
MOVED = {
    "DelayedScaling": "jamp.float8.DelayedScaling",
    "Float8State": "jamp.float8.Float8State",
    "float8_init": "jamp.float8.init",
    "autocast_report": "jamp.debug.autocast_report",
    "AutocastReport": "jamp.debug.AutocastReport",
    "nonfinite_report": "jamp.debug.nonfinite_report",
    "log_nonfinite": "jamp.debug.log_nonfinite",
    "NonfiniteCount": "jamp.debug.NonfiniteCount",
    "select_tree": "jamp.compat.select_tree",
    "get_policy": "jamp.compat.get_policy",
    "half_dtype": "jamp.compat.half_dtype",
    "parse_dtype": "jamp.compat.parse_dtype",
    "from_flax_dynamic_scale": "jamp.compat.from_flax_dynamic_scale",
}


def _resolve(dotted):
    obj = jamp
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def test_the_top_level_holds_the_main_paths_only():
    assert len(jamp.__all__) <= 25, jamp.__all__
    assert len(set(jamp.__all__)) == len(jamp.__all__)
    public = {n for n in dir(jamp) if not n.startswith("_")}
    assert public == set(jamp.__all__) | {"float8", "debug", "optimizer", "compat"}
    for name in jamp.__all__:
        assert getattr(jamp, name).__module__.startswith("jamp._src."), name


@pytest.mark.parametrize("namespace", ["float8", "debug", "optimizer", "compat"])
def test_each_namespace_lists_what_it_holds(namespace):
    module = getattr(jamp, namespace)
    assert module.__doc__
    assert sorted(n for n in dir(module) if not n.startswith("_")) == sorted(module.__all__)
    for name in module.__all__:
        assert not name.startswith("_") and callable(getattr(module, name)), name
    assert not set(module.__all__) & set(jamp.__all__)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_name_still_works_and_names_its_new_home(old):
    new = MOVED[old]
    want = (
        rf"^jamp\.{old} is deprecated since jamp 0\.2\.0 and will be removed in jamp 0\.3\.0: "
        rf"it moved to {re.escape(new)} \(the same object\)\. Write {re.escape(new)} instead\.$"
    )
    with pytest.warns(DeprecationWarning, match=want):
        assert getattr(jamp, old) is _resolve(new)
    with pytest.warns(DeprecationWarning, match=want) as record:
        exec(f"from jamp import {old}", {})
    assert record[0].filename == "<string>"  # the importing line, not jamp's __getattr__


def test_autocast_disabled_is_now_written_with_enabled_false():
    import jax
    import jax.numpy as jnp

    want = r"it is now written jamp\.autocast\(fun, enabled=False\)\. Write jamp\.autocast\("
    with pytest.warns(DeprecationWarning, match=want):
        disabled = jamp.autocast_disabled
    f = jamp.autocast(lambda x: disabled(lambda y: y @ y)(x) + x @ x)
    eqns = jax.make_jaxpr(f)(jnp.ones((2, 2))).eqns
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert [str(e.outvars[0].aval.dtype) for e in dots] == ["float32", "bfloat16"]


def test_star_import_brings_the_main_paths_and_no_old_name():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        namespace = {}
        exec("from jamp import *", namespace)
    assert set(jamp.__all__) <= set(namespace)
    assert not set(MOVED) & set(namespace)


SKIP = {"build", "dist", "site", "runs", "venv", "node_modules"}
# Where an old name may still be written: its alias, its tests, the records of the past.
ALLOWED = {
    "jamp/__init__.py",
    "CHANGELOG.md",
    "tests/test_namespaces.py",
    "tests/test_deprecations.py",
    "benchmarks/RESULTS.md",
    "benchmarks/FINDINGS.md",
}


def test_nothing_in_the_repository_uses_a_moved_name():
    old_names = [*MOVED, "autocast_disabled", "LossScaling" + "State"]
    old = re.compile(r"\bjamp\\?\.(" + "|".join(old_names) + r")\b")
    users = []
    for folder, dirs, files in os.walk(ROOT):  # pruned: no .git, venvs, caches or builds
        dirs[:] = [d for d in dirs if not d.startswith((".", "_")) and d not in SKIP]
        for name in files:
            path = pathlib.Path(folder, name)
            rel = path.relative_to(ROOT).as_posix()
            if path.suffix in {".py", ".md", ".toml", ".yml", ".sh"} and rel not in ALLOWED:
                users += [f"{rel}: {m.group(0)}" for m in old.finditer(path.read_text())]
    assert users == []


def test_import_jamp_imports_neither_flax_nor_equinox():
    """jamp first, flax after: a Flax TrainState with a loss-scaled optimizer still saves and
    restores with flax.serialization, as when flax was imported by jamp."""
    code = (
        "import sys, jamp\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('flax', 'equinox')]\n"
        "import jax.numpy as jnp, optax\n"
        "from flax import serialization\n"  # registers jamp's states, as it is imported
        "from flax.training import train_state\n"
        "tx = jamp.loss_scaling(optax.sgd(0.1), jamp.dynamic_loss_scale(1024.0))\n"
        "ts = train_state.TrainState.create(apply_fn=None, params={'w': jnp.ones(2)}, tx=tx)\n"
        "saved = serialization.to_bytes(ts)\n"
        "new = jamp.GradScaler().init()\n"
        "assert set(serialization.to_state_dict(new)) == {'scale', 'growth_tracker', "
        "'overflow_streak'}\n"
        "fresh = ts.replace(opt_state=tx.init({'w': jnp.ones(2)})._replace(\n"
        "    loss_scale=jamp.dynamic_loss_scale(2.0)))\n"
        "back = serialization.from_bytes(fresh, saved)\n"
        "assert float(jamp.get_loss_scale(back.opt_state).scale) == 1024.0\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
