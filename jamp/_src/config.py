"""The one validation of a loss-scale configuration.

Every entry point that takes a loss-scale configuration (the constructors,
``GradScaler``'s constructor, setters, ``update(new_scale=...)`` and
``load_state_dict``) calls :func:`check_config`, so a value is accepted or
refused the same way everywhere: ``TypeError`` for a wrong type, ``ValueError``
for a wrong value, each naming the argument and showing the value. It runs on
the host, at construction, never inside a trace. Imports only jax and numpy.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

from jamp._src.leaves import is_integer, is_real_number

# The default bounds keep 1/scale a *normal* float32 number, so unscaling never
# multiplies by inf, 0, or a subnormal that a backend may flush to zero.
MIN_SCALE = 2.0**-126
MAX_SCALE = 2.0**126
INT32_MAX = 2**31 - 1

NO_SCALE: Any = object()  # check_config's scale when there is no scale to check


class Config(NamedTuple):
    """A checked configuration; ``scale`` is ``None`` when none was checked."""

    scale: float | None
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float
    max_scale: float
    hysteresis: int


def _scalar_float(name: str, value: Any) -> float:
    """A Python float from a number or a concrete float32/float64 0-d array."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"Expected `{name}` to be a concrete Python number, got a traced value instead; "
            "build the loss-scale state outside `jit`."
        )
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        dtype = np.dtype(value.dtype)
        if dtype not in (np.dtype(np.float32), np.dtype(np.float64)) and not np.issubdtype(
            dtype, np.integer
        ):
            raise TypeError(
                f"Expected `{name}` to be a Python number or a float32/float64 scalar, got an "
                f"array of dtype {dtype} instead; a {dtype} scale cannot represent the range a "
                "loss scale needs. Pass a Python float."
            )
        if np.ndim(value) != 0:
            raise ValueError(
                f"Expected `{name}` to be a scalar, got an array of shape {np.shape(value)} "
                "instead."
            )
        return float(np.asarray(value))
    if not is_real_number(value):
        raise TypeError(f"Expected `{name}` to be a real number, got {value!r} instead.")
    return float(value)


def _count(name: str, value: Any) -> int:
    """An int in ``[1, 2**31 - 1]``: a TypeError for a non-integer, a ValueError out of range."""
    if not is_integer(value):
        raise TypeError(f"Expected `{name}` to be an integer >= 1, got {name}={value!r} instead.")
    if int(value) < 1:
        raise ValueError(f"Expected `{name}` to be an integer >= 1, got {name}={value!r} instead.")
    if int(value) > INT32_MAX:
        raise ValueError(
            f"Expected `{name}` to be an integer in [1, 2**31 - 1], got {name}={value!r} instead."
        )
    return int(value)


def _bound(name: str, value: Any) -> float:
    v = _scalar_float(name, value)
    if not (math.isfinite(v) and MIN_SCALE <= v <= MAX_SCALE):
        raise ValueError(
            f"Expected `{name}` in [2**-126, 2**126] (so that 1/scale is a normal float32), "
            f"got {name}={v!r} instead."
        )
    return v


def _scale(name: str, value: Any, lo: float, hi: float) -> float:
    v = _scalar_float(name, value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"Expected `{name}` to be positive and finite, got {name}={v!r} instead.")
    f32 = float(np.float32(v)) if v <= float(np.finfo(np.float32).max) else math.inf
    if not (lo <= f32 <= hi):
        raise ValueError(
            f"Expected `{name}` within [min_scale, max_scale] = [{lo!r}, {hi!r}] after rounding "
            f"to float32, got {name}={v!r} instead."
        )
    return v


def check_config(
    *,
    scale: Any = NO_SCALE,
    scale_name: str = "init_scale",
    growth_factor: Any = 2.0,
    backoff_factor: Any = 0.5,
    growth_interval: Any = 2000,
    min_scale: Any = MIN_SCALE,
    max_scale: Any = MAX_SCALE,
    hysteresis: Any = 1,
) -> Config:
    """Checks a loss-scale configuration (and a scale, when given) and normalises it.

    Args:
      scale: a scale to check against the bounds (:data:`NO_SCALE`: none to check).
      scale_name: the argument name ``scale`` came from, for messages.
      growth_factor: > 1 and finite.
      backoff_factor: in (0, 1).
      growth_interval: an int in [1, 2**31 - 1].
      min_scale, max_scale: in [2**-126, 2**126], ``min_scale <= max_scale``.
      hysteresis: an int in [1, 2**31 - 1].

    Returns:
      A :class:`Config` of Python numbers.

    Raises:
      TypeError: a value of the wrong type (a string, a bool, a float
        ``growth_interval``, a traced value, an integer array scale ...).
      ValueError: a value out of range; the message names the argument.
    """
    gf = _scalar_float("growth_factor", growth_factor)
    if not (math.isfinite(gf) and gf > 1.0):
        raise ValueError(
            f"Expected `growth_factor` > 1 and finite, got growth_factor={gf!r} instead."
        )
    bf = _scalar_float("backoff_factor", backoff_factor)
    if not (0.0 < bf < 1.0):
        raise ValueError(
            f"Expected `backoff_factor` in the open interval (0, 1), got backoff_factor={bf!r} "
            "instead."
        )
    interval = _count("growth_interval", growth_interval)
    hyst = _count("hysteresis", hysteresis)
    lo, hi = _bound("min_scale", min_scale), _bound("max_scale", max_scale)
    if lo > hi:
        raise ValueError(
            f"Expected `min_scale` <= `max_scale`, got min_scale={lo!r} > max_scale={hi!r} instead."
        )
    checked = None if scale is NO_SCALE else _scale(scale_name, scale, lo, hi)
    return Config(checked, gf, bf, interval, lo, hi, hyst)
