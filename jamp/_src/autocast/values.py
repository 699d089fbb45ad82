"""The values autocast's interpreter evaluates: what it knows of each, and its casts.

Every value carries an ``Info`` (where it comes from, whether it is a
low activation, its size before broadcasting, a constant's span); the
``Casts`` cache makes one cast per value and dtype; ``bind``
re-binds a traced equation with the user's source information.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias
from typing import cast as static_cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.typing import DTypeLike

from jamp._src import jaxprs
from jamp._src.autocast import folding
from jamp._src.autocast.rules import Span, narrows, saturated, widest
from jamp._src.jaxprs import ClosedJaxpr
from jamp._src.types import is_tracer

try:  # Keeps user name scopes and tracebacks on the re-emitted equations.
    from jax._src import source_info_util as _source_info_util
except ImportError:  # pragma: no cover - depends on the jax version
    _source_info_util = None


# Where a value comes from (see autocast/README.md). Ordered: an output has the
# smallest kind of its inputs.
TRACED = 0  # depends on the function's arguments: activations, parameters
CONST = 1  # known when the function is traced: a concrete constant, or computed from those
LITERAL = 2  # computed from literals only (Python scalars): also follows under promote

FOLD_MAX = 4096  # elements: constants this small are computed when traced

Value: TypeAlias = jax.Array | np.ndarray | np.number | np.bool_
"""What a variable holds as the interpreter evaluates it: a tracer or a concrete array, or a
NumPy constant or literal."""

JaxprLike: TypeAlias = jex_core.Jaxpr | ClosedJaxpr
"""A jaxpr as sub-computations carry it: open, or closed over its constants."""


def aval(v: jax.core.Atom) -> jax.core.ShapedArray:
    """``v``'s abstract value, with its shape and dtype: jax types it as an ``AbstractValue``,
    in the jaxprs autocast evaluates (arrays, no tokens or references) it is a ``ShapedArray``."""
    return static_cast(jax.core.ShapedArray, v.aval)


class Info(NamedTuple):
    """What the interpreter knows about a value besides the value itself (its lattice with
    ``Lift``: ``autocast/README.md``)."""

    kind: int = TRACED
    low: bool = False  # derived from low-precision activations only (not params, constants)
    size: int | None = None  # elements before broadcasting; None: its own size
    span: Span | None = None  # a traced constant's values (a concrete one is looked at)
    held: bool = False  # a low activation computed in float32 for float32 consumers
    statistic: bool = False  # low, and a reduction (or computed from reductions alone)


class Recorder:
    """Counts, per (primitive, rule, dtype), the equations evaluated; and unknown primitives."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.unknown: set[str] = set()

    def add(self, prim: str, rule: str, dtype: str) -> None:
        self.counts[(prim, rule, dtype)] += 1


@dataclasses.dataclass(frozen=True)
class Context:
    dtype: np.dtype
    recorder: Recorder | None
    as_traced: bool = False
    # A rule tried before the table (float8: autocast_float8): (eqn, invals, infos, ctx) ->
    # (outs, infos), or None to leave the equation to the table.
    rule: Rule | None = None
    # The dtype of the weight-gradient products whose outputs XLA sums across devices (a
    # float32 value read by a half product: ``autocast.sums.product_with_wide_gradients``);
    # ``dtype``: as jax transposes the half product; ``None``: float32 in a sharded program
    # (``autocast.sums.sharded``), else as jax transposes it.
    reduce_dtype: np.dtype | None = None


Evaluated: TypeAlias = tuple[list[Value], list[Info]]
"""What evaluating an equation or a jaxpr under the rules gives: its outputs and their infos."""


class Evaluate(Protocol):
    """The interpreter's evaluation of a jaxpr under the rules (``interpreter.eval_closed``),
    which sub-computations and a fused softmax take as an argument: its outputs and their
    infos; an output marked in ``wide`` (a float32 loop carry) is not rounded."""

    def __call__(
        self,
        closed: JaxprLike,
        args: Sequence[Value],
        infos: Sequence[Info],
        ctx: Context,
        wide: Sequence[bool] = (),
    ) -> Evaluated: ...


