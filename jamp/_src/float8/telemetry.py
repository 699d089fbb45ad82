"""Float8 telemetry: what the float8 products made of each tensor in a step (its amax,
scale, and the fractions it underflowed and saturated), returned as the cotangent of a
telemetry argument; ``telemetry_metrics`` flattens it for a logger; ``refuse_in`` keeps a
state or telemetry out of the parameters.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jamp._src.float8.products import (
    Spec,
    current_fwd,
    current_scale,
    delayed_fwd,
    forward,
    quantize,
    state_check,
    transposed,
    usable,
)
from jamp._src.float8.recipe import E5M2, F32, GRAD, LHS, RHS, Float8State, next_state
from jamp._src.types import PyTree

# ---------------------------------------------------------------------------
# Telemetry: what float8 made of each tensor, returned as a cotangent
# ---------------------------------------------------------------------------


class Telemetry(NamedTuple):
    """What float8 made of the tensors of one matrix product in one step: immutable, a pytree.

    Each field is float32 ``(..., 3)``, with the rows of a
    [`Float8State`][jamp.float8.Float8State]: row 0 the left operand (``x``
    in ``x @ w``), row 1 the right operand (``w``), row 2 the gradient of the
    output (quantised to ``float8_e5m2``); a product inside a ``lax.scan`` of
    length ``n`` has leading axes ``(n,)``. A product returns its telemetry
    as the *cotangent* of a telemetry argument (whose values it ignores):
    ``jax.grad`` with respect to that argument returns it, as arrays, with
    the gradients ([`jamp.float8.telemetry_init`][], ``docs/float8.md``).

    Attributes:
      amax: the tensor's largest magnitude (NaN if it holds a NaN). The
        gradient's is the gradient the product received: times the loss
        scale, under loss scaling.
      scale: the scale it was quantised with (``float8 = x * scale``): its
        current scale, ``finfo.max / amax``, or under delayed scaling the
        state's (1 for a fresh state, the current scale for a row not yet
        measured with ``unmeasured="current"``).
      underflow: the fraction of its elements that are not zero and
        quantise to zero (flushed: a scaled magnitude of at most half the
        format's smallest subnormal, ``2**-10`` for ``float8_e4m3fn``,
        ``2**-17`` for ``float8_e5m2``).
      saturated: the fraction of its elements that are finite and whose
        scaled magnitude is beyond the format's range, so that quantisation
        clamped them to its largest finite value (448, 57344): above 464 for
        ``float8_e4m3fn`` and from 61440 for ``float8_e5m2``, the values that
        would not round to that largest value. Current scaling maps the amax
        to it, so it saturates nothing finite; delayed scaling saturates
        what grew past the history's amax.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> f = jamp.autocast(lambda w, x: jnp.sum(x @ w), "float8", telemetry=True)
      >>> w, x = jnp.full((4, 4), 0.5), jnp.array([[1.0, 2.0, 1e-6, 0.0]])
      >>> zeros = jamp.float8.telemetry_init(f, w, x)
      >>> stats = jax.grad(f)(zeros, w, x)["0:dot_general"]
      >>> stats.amax  # x, w, the gradient of the output
      Array([2. , 0.5, 1. ], dtype=float32)
      >>> stats.underflow  # 1e-6 * 224 is below 2**-10: flushed, 1 of the 4 values of x
      Array([0.25, 0.  , 0.  ], dtype=float32)
    """

    amax: jax.Array
    scale: jax.Array
    underflow: jax.Array
    saturated: jax.Array


# Each row's largest scaled magnitude that quantises to zero (half the smallest subnormal:
# round to nearest, ties to even) and its largest one that does not round past the largest
# finite value: float8_e4m3fn rounds 464 to 448 and more to NaN, float8_e5m2 rounds 61440
# to inf. Quantisation clamps, so the values above it are those the clamp changed.
_FLUSHES_AT_MOST = np.array([2.0**-10, 2.0**-10, 2.0**-17], np.float32)
_SATURATES_ABOVE = np.array(
    [464.0, 464.0, np.nextafter(np.float32(61440.0), np.float32(0.0))], np.float32
)
_ZERO = np.float32(0.0)

# The statistics are full reductions of the flattened tensor (``_flat``: a view in the
# tensor's own layout, whatever layout its other uses get), each a single variadic
# ``reduce``: XLA:GPU fuses one such reduction into a pass that reads the tensor anyway
# (its amax, or its quantisation), where two sibling reductions, or one over the 2-D
# tensor, get passes of their own (``tests/float8/test_float8_telemetry.py`` measures the bytes).


def _flat(x):
    """``x`` as a vector; ``x`` itself when an explicit sharding of an axis past the first
    makes the vector no view of it (a reshape would gather it): the reductions of both
    are the same."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return x if any(axis is not None for axis in spec[1:]) else x.reshape(-1)


