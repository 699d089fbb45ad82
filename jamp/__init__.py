"""jamp: automatic mixed precision for JAX.

Loss scaling with immutable state and pure functions, an Optax transformation
that mirrors ``torch.amp.GradScaler``, and op-level ``autocast``. The main
paths are here; four namespaces hold the rest: ``jamp.float8`` (float8
products' delayed scaling), ``jamp.debug`` (what overflowed, what autocast
ran and kept), ``jamp.optimizer`` (the optimizer-memory states) and
``jamp.compat`` (jmp's and flax's helpers, for migrants).
"""

from jamp import compat, debug, float8, optimizer  # noqa: F401 (the namespaces)
from jamp._src import flax_support as _flax_support
from jamp._src.autocast.api import autocast
from jamp._src.autocast.api import autocast_disabled as _autocast_disabled
from jamp._src.deprecations import Rename as _Rename
from jamp._src.deprecations import module_getattr as _module_getattr
from jamp._src.finite.check import all_finite, unscale_and_check
from jamp._src.grad_scaler.scaler import GradScaler, GradScalerState
from jamp._src.lookup import check_restored, get_loss_scale, metrics
from jamp._src.loss_scale import (
    LossScaleState,
    dynamic_loss_scale,
    no_loss_scale,
    scale,
    static_loss_scale,
    unscale,
    update,
)
from jamp._src.loss_scaling import ScaledOptimizerState, loss_scaling, multi_steps
from jamp._src.optimizer.master import master_weights
from jamp._src.optimizer.state import low_precision_state
from jamp._src.policy import Policy
from jamp._src.value_and_grad import (
    ScaledValueAndGrad,
    filter_value_and_grad,
    step_if_finite,
    value_and_grad,
)

# Flax checkpoints of jamp's states: registered now if flax.serialization is loaded, else
# when it is first imported (jamp never imports flax itself).
_flax_support.register_when_imported()

# The one place the version is written: pyproject.toml reads it ([tool.setuptools.dynamic]).
__version__ = "0.2.0"


def _moved(new: str, obj: object) -> _Rename:
    return _Rename(new, obj, since="0.2.0", how="moved to")


# Old names, served with a DeprecationWarning until they are removed (CHANGELOG.md).
__getattr__ = _module_getattr(
    "jamp",
    {
        "LossScalingState": _Rename("ScaledOptimizerState", ScaledOptimizerState, since="0.2.0"),
        "autocast_disabled": _Rename(
            "autocast(fun, enabled=False)",
            _autocast_disabled,
            since="0.2.0",
            how="is now written",
            same_object=False,
        ),
        "DelayedScaling": _moved("float8.DelayedScaling", float8.DelayedScaling),
        "Float8State": _moved("float8.Float8State", float8.Float8State),
        "float8_init": _moved("float8.init", float8.init),
        "autocast_report": _moved("debug.autocast_report", debug.autocast_report),
        "AutocastReport": _moved("debug.AutocastReport", debug.AutocastReport),
        "nonfinite_report": _moved("debug.nonfinite_report", debug.nonfinite_report),
        "log_nonfinite": _moved("debug.log_nonfinite", debug.log_nonfinite),
        "NonfiniteCount": _moved("debug.NonfiniteCount", debug.NonfiniteCount),
        "select_tree": _moved("compat.select_tree", compat.select_tree),
        "get_policy": _moved("compat.get_policy", compat.get_policy),
        "half_dtype": _moved("compat.half_dtype", compat.half_dtype),
        "parse_dtype": _moved("compat.parse_dtype", compat.parse_dtype),
        "from_flax_dynamic_scale": _moved(
            "compat.from_flax_dynamic_scale", compat.from_flax_dynamic_scale
        ),
    },
)

# The main paths, for each audience (docs/index.md has the map). At most 25 names
# (tests/test_namespaces.py): the rest lives in jamp.float8, jamp.debug and jamp.compat.
__all__ = [
    # the loss-scale state and its pure functions
    "LossScaleState",
    "dynamic_loss_scale",
    "static_loss_scale",
    "no_loss_scale",
    "scale",
    "unscale",
    "update",
    "all_finite",
    "unscale_and_check",
    # Optax: the transformations, and finding their state
    "loss_scaling",
    "multi_steps",
    "ScaledOptimizerState",
    "get_loss_scale",
    "metrics",
    "check_restored",
    # scale, differentiate, unscale and check in one call (Equinox: filter_...)
    "value_and_grad",
    "filter_value_and_grad",
    "step_if_finite",
    "ScaledValueAndGrad",
    # PyTorch's GradScaler
    "GradScaler",
    "GradScalerState",
    # op-level mixed precision
    "autocast",
    "Policy",
    # the optimizer's memory: bfloat16 parameters with a master, narrow moments
    "master_weights",
    "low_precision_state",
]