Rule: TypeAlias = Callable[[jex_core.JaxprEqn, list[Value], list[Info], Context], Evaluated | None]
"""A rule tried before the table: an equation's outputs, or ``None`` to leave it to the table."""


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def is_float(dtype: DTypeLike) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def is_inexact(dtype: DTypeLike) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def cast(x: Value, dtype: DTypeLike) -> Value:
    return x if x.dtype == dtype else lax.convert_element_type(x, dtype)


def upcast(x: Value, dtype: DTypeLike) -> jax.Array:
    """``x`` cast to ``dtype``; a half-precision value going up keeps its rounding explicit.

    Under ``jit`` XLA's excess precision (on by default, on GPUs too) may skip
    the rounding of a half-precision value for one consumer and keep it for
    another, so a loss's normaliser and its label logit can disagree (a
    cross-entropy below zero). ``reduce_precision`` after the upcast makes every
    float32 consumer see the value rounded to the half dtype, as the others do.
    """
    y = lax.convert_element_type(x, dtype)
    if np.dtype(x.dtype).itemsize < 4 <= np.dtype(dtype).itemsize and is_float(x.dtype):
        y = _rounded(y, np.dtype(x.dtype))
    return y


@jax.custom_vjp
def routed(half: Value, wide: Value) -> jax.Array:
    """``half`` upcast to float32, its cotangent sent to ``wide`` (``half`` upcast once,
    outside): computed from ``half``, which is what a checkpoint around it keeps, while the
    cotangents of all its float32 uses add up in float32 at ``wide``, rounded once."""
    return upcast(half, np.dtype(np.float32))


def _routed_fwd(half: Value, wide: Value) -> tuple[jax.Array, None]:
    return upcast(half, np.dtype(np.float32)), None


def _routed_bwd(_: None, ct: jax.Array) -> tuple[None, jax.Array]:
    return None, ct  # None: a zero cotangent for half


