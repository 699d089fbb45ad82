"""Seeing where low precision goes wrong: which leaf overflowed, and what autocast ran in
which dtype and keeps for the backward pass.

``nonfinite_report`` counts the infs and NaNs of every leaf on device;
``log_nonfinite`` logs them only on the steps that have some (and
``jamp.loss_scaling(..., report_nonfinite=True)`` does it on skipped steps);
``autocast_report`` traces an autocast function and lists its primitives'
dtypes and its saved residuals. See ``docs/observability.md``.
"""

from jamp._src.autocast.api import AutocastReport, autocast_report
from jamp._src.finite.report import NonfiniteCount, log_nonfinite, nonfinite_report

__all__ = [
    "AutocastReport",
    "NonfiniteCount",
    "autocast_report",
    "log_nonfinite",
    "nonfinite_report",
]