def _reduce(operands, combine):
    """One variadic reduction of ``operands`` (float32, of one shape) over all their axes,
    each combined by ``combine`` (``lax.max`` or ``lax.add``)."""
    return lax.reduce(
        operands,
        [_ZERO] * len(operands),
        lambda a, b: [f(u, v) for f, u, v in zip(combine, a, b, strict=True)],
        tuple(range(operands[0].ndim)),
    )


def _count(mask):
    return mask.astype(F32)


def _clamped(magnitude, scale, row):
    """Which of the values of ``magnitude`` (``|x|``, float32) ``scale`` saturates."""
    return lax.is_finite(magnitude) & (magnitude * scale > _SATURATES_ABOVE[row])


def _before(x, row, recipe, state_scale):
    """The scale ``x`` is quantised with, and what ``_after`` needs to report on ``x``.

    With a scale that does not wait for the amax (delayed scaling, ``unmeasured="one"``)
    nothing: ``_after`` reads ``x`` once, for the amax and both counts, in a pass XLA
    fuses into the quantising pass. Otherwise (current scaling, ``unmeasured="current"``)
    the pass before quantisation is the amax's, which counts ``x``'s zeros too and, under
    delayed scaling, the values the state's scale saturates.
    """
    if recipe is not None and recipe.unmeasured == "one":
        unread = typing.cast(jax.Array, _ZERO)  # "one" reads no amax
        return usable(state_scale, unread, row, recipe), None
    flat = _flat(x)
    magnitude = jnp.abs(flat).astype(F32)
    counted = [magnitude, _count(flat == 0)]
    if recipe is not None:
        counted.append(_count(_clamped(magnitude, state_scale, row)))
    x_amax, *counts = _reduce(counted, [lax.max, *[lax.add] * (len(counted) - 1)])
    if recipe is None:
        return current_scale(x_amax, row), (x_amax, *counts, _ZERO)
    return usable(state_scale, x_amax, row, recipe), (x_amax, *counts)


def _after(x, q, scale, row, pending, state_scale):
    """``(amax, scale, underflow, saturated)`` of ``x``, quantised to ``q`` with ``scale``."""
    n = np.float32(max(x.size, 1))
    if pending is None:  # the scale did not wait: one pass, counted from the scaled values
        if x.size == 0:
            return _ZERO, scale, _ZERO, _ZERO
        magnitude = jnp.abs(_flat(x)).astype(F32)
        flushed = (magnitude != 0) & (magnitude * scale <= _FLUSHES_AT_MOST[row])
        x_amax, n_flushed, n_clamped = _reduce(
            [magnitude, _count(flushed), _count(_clamped(magnitude, scale, row))],
            [lax.max, lax.add, lax.add],
        )
        return x_amax, scale, n_flushed / n, n_clamped / n
    x_amax, zeros, clamped = pending
    # The flushed values are the zeros of q that were not zeros of x: q is read where XLA
    # can fuse the count into the pass that quantises x, else once more (a byte a value).
    # A NaN scale (a NaN amax) quantises every value to NaN: nothing is flushed.
    (q_zeros,) = _reduce([_count(_flat(q) == 0)], [lax.add])
    flushed = jnp.maximum(q_zeros - zeros, _ZERO)
    # The current scale maps the amax to at most finfo.max * (1 + 2**-22), so it saturates
    # nothing; the state's scale, when it was used, saturates what was counted.
    if state_scale is not None:
        clamped = jnp.where(jnp.isfinite(state_scale) & (state_scale > 0), clamped, _ZERO)
    return x_amax, scale, flushed / n, clamped / n