routed.defvjp(_routed_fwd, _routed_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _rounded(y: jax.Array, half: np.dtype) -> jax.Array:
    """``y`` rounded to ``half``'s precision; its derivative is the identity (the cotangent
    is not rounded: reduce_precision's own transpose would flush float16 gradients)."""
    info = jnp.finfo(half)
    return lax.reduce_precision(y, exponent_bits=info.nexp, mantissa_bits=info.nmant)


@_rounded.defjvp
def _rounded_jvp(half: np.dtype, primals: tuple, tangents: tuple) -> tuple:
    return _rounded(primals[0], half), tangents[0]


class Lift(NamedTuple):
    """How a value computed in the half dtype is computed in float32 instead, for a float32
    consumer: ``fun`` of ``args`` (half activations, each upcast exactly; parameters and
    constants are closed over as they are), recomputed in the backward pass, which keeps
    ``args``. ``autocast.flow.lift_of`` makes one for a sigmoid, a tanh or the arithmetic
    (``+ - *``, a square) of half activations, parameters and constants that ran in the half
    dtype; the interpreter uses it where the value would go up to float32 rounded."""

    args: tuple[Value, ...]
    fun: Callable[..., Value]
    name: str = ""  # the primitive whose output it computes


class Casts:
    """The casts autocast inserts, one per value and dtype (torch's cast cache).

    A value cast to the same dtype twice (the input of the query, key and
    value projections; a weight used twice) is cast once, so the backward
    pass saves one copy. It also holds the ``Lift`` of each half value that has one.
    """

    def __init__(self) -> None:
        self._done: dict[tuple[int, np.dtype, bool], tuple[Value, Value]] = {}
        self._lifts: dict[int, tuple[Value, Lift]] = {}

    def lift(self, y: Value, lift: Lift | None) -> None:
        if lift is not None:
            self._lifts[id(y)] = (y, lift)  # keeps y alive, so its id is not reused

    def lifted(self, y: Value) -> Lift | None:
        """``y``'s ``Lift``, or ``None``."""
        hit = self._lifts.get(id(y))
        return hit[1] if hit is not None and hit[0] is y else None

    def wides(self, lift: Lift) -> tuple[Value, ...]:
        """The float32 casts of ``lift``'s half inputs (one each, shared by its uses)."""
        return tuple(self(a, np.dtype(np.float32), Info()) for a in lift.args)

    def __call__(self, x: Value, dtype: DTypeLike, info: Info, saturate: bool = False) -> Value:
        if x.dtype == dtype:
            return x
        key = (id(x), np.dtype(dtype), saturate)
        hit = self._done.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        y = x
        if saturate and info.kind >= CONST and narrows(x.dtype, dtype):
            y = saturated(y, dtype)
        if info.kind < CONST or is_tracer(y) or np.size(y) > FOLD_MAX:
            y = upcast(y, dtype) if info.kind == TRACED else lax.convert_element_type(y, dtype)
        else:  # a small concrete constant: cast now, not in the program
            y = np.asarray(y).astype(dtype)
        self._done[key] = (x, y)  # keeps x alive, so its id is not reused
        return y

    def prime(self, x: Value, dtype: DTypeLike, y: Value) -> None:
        """Makes ``y`` the cast of ``x`` to ``dtype`` (a fused softmax's own cast)."""
        self._done[(id(x), np.dtype(dtype), False)] = (x, y)


def strong_cast(x: Value, dtype: DTypeLike) -> jax.Array:
    """A cast that also drops weak typing (loop carries must type-check)."""
    return lax.convert_element_type(x, dtype)


def source(eqn: jex_core.JaxprEqn) -> contextlib.AbstractContextManager:
    stack = contextlib.ExitStack()
    if _source_info_util is not None:
        name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
        stack.enter_context(
            _source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
        )
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is not None:
        stack.enter_context(manager)
    return stack


def bind(
    eqn: jex_core.JaxprEqn, vals: Sequence[Value], params: Mapping[str, object] | None = None
) -> list[Value]:
    """Binds ``eqn``'s primitive on ``vals`` under its source line and name stack; an
    equation the interpreter computes when tracing, in NumPy where that is exact
    (``folding``: no compile)."""
    params = dict(eqn.params if params is None else params)
    if folding.FOLDING.get():
        outs = folding.fold(eqn.primitive, vals, params, [aval(v) for v in eqn.outvars])
        if outs is not None:
            return list(outs)
    with source(eqn):
        return jaxprs.bind(eqn.primitive, vals, params)


def float0_zeros(aval: jax.core.ShapedArray) -> np.ndarray:
    return np.zeros(aval.shape, dtype=jax.dtypes.float0)


def ran_in(vals: Sequence[Value], outs: Sequence[Value]) -> str:
    floats = [np.dtype(x.dtype) for x in vals if is_float(x.dtype)]
    if floats:
        return widest(floats).name
    for x in outs:
        return str(x.dtype)
    return "-"


def record(
    ctx: Context, eqn: jex_core.JaxprEqn, rule: str, vals: Sequence[Value], outs: Sequence[Value]
) -> None:
    if ctx.recorder is not None:
        ctx.recorder.add(eqn.primitive.name, rule, ran_in(vals, outs))


def shard_map_like(params: Mapping[str, Any], body: Callable[..., tuple]) -> Callable:
    """``body`` under ``jax.shard_map`` with the mesh, specs, manual axes and ``check_vma``
    of a ``shard_map`` equation's ``params``: that equation run with another body."""
    return jax.shard_map(
        body, mesh=params["mesh"], in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]), axis_names=set(params["newly_manual_axes"]),
        check_vma=params["check_vma"],
    )  # fmt: skip
