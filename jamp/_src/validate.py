"""The one validation of a loss-scale configuration.

Every entry point that takes a loss-scale configuration (the constructors,
``GradScaler``'s constructor, setters, ``update(new_scale=...)`` and
``load_state_dict``) calls ``check_config``, so a value is accepted or
refused the same way everywhere: ``TypeError`` for a wrong type, ``ValueError``
for a wrong value, each naming the argument and showing the value. It runs on
the host, at construction, never inside a trace. Imports only jax and numpy.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.core
import numpy as np

from jamp._src.leaves import is_integer, is_real_number

# The default bounds keep 1/scale a *normal* float32 number, so unscaling never
# multiplies by inf, 0, or a subnormal that a backend may flush to zero.
MIN_SCALE = 2.0**-126
MAX_SCALE = 2.0**126
INT32_MAX = 2**31 - 1

NO_SCALE: Any = object()  # check_config's scale when there is no scale to check


class Config(NamedTuple):
    """A checked configuration; ``scale`` and the counters are ``None`` when not given."""

    scale: float | None
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float
    max_scale: float
    hysteresis: int
    growth_tracker: int | None = None
    overflow_streak: int | None = None


def _refuse_tracer(name: str, value: Any, what: str, action: str) -> None:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"Expected `{name}` to be a concrete {what}, got a traced value instead; {action} "
            "outside `jit`."
        )


def _scalar_float(name: str, value: Any) -> float:
    """A Python float from a number or a concrete float32/float64 0-d array."""
    _refuse_tracer(name, value, "Python number", "build the loss-scale state")
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
        raise TypeError(f"Expected `{name}` to be a real number, got {_show(value)} instead.")
    try:
        return float(value)
    except OverflowError:  # an int past float64's range, such as 10**400
        raise ValueError(
            f"Expected `{name}` to be a finite number within float32's range, got an integer "
            f"of {len(str(abs(value)))} digits instead."
        ) from None


def _show(value: Any) -> str:
    """``repr(value)``, cut short: a message shows a 10**400 or a large array in a line."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:48]}... ({len(text)} characters)"


def _count(name: str, value: Any) -> int:
    """An int in ``[1, 2**31 - 1]``: a TypeError for a non-integer, a ValueError out of range."""
    if not is_integer(value):
        raise TypeError(
            f"Expected `{name}` to be an integer >= 1, got {name}={_show(value)} instead."
        )
    if int(value) < 1:
        raise ValueError(
            f"Expected `{name}` to be an integer >= 1, got {name}={_show(value)} instead."
        )
    if int(value) > INT32_MAX:
        raise ValueError(
            f"Expected `{name}` to be an integer in [1, 2**31 - 1], got {name}={_show(value)} "
            "instead."
        )
    return int(value)


def _float32(v: float) -> float:
    """``v`` rounded to float32, as the state holds it (inf past float32's range)."""
    return (
        float(np.float32(v))
        if abs(v) <= float(np.finfo(np.float32).max)
        else math.copysign(math.inf, v)
    )


def _bound(name: str, value: Any) -> float:
    """A bound rounded to float32: construction compares what the update rule compares."""
    v = _float32(_scalar_float(name, value))
    if not (math.isfinite(v) and MIN_SCALE <= v <= MAX_SCALE):
        raise ValueError(
            f"Expected `{name}` in [2**-126, 2**126] (so that 1/scale is a normal float32), "
            f"got {name}={value!r} instead."
        )
    return v


def _scale(name: str, value: Any, lo: float, hi: float, clamp: bool) -> float:
    v = _scalar_float(name, value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"Expected `{name}` to be positive and finite, got {name}={v!r} instead.")
    f32 = _float32(v)
    if clamp:
        return min(max(f32, lo), hi)
    if not (lo <= f32 <= hi):
        raise ValueError(
            f"Expected `{name}` within [min_scale, max_scale] = [{lo!r}, {hi!r}] after rounding "
            f"to float32, got {name}={v!r} instead."
        )
    return v


