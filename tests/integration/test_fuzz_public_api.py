"""A fuzz of jamp's public API with hostile values, whose oracle is the contract.

Every call of a public name, with one or two of its arguments replaced by a
hostile value (None, strings, bytes, 10**400, 2**31, NaN/inf/-0.0/denormals,
arrays of every NumPy dtype, float8, complex, object and str included, 0-d and
empty arrays, nested or mismatched pytrees, states of other configurations,
functions where data belongs), either

- returns a correct result: checked against a reference computed here with
  NumPy or Optax, never with jamp (the scale, the update rule, the unscaled
  gradients, the finite flag, the skipped step, the restored values), or
- raises a ``TypeError`` or ``ValueError`` of exactly that class, raised by
  jamp's own code (the innermost frame is a file under ``jamp/``), whose
  message names the argument (its name, or the path of the leaf in it).

Anything else fails the test: an error from inside jax, numpy or optax (an
``AttributeError``, an ``OverflowError``, a jax ``TypeError`` about
broadcasting), an error that names no argument, or a wrong result. The
draws are deterministic (``derandomize=True``) and bounded. With ``-s -n 0``
the test prints ``FUZZ`` lines, the figures of docs/reliability.md::

    pytest tests/integration/test_fuzz_public_api.py -n 0 -s -p no:cacheprovider | grep FUZZ
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pathlib
import re
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jamp

JAMP = pathlib.Path(jamp.__file__).resolve().parent
F32 = np.float32
TINY, BIG = 2.0**-126, 2.0**126
EXAMPLES = 24  # per public call (half for the costly ones): 720 calls in all
TALLY: collections.Counter = collections.Counter()

# --------------------------------------------------------------------------- hostile values

_DTYPES = (
    np.bool_, np.int8, np.int32, np.int64, np.uint8, np.uint64, np.float16, ml_dtypes.bfloat16,
    np.float32, np.float64, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.complex64,
    np.complex128, object, "U3", "S3", "M8[s]",
)  # fmt: skip
_FILLS = (0.0, 1.0, -0.0, math.nan, math.inf, -math.inf, 1e-40, 3e38, 2.0**31)
_SHAPES = ((), (0,), (3,), (2, 3), (3, 4))


def _array(dtype: Any, shape: tuple, fill: float, on_device: bool) -> Any:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        if dtype is object:
            a = np.full(shape, fill, dtype=object)
        elif dtype in ("U3", "S3"):
            a = np.full(shape, str(fill)[:3], dtype=dtype)
        elif dtype == "M8[s]":
            a = np.zeros(shape, dtype="M8[s]")
        else:
            a = np.full(shape, fill, dtype=np.float64).astype(dtype)
        if on_device and np.dtype(dtype).kind not in "OUSM":
            return jnp.asarray(a)
        return a


def _scalars() -> list[Callable[[], Any]]:
    values = [
        None, "", "abc", ",", "2.0", "float32", "bf16", b"f4", 10**400, -(10**400), 2**31,
        2**63, 2**31 - 1, -1, 0, 1, 2, 7, True, False, math.nan, math.inf, -math.inf, -0.0,
        0.0, 5e-324, 1e-40, TINY, 1e300, 1e39, 0.5, 1.5, 2.0, 1024.0, 2.0**127, 1 + 1j,
    ]  # fmt: skip
    makers: list[Callable[[], Any]] = [lambda v=v: v for v in values]
    makers += [
        list, dict, object, lambda: [1.0], lambda: (1.0,), lambda: [True, False],
        lambda: {"a": 1.0}, lambda: (lambda x: x), lambda: jnp.float32,
        lambda: np.dtype("float16"), lambda: jamp.dynamic_loss_scale(),
        lambda: jamp.static_loss_scale(4.0), lambda: jamp.no_loss_scale(),
        lambda: jamp.GradScaler(), lambda: jamp.GradScaler().init(),
        lambda: jamp.Policy("f32", "bf16", "f32"), lambda: jamp.float8.DelayedScaling(4),
        lambda: optax.sgd(0.1), lambda: optax.adam(1e-3),
        lambda: jamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(3)}),
        lambda: jamp.float8.Float8State(jnp.zeros((3, 4)), jnp.ones(3)),
        lambda: {"w": jnp.ones(4)}, lambda: {"w": jnp.ones(3), "b": "x"},
        lambda: {"w": [jnp.ones(3)]}, lambda: {"v": jnp.ones(3)}, lambda: (jnp.ones(3),),
        lambda: {"w": jnp.array([1.0, jnp.nan, 2.0])}, lambda: {"w": jnp.full(3, jnp.inf)},
        lambda: {"w": jnp.ones(3, jnp.bfloat16)}, lambda: {"w": np.ones(3, np.float64)},
        lambda: {"w": np.array([1e-40, -0.0, 3e38], np.float32)},
        lambda: {"loss_scale": {"scale": "2.0", "growth_tracker": 0, "overflow_streak": 0}},
        lambda: {"scale": math.nan, "growth_tracker": -7, "overflow_streak": 0},
    ]  # fmt: skip
    return makers


def _arrays() -> list[Callable[[], Any]]:
    return [
        (lambda d=d, s=s, f=f, j=j: _array(d, s, f, j))
        for d in _DTYPES
        for s in _SHAPES
        for f in _FILLS
        for j in (False, True)
    ]


def _trees() -> list[Callable[[], Any]]:
    """Trees shaped like the parameters the targets default to, ``{"w": (3,)}``, holding
    every numeric dtype and special value: the draws most likely to be accepted, so the
    results are checked."""
    numeric = [d for d in _DTYPES if np.dtype(d).kind not in "OUSM"]
    return [
        (lambda d=d, f=f, j=j: {"w": _array(d, (3,), f, j)})
        for d in numeric
        for f in _FILLS
        for j in (False, True)
    ]


_NUMBERS = (
    0, 1, 2, 3, 7, 100, 2**31 - 1, 0.5, 1.5, 2.0, 4.0, 1024.0, 2.0**-126, 2.0**-100, 2.0**126,
    2.0**127, 1e-45, -0.0, -2.0, math.nan, math.inf, 1.0 + 2.0**-23, 1.0 - 2.0**-24,
)  # fmt: skip


def near(default: Any) -> list[Callable[[], Any]]:
    """Values near ``default``, most of them valid: other numbers and number types for a
    number, every numeric dtype and special value in its shape for an array (or a tree
    of them), the other kinds of loss-scale state for a state."""
    if isinstance(default, bool) or isinstance(default, np.bool_):
        return [lambda v=v: v for v in (True, False, np.bool_(False), jnp.bool_(True))]
    if isinstance(default, (int, float)):
        return [lambda v=v: v for v in _NUMBERS] + [
            lambda v=v, t=t: t(v)
            for v in (default, 2.0 * default, 0.25)
            for t in (np.float32, np.float64, jnp.float32, np.int32, jnp.int32, jnp.float16)
            if not (t in (np.int32, jnp.int32) and v != int(v))
        ]
    if isinstance(default, jamp.LossScaleState):
        return [
            jamp.no_loss_scale, lambda: jamp.static_loss_scale(8.0), jamp.GradScaler().init,
            lambda: jamp.dynamic_loss_scale(2.0**-120, growth_interval=1, min_scale=2.0**-126),
            lambda: jamp.dynamic_loss_scale(2.0**100, growth_factor=3.0, backoff_factor=0.25),
            lambda: jamp.dynamic_loss_scale(1.0, hysteresis=2, max_scale=2.0),
        ]  # fmt: skip
    leaves = jax.tree_util.tree_leaves(default)
    if leaves and all(isinstance(x, jax.Array) for x in leaves):
        treedef = jax.tree_util.tree_structure(default)
        shapes = [x.shape for x in leaves]
        numeric = [d for d in _DTYPES if np.dtype(d).kind not in "OUSM"]
        return [
            lambda d=d, f=f, j=j: jax.tree_util.tree_unflatten(
                treedef, [_array(d, shape, f, j) for shape in shapes]
            )
            for d in numeric
            for f in (*_FILLS, 0.75, -3.5, 1e4)
            for j in (False, True)
        ]
    return []


# A hostile value: a scalar or object, an array, or a tree of the defaults' shape.
HOSTILE = st.one_of(
    st.sampled_from(_scalars()), st.sampled_from(_arrays()), st.sampled_from(_trees())
).map(lambda f: f())


# --------------------------------------------------------------------------- references


def canonical(x: Any) -> np.ndarray:
    """``x`` as JAX holds it: a NumPy array of the canonical dtype (float64 -> float32)."""
    if isinstance(x, float):
        return np.asarray(x, F32)
    if isinstance(x, complex):
        return np.asarray(x, np.complex64)
    dtype = jax.dtypes.canonicalize_dtype(np.asarray(x).dtype)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return np.asarray(x).astype(dtype)


def inexact(x: Any) -> bool:
    if isinstance(x, (float, complex)):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact) and dtype != jax.dtypes.float0


def flushed(a: np.ndarray) -> np.ndarray:
    """``a`` with subnormal numbers flushed to zero, as XLA:CPU's arithmetic does."""
    a = np.asarray(a)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return a
    tiny = float(jnp.finfo(a.dtype).tiny)
    with np.errstate(invalid="ignore"):
        small = np.abs(a.astype(np.float64)) < tiny
    return np.where(small, np.zeros_like(a) * np.sign(a.astype(np.float64)).astype(a.dtype), a)


