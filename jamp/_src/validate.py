"""The checks of user input that more than one entry point makes, in one place.

The loss-scale configuration (``check_config``, used by every constructor,
setter and restore path), filters, flags, axis names, skip modes,
optimizers, gradients against parameters and optimizer states against their
``init``. Each runs on the host, once, at the public edge: when the public
function is called (under ``jit``, while it is traced), before it computes
anything; the unchecked functions it then calls, and the ones a step runs
inside, do not check again. A wrong kind of value is a ``TypeError``, a
wrong value (out of range, another shape, another structure) a
``ValueError``, each naming the argument, showing the value and saying the
fix. ``diagnosing`` is the one place that explains a failure inside the
user's optimizer. Imports only jax, numpy and the ground floor's ``leaves``
and ``types``. ``hide_from_tracebacks`` leaves the modules that refuse a
misuse (this one, ``grad_scaler``'s) out of JAX's filtered tracebacks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Final, NamedTuple, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jamp._src.leaves import is_integer, is_numeric_dtype, is_real_number, partition
from jamp._src.types import AxisName, Filter, Grads, OptState, Params, PyTree, Updates, is_tracer


def hide_from_tracebacks(path: str) -> None:
    """Leave the module at ``path`` out of the tracebacks JAX filters (an error raised while
    a function is transformed), as JAX, Optax, Equinox and Flax leave theirs: a misuse that
    a module of jamp's refuses is shown from the user's line that made it
    (``JAX_TRACEBACK_FILTERING=off`` shows every frame). Nothing happens on a jax without
    the (private) hook."""
    try:
        from jax._src import traceback_util

        traceback_util.register_exclusion(path)
    except (ImportError, AttributeError):  # pragma: no cover - depends on the jax version
        pass


hide_from_tracebacks(__file__)

# The default bounds keep 1/scale a *normal* float32 number, so unscaling never
# multiplies by inf, 0, or a subnormal that a backend may flush to zero.
MIN_SCALE = 2.0**-126
MAX_SCALE = 2.0**126
INT32_MAX = 2**31 - 1

NO_SCALE: Final = object()  # check_config's scale when there is no scale to check


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


def _refuse_tracer(name: str, value: object, what: str, action: str) -> None:
    if is_tracer(value):
        raise TypeError(
            f"Expected `{name}` to be a concrete {what}, got a traced value instead; {action} "
            "outside `jit`."
        )


def _scalar_float(name: str, value: object) -> float:
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


def _show(value: object) -> str:
    """``repr(value)``, cut short: a message shows a 10**400 or a large array in a line."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:48]}... ({len(text)} characters)"


def check_count(name: str, value: object, lo: int = 1, alternative: str = "") -> int:
    """``value`` as a Python int in ``[lo, 2**31 - 1]`` (counted in an int32): a TypeError
    for a non-integer (a bool, a float), a ValueError out of range. ``alternative`` names
    what else the argument may be, for the TypeError's message."""
    if not is_integer(value):
        raise TypeError(
            f"Expected `{name}` to be an integer >= {lo}{alternative}, got "
            f"{name}={_show(value)} instead."
        )
    if int(value) < lo:
        raise ValueError(
            f"Expected `{name}` to be an integer >= {lo}, got {name}={_show(value)} instead."
        )
    if int(value) > INT32_MAX:
        raise ValueError(
            f"Expected `{name}` to be an integer in [{lo}, 2**31 - 1] (it is counted in an "
            f"int32), got {name}={_show(value)} instead."
        )
    return int(value)


def _float32(v: float) -> float:
    """``v`` rounded to float32, as the state holds it (inf past float32's range)."""
    return (
        float(np.float32(v))
        if abs(v) <= float(np.finfo(np.float32).max)
        else math.copysign(math.inf, v)
    )


def _bound(name: str, value: object) -> float:
    """A bound rounded to float32: construction compares what the update rule compares."""
    v = _float32(_scalar_float(name, value))
    if not (math.isfinite(v) and MIN_SCALE <= v <= MAX_SCALE):
        raise ValueError(
            f"Expected `{name}` in [2**-126, 2**126] (so that 1/scale is a normal float32), "
            f"got {name}={value!r} instead."
        )
    return v


def _scale(name: str, value: object, lo: float, hi: float, clamp: bool) -> float:
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