def _moves(factor: float, grows: bool) -> bool:
    """Whether torch's ``float32(float64(s) * factor)`` moves every normal float32 ``s``.

    A factor too close to 1 rounds some scales back to themselves (after an
    overflow the scale would never back off, and every later step would be
    skipped). Rounding is relative, so the mantissas where the spacing of
    float32 numbers is widest relative to ``s`` decide: 1.0 and its
    neighbours.
    """
    for m in (1.0, 1.0 + 2.0**-23, 2.0 - 2.0**-23):
        s = np.float32(m)
        with np.errstate(over="ignore"):  # a huge factor is refused by its bound
            out = np.float32(np.float64(s) * factor)
        if (out <= s) if grows else (out >= s):
            return False
    return True


def _counter(name: str, value: Any) -> int:
    """A restored counter: a concrete integer >= 0 (a Python int or an integer 0-d array)."""
    _refuse_tracer(name, value, "integer", "restore the loss-scale state")
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        if np.ndim(value) != 0 or not np.issubdtype(np.dtype(value.dtype), np.integer):
            raise TypeError(
                f"Expected `{name}` to be an integer scalar, got an array of dtype "
                f"{value.dtype} and shape {np.shape(value)} instead."
            )
        value = int(np.asarray(value))
    if not is_integer(value):
        raise TypeError(f"Expected `{name}` to be an integer, got {name}={_show(value)} instead.")
    if not 0 <= int(value) <= INT32_MAX:
        raise ValueError(
            f"Expected `{name}` to be an integer in [0, 2**31 - 1], got {name}={_show(value)} "
            "instead."
        )
    return int(value)


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
    growth_tracker: Any = None,
    overflow_streak: Any = None,
    restore: bool = False,
    names: Any = None,
) -> Config:
    """Checks a loss-scale configuration (and a scale, when given) and normalises it.

    Args:
      scale: a scale to check against the bounds (``NO_SCALE``: none to check).
      scale_name: the argument name ``scale`` came from, for messages.
      growth_factor: > 1 and finite, far enough from 1 to move a float32
        scale (more than 1 + 2**-24), and at most ``max_scale / min_scale``
        (a larger one jumps past the whole range in one growth, and a grown
        scale past float32's range is dropped: the scale would stop growing).
      backoff_factor: in (0, 1), and far enough from 1 to move a float32
        scale (below about 1 - 2**-24).
      growth_interval: an int in [1, 2**31 - 1].
      min_scale, max_scale: in [2**-126, 2**126], ``min_scale <= max_scale``,
        rounded to float32 (the state's dtype) before anything is compared.
      hysteresis: an int in [1, 2**31 - 1].
      growth_tracker, overflow_streak: restored counters (``None``: not given),
        integers >= 0.
      restore: the values come from a checkpoint, not from the user's code: a
        non-finite or non-positive scale is still an error, but a scale
        outside ``[min_scale, max_scale]`` is clamped into it, a growth
        tracker at or past ``growth_interval`` is held one short of it (so
        the scale grows on the next finite step instead of never), and an
        overflow streak past ``hysteresis`` is held at it.
      names: how to name the values in messages (a mapping from the
        argument names above), e.g. ``{"growth_tracker":
        "state_dict['_growth_tracker']"}``; ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``growth_tracker`` and
        ``overflow_streak`` may be renamed.

    Returns:
      A ``Config`` of Python numbers.

    Raises:
      TypeError: a value of the wrong type (a string, a bool, a float
        ``growth_interval``, a traced value, a float16, bfloat16, complex or
        boolean array scale ...). An integer scale, a Python ``int`` or an
        integer 0-d array, is a number like any other and is accepted.
      ValueError: a value out of range (an integer past float64's range,
        ``10**400``, included); the message names the argument.
    """
    names = dict(names or {})
    gf_name = names.get("growth_factor", "growth_factor")
    bf_name = names.get("backoff_factor", "backoff_factor")
    gf = _scalar_float(gf_name, growth_factor)
    if not (math.isfinite(gf) and gf > 1.0):
        raise ValueError(f"Expected `{gf_name}` > 1 and finite, got growth_factor={gf!r} instead.")
    bf = _scalar_float(bf_name, backoff_factor)
    if not (0.0 < bf < 1.0):
        raise ValueError(
            f"Expected `{bf_name}` in the open interval (0, 1), got backoff_factor={bf!r} instead."
        )
    for name, factor, grows in ((gf_name, gf, True), (bf_name, bf, False)):
        if not _moves(factor, grows):
            plain = "growth_factor" if grows else "backoff_factor"
            raise ValueError(
                f"Expected `{name}` to move a float32 scale, got {plain}={factor!r} instead: it "
                "is so close to 1 that the scale rounds back to itself, so it would never "
                f"{'grow' if grows else 'back off'} (and after an overflow every step would be "
                "skipped)."
            )
    interval = _count(names.get("growth_interval", "growth_interval"), growth_interval)
    hyst = _count("hysteresis", hysteresis)
    lo, hi = _bound("min_scale", min_scale), _bound("max_scale", max_scale)
    if lo > hi:
        raise ValueError(
            f"Expected `min_scale` <= `max_scale`, got min_scale={lo!r} > max_scale={hi!r} instead."
        )
    f32_max = float(np.finfo(np.float32).max)
    top = min(hi / lo, f32_max) if lo < hi else f32_max
    if gf > top:
        # A grown scale past float32's range is dropped (torch's rule): with a factor
        # larger than the whole range, the scale would grow from almost none of its values.
        raise ValueError(
            f"Expected `{gf_name}` <= max_scale / min_scale = {top!r}, got "
            f"growth_factor={gf!r} instead: it jumps past the whole range of the scale in one "
            "growth, and a grown scale past float32's range is dropped (torch's rule), so the "
            "scale would stop growing. Use a factor such as 2.0."
        )
    checked = None if scale is NO_SCALE else _scale(scale_name, scale, lo, hi, restore)
    tracker = streak = None
    if growth_tracker is not None:
        name = names.get("growth_tracker", "growth_tracker")
        tracker = _counter(name, growth_tracker)
        if tracker >= interval:
            if not restore:
                raise ValueError(
                    f"Expected `{name}` < growth_interval={interval}, got {name}={tracker} instead."
                )
            tracker = interval - 1
    if overflow_streak is not None:
        streak = min(
            _counter(names.get("overflow_streak", "overflow_streak"), overflow_streak), hyst
        )
        if hyst == 1:  # not counted with hysteresis 1 (loss_scale.update)
            streak = 0
    return Config(checked, gf, bf, interval, lo, hi, hyst, tracker, streak)