def _stacked(*rows) -> Telemetry:
    """The Telemetry of three rows of ``(amax, scale, underflow, saturated)``."""
    return Telemetry(*(jnp.stack(field) for field in zip(*rows, strict=True)))


def _telemetry_fwd(spec: Spec, lhs, rhs, scale=None, checked=None):
    """The product of ``lhs`` and ``rhs`` and its residuals, the operands' rows of
    telemetry among them; ``scale`` is the state's, under delayed scaling, and ``checked``
    its ``traced_check``."""
    s_lhs, p_lhs = _before(lhs, LHS, spec.recipe, None if scale is None else scale[LHS])
    s_rhs, p_rhs = _before(rhs, RHS, spec.recipe, None if scale is None else scale[RHS])
    out, operands = forward(spec, lhs, rhs, s_lhs, s_rhs, checked)
    q_lhs, q_rhs = operands[:2]
    seen = (
        _after(lhs, q_lhs, s_lhs, LHS, p_lhs, None if scale is None else scale[LHS]),
        _after(rhs, q_rhs, s_rhs, RHS, p_rhs, None if scale is None else scale[RHS]),
    )
    return out, (operands, seen)


def _telemetry_bwd(spec: Spec, operands, seen, g, scale=None):
    """The operands' gradients and the product's Telemetry."""
    s_grad = None if scale is None else scale[GRAD]
    s_g, p_g = _before(g, GRAD, spec.recipe, s_grad)
    q_g = quantize(g, s_g, E5M2)  # as _backward does
    d_lhs, d_rhs = transposed(spec, operands, q_g, 1 / s_g)
    return d_lhs, d_rhs, _stacked(*seen, _after(g, q_g, s_g, GRAD, p_g, s_grad))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def current_dot_telemetry(
    lhs: jax.Array, rhs: jax.Array, telemetry: Telemetry, spec: Spec
) -> jax.Array:
    """``current_dot``, whose cotangent of ``telemetry`` (values ignored) is this step's
    [`Telemetry`][jamp.float8.Telemetry], whatever the cotangent of the output is."""
    return current_fwd(lhs, rhs, spec)[0]


def _current_telemetry_fwd(lhs, rhs, telemetry, spec):
    return _telemetry_fwd(spec, lhs, rhs)


def _current_telemetry_bwd(spec, res, g):
    operands, seen = res
    return _telemetry_bwd(spec, operands, seen, g)


