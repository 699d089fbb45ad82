"""Float8 matrix products with per-tensor scaling: the delayed-scaling recipe and its state,
and telemetry.

``jamp.autocast(fun, "float8")`` runs ``fun``'s matrix products in float8 with
scales computed from each tensor in the same step (current scaling). With
``recipe=jamp.float8.DelayedScaling(...)`` the scales come from an amax
history kept in a state (Transformer Engine's recipe): ``jamp.float8.init``
creates it, a dict of ``jamp.float8.Float8State``. With ``telemetry=True``
the function reports, for each product, the amax, scale and fractions
underflowed and saturated of its operands and output gradient, as the
gradient of a telemetry argument (``jamp.float8.telemetry_init``, a dict of
``jamp.float8.Telemetry``; ``jamp.float8.telemetry_metrics`` flattens it for a
logger). See ``docs/float8.md``.
"""

from jamp._src.autocast.api import float8_init as init
from jamp._src.autocast.api import telemetry_init
from jamp._src.float8.recipe import DelayedScaling, Float8State
from jamp._src.float8.telemetry import Telemetry, telemetry_metrics

__all__ = [
    "DelayedScaling",
    "Float8State",
    "Telemetry",
    "init",
    "telemetry_init",
    "telemetry_metrics",
]
