"""The delayed-scaling recipe and its state: [`Float8State`][jamp.float8.Float8State],
[`DelayedScaling`][jamp.float8.DelayedScaling] (Transformer Engine's recipe), the next
state from a step's amaxes, and the checks of a state: ``check_values`` on the values this
process can read, ``traced_check`` under ``jit``.

The float8 formats and the rows of a state are defined here, below the products
(``products``) and the telemetry (``telemetry``) that use them.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jamp._src.dtypes import E4M3, E5M2  # operands (forward), gradients (backward)
from jamp._src.dtypes import FLOAT32 as F32
from jamp._src.types import is_tracer

E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
E5M2_MAX = float(jnp.finfo(E5M2).max)  # 57344

# The rows of a Float8State: the left operand, the right operand, the gradient
# of the output; and the largest finite value of each row's format.
LHS, RHS, GRAD = 0, 1, 2
ROW_MAX = np.array([E4M3_MAX, E4M3_MAX, E5M2_MAX], np.float32)

ALGOS = ("max", "most_recent")
UNMEASURED = ("one", "current")

# The largest margin that keeps the largest recorded amax a normal float8_e4m3fn number
# (448 / 2**14 >= 2**-6); past 18 it is below the smallest subnormal, and flushes to 0.
MAX_MARGIN = 14
# 3 rows of float32 per step: 768 KiB per product. TE's default is 1024.
MAX_HISTORY = 2**16

# ---------------------------------------------------------------------------
# The state and the recipe of delayed scaling
# ---------------------------------------------------------------------------


class Float8State(NamedTuple):
    """The delayed-scaling state of one float8 matrix product: immutable, a pytree.

    Row 0 is the left operand, row 1 the right operand, row 2 the gradient of
    the output (``float8_e5m2``). A product inside a ``lax.scan`` of length
    ``n`` has one state per iteration, stacked: leading dimensions ``(n,)``
    (``(n, m)`` for nested scans), as Transformer Engine stacks a scanned
    layer's state.

    Attributes:
      amax_history: float32 ``(..., 3, amax_history_len)``: the amaxes of the
        last ``amax_history_len`` steps, the most recent at index 0 (as
        Transformer Engine and ``flax.linen.fp8_ops`` roll it).
      scale: float32 ``(..., 3)``: the scales the next step quantises with
        (``float8 = x * scale``): ``finfo.max / amax / 2**margin``. A fresh
        state's is 1, as Transformer Engine's (0, "not measured yet", with
        ``DelayedScaling(unmeasured="current")``).
    """

    amax_history: jax.Array
    scale: jax.Array


def _short(n: int) -> str:
    """An integer as written, or its number of digits when it is too long to read."""
    text = str(int(n))
    return text if len(text) <= 20 else f"<an integer of {len(text.lstrip('-'))} digits>"


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Transformer Engine's delayed-scaling recipe (``DelayedScaling`` in TE).

    After every step, each tensor's amax is rolled into its history (most
    recent at index 0, the oldest dropped) and the next scale is
    ``finfo(float8).max / amax / 2**margin``, where ``amax`` is the largest
    value of the history (``"max"``) or the newest (``"most_recent"``). A
    scale is kept from the step before when ``amax`` is 0 or not finite, or
    when the new scale would not be a finite float32 number (an amax below
    ``finfo.max * 2**-128``; TE has no such guard).

    ``unmeasured`` says what a tensor without a measured scale is quantised
    with: a fresh state's ([`jamp.float8.init`][]), and one whose next
    state came back zero (a product that the backward pass did not reach,
    such as one under ``stop_gradient``: its cotangent is zero):

    * ``"one"`` (TE's recipe, the default): scale 1, as Transformer Engine
      and Flax start. The quantisation never waits for this step's amax, so
      XLA can compute the amax in the same pass that quantises: the reason
      delayed scaling is faster than current scaling. On the first step a
      tensor above 448 saturates and one below ``2**-9`` flushes to zero,
      and a zero output has amax 0, so the next layer flushes on the next
      step, and so on down the network (``benchmarks/RESULTS.md``).
    * ``"current"``: a fresh state has scales of 0, "not measured yet", and
      a tensor whose scale is not positive and finite is quantised with its
      current scale: the first step is current scaling. The quantisation then
      depends on this step's amax on every step, so each operand is read
      twice, as under current scaling.

    Args:
      amax_history_len: how many steps of amaxes to keep (TE: 1024).
      margin: the scale is divided by ``2**margin``, leaving that many powers
        of two of headroom above the recorded amax (TE: 0).
      amax_compute_algo: ``"max"`` (TE's default) or ``"most_recent"``.
      unmeasured: ``"one"`` (TE's) or ``"current"``, see above.

    Raises:
      TypeError: ``amax_history_len`` or ``margin`` is not an integer, or
        ``amax_compute_algo`` or ``unmeasured`` not a string.
      ValueError: ``amax_history_len`` outside ``[1, 2**16]`` (a longer
        history is 12 bytes a step for every product: 2**28 steps would be
        3 GiB each), ``margin`` outside ``[0, 14]`` (a larger one maps even
        the largest value below float8_e4m3fn's smallest normal number,
        ``2**-6``, so the products lose their precision, and past 18 are all
        zero) or an unknown ``amax_compute_algo`` or ``unmeasured``.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> recipe = jamp.float8.DelayedScaling(amax_history_len=16, margin=1)
      >>> recipe
      DelayedScaling(amax_history_len=16, margin=1, amax_compute_algo='max', unmeasured='one')
      >>> f = jamp.autocast(lambda w, x: x @ w, "float8", recipe=recipe)
      >>> state = jamp.float8.init(f, jnp.ones((4, 4)), jnp.ones((2, 4)))
      >>> f(state, jnp.ones((4, 4)), jnp.ones((2, 4))).shape  # the state comes first
      (2, 4)
    """

    amax_history_len: int = 1024
    margin: int = 0
    amax_compute_algo: str = "max"
    unmeasured: str = "one"

    def __post_init__(self) -> None:
        for name in ("amax_history_len", "margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"Expected an int for `{name}`, got {value!r} instead.")
        if self.amax_history_len < 1:
            raise ValueError(
                f"Expected `amax_history_len` >= 1, got {self.amax_history_len} instead."
            )
        if self.amax_history_len > MAX_HISTORY:
            raise ValueError(
                f"Expected `amax_history_len` <= 2**16 = {MAX_HISTORY}, got "
                f"amax_history_len={_short(self.amax_history_len)} instead: the history holds 12 "
                "bytes per step for every float8 product (Transformer Engine's default is 1024)."
            )
        if self.margin < 0:
            raise ValueError(f"Expected `margin` >= 0, got {self.margin} instead.")
        if self.margin > MAX_MARGIN:
            raise ValueError(
                f"Expected `margin` in [0, {MAX_MARGIN}], got margin={_short(self.margin)} "
                f"instead: the scale divides by 2**margin, and past {MAX_MARGIN} even the largest "
                "recorded value quantises below float8_e4m3fn's smallest normal number "
                "(2**-6), so the products lose their precision (past 18 they are all zero). "
                "Transformer Engine's default is 0."
            )
        for name, allowed in (("amax_compute_algo", ALGOS), ("unmeasured", UNMEASURED)):
            value, choices = getattr(self, name), " or ".join(repr(a) for a in allowed)
            if not isinstance(value, str):
                raise TypeError(
                    f"Expected a string for `{name}` ({choices}), got {value!r} instead."
                )
            if value not in allowed:
                raise ValueError(f"Expected {choices} for `{name}`, got {value!r} instead.")


def _concrete(x: object) -> bool:
    """Whether ``x`` holds values this process can read (not a tracer, not another host's)."""
    if is_tracer(x):
        return False
    return getattr(x, "is_fully_addressable", True)


# Relative tolerance of a restored scale against the one its history gives (the recipe
# computes it in float32; a state from another backend may round differently).
_TOLERANCE = 2.0**-8


def _scales_from(amax: np.ndarray, margin: int, history: bool = False) -> np.ndarray:
    """The recipe's scale for each row's ``amax`` (``(..., 3)``, or a history ``(..., 3,
    steps)``), as ``next_state`` computes it in float32; inf where it would not be a
    finite float32 number."""
    row_max = ROW_MAX[:, None] if history else ROW_MAX
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        new = (row_max / amax.astype(np.float32)) / np.float32(2.0**margin)
    return np.where(np.isfinite(new), new, np.inf)


def _matches(scale: np.ndarray, want: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.isfinite(want) & (np.abs(scale / want - 1.0) <= _TOLERANCE)


def check_values(state: Float8State, where: str, recipe: DelayedScaling | None = None) -> None:
    """A ``ValueError`` naming ``where`` unless ``state`` (a [`jamp.float8.Float8State`][]) holds
    values the recipe can have produced: the scale the next product quantises with.

    An amax history with a negative entry, or a scale that is negative or not
    finite, never comes from the recipe. A row whose history is finite and
    measured (an amax > 0) must hold the scale the recipe computes from it,
    ``finfo.max / amax / 2**margin``, for ``recipe``'s ``amax_compute_algo`` and
    ``margin`` (with ``recipe=None``, for either algorithm and some margin in
    ``[0, 14]``); a row never measured holds 1 (a fresh state) or 0 ("not
    measured yet"). A restored scale of ``1e30`` for a tensor of amax 10 would
    saturate every value and make the product 0.0: finite, so loss scaling
    would apply the step. Traced values (under ``jit``) cannot be read: there
    ``traced_check`` makes the products and their gradients NaN instead, where a
    row's history determines its scale and the scale is another.
    """
    history, scale = state.amax_history, state.scale
    if not (_concrete(history) and _concrete(scale)):
        return
    fix = (
        "start from a fresh state (jamp.float8.init) or restore the checkpoint the run saved; "
        "a state saved by another recipe (a changed margin or amax_compute_algo) does not carry "
        "over"
    )
    for name, x in (("amax_history", history), ("scale", scale)):
        if not hasattr(x, "dtype") or np.dtype(x.dtype) != F32:
            raise TypeError(
                f"Expected {where}.{name} to be a float32 array, got "
                f"{type(x).__name__}{'' if not hasattr(x, 'dtype') else ' of ' + str(x.dtype)} "
                f"instead; {fix}."
            )
    h, s = np.asarray(history), np.asarray(scale)
    if h.ndim < 2 or h.shape[-2] != 3 or s.shape != h.shape[:-1]:
        raise ValueError(
            f"Expected {where} to hold an amax_history of shape (..., 3, amax_history_len) and "
            f"a scale of shape (..., 3), got {h.shape} and {s.shape} instead; {fix}."
        )
    if np.any(h < 0) or np.any(np.isneginf(h)):
        raise ValueError(
            f"Expected {where}.amax_history to hold amaxes (largest magnitudes, >= 0), found "
            f"a negative one ({float(h[h < 0].min())!r}) instead; {fix}."
        )
    if not (np.all(np.isfinite(s)) and np.all(s >= 0)):
        bad = s[~(np.isfinite(s) & (s >= 0))]
        raise ValueError(
            f"Expected {where}.scale to be finite and >= 0 (0: not measured yet), got "
            f"{float(bad.flat[0])!r} instead; {fix}."
        )
    algos = ALGOS if recipe is None else (recipe.amax_compute_algo,)
    margins = range(MAX_MARGIN + 1) if recipe is None else (recipe.margin,)
    finite = np.all(np.isfinite(h), axis=-1)  # a non-finite amax freezes a row's scale
    ok = (s == 0) | ~finite
    for algo in algos:
        amax = np.max(h, axis=-1) if algo == "max" else h[..., 0]
        measured = finite & (amax > 0)
        for m in margins:
            want = _scales_from(amax, m)
            # A scale past float32 is not taken: the row keeps an earlier one.
            ok |= measured & (_matches(s, want) | np.isinf(want))
            if algo == "most_recent":  # an amax of 0 keeps the scale of an earlier one
                earlier = _matches(s[..., None], _scales_from(h, m, history=True)) & (h > 0)
                ok |= finite & (amax == 0) & np.any(earlier, axis=-1)
        ok |= finite & (amax == 0) & (s == 1)  # never measured: a fresh state's 1
    if not np.all(ok):
        idx = tuple(int(i) for i in np.argwhere(~ok)[0])
        row = ("the left operand", "the right operand", "the output's gradient")[idx[-1]]
        amaxes = h[idx]
        expected = (
            f"the amax history of that row has max {float(np.max(amaxes)):.4g}, most recent "
            f"{float(amaxes[0]):.4g}"
            if np.any(amaxes > 0)
            else "that row was never measured (its history is all zero), so its scale is 1 or 0"
        )
        which = (
            "any margin in [0, 14]"
            if recipe is None
            else f"margin={recipe.margin}, amax_compute_algo={recipe.amax_compute_algo!r}"
        )
        raise ValueError(
            f"Expected {where}.scale{list(idx)} (the scale of {row}) to be the one its amax "
            f"history gives, finfo.max / amax / 2**margin with {which}, got "
            f"{float(s[idx])!r} instead: {expected}. Quantised with it, the product would be "
            f"wrong (saturated or flushed to zero) while still finite; {fix}."
        )


def kept_max(amax_history: jax.Array) -> jax.Array:
    """The largest amax of the history that ``next_state`` keeps (``(..., 3)``): every
    entry but the one it overwrites (index ``1 % amax_history_len``, rolled to 0); -inf
    for a history of 1. The largest of the next history is ``max(new amax, this)``, and
    of this one ``max(this, that entry)``: one pass over the history serves both
    (``traced_check`` in the forward pass, ``next_state`` in the backward)."""
    n = amax_history.shape[-1]
    kept = np.arange(n) != 1 % n
    return jnp.max(jnp.where(kept, amax_history, np.float32(-np.inf)), axis=-1)


def traced_check(
    amax_history: jax.Array,
    scale: jax.Array,
    recipe: DelayedScaling,
    kept: jax.Array | None = None,
) -> jax.Array:
    """``1.0`` if ``scale`` (``(3,)``) is one the recipe can have computed from
    ``amax_history`` (``(3, amax_history_len)``), else NaN: ``check_values`` for the values
    it cannot read (under ``jit``), as a float32 scalar that multiplies the products'
    inverse scales, so a corrupted state gives non-finite outputs and gradients, which loss
    scaling skips, instead of finite wrong ones (a scale of ``1e30`` saturates every value;
    the product was 0.0).

    A row is checked only where the recipe itself leaves no choice: its amax (the
    history's max, or its newest entry for ``"most_recent"``) is positive and finite and
    gives a finite scale, so ``next_state`` wrote ``finfo.max / amax / 2**margin`` there,
    from this very history. Its scale must then be that one, for any margin in
    ``[0, 14]`` and the amax of the recipe's algorithm (with ``"max"``, the newest amax
    too), within ``_TOLERANCE``: a state saved with another margin, or computed on
    another backend, passes; ``1e30`` does not. Or it may be 0 ("not measured yet",
    which ``products.usable`` replaces). Every other row holds a scale the
    recipe kept from an earlier step (a history never measured, all zero: a fresh state's
    1 or 0, or a scale whose amaxes have all rolled out of the history; an amax that is
    inf or NaN; one so small its scale is not a finite float32), which its history cannot
    vouch for: only its value is checked, finite and >= 0. So a state the recipe produced
    is never touched, and its products are bit for bit what they were (they are
    multiplied by exactly 1). Scalar work: a few operations on 3 scalars. The history's
    largest amax (``"max"``) comes from ``kept``, the pass over the history that
    ``next_state`` needs anyway (``kept_max``), made once in the forward pass and kept
    for the backward; the quantisation does not depend on any of it.
    """
    n = amax_history.shape[-1]
    newest = amax_history[..., 0]
    if recipe.amax_compute_algo == "max":
        kept = kept_max(amax_history) if kept is None else kept
        amax = jnp.maximum(kept, amax_history[..., 1 % n])  # the history's largest
        candidates = (amax, newest)
    else:
        amax, candidates = newest, (newest,)
    # The checks make no inf or NaN from a finite state (a zero history divides nothing):
    # jamp.debug.locate_nonfinite would name them, and they are masked anyway.
    one = np.float32(1.0)
    positive = amax > 0
    want = (ROW_MAX / jnp.where(positive, amax, one)) / np.float32(2.0**recipe.margin)
    determined = positive & jnp.isfinite(amax) & jnp.isfinite(want)
    log_scale = jnp.log2(jnp.where(scale > 0, scale, one))

    def given_by(a: jax.Array) -> jax.Array:
        """Whether ``scale == finfo.max / a / 2**m`` for some margin ``m`` in [0, 14], in
        the log domain (no quotient overflows)."""
        log_ratio = jnp.log2(ROW_MAX) - jnp.log2(jnp.where(a > 0, a, one)) - log_scale
        m = jnp.round(log_ratio)
        close = jnp.abs(jnp.exp2(log_ratio - m) - 1) <= _TOLERANCE
        return (a > 0) & (scale > 0) & (m >= 0) & (m <= MAX_MARGIN) & close

    given = functools.reduce(jnp.logical_or, [given_by(a) for a in candidates])
    ok = jnp.isfinite(scale) & (scale >= 0) & (~determined | (scale == 0) | given)
    return jnp.where(jnp.all(ok), np.float32(1), np.float32(np.nan))


def init_state(
    recipe: DelayedScaling, stack: Sequence[int] = (), scale: float | None = None
) -> Float8State:
    """A fresh state: an empty history and scales of 1 (``unmeasured="one"``, TE's start)
    or 0 ("not measured yet", ``unmeasured="current"``), unless ``scale`` is given."""
    if scale is None:
        scale = 1.0 if recipe.unmeasured == "one" else 0.0
    stack = tuple(stack)
    return Float8State(
        amax_history=jnp.zeros((*stack, 3, recipe.amax_history_len), F32),
        scale=jnp.full((*stack, 3), scale, F32),
    )


def next_state(
    state: Float8State,
    amaxes: jax.Array,
    recipe: DelayedScaling,
    kept: jax.Array | None = None,
) -> Float8State:
    """Transformer Engine's update: roll ``amaxes`` (shape ``(3,)``) in, compute the scales.

    ``kept``: ``kept_max(state.amax_history)``, when the caller has it already."""
    history = jnp.roll(state.amax_history, -1, axis=-1).at[..., 0].set(amaxes)
    if recipe.amax_compute_algo == "max":  # the max of the new history, from one pass
        kept = kept_max(state.amax_history) if kept is None else kept
        amax = jnp.maximum(amaxes, kept)
    else:
        amax = history[..., 0]
    # A row never measured keeps its scale; it divides nothing (no inf is made, for
    # jamp.debug.locate_nonfinite to name).
    positive = amax > 0
    new = (ROW_MAX / jnp.where(positive, amax, np.float32(1.0))) / np.float32(2.0**recipe.margin)
    keep = positive & jnp.isfinite(amax) & jnp.isfinite(new)
    return Float8State(history, jnp.where(keep, new, state.scale))
