"""jamp: automatic mixed precision for JAX.

Loss scaling with immutable state and pure functions, an Optax transformation
that mirrors ``torch.amp.GradScaler``, and op-level ``autocast``.
"""

from jamp._src.finite import all_finite, select_tree, unscale_and_check
from jamp._src.loss_scale import (
    LossScaleState,
    dynamic_loss_scale,
    no_loss_scale,
    scale,
    static_loss_scale,
    unscale,
    update,
)

__version__ = "0.1.0"

__all__ = [
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