def _counter(name: str, value: object) -> int:
    """A restored counter: a concrete integer >= 0 (a Python int or an integer 0-d array)."""
    _refuse_tracer(name, value, "integer", "restore the loss-scale state")
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        if not np.issubdtype(np.dtype(value.dtype), np.integer):
            raise TypeError(
                f"Expected `{name}` to be an integer scalar, got an array of dtype "
                f"{value.dtype} and shape {np.shape(value)} instead."
            )
        if np.ndim(value) != 0:
            raise ValueError(
                f"Expected `{name}` to be a scalar, got an array of shape {np.shape(value)} "
                "instead."
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
    scale: object = NO_SCALE,
    scale_name: str = "init_scale",
    growth_factor: object = 2.0,
    backoff_factor: object = 0.5,
    growth_interval: object = 2000,
    min_scale: object = MIN_SCALE,
    max_scale: object = MAX_SCALE,
    hysteresis: object = 1,
    growth_tracker: object = None,
    overflow_streak: object = None,
    restore: bool = False,
    names: Mapping[str, str] | None = None,
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
    interval = check_count(names.get("growth_interval", "growth_interval"), growth_interval)
    hyst = check_count("hysteresis", hysteresis)
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


def checked_scale(name: str, value: object) -> float:
    """A scale read from a checkpoint without its configuration, as a Python float.

    A number in ``[2**-126, 2**126]``, the bounds of every scale jamp keeps, as
    the state holds it: rounded to float32 (a Python number or a concrete 0-d
    float32, float64 or integer array). A string, a bool or a traced value is a
    ``TypeError``; NaN, inf, zero, a negative number or one outside the bounds
    a ``ValueError``: ``5e-324`` and ``1e-46`` are positive float64 numbers and
    float32 zeros, ``1e-40`` a float32 subnormal (XLA:CPU computes with it as
    0, and ``1/scale`` is inf), ``1e39`` a float32 inf.
    """
    v = _scalar_float(name, value)
    f32 = _float32(v) if math.isfinite(v) else v
    if not (math.isfinite(f32) and f32 > 0):
        rounded = "" if f32 == v or not math.isfinite(v) else f" ({f32!r} as a float32)"
        raise ValueError(
            f"Expected `{name}` to be positive and finite, got {name}={v!r}{rounded} instead; "
            "every step would be skipped (or none scaled) with it."
        )
    if not MIN_SCALE <= f32 <= MAX_SCALE:
        raise ValueError(
            f"Expected `{name}` in [2**-126, 2**126], the bounds of every scale jamp keeps (so "
            f"that 1/scale is a normal float32), got {name}={v!r} instead; jamp saved no such "
            "scale."
        )
    return v


def checked_counter(name: str, value: object) -> int:
    """A counter read from a checkpoint: a concrete integer in ``[0, 2**31 - 1]``."""
    return _counter(name, value)


def checked_floor(name: str, value: object) -> float:
    """flax's ``minimum_scale`` as jamp's ``min_scale``: a number in ``[0, 2**126]``,
    raised to jamp's floor of ``2**-126`` when below it."""
    v = _scalar_float(name, value)
    if not (math.isfinite(v) and 0 <= v <= MAX_SCALE):
        raise ValueError(
            f"Expected `{name}` in [0, 2**126] (None or below 2**-126: jamp's floor of "
            f"2**-126), got {name}={v!r} instead."
        )
    return max(_float32(v), MIN_SCALE)


# --------------------------------------------------------------------------
# Arguments several entry points take.


def check_flag(name: str, value: object, note: str = "") -> bool:
    """``value`` if it is a Python bool, else a TypeError naming ``name`` (``note`` says
    what the flag means)."""
    if isinstance(value, bool):
        return value
    raise TypeError(f"Expected `{name}` to be a bool{note}, got {name}={value!r:.60} instead.")


def check_filter(filter: object, fn: str) -> Filter:
    """``filter`` if it is ``None`` or callable, else a TypeError naming ``jamp.{fn}``."""
    if filter is None or callable(filter):
        return filter
    raise TypeError(
        f"`jamp.{fn}` expected `filter` to be a function of a leaf that returns a bool, such as "
        f"eqx.is_inexact_array, got {filter!r:.60} (type {type(filter).__name__}) instead."
    )


def check_bool_scalar(value: object, name: str, source: str) -> jax.Array:
    """``value`` as a boolean scalar array: a TypeError for another kind or dtype, a
    ValueError for another shape, each naming ``name``."""
    if isinstance(value, bool):
        return jnp.asarray(value)
    dtype = getattr(value, "dtype", None)
    shape = getattr(value, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(
            f"Expected `{name}` to be a boolean scalar array ({source}), got "
            f"{type(value).__name__} instead."
        )
    if dtype != jnp.bool_:
        raise TypeError(
            f"Expected `{name}` to be a boolean scalar, got dtype {dtype} instead; pass the "
            f"flag {source}."
        )
    if tuple(shape) != ():
        raise ValueError(
            f"Expected `{name}` to be a scalar (shape ()), got shape {tuple(shape)} instead; "
            "reduce it over the whole tree with jamp.all_finite."
        )
    return cast(jax.Array, value)


def check_axis_name(axis_name: object) -> AxisName | None:
    """``axis_name`` if it is ``None``, a str or a non-empty tuple of str, else a TypeError."""
    if axis_name is None or isinstance(axis_name, str):
        return axis_name
    if isinstance(axis_name, tuple) and axis_name and all(isinstance(a, str) for a in axis_name):
        return cast(AxisName, axis_name)
    raise TypeError(
        "Expected `axis_name` to be the name of a shard_map/pmap axis (a str) or a tuple of "
        f"them, got {axis_name!r} instead."
    )


def refuse_axis_name(extra_args: Mapping[str, object], fn: str, receiver: str, owner: str) -> None:
    """A TypeError if ``axis_name`` came as an extra argument that ``receiver`` would ignore."""
    if "axis_name" in extra_args:
        raise TypeError(
            f"{fn} got `axis_name`, which it would pass on to {receiver} and ignore: give it "
            f"to {owner}(..., axis_name=...)."
        )


SKIP_MODES = ("auto", "cond", "select")


def check_skip(skip: object) -> str:
    """``skip`` if it names a skipping mode: a TypeError for a non-str, a ValueError for
    another string."""
    if isinstance(skip, str) and skip in SKIP_MODES:
        return skip
    raise (ValueError if isinstance(skip, str) else TypeError)(
        f"Expected `skip` to be one of {SKIP_MODES} ('auto': 'select' on GPUs and TPUs, "
        "'cond' on CPUs; 'cond': apply the update under lax.cond; 'select': compute it, "
        f"then keep or drop it), got {skip!r:.60} instead."
    )


class Transformation(Protocol):
    """What jamp calls of an optimizer: an Optax transformation's ``init`` and ``update``."""

    @property
    def init(self) -> Callable[..., OptState]: ...

    @property
    def update(self) -> Callable[..., tuple[Updates, OptState]]: ...


def check_optimizer(tx: object, name: str = "tx", kind: type | None = None) -> Transformation:
    """``tx`` if it is an Optax transformation, else a TypeError naming ``name``: an
    instance of ``kind`` when given (this module imports no optax), else anything with an
    ``init`` and an ``update``."""
    if kind is not None:
        ok = isinstance(tx, kind)
    else:
        ok = callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))
    if not ok:
        hint = " (call it: optax.sgd(0.1), not optax.sgd)" if callable(tx) else ""
        raise TypeError(
            f"Expected `{name}` to be an optax.GradientTransformation, got "
            f"{getattr(tx, '__name__', type(tx).__name__)} instead{hint}."
        )
    return cast(Transformation, tx)


