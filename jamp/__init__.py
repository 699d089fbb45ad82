"""jamp: automatic mixed precision for JAX.

Loss scaling with immutable state and pure functions, an Optax transformation
that mirrors ``torch.amp.GradScaler``, and op-level ``autocast``.
"""

from jamp._src import flax_support as _flax_support
from jamp._src.autocast import (
    AutocastReport,
    autocast,
    autocast_disabled,
    autocast_report,
    float8_init,
)
from jamp._src.deprecations import Rename as _Rename
from jamp._src.deprecations import module_getattr as _module_getattr
from jamp._src.finite import all_finite, unscale_and_check
from jamp._src.flax_support import from_flax_dynamic_scale
from jamp._src.float8 import DelayedScaling, Float8State
from jamp._src.grad_scaler import GradScaler, GradScalerState
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
from jamp._src.policy import Policy, get_policy, half_dtype, parse_dtype
from jamp._src.report import NonfiniteCount, log_nonfinite, nonfinite_report
from jamp._src.skip import select_tree
from jamp._src.value_and_grad import (
    ScaledValueAndGrad,
    filter_value_and_grad,
    step_if_finite,
    value_and_grad,
)

_flax_support.register()

# The one place the version is written: pyproject.toml reads it ([tool.setuptools.dynamic]).
__version__ = "0.2.0.dev0"

# Old names, served with a DeprecationWarning until they are removed (CHANGELOG.md).
__getattr__ = _module_getattr(
    "jamp",
    {"LossScalingState": _Rename("ScaledOptimizerState", ScaledOptimizerState, since="0.2.0")},
)

__all__ = [
    "AutocastReport",
    "Policy",
    "autocast",
    "autocast_disabled",
    "autocast_report",
    "DelayedScaling",
    "Float8State",
    "float8_init",
    "get_policy",
    "half_dtype",
    "parse_dtype",
    "GradScaler",
    "GradScalerState",
    "NonfiniteCount",
    "log_nonfinite",
    "metrics",
    "check_restored",
    "from_flax_dynamic_scale",
    "multi_steps",
    "nonfinite_report",
    "ScaledOptimizerState",
    "ScaledValueAndGrad",
    "get_loss_scale",
    "loss_scaling",
    "value_and_grad",
    "filter_value_and_grad",
    "step_if_finite",
    "LossScaleState",
    "all_finite",
    "dynamic_loss_scale",
    "no_loss_scale",
    "scale",
    "select_tree",
    "static_loss_scale",
    "unscale",
    "unscale_and_check",
    "update",
]
