"""jamp/_src/deprecations.py: renamed names and arguments keep working, and warn."""

import warnings

import jax.numpy as jnp
import optax
import pytest

import jamp
from jamp._src.deprecations import Rename, module_getattr

OLD_NAME = "LossScaling" + "State"  # spelled apart: test_namespaces finds only real uses
RENAMED = (
    rf"^jamp\.{OLD_NAME} is deprecated since jamp 0\.2\.0 and will be removed in jamp 0\.3\.0: "
    r"it was renamed jamp\.ScaledOptimizerState \(the same object\)\. Write "
    r"jamp\.ScaledOptimizerState instead\.$"
)


def test_the_old_name_of_the_optax_state_is_the_new_class_and_warns():
    with pytest.warns(DeprecationWarning, match=RENAMED):
        old = getattr(jamp, OLD_NAME)
    assert old is jamp.ScaledOptimizerState
    state = jamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    with pytest.warns(DeprecationWarning, match=RENAMED):
        assert isinstance(state, getattr(jamp, OLD_NAME))  # an isinstance check still holds


def test_importing_the_old_name_warns_where_it_is_imported():
    with pytest.warns(DeprecationWarning, match=RENAMED) as record:
        exec(f"from jamp import {OLD_NAME}", {})
    assert record[0].filename == "<string>"  # the importing line, not jamp's __getattr__


def test_the_old_name_is_neither_listed_nor_exported():
    assert OLD_NAME not in jamp.__all__ and OLD_NAME not in dir(jamp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        namespace = {}
        exec("from jamp import *", namespace)  # no warning: the old name is not in __all__
    assert "ScaledOptimizerState" in namespace and OLD_NAME not in namespace


def test_an_unknown_name_is_pythons_attribute_error():
    with pytest.raises(AttributeError, match=r"^module 'jamp' has no attribute 'loss_scaling_'$"):
        jamp.loss_scaling_  # noqa: B018


def test_module_getattr_serves_any_rename_with_its_versions():
    class New:
        pass

    getattr_ = module_getattr("pkg", {"Old": Rename("New", New, since="1.4.0", removed_in="2.0.0")})
    with pytest.warns(
        DeprecationWarning,
        match=r"^pkg\.Old is deprecated since jamp 1\.4\.0 and will be removed in jamp 2\.0\.0",
    ):
        assert getattr_("Old") is New
    with pytest.raises(AttributeError, match="'pkg' has no attribute 'New'"):
        getattr_("New")