def check_own_state(state: object, kind: type, name: str) -> None:
    """A TypeError unless ``state`` is a ``kind`` (called ``name``): the state an Optax
    transformation's ``update`` takes is the one its own ``init`` made."""
    if not isinstance(state, kind):
        raise TypeError(
            f"Expected `state` to be the {name} from this transformation's init, got "
            f"{type(state).__name__} instead."
        )


def check_counter(value: object, dtype: DTypeLike, name: str, why: str) -> None:
    """A TypeError unless ``value`` is a scalar array of ``dtype``: a counter an optimizer
    state keeps (``master_weights``, ``low_precision_state``; ``check_counters`` checks the
    loss-scaling state's)."""
    shape, got = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape != () or got != jnp.dtype(dtype):
        shown = "None" if value is None else f"{type(value).__name__} {got} {shape}"
        raise TypeError(
            f"Expected `{name}` to be a {jnp.dtype(dtype)} scalar ({why}), got {shown} "
            "instead: the state was not made by this transformation's init, or was changed. "
            "Pass the state from `tx.init(params)`."
        )


def refuse_counter(value: object, name: str, why: str) -> None:
    """A TypeError unless ``value`` is None (a counter the configuration does not keep)."""
    if value is not None:
        raise TypeError(
            f"Expected `{name}` to be None ({why}), got {type(value).__name__} instead: the "
            "state was made by a transformation of another configuration. Pass the state "
            "from `tx.init(params)` of this one."
        )


