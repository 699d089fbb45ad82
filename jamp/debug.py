"""Seeing where low precision goes wrong: which operation loses precision or overflows
first, which leaf overflowed, and what autocast ran in which dtype and keeps.

``precision_report`` runs a step under autocast beside the same step in float32 and
reports every operation's error, underflow and overflow, worst first;
``locate_nonfinite`` names the first operation that made an inf or a NaN from
finite inputs (``locate_when_skipped`` does it inside a step, on skipped steps only);
``nonfinite_report`` counts the infs and NaNs of every leaf on device;
``log_nonfinite`` logs them only on the steps that have some (and
``jamp.loss_scaling(..., report_nonfinite=True)`` does it on skipped steps);
``autocast_report`` traces an autocast function and lists its primitives'
dtypes and its saved residuals. See ``docs/debugging-precision.md``.
"""

from jamp._src.autocast.report import AutocastReport, autocast_report
from jamp._src.finite.report import NonfiniteCount, log_nonfinite, nonfinite_report
from jamp._src.numerics.locate import NonfiniteSite, locate_nonfinite, locate_when_skipped
from jamp._src.numerics.report import PrecisionReport, precision_report

__all__ = [
    "AutocastReport",
    "NonfiniteCount",
    "NonfiniteSite",
    "PrecisionReport",
    "autocast_report",
    "locate_nonfinite",
    "locate_when_skipped",
    "log_nonfinite",
    "nonfinite_report",
    "precision_report",
]