current_dot_telemetry.defvjp(_current_telemetry_fwd, _current_telemetry_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def delayed_dot_telemetry(
    lhs: jax.Array,
    rhs: jax.Array,
    amax_history: jax.Array,
    scale: jax.Array,
    telemetry: Telemetry,
    spec: Spec,
) -> jax.Array:
    """``delayed_dot``, whose cotangent of ``telemetry`` (values ignored) is this step's
    [`Telemetry`][jamp.float8.Telemetry]; that of the state is the next state."""
    return delayed_fwd(lhs, rhs, amax_history, scale, spec)[0]


def _delayed_telemetry_fwd(lhs, rhs, amax_history, scale, telemetry, spec):
    kept, checked = state_check(amax_history, scale, spec.recipe)  # as delayed_dot's
    out, (operands, seen) = _telemetry_fwd(spec, lhs, rhs, scale, checked)
    return out, (operands, seen, amax_history, scale, kept)


def _delayed_telemetry_bwd(spec, res, g):
    operands, seen, amax_history, scale, kept = res
    d_lhs, d_rhs, stats = _telemetry_bwd(spec, operands, seen, g, scale)
    new = next_state(Float8State(amax_history, scale), stats.amax, spec.recipe, kept)
    return d_lhs, d_rhs, new.amax_history, new.scale, stats


delayed_dot_telemetry.defvjp(_delayed_telemetry_fwd, _delayed_telemetry_bwd)


_ROWS = ("lhs", "rhs", "grad")


def telemetry_metrics(telemetry: Mapping[str, Telemetry]) -> dict[str, jax.Array]:
    """The telemetry of a step as a flat dict of device scalars, ready for any logger.

    ``telemetry`` is what ``jax.grad`` returned for the telemetry argument of
    an autocast function made with ``telemetry=True`` (a dict of
    [`jamp.float8.Telemetry`][]). Each key is ``"<product>/<tensor>/<field>"``:
    the product's key (``"0:MLP.Dense_0"``), the tensor (``lhs``, ``rhs`` or
    ``grad``: ``x``, ``w`` and the output's gradient of ``x @ w``) and the
    field (``amax``, ``scale``, ``underflow``, ``saturated``). A product in a
    ``lax.scan`` has one entry per iteration, its index after its key:
    ``"1:scan.dot_general[3]/lhs/amax"``. Nothing is read back to the host:
    convert with ``float()`` (or ``jax.device_get``) when you log.

    Raises:
      TypeError: ``telemetry`` is not a dict of ``Telemetry``.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> stats = {"0:dot_general": jamp.float8.Telemetry(*[jnp.zeros(3)] * 4)}
      >>> metrics = jamp.float8.telemetry_metrics(stats)
      >>> len(metrics), sorted(metrics)[:2]
      (12, ['0:dot_general/grad/amax', '0:dot_general/grad/saturated'])
    """
    fix = (
        "pass what jax.grad returned for the telemetry argument of jamp.autocast(f, 'float8', "
        "telemetry=True)"
    )
    if not isinstance(telemetry, Mapping):
        raise TypeError(
            f"Expected a dict of jamp.float8.Telemetry, got {type(telemetry).__name__} "
            f"instead; {fix}."
        )
    out: dict[str, jax.Array] = {}
    for key, entry in telemetry.items():
        if not isinstance(entry, Telemetry):
            raise TypeError(
                f"Expected a jamp.float8.Telemetry for entry {key!r}, got "
                f"{type(entry).__name__} instead; {fix}."
            )
        stack = np.shape(entry.amax)[:-1]
        for index in np.ndindex(*stack):
            name = key if not stack else f"{key}[{','.join(map(str, index))}]"
            for row, tensor in enumerate(_ROWS):
                for field, values in zip(entry._fields, entry, strict=True):
                    out[f"{name}/{tensor}/{field}"] = values[(*index, row)]
    return out


def refuse_in(tree: PyTree, what: str) -> None:
    """A ``TypeError`` when ``tree`` holds a [`jamp.float8.Float8State`][] or a
    [`jamp.float8.Telemetry`][]: neither is a parameter."""
    found = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, (Float8State, Telemetry))
    )[0]
    for path, leaf in found:
        if isinstance(leaf, Float8State):
            raise TypeError(
                f"Expected no jamp.float8.Float8State in {what}, found one at "
                f"{jax.tree_util.keystr(path)}: the float8 state is not a parameter. An "
                "optimizer would apply a learning-rate update to it and loss scaling would "
                "unscale it. Keep it out of the parameters: pass it to the delayed-scaling "
                "function as its own argument and take the next state from jax.grad with "
                "respect to that argument (docs/float8.md)."
            )
        if isinstance(leaf, Telemetry):
            raise TypeError(
                f"Expected no jamp.float8.Telemetry in {what}, found one at "
                f"{jax.tree_util.keystr(path)}: float8 telemetry is not a parameter. An "
                "optimizer would apply a learning-rate update to it and loss scaling would "
                "unscale it. Keep it out of the parameters: pass it to the telemetry function "
                "as its own argument and take the step's telemetry from jax.grad with respect "
                "to that argument (docs/float8.md)."
            )