def check_counters(skipped_steps: object, last_finite: object, fix: str) -> None:
    """A clear error for ``state.skipped_steps`` and ``state.last_finite`` that no update
    made (a checkpoint restored without validation): an integer scalar (when concrete, in
    [0, 2**31 - 1]) and a bool scalar. ``fix`` says what to do instead."""
    for name, value, want in (
        ("skipped_steps", skipped_steps, np.integer),
        ("last_finite", last_finite, np.bool_),
    ):
        if isinstance(value, bool):
            dtype = np.dtype(np.bool_)
        elif isinstance(value, int):
            dtype = np.dtype(np.int32)
        else:
            dtype = getattr(value, "dtype", None)
        kind = "a bool" if want is np.bool_ else "an integer"
        if dtype is None or not np.issubdtype(dtype, want):
            described = type(value).__name__ + ("" if dtype is None else f" of dtype {dtype}")
            raise TypeError(
                f"Expected `state.{name}` to be {kind} scalar, got {described} instead; {fix}."
            )
        shape = tuple(getattr(value, "shape", ()))
        if shape != ():
            raise ValueError(
                f"Expected `state.{name}` to be {kind} scalar, got an array of shape {shape} "
                f"instead; {fix}."
            )
    concrete = not is_tracer(skipped_steps)
    if concrete and getattr(skipped_steps, "is_fully_addressable", True):
        v = int(np.asarray(skipped_steps))
        if not 0 <= v <= INT32_MAX:
            raise ValueError(
                f"Expected `state.skipped_steps` to be an integer in [0, 2**31 - 1], got {v} "
                f"instead; {fix}."
            )


# --------------------------------------------------------------------------
# The trees of an optimizer step: parameters, gradients, the optimizer's state.


def _where(path: jax.tree_util.KeyPath) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def check_params(params: Params, fn: str) -> None:
    """A TypeError naming the path of a leaf of ``params`` no optimizer can update (a
    function, a string), with the fix for an Equinox module; a ValueError for a Python int
    past int32."""

    def visit(path: jax.tree_util.KeyPath, leaf: object) -> None:
        if isinstance(leaf, int) and not isinstance(leaf, bool) and not -(2**31) <= leaf < 2**31:
            raise ValueError(
                f"`jamp.{fn}` expected `params` to hold arrays or numbers JAX can hold, got a "
                f"Python int of {len(str(abs(leaf)))} digits at path {_where(path)} instead: "
                "it does not fit in int32."
            )
        dtype = getattr(leaf, "dtype", None)
        if isinstance(leaf, (bool, int, float, complex)) or (
            dtype is not None and is_numeric_dtype(dtype)
        ):
            return
        raise TypeError(
            f"`jamp.{fn}` expected `params` to be a pytree of arrays, got a leaf of type "
            f"{type(leaf).__name__} at path {_where(path)} ({leaf!r:.60}) instead. For an "
            "Equinox module, pass the filter its optimizer state was initialised with "
            "(filter=eqx.is_array for tx.init(eqx.filter(model, eqx.is_array))): the leaves "
            "it leaves out are returned untouched."
        )

    jax.tree_util.tree_map_with_path(visit, params)


def check_gradients(grads: Grads, fn: str) -> None:
    """A TypeError naming the first leaf of ``grads`` that is not a gradient: a floating or
    complex array, ``float0`` (``jax.grad(allow_int=True)``'s), a Python float or ``None``."""

    def visit(path: jax.tree_util.KeyPath, leaf: object) -> None:
        if leaf is None or isinstance(leaf, (float, complex)):
            return
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and is_numeric_dtype(dtype):
            if jnp.issubdtype(dtype, jnp.inexact) or dtype == jax.dtypes.float0:
                return
        described = type(leaf).__name__ + ("" if dtype is None else f" of dtype {dtype}")
        raise TypeError(
            f"`jamp.{fn}` expected the gradients to be floating arrays, got a leaf of type "
            f"{described} at path {_where(path)} instead: an integer or boolean leaf is not a "
            "gradient (jax.grad gives float0 for integer inputs), and its update would be "
            "cast back to the parameter's dtype."
        )

    jax.tree_util.tree_map_with_path(visit, grads, is_leaf=lambda x: x is None)