def checked_scale(name: str, value: Any) -> float:
    """A scale read from a checkpoint without its configuration, as a Python float.

    A positive, finite number (a Python number or a concrete 0-d float32,
    float64 or integer array); a string, a bool or a traced value is a
    ``TypeError``, NaN, inf, zero or a negative number a ``ValueError``.
    """
    v = _scalar_float(name, value)
    if not (math.isfinite(v) and 0 < v <= float(np.finfo(np.float32).max)):
        raise ValueError(
            f"Expected `{name}` to be positive and finite, got {name}={v!r} instead; every step "
            "would be skipped (or none scaled) with it."
        )
    return v


def checked_counter(name: str, value: Any) -> int:
    """A counter read from a checkpoint: a concrete integer in ``[0, 2**31 - 1]``."""
    return _counter(name, value)


def checked_floor(name: str, value: Any) -> float:
    """flax's ``minimum_scale`` as jamp's ``min_scale``: a number in ``[0, 2**126]``,
    raised to jamp's floor of ``2**-126`` when below it."""
    v = _scalar_float(name, value)
    if not (math.isfinite(v) and 0 <= v <= MAX_SCALE):
        raise ValueError(
            f"Expected `{name}` in [0, 2**126] (None or below 2**-126: jamp's floor of "
            f"2**-126), got {name}={v!r} instead."
        )
    return max(_float32(v), MIN_SCALE)