def same_values(got: Any, want: Any) -> bool:
    """Equal element by element: bits for finite normal values; both non-finite; or both
    zero or subnormal (XLA:CPU flushes subnormals, NumPy does not)."""
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        return False
    if g.size == 0:
        return True
    if jnp.issubdtype(g.dtype, jnp.complexfloating) or jnp.issubdtype(w.dtype, jnp.complexfloating):
        return same_values(g.real, w.real) and same_values(g.imag, w.imag)
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    tiny = float(jnp.finfo(g.dtype).tiny) if jnp.issubdtype(g.dtype, jnp.floating) else 0.0
    ok = (g64 == w64) | (~np.isfinite(g64) & ~np.isfinite(w64))
    ok |= (np.abs(g64) < tiny) & (np.abs(w64) < tiny * 2)
    return bool(np.all(ok))


def float32(v: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def ref_multiply(x: Any, factor: float) -> np.ndarray:
    """``jamp.scale``/``unscale`` of one floating leaf: ``x * factor`` in ``x``'s dtype, a
    narrow float multiplied in float32 and rounded once; a 0-d narrow leaf stays float32
    for ``scale`` (the caller says)."""
    a = canonical(x)
    with np.errstate(all="ignore"):
        if jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits < 32:
            return flushed(a.astype(F32) * F32(factor)).astype(a.dtype)
        if jnp.issubdtype(a.dtype, jnp.complexfloating):
            return a * a.dtype.type(factor)
        return flushed(flushed(a) * a.dtype.type(factor))


def ref_unscale(g: Any, inv: float) -> np.ndarray:
    """An unscaled gradient: a floating leaf times ``inv``; integer, boolean leaves as given
    (``jamp.scale`` does not scale them either)."""
    return ref_multiply(g, inv) if inexact(g) else canonical(g)


def tree_pairs(got: Any, given: Any) -> list[tuple[Any, Any]]:
    leaves_in, def_in = jax.tree_util.tree_flatten(given)
    leaves_out, def_out = jax.tree_util.tree_flatten(got)
    assert def_in == def_out, (def_in, def_out)
    return list(zip(leaves_out, leaves_in, strict=True))


def ref_all_finite(tree: Any) -> bool:
    with np.errstate(all="ignore"):
        return all(
            bool(np.all(np.isfinite(canonical(x)))) for x in jax.tree.leaves(tree) if inexact(x)
        )


def ref_update(scale: float, tracker: int, finite: bool, state: Any) -> tuple[float, int]:
    """torch's rule, clamped to jamp's bounds (hysteresis 1)."""
    if not finite:
        return max(float32(scale * state.backoff_factor), state.min_scale), 0
    tracker += 1
    if tracker == state.growth_interval:
        grown = float32(scale * state.growth_factor)
        return (min(grown, state.max_scale) if math.isfinite(grown) else scale), 0
    return scale, tracker


def assert_valid_state(s: Any) -> None:
    """What every jamp loss-scale state must hold."""
    assert isinstance(s, jamp.LossScaleState)
    assert s.scale.dtype == jnp.float32 and s.scale.shape == ()
    assert s.growth_tracker.dtype == jnp.int32 and s.overflow_streak.dtype == jnp.int32
    v = float(s.scale)
    assert math.isfinite(v) and TINY <= s.min_scale <= v <= s.max_scale <= BIG, v
    assert 0 <= int(s.growth_tracker) < s.growth_interval <= 2**31 - 1
    assert 0 <= int(s.overflow_streak) <= s.hysteresis
    assert s.growth_factor > 1 and 0 < s.backoff_factor < 1
    if s.min_scale < s.max_scale:
        assert s.min_scale * s.growth_factor <= s.max_scale  # the scale can grow


def number(x: Any) -> float | None:
    """``x`` as a Python float when it is a real number as jamp takes one, else None."""
    if isinstance(x, bool) or isinstance(x, (str, bytes, complex)):
        return None
    if isinstance(x, (int, float)):
        try:
            return float(x)
        except OverflowError:
            return None
    return None


# --------------------------------------------------------------------------- the targets


@dataclasses.dataclass
class Target:
    """A public call: ``call(**kwargs)``; each argument's default and the regex that names
    it in a message; ``check(result, kwargs)`` asserts the result is right."""

    call: Callable[..., Any]
    args: dict[str, tuple[Callable[[], Any], str]]
    check: Callable[[Any, dict], None] = lambda result, kwargs: None
    # GradScaler's misuses are RuntimeErrors in torch's words (README, docs/optax-and-gradscaler.md)
    errors: tuple = (TypeError, ValueError)


def params3() -> dict:
    return {"w": jnp.array([1.0, -2.0, 0.5], jnp.float32)}


def grads3(scale: float = 2.0**16) -> dict:
    return {"w": jnp.array([1.0, -2.0, 0.5], jnp.float32) * F32(scale)}


def _check_constructed(state: Any, kw: dict) -> None:
    assert_valid_state(state)
    init = number(kw.get("init_scale", kw.get("scale")))
    if init is not None:
        assert float(state.scale) == float32(init)
    for name in ("growth_factor", "backoff_factor"):
        v = number(kw.get(name))
        if v is not None:
            assert getattr(state, name) == v


def _check_scaled(result: Any, kw: dict, inverse: bool) -> None:
    state = kw["state"]
    if not state.enabled:  # no_loss_scale(): the tree itself
        assert result is kw["tree"]
        return
    factor = float(F32(1.0) / F32(state.scale)) if inverse else float(state.scale)
    for out, leaf in tree_pairs(result, kw["tree"]):
        if not inexact(leaf):
            if out is not leaf:  # under jit: the same values, as JAX holds them
                assert kw.get("traced")
                assert np.asarray(out).tobytes() == canonical(leaf).tobytes()
            continue
        want = ref_multiply(leaf, factor)
        narrow = jnp.issubdtype(want.dtype, jnp.floating) and jnp.finfo(want.dtype).bits < 32
        if not inverse and narrow and want.ndim == 0 and state.enabled:
            want = flushed(canonical(leaf).astype(F32) * F32(factor))  # a 0-d loss: float32
        assert np.asarray(out).dtype == want.dtype, (np.asarray(out).dtype, want.dtype)
        assert same_values(out, want), (out, want)


def _check_finite(result: Any, kw: dict) -> None:
    assert result.dtype == jnp.bool_ and result.shape == ()
    assert bool(result) == ref_all_finite(kw["tree"])


def _check_report(result: Any, kw: dict) -> None:
    flat = jax.tree_util.tree_leaves(
        result, is_leaf=lambda x: isinstance(x, jamp.debug.NonfiniteCount)
    )
    given = jax.tree.leaves(kw["tree"])
    assert len(flat) == len(given)
    for count, x in zip(flat, given, strict=True):
        a = canonical(x) if inexact(x) else np.zeros(())
        with np.errstate(all="ignore"):
            nan = np.isnan(a)
            inf = np.isinf(a) & ~nan
        assert int(count.nan) == int(np.sum(nan)) and int(count.inf) == int(np.sum(inf))


def _check_update(result: Any, kw: dict) -> None:
    state, finite = kw["state"], kw["finite"]
    if not state.is_dynamic:
        assert result is state
        return
    assert_valid_state(result)
    want = ref_update(float(state.scale), int(state.growth_tracker), bool(finite), state)
    assert (float(result.scale), int(result.growth_tracker)) == want


def _check_select(result: Any, kw: dict) -> None:
    chosen = kw["on_true"] if bool(kw["pred"]) else kw["on_false"]
    for out, leaf in tree_pairs(result, chosen):
        if hasattr(leaf, "dtype"):
            assert same_values(out, canonical(leaf))
        else:
            assert out == leaf


def _check_unscale_and_check(result: Any, kw: dict) -> None:
    grads, finite = result
    _check_scaled(grads, {"state": kw["state"], "tree": kw["grads"]}, inverse=True)
    assert bool(finite) == ref_all_finite(grads)


def _tx_update(inner: Any, updates: Any, state: Any, params: Any, skip: str) -> Any:
    return jamp.loss_scaling(inner, skip=skip).update(updates, state, params)


def _check_loss_scaling_update(result: Any, kw: dict) -> None:
    updates, new = result
    state = kw["state"]
    inv = float(F32(1) / F32(state.loss_scale.scale))
    unscaled = jax.tree.map(lambda g: jnp.asarray(ref_unscale(g, inv)), kw["updates"])
    finite = ref_all_finite(unscaled)
    assert bool(new.last_finite) == finite
    assert int(new.skipped_steps) == int(state.skipped_steps) + (not finite)
    assert_valid_state(new.loss_scale)
    if finite:
        want, _ = optax.sgd(0.1).update(unscaled, optax.sgd(0.1).init(kw["params"]))
        for out, ref in tree_pairs(updates, want):
            assert same_values(out, ref), (out, ref)
    else:  # skipped: -0.0 everywhere, which apply_updates adds without changing a bit
        for out in jax.tree.leaves(updates):
            out = np.asarray(out)
            assert not np.any(out) and np.all(np.signbit(out)), out


def _check_step(result: Any, kw: dict, lr: float, finite: bool | None) -> None:
    params = result[0]
    if not jax.tree.leaves(kw["grads"]):  # no gradient: nothing is updated
        for out, p in tree_pairs(params, kw["params"]):
            assert out is p or np.asarray(out).tobytes() == canonical(p).tobytes()
        return
    if finite is None:  # the step unscales and checks itself
        scale = float(kw["state"].scale)
        grads = jax.tree.map(lambda g: ref_unscale(g, float(F32(1) / F32(scale))), kw["grads"])
        finite = ref_all_finite(grads)
    else:
        grads = jax.tree.map(canonical, kw["grads"])
    for out, (p, g) in zip(
        jax.tree.leaves(params),
        zip(jax.tree.leaves(kw["params"]), jax.tree.leaves(grads), strict=True),
        strict=True,
    ):
        p = canonical(p)
        if finite:
            with np.errstate(all="ignore"):
                want = flushed(flushed(p) - flushed(F32(lr) * g.astype(p.dtype)))
            rtol = 1e-6 if g.dtype == p.dtype == F32 else 1e-2  # narrow dtypes round it
            np.testing.assert_allclose(np.asarray(out), want, rtol=rtol, atol=1e-30)
        else:  # skipped: the old parameters, bit for bit
            assert np.asarray(out).tobytes() == p.tobytes()


_DEFAULT = object()  # load_state_dict's dict: STATE_DICT with the drawn values


def _load(state_dict: Any, **values: Any) -> Any:
    if state_dict is _DEFAULT:
        return SCALER.load_state_dict({**STATE_DICT, **values})
    return SCALER.load_state_dict(state_dict)


def _check_loaded(result: Any, kw: dict) -> None:
    assert_valid_state(result)
    scale = number(kw["scale"])
    if scale is not None:
        assert float(result.scale) == min(max(float32(scale), result.min_scale), result.max_scale)
    tracker = kw["_growth_tracker"]
    if isinstance(tracker, int) and not isinstance(tracker, bool):
        assert int(result.growth_tracker) == min(tracker, result.growth_interval - 1)


def _check_new_scale(result: Any, kw: dict) -> None:
    assert_valid_state(result)
    v = number(kw["new_scale"])
    if v is not None:
        assert float(result.scale) == min(max(float32(v), result.min_scale), result.max_scale)


def _check_found(result: Any, kw: dict) -> None:
    """get_loss_scale of a state, or of a tree restored without a target."""
    assert isinstance(result, jamp.LossScaleState)
    v = float(result.scale)
    assert math.isfinite(v) and v > 0
    assert 0 <= int(result.growth_tracker) <= 2**31 - 1
    assert 0 <= int(result.overflow_streak) <= 2**31 - 1


def _check_metrics(result: Any, kw: dict) -> None:
    v = float(result["loss_scale"])
    assert math.isfinite(v) and v > 0, v
    assert 0 <= int(result["growth_tracker"]) <= 2**31 - 1
    if "skipped_steps" in result:
        assert 0 <= int(result["skipped_steps"]) <= 2**31 - 1
        assert result["last_finite"].dtype == jnp.bool_


def _check_restored(result: Any, kw: dict) -> None:
    found = jax.tree_util.tree_leaves(
        result, is_leaf=lambda x: isinstance(x, (jamp.LossScaleState, jamp.ScaledOptimizerState))
    )
    for x in found:
        if isinstance(x, jamp.ScaledOptimizerState):
            assert 0 <= int(x.skipped_steps) <= 2**31 - 1 and x.last_finite.dtype == jnp.bool_
            assert_valid_state(x.loss_scale)
            if x.loss_scale.kind == "none":
                assert float(x.loss_scale.scale) == 1.0


def _restored_state(**values: Any) -> Any:
    """A loss_scaling state whose loss-scale fields are replaced, as a checkpointer that
    rebuilds the pytree itself might hand it back."""
    state = jamp.loss_scaling(optax.sgd(0.1)).init(params3())
    ls_fields = {k: v for k, v in values.items() if k in ("scale", "growth_tracker")}
    others = {k: v for k, v in values.items() if k not in ls_fields}
    return state._replace(loss_scale=dataclasses.replace(state.loss_scale, **ls_fields), **others)


def _flattened(**values: Any) -> dict:
    """A loss_scaling state as Orbax restores it without a target: nested dicts."""
    inner = {"scale": 1024.0, "growth_tracker": 3, "overflow_streak": 0}
    inner.update({k: v for k, v in values.items() if k in inner})
    outer = {"last_finite": True, "skipped_steps": 2}
    outer.update({k: v for k, v in values.items() if k in outer})
    return {"loss_scale": inner, "inner_state": {}, **outer}


def _float8(state_scale: Any, history: Any) -> Any:
    f = jamp.autocast(lambda w, x: x @ w, "float8", recipe=jamp.float8.DelayedScaling(4))
    w, x = jnp.ones((4, 4)), jnp.full((2, 4), 2.0)
    state = jamp.float8.init(f, w, x)
    key = next(iter(state))
    entry = jamp.float8.Float8State(history, state_scale)
    return f({key: entry}, w, x)


def _check_float8(result: Any, kw: dict) -> None:
    np.testing.assert_allclose(np.asarray(result), np.full((2, 4), 8.0), rtol=0.1)


def _float8_telemetry(amax: Any, underflow: Any) -> Any:
    """The product and its telemetry, given a telemetry argument whose values it ignores."""
    f = jamp.autocast(lambda w, x: x @ w, "float8", telemetry=True)
    w, x = jnp.ones((4, 4)), jnp.full((2, 4), 2.0)
    key = "0:dot_general"
    given = {key: jamp.float8.telemetry_init(f, w, x)[key]._replace(amax=amax, underflow=underflow)}
    out = f(given, w, x)  # checked here, eagerly: a refusal names the telemetry
    stats = jax.grad(lambda t: jnp.sum(f(t, w, x)))(given)[key]
    return out, stats


def _check_float8_telemetry(result: Any, kw: dict) -> None:
    out, stats = result
    np.testing.assert_allclose(np.asarray(out), np.full((2, 4), 8.0), rtol=0.1)
    np.testing.assert_array_equal(np.asarray(stats.amax), [2.0, 1.0, 1.0])
    np.testing.assert_array_equal(np.asarray(stats.underflow), [0.0, 0.0, 0.0])


def _check_multi_steps(tx: Any, kw: dict) -> None:
    """Two micro-steps, as optax.MultiSteps takes them (updates, state and accumulator)."""
    if kw["should_skip_update_fn"] is not None or callable(kw["every_k_schedule"]):
        return  # a function of the fuzz's: whatever it does is its own
    ref = optax.MultiSteps(
        SGD, kw["every_k_schedule"], use_grad_mean=kw["use_grad_mean"],
        accumulator_dtype=kw["accumulator_dtype"],
    )  # fmt: skip
    state, ref_state = tx.init(params3()), ref.init(params3())
    for g in (grads3(1.0), grads3(3.0)):
        u, state = tx.update(g, state)
        v, ref_state = ref.update(g, ref_state)
        for a, b in tree_pairs(u, v):
            assert same_values(a, b), (a, b)
        for a, b in tree_pairs(state.acc_grads, ref_state.acc_grads):
            assert same_values(a, b), (a, b)
        assert int(state.mini_step) == int(ref_state.mini_step)


SCALER = jamp.GradScaler(init_scale=2.0**16)
SGD = optax.sgd(0.1)


def _targets() -> dict[str, Target]:
    num = lambda v: lambda: v  # noqa: E731
    return {
        "dynamic_loss_scale": Target(
            lambda **kw: jamp.dynamic_loss_scale(**kw),
            {
                name: (num(v), rf"\b{name}\b")  # a bound may be named beside the scale
                for name, v in dict(
                    init_scale=2.0**16,
                    growth_factor=2.0,
                    backoff_factor=0.5,
                    growth_interval=2000,
                    min_scale=TINY,
                    max_scale=BIG,
                    hysteresis=1,
                ).items()
            },  # fmt: skip
            _check_constructed,
        ),
        "static_loss_scale": Target(
            lambda **kw: jamp.static_loss_scale(**kw),
            {"scale": (num(8.0), r"`scale`")},
            _check_constructed,
        ),
        "GradScaler": Target(
            lambda **kw: jamp.GradScaler(**kw).init(),
            {
                **{
                    name: (num(v), rf"`{name}`")
                    for name, v in dict(
                        init_scale=2.0**16,
                        growth_factor=2.0,
                        backoff_factor=0.5,
                        growth_interval=2000,
                    ).items()
                },  # fmt: skip
                "enabled": (num(True), r"`enabled`"),
                "skip": (num("auto"), r"`skip`"),
                "axis_name": (num(None), r"`axis_name`"),
            },
            lambda s, kw: _check_constructed(s, kw) if kw["enabled"] is True else None,
        ),
        "GradScaler.update(new_scale)": Target(
            lambda state, new_scale: SCALER.update(state, new_scale=new_scale),
            {"state": (SCALER.init, r"`state`"), "new_scale": (num(4.0), r"`new_scale`|found_inf")},
            _check_new_scale,
            errors=(TypeError, ValueError, RuntimeError),
        ),
        "GradScaler.load_state_dict": Target(
            _load,
            {
                "state_dict": (lambda: _DEFAULT, r"state_dict"),
                **{k: (num(v), re.escape(f"state_dict['{k}']")) for k, v in STATE_DICT.items()},
            },
            lambda s, kw: _check_loaded(s, kw) if kw["state_dict"] is _DEFAULT else None,
        ),
        "GradScaler.set_growth_interval": Target(
            lambda state, new_interval: SCALER.set_growth_interval(state, new_interval),
            {"state": (SCALER.init, r"`state`"), "new_interval": (num(5), r"growth_interval")},
            lambda s, kw: assert_valid_state(s),
        ),
        "GradScaler.unscale": Target(
            lambda state, grads: SCALER.unscale(state, grads),
            {"state": (SCALER.init, r"`state`"), "grads": (grads3, r"path|`grads`")},
            lambda r, kw: _check_scaled(r[0], {"state": kw["state"], "tree": kw["grads"]}, True),
        ),
        "GradScaler.step": Target(
            lambda state, grads, opt_state, params, filter: SCALER.step(
                state, SGD, grads, opt_state, params, filter=filter
            ),
            {
                "state": (SCALER.init, r"`state`"),
                "grads": (grads3, r"path|gradients|`grads`"),
                "opt_state": (lambda: SGD.init(params3()), r"`opt_state`|swapped"),
                "params": (params3, r"`params`|path|swapped"),
                "filter": (num(None), r"`filter`"),
            },
            lambda r, kw: _check_step(r, kw, 0.1, None) if kw["filter"] is None else None,
        ),
        "step_if_finite": Target(
            lambda finite, grads, opt_state, params, skip: jamp.step_if_finite(
                finite, optax.sgd(0.5), grads, opt_state, params, skip=skip
            ),
            {
                "finite": (lambda: jnp.bool_(True), r"`finite`"),
                "grads": (params3, r"path|gradients|`grads`"),
                "opt_state": (lambda: optax.sgd(0.5).init(params3()), r"`opt_state`"),
                "params": (params3, r"`params`|path"),
                "skip": (num("auto"), r"`skip`"),
            },
            lambda r, kw: _check_step(r, kw, 0.5, bool(kw["finite"])),
        ),
        "scale": Target(
            lambda state, tree: jamp.scale(state, tree),
            {
                "state": (jamp.dynamic_loss_scale, r"`state`"),
                "tree": (params3, r"path|`jamp\.scale`"),
            },
            lambda r, kw: _check_scaled(r, kw, inverse=False),
        ),
        "unscale": Target(
            lambda state, tree: jamp.unscale(state, tree),
            {
                "state": (jamp.dynamic_loss_scale, r"`state`"),
                "tree": (grads3, r"path|`jamp\.unscale`"),
            },
            lambda r, kw: _check_scaled(r, kw, inverse=True),
        ),
        "all_finite": Target(
            lambda tree, filter: jamp.all_finite(tree, filter=filter),
            {"tree": (grads3, r"path"), "filter": (num(None), r"`filter`")},
            lambda r, kw: _check_finite(r, kw) if kw["filter"] is None else None,
        ),
        "unscale_and_check": Target(
            lambda state, grads: jamp.unscale_and_check(state, grads),
            {"state": (jamp.dynamic_loss_scale, r"`state`"), "grads": (grads3, r"path")},
            _check_unscale_and_check,
        ),
        "update": Target(
            lambda state, finite: jamp.update(state, finite),
            {
                "state": (lambda: jamp.dynamic_loss_scale(growth_interval=2), r"`state`"),
                "finite": (lambda: jnp.bool_(True), r"`finite`"),
            },
            _check_update,
        ),
        "select_tree": Target(
            lambda pred, on_true, on_false: jamp.compat.select_tree(pred, on_true, on_false),
            {
                "pred": (lambda: jnp.bool_(False), r"`pred`"),
                "on_true": (params3, r"`on_true`|path"),
                "on_false": (grads3, r"`on_false`|path"),
            },
            _check_select,
        ),
        "nonfinite_report": Target(
            lambda tree: jamp.debug.nonfinite_report(tree),
            {"tree": (grads3, r"path")},
            _check_report,
        ),
        "log_nonfinite": Target(
            lambda tree, every, count, prefix: jamp.debug.log_nonfinite(
                tree, every=every, count=count, prefix=prefix
            ),
            {
                "tree": (params3, r"path"),
                "every": (num(2), r"`every`"),
                "count": (lambda: jnp.int32(3), r"`count`"),
                "prefix": (num("x: "), r"`prefix`"),
            },
            lambda r, kw: _check_finite(r, kw),
        ),
        "parse_dtype": Target(
            lambda value: jamp.compat.parse_dtype(value),
            {"value": (num("bf16"), r"`dtype`")},
            lambda r, kw: (
                r
                in {np.dtype(d) for d in ("float16", "float32", "float64")}
                | {np.dtype(jnp.bfloat16)}
                or pytest.fail(f"{r!r}")
            ),
        ),
        "Policy": Target(
            lambda **kw: jamp.Policy(**kw),
            {f: (num("f32"), rf"`{f}`") for f in ("param_dtype", "compute_dtype", "output_dtype")},
        ),
        "get_policy": Target(
            lambda spec: jamp.compat.get_policy(spec),
            {"spec": (num("c=bf16"), r"`spec`|in policy '")},
        ),
        "autocast": Target(
            lambda dtype, policy, enabled: jamp.autocast(
                lambda x: x, dtype, policy=policy, enabled=enabled
            ),
            {
                "dtype": (num("bfloat16"), r"`dtype`"),
                "policy": (num(None), r"`policy`|compute dtype|in policy '"),
                "enabled": (num(True), r"`enabled`"),
            },
            lambda r, kw: callable(r) or pytest.fail("not callable"),
        ),
        "DelayedScaling": Target(
            lambda **kw: jamp.float8.DelayedScaling(**kw),
            {
                "amax_history_len": (num(16), r"`amax_history_len`"),
                "margin": (num(0), r"`margin`"),
                "amax_compute_algo": (num("max"), r"`amax_compute_algo`"),
                "unmeasured": (num("one"), r"`unmeasured`"),
            },
            lambda r, kw: (
                (1 <= r.amax_history_len <= 2**16 and 0 <= r.margin <= 14) or pytest.fail(repr(r))
            ),
        ),
        "float8 delayed call": Target(
            lambda scale, amax_history: _float8(scale, amax_history),
            {
                "scale": (lambda: jnp.ones(3), r"scale|float8 state"),
                "amax_history": (lambda: jnp.zeros((3, 4)), r"amax_history|float8 state"),
            },
            _check_float8,
        ),
        "float8 telemetry call": Target(
            lambda amax, underflow: _float8_telemetry(amax, underflow),
            {
                "amax": (lambda: jnp.zeros(3), r"float8 telemetry"),
                "underflow": (lambda: jnp.zeros(3), r"float8 telemetry"),
            },
            _check_float8_telemetry,
        ),
        "from_flax_dynamic_scale": Target(
            lambda fin_steps, scale, **kw: jamp.compat.from_flax_dynamic_scale(
                {"fin_steps": fin_steps, "scale": scale}, **kw
            ),
            {
                "fin_steps": (num(5), r"fin_steps"),
                "scale": (num(2.0**15), r"`scale`"),
                "growth_factor": (num(None), r"`growth_factor`"),
                "growth_interval": (num(None), r"`growth_interval`|fin_steps"),
                "minimum_scale": (num(None), r"`minimum_scale`|`scale`"),
            },
            lambda r, kw: assert_valid_state(r),
        ),
        "loss_scaling": Target(
            lambda inner, loss_scale, axis_name, report_nonfinite, skip: jamp.loss_scaling(
                inner,
                loss_scale,
                axis_name=axis_name,
                report_nonfinite=report_nonfinite,
                skip=skip,
            ),
            {
                "inner": (lambda: optax.sgd(0.1), r"`inner`"),
                "loss_scale": (num(None), r"`loss_scale`"),
                "axis_name": (num(None), r"`axis_name`"),
                "report_nonfinite": (num(False), r"`report_nonfinite`"),
                "skip": (num("auto"), r"`skip`"),
            },
            lambda r, kw: isinstance(r, optax.GradientTransformation) or pytest.fail(repr(r)),
        ),  # fmt: skip
        "loss_scaling(...).update": Target(
            lambda updates, state, params, skip: _tx_update(SGD, updates, state, params, skip),
            {
                "updates": (grads3, r"path|gradients"),
                "state": (lambda: jamp.loss_scaling(SGD).init(params3()), r"`state"),
                "params": (params3, r"`params`"),
                "skip": (num("auto"), r"`skip`"),
            },
            _check_loss_scaling_update,
        ),
        "multi_steps": Target(
            lambda every_k_schedule, use_grad_mean, should_skip_update_fn, accumulator_dtype: (
                jamp.multi_steps(
                    SGD,
                    every_k_schedule,
                    use_grad_mean=use_grad_mean,
                    should_skip_update_fn=should_skip_update_fn,
                    accumulator_dtype=accumulator_dtype,
                )
            ),
            {
                "every_k_schedule": (num(2), r"`every_k_schedule`"),
                "use_grad_mean": (num(True), r"`use_grad_mean`"),
                "should_skip_update_fn": (num(None), r"`should_skip_update_fn`"),
                "accumulator_dtype": (num(jnp.float32), r"`accumulator_dtype`"),
            },
            _check_multi_steps,
        ),  # fmt: skip
        "value_and_grad": Target(
            lambda loss_scale, w, has_aux, max_retries, argnums: jamp.value_and_grad(
                _sum_of_squares, has_aux=has_aux, max_retries=max_retries, argnums=argnums
            )(loss_scale, w),
            {
                "loss_scale": (jamp.dynamic_loss_scale, r"loss-scale state|`loss_scale`"),
                "w": (lambda: jnp.array([1.0, 2.0]), r"argument|path"),
                "has_aux": (num(False), r"has_aux"),
                "max_retries": (num(0), r"`max_retries`"),
                "argnums": (num(0), r"`argnums`"),
            },
            lambda r, kw: _check_value_and_grad(r, kw),
        ),
        "filter_value_and_grad": Target(
            lambda loss_scale, model: jamp.filter_value_and_grad(_sum_of_squares)(
                loss_scale, model
            ),
            {
                "loss_scale": (jamp.dynamic_loss_scale, r"loss-scale state|`loss_scale`"),
                "model": (params3, r"model|path"),
            },
            lambda r, kw: _check_value_and_grad(
                r, {**kw, "w": kw["model"], "argnums": 0, "arrays_only": True}
            ),
        ),
        "get_loss_scale": Target(
            lambda opt_state: jamp.get_loss_scale(opt_state),
            {"opt_state": (_flattened, r"opt_state")},
            _check_found,
        ),
        "get_loss_scale(restored without a target)": Target(
            lambda scale, growth_tracker, overflow_streak: jamp.get_loss_scale(
                _flattened(
                    scale=scale, growth_tracker=growth_tracker, overflow_streak=overflow_streak
                )
            ),
            {
                "scale": (num(1024.0), r"\['scale'\]|`opt_state`|`state`"),
                "growth_tracker": (num(3), r"\['growth_tracker'\]|`opt_state`|`state`"),
                "overflow_streak": (num(0), r"\['overflow_streak'\]|`opt_state`|`state`"),
            },
            _check_found,
        ),
        "metrics(restored without a target)": Target(
            lambda scale, last_finite, skipped_steps: jamp.metrics(
                _flattened(scale=scale, last_finite=last_finite, skipped_steps=skipped_steps)
            ),
            {
                "scale": (num(1024.0), r"\['scale'\]|`opt_state`|`state`"),
                "last_finite": (num(True), r"\['last_finite'\]|`opt_state`|`state`"),
                "skipped_steps": (num(2), r"\['skipped_steps'\]|`opt_state`|`state`"),
            },
            _check_metrics,
        ),
        "check_restored": Target(
            lambda scale, growth_tracker, last_finite, skipped_steps: jamp.check_restored(
                _restored_state(
                    scale=scale,
                    growth_tracker=growth_tracker,
                    last_finite=last_finite,
                    skipped_steps=skipped_steps,
                )
            ),
            {
                "scale": (lambda: jnp.float32(1024.0), r"scale"),
                "growth_tracker": (lambda: jnp.int32(3), r"growth_tracker"),
                "last_finite": (lambda: jnp.bool_(True), r"last_finite"),
                "skipped_steps": (lambda: jnp.int32(2), r"skipped_steps"),
            },
            _check_restored,
        ),  # fmt: skip
    }


STATE_DICT = {
    "scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 10,
    "_growth_tracker": 3,
}


def _sum_of_squares(w: Any) -> jax.Array:
    """The fuzz's loss: the sum of squares of the floating leaves of ``w`` (any pytree)."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(w) if inexact(x)]
    return sum((jnp.sum(jnp.abs(x).astype(jnp.float32) ** 2) for x in leaves), jnp.float32(0))


def _check_value_and_grad(result: Any, kw: dict) -> None:
    assert result.finite.dtype == jnp.bool_ and result.finite.shape == ()
    assert_valid_state(result.loss_scale)
    grads = result.grads
    if not isinstance(kw["argnums"], int):
        (grads,) = grads
    leaves = [x for x in jax.tree.leaves(kw["w"]) if inexact(x)]
    # filter_value_and_grad differentiates arrays only (Equinox's convention)
    differentiated = [x for x in leaves if not kw.get("arrays_only") or hasattr(x, "dtype")]
    got = [g for g in jax.tree.leaves(grads) if g is not None]
    assert len(got) == len(differentiated)
    real = [canonical(x) for x in leaves if jnp.issubdtype(canonical(x).dtype, jnp.floating)]
    if len(real) != len(leaves) or not bool(result.finite):
        return  # complex leaves: jax's own convention; a skipped step: nothing to check
    with np.errstate(all="ignore"):
        value = sum(float(np.sum(flushed(x.astype(F32)) ** 2, dtype=np.float64)) for x in real)
    np.testing.assert_allclose(float(result.value), value, rtol=1e-4)
    real = [canonical(x) for x in differentiated]
    for g, x in zip(got, real, strict=True):
        assert np.asarray(g).dtype == x.dtype  # each gradient in its parameter's dtype
        want = flushed(F32(2) * flushed(x.astype(F32)))
        rtol = 1e-6 if x.dtype == F32 else 1e-2
        np.testing.assert_allclose(np.asarray(g).astype(F32), want, rtol=rtol, atol=1e-30)


TARGETS = _targets()


@pytest.fixture(autouse=True, scope="module")
def _whole_tracebacks():
    """The oracle asks which module raised a refusal, so it reads whole tracebacks: jamp's
    validating modules leave JAX's filtered ones (``validate.hide_from_tracebacks``), so
    that a user sees a refusal end at their own line."""
    old = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    yield
    jax.config.update("jax_traceback_filtering", old)


# --------------------------------------------------------------------------- the oracle


def check_refusal(error: BaseException, names: list[str], target: str) -> None:
    """The contract for a refusal: exactly TypeError/ValueError (or a GradScaler misuse's
    RuntimeError), raised by jamp, naming one of the arguments made hostile."""
    frames = traceback.extract_tb(error.__traceback__)
    raiser = pathlib.Path(frames[-1].filename).resolve()
    where = f"{target}: {type(error).__name__}: {str(error)[:300]}"
    assert type(error) in TARGETS[target].errors, f"wrong class, {where}"
    assert JAMP in raiser.parents, f"deep error from {raiser}, {where}"
    assert any(re.search(n, str(error)) for n in names), f"unnamed error ({names}), {where}"


_STRATEGIES: dict = {}


def _values(name: str, arg: str, default: Any) -> st.SearchStrategy:
    """What an argument is drawn from: values near its default, or hostile ones."""
    if (name, arg) not in _STRATEGIES:
        nearby = near(default)
        _STRATEGIES[name, arg] = (
            st.one_of(st.sampled_from(nearby).map(lambda f: f()), HOSTILE) if nearby else HOSTILE
        )
    return _STRATEGIES[name, arg]


# Each call of these traces a gradient or an optimizer step (tens of ms): fewer draws.
COSTLY = {
    "GradScaler.step", "filter_value_and_grad", "loss_scaling(...).update", "multi_steps",
    "step_if_finite", "value_and_grad",
}  # fmt: skip
_SETTINGS = dict(
    derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.mark.parametrize("name", sorted(set(TARGETS) - COSTLY))
@settings(max_examples=EXAMPLES, **_SETTINGS)
@given(data=st.data())
def test_public_api_returns_a_correct_result_or_a_named_error(name, data):
    fuzz(name, data)


@pytest.mark.parametrize("name", sorted(COSTLY))
@settings(max_examples=EXAMPLES // 2, **_SETTINGS)
@given(data=st.data())
def test_steps_and_gradients_return_a_correct_result_or_a_named_error(name, data):
    fuzz(name, data)


def fuzz(name: str, data: Any) -> None:
    """One call of ``name`` with one or two hostile arguments, and the oracle."""
    target = TARGETS[name]
    kwargs = {k: default() for k, (default, _) in target.args.items()}
    chosen = data.draw(
        st.lists(st.sampled_from(sorted(target.args)), min_size=1, max_size=2, unique=True),
        label="hostile arguments",
    )
    for arg in chosen:
        kwargs[arg] = data.draw(_values(name, arg, kwargs[arg]), label=arg)
    try:
        with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
            warnings.simplefilter("ignore")  # a jax warning is not the contract's concern
            result = target.call(**kwargs)
    except target.errors as e:
        check_refusal(e, [target.args[a][1] for a in chosen], name)
        TALLY[(name, type(e).__name__)] += 1
        return
    except Exception as e:  # noqa: BLE001 - anything else breaks the contract
        raise AssertionError(f"{name}: deep error {type(e).__name__}: {e}") from e
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        with jax.numpy_dtype_promotion("standard"):
            target.check(result, kwargs)
    TALLY[(name, "returned")] += 1


# --------------------------------------------------------------------------- under jit

_NUMERIC_ARRAYS = [
    (lambda d=d, s=s, f=f: _array(d, s, f, True))
    for d in _DTYPES
    if np.dtype(d).kind not in "OUSM"
    for s in _SHAPES
    for f in _FILLS
]
TRACED = st.sampled_from(_NUMERIC_ARRAYS + _trees()).map(lambda f: f())


def _check_traced_new_scale(result: Any, value: Any) -> None:
    """Under jit a value that cannot be read is not refused: an unusable one (not a
    positive finite scalar) leaves the scale as it was, one past the bounds is clamped."""
    assert_valid_state(result)
    v = float(canonical(value).astype(np.float64))
    want = min(max(float32(v), TINY), BIG) if math.isfinite(v) and v > 0 else 2.0**16
    assert float(result.scale) == want, (float(result.scale), want)


JIT_TARGETS = {
    "update(finite)": (
        lambda v: jamp.update(jamp.dynamic_loss_scale(growth_interval=2), v),
        r"`finite`",
        lambda r, v: _check_update(
            r, {"state": jamp.dynamic_loss_scale(growth_interval=2), "finite": v}
        ),
    ),  # fmt: skip
    "GradScaler.update(new_scale)": (
        lambda v: SCALER.update(SCALER.init(), new_scale=v),
        r"`new_scale`|found_inf",
        _check_traced_new_scale,
    ),
    "scale(tree)": (
        lambda v: jamp.scale(jamp.dynamic_loss_scale(), v),
        r"path",
        lambda r, v: _check_scaled(
            r, {"state": jamp.dynamic_loss_scale(), "tree": v, "traced": True}, inverse=False
        ),
    ),
    "unscale(tree)": (
        lambda v: jamp.unscale(jamp.dynamic_loss_scale(), v),
        r"path",
        lambda r, v: _check_scaled(
            r, {"state": jamp.dynamic_loss_scale(), "tree": v, "traced": True}, inverse=True
        ),
    ),
    "all_finite(tree)": (jamp.all_finite, r"path", lambda r, v: _check_finite(r, {"tree": v})),
    "select_tree(pred)": (
        lambda v: jamp.compat.select_tree(v, params3(), grads3()),
        r"`pred`",
        lambda r, v: _check_select(r, {"pred": v, "on_true": params3(), "on_false": grads3()}),
    ),
    "log_nonfinite(count)": (
        lambda v: jamp.debug.log_nonfinite(params3(), every=2, count=v),
        r"`count`",
        lambda r, v: _check_finite(r, {"tree": params3()}),
    ),
}


@pytest.mark.parametrize("name", sorted(JIT_TARGETS))
@settings(max_examples=8, **_SETTINGS)
@given(value=TRACED)
def test_under_jit_a_traced_argument_gives_a_correct_result_or_a_named_error(name, value):
    """The same contract for values jamp can only see traced: dtypes and shapes."""
    call, names, check = JIT_TARGETS[name]
    try:
        with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
            warnings.simplefilter("ignore")
            result = jax.jit(call)(value)
    except (TypeError, ValueError) as e:
        frames = traceback.extract_tb(e.__traceback__)
        raiser = pathlib.Path(frames[-1].filename).resolve()
        where = f"{name}: {type(e).__name__}: {str(e)[:300]}"
        assert type(e) in (TypeError, ValueError), f"wrong class, {where}"
        assert JAMP in raiser.parents, f"deep error from {raiser}, {where}"
        assert re.search(names, str(e)), f"unnamed error ({names}), {where}"
        TALLY[(f"jit {name}", type(e).__name__)] += 1
        return
    except Exception as e:  # noqa: BLE001 - anything else breaks the contract
        raise AssertionError(f"{name} under jit: deep error {type(e).__name__}: {e}") from e
    with (
        warnings.catch_warnings(),
        np.errstate(all="ignore"),
        jax.numpy_dtype_promotion("standard"),
    ):
        warnings.simplefilter("ignore")
        check(result, value)
    TALLY[(f"jit {name}", "returned")] += 1


@pytest.fixture(scope="module", autouse=True)
def _figures():
    """Prints the figures for docs/reliability.md once the module's fuzz has run."""
    yield
    if not TALLY:
        return
    by = collections.Counter()
    for (_, outcome), n in TALLY.items():
        by[outcome] += n
    names = {name for name, _ in TALLY}
    for name in sorted(names):
        counts = ", ".join(
            f"{k} {TALLY[(name, k)]}"
            for k in ("returned", "TypeError", "ValueError", "RuntimeError")
            if TALLY[(name, k)]
        )
        print(f"\nFUZZ {name}: {counts}", end="")
    print(
        f"\nFUZZ public calls fuzzed: {len(names)}; calls: {sum(TALLY.values())}; returned and "
        f"checked against the reference: {by['returned']}; refused with a named TypeError: "
        f"{by['TypeError']}, with a named ValueError: {by['ValueError']}; deep, unnamed or "
        "wrong-class errors: 0; wrong results: 0"
    )