def _leaves_with_paths(tree: PyTree) -> tuple[list[tuple[jax.tree_util.KeyPath, PyTree]], object]:
    """``tree``'s leaves with their paths, ``None`` counted as a leaf (Equinox's gradients
    of leaves it does not differentiate), and its structure."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)


def first_mismatch(tree: PyTree, like: PyTree) -> str | None:
    """Where ``tree`` and ``like`` differ: a path and two shapes, ``"structure"``, or None.

    ``None`` leaves match anything; leaves without a shape (Python numbers) match
    any scalar."""
    leaves, treedef = _leaves_with_paths(tree)
    like_leaves, like_def = _leaves_with_paths(like)
    if treedef != like_def:
        return "structure"
    for (path, a), (_, b) in zip(leaves, like_leaves, strict=True):
        if a is None or b is None:
            continue
        sa, sb = tuple(np.shape(a)), tuple(np.shape(b))
        if sa != sb:
            return f"{_where(path)}: shapes {sa} and {sb}"
    return None


def _mismatch(tree: PyTree, like: PyTree, strict: bool) -> str | tuple[object, object] | None:
    """What ``check_updates`` and ``check_state_matches`` refuse: the path and shapes of the
    first leaf of another shape, or (``strict`` only: another structure may be intended)
    both trees' structures; ``None`` when they match."""
    where = first_mismatch(tree, like)
    if where is None or (where == "structure" and not strict):
        return None
    if where == "structure":
        return jax.tree_util.tree_structure(tree), jax.tree_util.tree_structure(like)
    return where


def _unfit_parameter(updates: Updates, params: Params) -> str | None:
    """The path of a floating gradient for an integer or boolean parameter, if any (its
    update would be cast back to the parameter's dtype: True for a bool), or of an integer
    or boolean gradient for a floating parameter (never unscaled: not a gradient)."""
    leaves, treedef = _leaves_with_paths(updates)
    param_leaves, param_def = _leaves_with_paths(params)
    if treedef != param_def:
        return None
    for (path, g), (_, p) in zip(leaves, param_leaves, strict=True):
        g_dtype, p_dtype = getattr(g, "dtype", None), getattr(p, "dtype", None)
        if isinstance(g, (float, complex)):
            g_dtype = np.dtype(type(g))
        if g_dtype is None or p_dtype is None or not is_numeric_dtype(p_dtype):
            continue
        if not is_numeric_dtype(g_dtype) or g_dtype == jax.dtypes.float0:
            continue
        if not (jnp.issubdtype(g_dtype, jnp.inexact) and jnp.issubdtype(p_dtype, jnp.inexact)):
            return (
                f"{_where(path)} (a {np.dtype(g_dtype)} gradient for a {np.dtype(p_dtype)} "
                "parameter)"
            )
    return None


def check_updates(updates: Updates, params: Params | None, fn: str, strict: bool = False) -> None:
    """A ValueError when ``updates`` and ``params`` have one structure but a leaf of
    another shape, or (``strict``, once the optimizer has failed on them) another
    structure. A different structure alone may be intended: ``optax.lookahead`` takes
    the fast parameters' gradients with both parameter sets. A TypeError for a floating
    gradient of an integer parameter, or an integer gradient of a floating one; and, with
    or without ``params``, for a Python int or bool among the gradients, as
    ``check_gradients`` refuses them."""
    for path, leaf in _leaves_with_paths(updates)[0]:
        if isinstance(leaf, (bool, int)):  # not a NumPy integer: it has a dtype, checked below
            shown = (
                _show(leaf)
                if isinstance(leaf, bool) or abs(leaf) < 10**20
                else (f"an integer of {len(str(abs(leaf)))} digits")
            )
            raise TypeError(
                f"`{fn}` expected the gradients to be floating arrays or Python floats, got a "
                f"Python {type(leaf).__name__} at path {_where(path)} ({shown}) instead: "
                "jax.grad gives none (float0 for integer inputs), and an integer leaf is "
                "neither unscaled nor checked, so it would reach the optimizer as it is."
            )
    if params is None:
        return
    unfit = _unfit_parameter(updates, params)
    if unfit is not None:
        raise TypeError(
            f"`{fn}` expected floating gradients for the floating leaves of `params` only, got "
            f"one at {unfit}: an update of an integer or boolean parameter is cast back to its "
            "dtype (a bool becomes True), and an integer gradient is never unscaled. Keep "
            "such leaves out of the parameters and gradients (filter=eqx.is_inexact_array)."
        )
    where = _mismatch(updates, params, strict)
    if where is None:
        return
    if isinstance(where, tuple):
        got_def, want_def = where
        detail = f"a tree of structure {str(got_def):.200} for `params` {str(want_def):.200}"
    else:
        detail = f"different shapes at {where}"
    raise ValueError(
        f"`{fn}` expected the gradients and `params` to match leaf for leaf, got {detail}: "
        "the gradients come from other parameters than the ones passed. Pass the "
        "parameters the gradients were taken of."
    )


