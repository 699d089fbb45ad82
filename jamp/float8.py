"""Float8 matrix products with per-tensor scaling: the delayed-scaling recipe and its state.

``jamp.autocast(fun, "float8")`` runs ``fun``'s matrix products in float8 with
scales computed from each tensor in the same step (current scaling). With
``recipe=jamp.float8.DelayedScaling(...)`` the scales come from an amax
history kept in a state (Transformer Engine's recipe): ``jamp.float8.init``
creates it, a dict of ``jamp.float8.Float8State``. See ``docs/float8.md``.
"""

from jamp._src.autocast.api import float8_init as init
from jamp._src.float8 import DelayedScaling, Float8State

__all__ = ["DelayedScaling", "Float8State", "init"]