def expected_state(init: Callable[[Params], OptState], params: Params) -> OptState | None:
    """``init(params)``'s shapes (``jax.eval_shape``), or None when they cannot be had."""
    try:
        return jax.eval_shape(init, params)
    except Exception:  # an init that cannot run on these: nothing to compare with
        return None


def check_state_matches(
    state: OptState,
    init: Callable[[Params], OptState],
    params: Params,
    name: str,
    fn: str,
    strict: bool,
) -> None:
    """A ValueError when ``state`` is not shaped as ``init(params)`` is: a leaf of another
    shape, or (``strict``, once the optimizer has failed on it) another structure."""
    want = expected_state(init, params)
    if want is None:
        return
    where = _mismatch(state, want, strict)
    if where is None:
        return
    if isinstance(where, tuple):
        got_def, want_def = where
        detail = f"structure {str(got_def):.300}, where its init gives {str(want_def):.300}"
    else:
        detail = f"different shapes at {where} (the state's, then its init's)"
    raise ValueError(
        f"`{fn}` expected `{name}` to be the state that the optimizer's init made for these "
        f"parameters, got {detail}. It was made by another optimizer or for other "
        "parameters: pass the state from `tx.init(params)` of this optimizer."
    )


def check_step_arguments(
    tx: object,
    grads: Grads,
    opt_state: OptState,
    params: Params,
    *,
    filter: Filter,
    fn: str,
) -> None:
    """The arguments of an optimizer step (``step_if_finite``, ``GradScaler.step``),
    checked once: ``tx``, ``filter``, the parameters ``filter`` selects (all of them when
    it is ``None``), the gradients against them and ``opt_state`` against ``tx.init``'s
    shapes."""
    init = check_optimizer(tx).init
    check_filter(filter, fn)
    if filter is None:
        check_params(params, fn)
        dynamic = params
    else:
        dynamic = partition(params, filter)[0]
    check_gradients(grads, fn)
    if jax.tree_util.tree_leaves(grads) and not jax.tree_util.tree_leaves(dynamic):
        raise ValueError(
            f"`jamp.{fn}` expected `params` to hold the parameters the gradients update, got "
            f"{type(params).__name__} with no parameter in it instead."
        )
    check_updates(grads, dynamic, f"jamp.{fn}")
    check_state_matches(opt_state, init, dynamic, "opt_state", f"jamp.{fn}", strict=False)


def check_not_swapped(grads: Grads, opt_state: OptState, params: Params) -> None:
    """A TypeError if ``opt_state`` is shaped like the gradients and ``params`` is not
    (``GradScaler.step``'s arguments in ``tx.update``'s order, mistaken)."""
    structure = jax.tree_util.tree_structure
    if structure(opt_state) == structure(grads) != structure(params):
        raise TypeError(
            "`GradScaler.step(state, tx, grads, opt_state, params)` got an `opt_state` shaped "
            "like the gradients and `params` shaped otherwise: the parameters and the optimizer "
            "state look swapped. The optimizer state (from `tx.init(params)`) comes before the "
            "parameters, as in `tx.update(grads, opt_state, params)`: write "
            "`params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)`."
        )


# What a user's optimizer may raise when given a state or gradients it was not made for.
_OPTIMIZER_FAILURES = (AttributeError, KeyError, IndexError, TypeError, ValueError)


@contextlib.contextmanager
def diagnosing(
    fn: str,
    state: OptState,
    name: str,
    init: Callable[[Params], OptState],
    like: Params,
    grads: Grads,
    params: Params | None,
) -> Iterator[None]:
    """Run the user's optimizer; if it fails, say why when the arguments do.

    The checks before the step compare leaf shapes only: a different
    structure may be intended (``optax.lookahead``). Once the optimizer has
    failed, a ``state`` (called ``name``) not of the structure ``init(like)``
    gives, or gradients not of ``params``' structure, is the likely cause:
    that clear ``ValueError`` is raised instead. Otherwise the optimizer's
    own error goes on unchanged.
    """
    try:
        yield
    except _OPTIMIZER_FAILURES:
        check_state_matches(state, init, like, name, fn, strict=True)
        check_updates(grads, params, fn, strict=True)
        raise
