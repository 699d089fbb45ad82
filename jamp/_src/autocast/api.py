"""Op-level mixed precision as a function transformation: ``jamp.autocast``.

``autocast(fun)`` traces ``fun`` to a jaxpr and evaluates that jaxpr with an
interpreter that decides, primitive by primitive, in which dtype it runs. The
decision comes from one table, ``RULES`` (``jamp/_src/autocast.rules.py``,
whose docstring states every rule), the JAX analogue of torch.autocast's op
lists: matrix products and convolutions in the low dtype; exp, log, pow,
rsqrt, sums and divisions (so softmax, norm statistics and losses) in
float32; every other primitive in its input's dtype, with float32 parameters
and constants following a low activation down (a bias, a scale), while a
float32 residual stream or a norm statistic keeps it in float32 (and the
scale and bias ending a norm of low activations apply in float32, as Flax's
norms do, the next primitive reading the result in the low dtype). Constants
that do not fit the low dtype are never narrowed, except the mask fill
``finfo(float32).min``, which saturates. [`autocast_report`][jamp.debug.autocast_report] shows what
ran in which dtype and what the backward pass saves.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, ParamSpec, TypeVar
from typing import cast as static_cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jamp._src.autocast.float8 import (
    check_states,
    check_telemetry,
    current_rule,
    init_states,
    init_telemetry,
    site_rule,
    sites,
)
from jamp._src.autocast.interpreter import eval_closed
from jamp._src.autocast.rules import RULES
from jamp._src.autocast.values import (
    SCOPE_AUTOCAST,
    SCOPE_DISABLED,
    Context,
    Info,
    Recorder,
    Rule,
    Value,
    cast,
    is_float,
)
from jamp._src.float8.recipe import DelayedScaling, Float8State
from jamp._src.float8.telemetry import Telemetry
from jamp._src.jaxprs import ClosedJaxpr
from jamp._src.policy import Policy, check_dtype, parse_policy
from jamp._src.types import PyTree

__all__ = [
    "RULES",
    "AutocastReport",
    "autocast",
    "autocast_report",
    "float8_init",
    "telemetry_init",
]

P = ParamSpec("P")
R = TypeVar("R")

_DEFAULT = np.dtype(jnp.bfloat16)  # autocast's dtype when neither dtype nor policy is given


@dataclasses.dataclass(frozen=True)
class Residual:
    """Values of one dtype, shape and source that the backward pass keeps.

    Attributes:
      dtype: the dtype they are saved in.
      shape: their shape.
      count: how many values of this dtype and shape the same source saves.
      nbytes: the bytes of all of them.
      source: what computed them: a primitive and the user's source line, as
        ``jax.ad_checkpoint.print_saved_residuals`` names it.
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    count: int
    nbytes: int
    source: str


@dataclasses.dataclass(frozen=True)
class AutocastReport:
    """Which primitives an autocast function ran, under which rule, in which dtype.

    Attributes:
      dtype: the low-precision dtype of the autocast.
      rows: ``(primitive, rule, dtype, count)`` tuples, sorted. ``dtype`` is
        the floating dtype the primitive computed in (its widest floating
        input after casting, else its first output's dtype).
      unknown: the primitives the table does not know; they ran as traced.
      residuals: what the backward pass of the autocast function saves (the
        arguments excluded), as ``Residual`` rows, largest first; ``()``
        when the function cannot be differentiated with respect to its array
        arguments (``residuals_note`` says why).
      residuals_note: why ``residuals`` is empty, or ``""``.
    """

    dtype: np.dtype
    rows: tuple[tuple[str, str, str, int], ...]
    unknown: tuple[str, ...]
    residuals: tuple[Residual, ...] = ()
    residuals_note: str = ""

    @property
    def residual_bytes(self) -> dict[str, int]:
        """``{dtype name: bytes}`` saved for the backward pass, arguments excluded."""
        out: dict[str, int] = {}
        for r in self.residuals:
            out[np.dtype(r.dtype).name] = out.get(np.dtype(r.dtype).name, 0) + r.nbytes
        return out

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """``{primitive: {dtype: count}}``."""
        out: dict[str, dict[str, int]] = {}
        for prim, _, dtype, count in self.rows:
            out.setdefault(prim, {})
            out[prim][dtype] = out[prim].get(dtype, 0) + count
        return out

    def __str__(self) -> str:
        header = ("primitive", "rule", "dtype", "count")
        body = [(p, r, d, str(c)) for p, r, d, c in self.rows]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(4)]

        def line(row: Sequence[str]) -> str:
            return "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()

        lines = [f"autocast report (low precision: {np.dtype(self.dtype).name})", line(header)]
        lines.append(line(["-" * w for w in widths]))
        lines.extend(line(row) for row in body)
        if self.unknown:
            lines.append(
                "unknown primitives (ran as traced, float32 for a float32 program): "
                + ", ".join(self.unknown)
            )
        lines.extend(_residual_lines(self))
        return "\n".join(lines)


def _mib(nbytes: int) -> str:
    if nbytes < 2**10:
        return f"{nbytes} B"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"


def _residual_lines(report: AutocastReport) -> list[str]:
    if report.residuals_note:
        return ["", f"saved for the backward pass: not computed ({report.residuals_note})"]
    totals = ", ".join(f"{name} {_mib(n)}" for name, n in report.residual_bytes.items())
    lines = ["", f"saved for the backward pass (arguments excluded): {totals or 'nothing'}"]
    header = ("dtype", "shape", "count", "bytes", "source")
    body = [
        (np.dtype(r.dtype).name, str(r.shape), str(r.count), _mib(r.nbytes), r.source)
        for r in report.residuals
    ]
    if body:
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(4)]
        for row in [header, *body]:
            cells = [cell.ljust(w) for cell, w in zip(row[:4], widths, strict=True)]
            lines.append("  ".join([*cells, row[4]]).rstrip())
    return lines


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------


def _is_array(leaf: object) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _check_fun(fun: object, name: str) -> None:
    if not callable(fun):
        raise TypeError(
            f"Expected a callable for `fun` of jamp.{name}, got {fun!r} "
            f"(type {type(fun).__name__}) instead."
        )


_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _low_dtype(value: DTypeLike, what: str) -> np.dtype:
    dtype = check_dtype(value, what)
    if dtype not in _HALF:
        raise ValueError(
            f"Expected float16 or bfloat16 for {what} of jamp.autocast (its low-precision "
            f"dtype), got {dtype.name} instead. To run a function as written, use "
            "enabled=False or call it directly."
        )
    return dtype


FLOAT8 = "float8"  # the dtype argument of float8 mode


def _is_float8(dtype: object) -> bool:
    return isinstance(dtype, str) and dtype.strip().lower() == FLOAT8


def _resolve(
    dtype: DTypeLike | None, policy: Policy | str | None
) -> tuple[np.dtype, Policy | None, bool]:
    """The low-precision dtype, the policy and whether it is float8 mode.

    ``dtype=None`` means "not given"; in float8 mode the low-precision dtype
    (of everything but the float8 products) is bfloat16 or the policy's.
    """
    float8 = _is_float8(dtype)
    if float8:
        dtype = None
    if policy is None:
        return (_DEFAULT if dtype is None else _low_dtype(dtype, "`dtype`")), None, float8
    if not isinstance(policy, (Policy, str)):
        raise TypeError(
            "Expected a jamp.Policy or a policy string such as 'p=f32,c=bf16,o=f32' for "
            f"`policy`, got {policy!r} (type {type(policy).__name__}) instead."
        )
    low = None if dtype is None else _low_dtype(dtype, "`dtype`")
    policy = parse_policy(policy, "policy")
    compute = _low_dtype(policy.compute_dtype, "the compute dtype of `policy`")
    if low is not None and low != compute:
        raise ValueError(
            f"Expected `dtype` to be left out or to equal the policy's compute dtype "
            f"{compute.name}, got {low.name} instead: with a policy, its compute_dtype is "
            "the low-precision dtype."
        )
    return compute, policy, float8


def _check_recipe(recipe: object, float8: bool, telemetry: object = False) -> None:
    if not isinstance(telemetry, (bool, np.bool_)):
        raise TypeError(f"Expected a bool for `telemetry`, got {telemetry!r} instead.")
    if telemetry and not float8:
        raise ValueError(
            "Expected dtype='float8' with telemetry=True, got a half-precision autocast "
            "instead: telemetry reports what float8 made of each product's tensors. Write "
            "jamp.autocast(fun, 'float8', telemetry=True)."
        )
    if recipe is None:
        return
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(
            f"Expected a jamp.float8.DelayedScaling (or None, for current scaling) for `recipe`, "
            f"got {recipe!r} (type {type(recipe).__name__}) instead."
        )
    if not float8:
        raise ValueError(
            f"Expected dtype='float8' with `recipe`, got recipe={recipe!r} for a "
            "half-precision autocast instead: a scaling recipe applies to float8 products "
            "only. Write jamp.autocast(fun, 'float8', recipe=...)."
        )


def _check_leading(fun: Callable, leading: tuple[str, ...], args: tuple, kwargs: dict) -> None:
    """A clear error when a float8 function is called without its leading arguments
    (``leading``: ``"state"``, ``"telemetry"``, or both), which ``args`` begins with."""
    k = len(leading)
    if len(args) < k:
        _missing(fun, leading, len(args))
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return  # no signature to check the call against: fun reports its own call errors
    try:
        signature.bind(*args[k:], **kwargs)
        return
    except TypeError:
        pass
    for given in range(k):  # the call holds only the first `given` of them
        try:
            signature.bind(*args[given:], **kwargs)
        except TypeError:
            continue
        _missing(fun, leading, given)


def _missing(fun: Callable, leading: tuple[str, ...], given: int) -> NoReturn:
    name = getattr(fun, "__name__", "fun")
    if leading == ("state",):
        raise TypeError(
            "Expected the float8 state (a dict of jamp.float8.Float8State from "
            "jamp.float8.init) as the first argument of a delayed-scaling autocast "
            f"function, then the arguments of {name}; got only the latter. "
            "Call f(state, *args)."
        )
    described = " and ".join(_LEADING[what] for what in leading)
    first = "the first argument" if len(leading) == 1 else f"the first {len(leading)} arguments"
    raise TypeError(
        f"Expected {described} as {first} of this float8 autocast function, then the "
        f"arguments of {name}; got {given} of them. Call f({', '.join(leading)}, *args)."
    )


_LEADING = {
    "state": "the float8 state (a dict of jamp.float8.Float8State from jamp.float8.init)",
    "telemetry": (
        "the float8 telemetry (a dict of jamp.float8.Telemetry from jamp.float8.telemetry_init)"
    ),
}


def _flat(fun: Callable, args: tuple, kwargs: dict, shapes: bool = False):
    """``fun`` as a function of the array leaves of ``(args, kwargs)``, and those leaves.

    Array leaves are traced (and ``jax.ShapeDtypeStruct`` with ``shapes``);
    other leaves (Python numbers, booleans, strings, ...) are passed to
    ``fun`` unchanged, so ``fun`` can branch on them as it would without
    autocast.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    mask = [
        _is_array(leaf) or (shapes and isinstance(leaf, jax.ShapeDtypeStruct)) for leaf in leaves
    ]
    dynamic = [leaf for leaf, is_dyn in zip(leaves, mask, strict=True) if is_dyn]

    def flat_fun(*xs: jax.Array) -> PyTree:
        it = iter(xs)
        full = [next(it) if is_dyn else leaf for leaf, is_dyn in zip(leaves, mask, strict=True)]
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fun(*a, **k)

    return flat_fun, dynamic


def _trace(fun: Callable, args: tuple, kwargs: dict, shapes: bool = False):
    """``fun``'s closed jaxpr, output shapes and dynamic arguments (see ``_flat``)."""
    flat_fun, dynamic = _flat(fun, args, kwargs, shapes)
    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dynamic)
    return closed, out_shape, dynamic


def _autocast(
    fun: Callable,
    low: np.dtype,
    policy: Policy | None,
    recorder: Recorder | None,
    float8: bool = False,
    recipe: DelayedScaling | None = None,
    telemetry: bool = False,
):
    def run(
        closed: ClosedJaxpr, out_shape: PyTree, dynamic: list[Value], rule: Rule | None
    ) -> PyTree:
        ctx = Context(dtype=low, recorder=recorder, rule=rule)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
        with jax.named_scope(SCOPE_AUTOCAST):
            outs, _ = eval_closed(closed, dynamic, [Info()] * len(dynamic), ctx)
            final = []
            for x, shape in zip(outs, out_leaves, strict=True):
                target = shape.dtype
                if policy is not None and is_float(target):
                    target = policy.output_dtype
                final.append(cast(x, target))
        return jax.tree_util.tree_unflatten(out_tree, final)

    if recipe is not None or telemetry:
        leading = _leading(recipe, telemetry)

        def with_sites(*args: Any, **kwargs: Any) -> PyTree:
            _check_leading(fun, leading, args, kwargs)
            first, args = args[: len(leading)], args[len(leading) :]
            closed, out_shape, dynamic = _trace(fun, args, kwargs)
            found = sites(closed)
            state = tel = None
            if recipe is not None:
                check_states(first[0], found, recipe)  # a dict of Float8State from here on
                state = static_cast(Mapping[str, Float8State], first[0])
            if telemetry:
                check_telemetry(first[-1], found)  # a dict of Telemetry from here on
                tel = static_cast(Mapping[str, Telemetry], first[-1])
            return run(closed, out_shape, dynamic, site_rule(found, recipe, state, tel))

        return Float8Function(with_sites, fun, recipe, telemetry)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> PyTree:
        closed, out_shape, dynamic = _trace(fun, args, kwargs)
        return run(closed, out_shape, dynamic, current_rule if float8 else None)

    return wrapped


def _leading(recipe: DelayedScaling | None, telemetry: bool) -> tuple[str, ...]:
    """The arguments a float8 function takes before ``fun``'s: the state, the telemetry."""
    return (("state",) if recipe is not None else ()) + (("telemetry",) if telemetry else ())


class Float8Function:
    """What ``autocast(f, "float8", recipe=...)`` or ``autocast(f, "float8", telemetry=True)``
    returns: a function of ``(state, *args)``, ``(telemetry, *args)`` or ``(state,
    telemetry, *args)`` that carries what [`jamp.float8.init`][] and
    [`jamp.float8.telemetry_init`][] need to make its first state and its telemetry.

    It is called as ``f`` is, with the float8 state and then the telemetry
    first, and passes ``jit``, ``grad`` and ``vmap`` like any function;
    ``functools.wraps`` gives it ``f``'s name and docstring. As a method it
    takes them first too: ``model.f(state, x)``, and
    ``jamp.float8.init(model.f, x)`` makes the state.

    Attributes:
      traced: the function whose float8 products have states (``f``).
      recipe: the [`jamp.float8.DelayedScaling`][] recipe, or ``None`` (current scaling).
      telemetry: whether it takes (and reports) telemetry.
    """

    def __init__(
        self,
        call: Callable,
        traced: Callable,
        recipe: DelayedScaling | None,
        telemetry: bool = False,
    ) -> None:
        self._call, self.traced, self.recipe, self.telemetry = call, traced, recipe, telemetry
        functools.update_wrapper(self, traced)

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree:
        return self._call(*args, **kwargs)

    def __get__(self, obj: object, objtype: type | None = None) -> Float8Function:
        """As a method: ``model.f(state, x)`` is ``f(state, model, x)``, the state first."""
        if obj is None:
            return self
        k = len(_leading(self.recipe, self.telemetry))

        def call(*args: Any, **kwargs: Any) -> PyTree:
            return self._call(*args[:k], obj, *args[k:], **kwargs)

        bound = functools.partial(self.traced, obj)
        return Float8Function(call, bound, self.recipe, self.telemetry)


_WRAPS_A_FUNCTION = (
    "jamp.autocast wraps a function; it is not a context manager and takes no device: where "
    "PyTorch has `with torch.autocast(device_type=..., dtype=torch.float16): out = fn(x)`, "
    "write `out = jamp.autocast(fn, jnp.float16)(x)`, or decorate the function with "
    "`@jamp.autocast(dtype=jnp.float16)`"
)
_MARKS_A_FUNCTION = (
    "jamp.autocast(enabled=False) marks a function; it is not a context manager: where "
    "PyTorch has `with torch.autocast(device_type=..., enabled=False): out = fn(x)`, write "
    "`out = jamp.autocast(fn, enabled=False)(x)`, or decorate the function with "
    "`@jamp.autocast(enabled=False)`"
)


class _Decorator:
    """``autocast(dtype=...)``/``autocast_disabled()`` without a function; ``with`` refused."""

    def __init__(self, transform: Callable, message: str, **kwargs: object) -> None:
        self._transform, self._message, self._kwargs = transform, message, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Callable:
        if len(args) != 1 or kwargs:  # decorator(x, y): the function's arguments, not `fun`
            given = [type(a).__name__ for a in args] + [f"{k}=..." for k in kwargs]
            args_ = "enabled=False" if self._message == _MARKS_A_FUNCTION else "dtype=jnp.bfloat16"
            raise TypeError(
                f"Expected one function for `fun` of {self!r}, got {len(given)} arguments "
                f"({', '.join(given)}) instead: jamp.{self._transform.__name__} without a "
                "function returns a decorator, which takes the function to transform. Write "
                f"`jamp.autocast(fn, {args_})(x, y)` to call a function, or "
                f"`@jamp.autocast({args_})` above its `def`."
            )
        return self._transform(args[0], **self._kwargs)

    def __enter__(self) -> None:
        raise TypeError(f"{self._message}.")

    def __exit__(self, *exc: object) -> None:
        return None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._kwargs.items())
        return f"<decorator jamp.{self._transform.__name__}({args})>"


def _explains_torch_calls(autocast: Callable[P, R]) -> Callable[P, R]:
    """``autocast``, saying how to write it when called as ``torch.autocast`` is."""
    signature = inspect.signature(autocast)

    @functools.wraps(autocast)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as e:  # autocast(device_type="cuda", dtype=...), autocast(dtype=...)
            raise TypeError(f"{_WRAPS_A_FUNCTION} ({e}).") from None
        fun = args[0] if args else kwargs.get("fun")
        if fun is None and (args or "fun" in kwargs):  # autocast(None, jnp.bfloat16)
            raise TypeError(
                "Expected a callable for `fun` of jamp.autocast, got None instead: only a `fun` "
                "left out makes a decorator (`@jamp.autocast(dtype=jnp.bfloat16)`, the "
                "arguments by name). Pass the function to transform: "
                "`jamp.autocast(fn, jnp.bfloat16)(x, y)`."
            )
        if isinstance(fun, str) or _is_dtype(fun):  # autocast("cuda", ...), autocast(jnp.float16)
            raise TypeError(
                f"{_WRAPS_A_FUNCTION} (got {fun!r} for `fun`; as a decorator, the dtype is "
                "passed by name)."
            )
        return autocast(*args, **kwargs)

    return checked


def _is_dtype(x: object) -> bool:
    """A dtype, or a scalar type such as ``jnp.float16`` (callable, yet not a function to run)."""
    if isinstance(x, type):
        return issubclass(x, np.generic) or isinstance(getattr(x, "dtype", None), np.dtype)
    return isinstance(x, np.dtype)


@_explains_torch_calls
def autocast(
    fun: Callable | None = None,
    dtype: DTypeLike | None = None,
    *,
    policy: Policy | str | None = None,
    enabled: bool = True,
    recipe: DelayedScaling | None = None,
    telemetry: bool = False,
) -> Callable:
    """Runs ``fun`` with matrix products in ``dtype`` and sensitive ops in float32.

    ``autocast`` is a function transformation, the JAX analogue of
    ``torch.autocast``. It traces ``fun`` to a jaxpr and evaluates it with an
    interpreter that applies one table of rules (``RULES`` in
    ``jamp/_src/autocast/api.py``, explained in ``docs/autocast.md``):

    * ``dot_general`` and ``conv_general_dilated`` (every matmul, einsum,
      Dense and Conv layer) run in ``dtype``, output included (a
      ``preferred_element_type`` wider than the traced inputs is kept);
    * exp, log, pow, rsqrt, sums (window sums too), cumulative sums,
      divisions, FFTs and linear algebra run in float32, and so does the
      add/sub/mul producing their operand (``x - max(x)`` in softmax), so
      softmax, log-softmax, logsumexp, the statistics of layer/group norm,
      mean, variance and losses are computed in float32 from their
      (possibly ``dtype``) inputs, and return float32;
    * every other floating primitive (bias adds, activation functions,
      dropout, reshapes, ...) runs in ``dtype`` when a ``dtype`` activation
      is among its inputs: float32 parameters broadcast against it (a bias, a
      scale, a gate), constants and float32 values computed from such
      activations are cast down, as torch casts a Linear's bias; a float32
      norm statistic or a full-size float32 value that does not come from
      ``dtype`` activations (a residual stream) keeps it in float32; the
      scale and bias that end a norm of ``dtype`` activations apply in
      float32 to its float32 normalised value, as Flax's norms do, and the
      next primitive reads the result in ``dtype``, so their gradients (and
      every other gradient of a broadcast parameter) are summed in float32;
      otherwise it runs in the widest floating dtype of its inputs;
    * a constant that does not fit ``dtype`` (it would overflow or flush to
      zero) is never narrowed: the primitive runs in float32; only the mask
      fill (a select, max, min or clamp against ``+-finfo(float32).max``)
      saturates to ``dtype``'s finite extreme. Values that depend on the
      arguments are cast as they are, so their overflow reaches loss scaling;
      integers are never touched;
    * primitives the table does not know run as traced (float32 for a float32
      program); [`autocast_report`][jamp.debug.autocast_report] lists them.

    The backward pass keeps half-precision values where JAX's rules would keep
    float32 ones: a unary float32 primitive of a ``dtype`` activation (``x**3``
    in gelu, ``exp``) is recomputed from that activation, with unchanged
    values, and a softmax whose only consumers are matmuls (through dropout,
    perhaps) keeps just the ``dtype`` probabilities those matmuls keep, or,
    under attention dropout, the ``dtype`` scores they are recomputed from,
    its backward computed in float32 (``docs/autocast.md``, "Memory").

    The rules apply inside ``jit``, ``scan``, ``while_loop``, ``cond``,
    ``checkpoint``, ``custom_jvp`` and ``custom_vjp`` too. Loop carries and
    ``cond`` outputs keep their traced dtypes; the outputs of the returned
    function have the dtypes ``fun`` would have returned (or
    ``policy.output_dtype`` for floating outputs). It composes with ``jit``,
    ``grad``, ``vmap`` and Flax ``apply``; gradients with respect to float32
    parameters are float32, since every cast is differentiable.

    Without ``fun``, ``autocast`` returns a decorator, as
    ``eqx.filter_jit(donate=...)`` does: ``@jamp.autocast(dtype=jnp.float16)``
    (the arguments by name), or ``@jamp.autocast()`` for the defaults. The
    arguments are checked when the decorator is made.

    Array arguments (``jax.Array`` and NumPy arrays, anywhere in pytrees and
    keyword arguments) are traced; other leaves (Python numbers, booleans,
    strings) are passed to ``fun`` unchanged, so ``fun`` may branch on them.

    ``dtype="float8"`` runs every ``dot_general`` of floating operands with
    float8 operands scaled per tensor (``float8_e4m3fn`` forward,
    ``float8_e5m2`` for the gradient, float32 accumulation) and everything
    else as ``dtype=jnp.bfloat16`` (or the policy's compute dtype) would,
    the products' outputs included; convolutions stay bfloat16. The scales
    are computed from each tensor in the same step (current scaling), or,
    with ``recipe=jamp.float8.DelayedScaling(...)``, come from an amax history kept
    in a state: the returned function then takes that state first,
    ``f(state, *args)``, [`float8_init`][jamp.float8.init] creates it, and ``jax.grad``
    with respect to it returns the next state (``docs/float8.md``). With
    ``telemetry=True`` it takes a telemetry argument too (after the state,
    if any: ``f(telemetry, *args)``, ``f(state, telemetry, *args)``), which
    [`jamp.float8.telemetry_init`][] creates and whose gradient is each
    product's [`jamp.float8.Telemetry`][]: the amax, scale and fractions
    underflowed and saturated of its operands and output gradient, returned
    as arrays with the gradients. Without it, the program is the same as
    before telemetry existed.

    Args:
      fun: the function to transform; left out, a decorator is returned.
      dtype: the low-precision dtype: ``jnp.bfloat16`` (the default) or
        ``jnp.float16``; the short names of [`jamp.compat.get_policy`][]
        (``"bf16"``, ``"f16"``, ``"half"``) work too; or ``"float8"``. Left
        out (``None``) it is bfloat16, or the policy's compute dtype.
      policy: optional [`jamp.Policy`][] or policy string. Its
        ``compute_dtype`` (float16 or bfloat16) is the low-precision dtype
        (``dtype`` must then be left out or agree) and its ``output_dtype``
        the dtype of the floating outputs.
      enabled: ``False`` marks ``fun`` as a region that an enclosing
        autocast leaves alone: ``torch.autocast(enabled=False)`` nested in an
        autocast region. Inside it every primitive runs in the dtypes it was
        traced with (float32 for a float32 function): arguments arriving in
        low precision are cast back first. Outside any autocast ``fun`` is
        unchanged. The marker is a ``jax.named_scope``, so the region may
        contain anything, ``jit``, loops and custom derivatives included.
        Stacked over ``@jax.custom_vjp`` (or ``custom_jvp``), the returned
        function keeps ``defvjp`` (``defjvp``), which defines the rule of the
        function it wraps: the forward and backward passes then run as
        written; under it (``@jax.custom_vjp`` outermost) only the primal
        function is marked. With a ``recipe`` (``telemetry=True``), the
        function still takes a state (telemetry) first, and ignores it.
      recipe: with ``dtype="float8"``: ``None`` (current scaling) or a
        [`jamp.float8.DelayedScaling`][].
      telemetry: with ``dtype="float8"``: whether the function takes a
        telemetry argument and reports each product's telemetry as its
        gradient (``docs/float8.md``, "Telemetry").

    Returns:
      A function with the signature of ``fun``; with a ``recipe``, one that
      takes the float8 state (a dict of [`jamp.float8.Float8State`][]) first;
      with ``telemetry=True``, one that takes the telemetry (a dict of
      [`jamp.float8.Telemetry`][]) first, after the state if any. Without
      ``fun``, a decorator that returns that function.

    Raises:
      TypeError: ``fun`` is not callable, ``dtype`` is not a dtype or not a
        floating one (``jnp.int32``, ``"int32"``), ``policy`` is neither a
        ``Policy`` nor a string, ``recipe`` is not a ``DelayedScaling``, or
        ``telemetry`` is not a bool.
      ValueError: ``dtype`` (or the policy's compute dtype) is a floating
        dtype other than float16 and bfloat16 (``jnp.float32``,
        ``jnp.float8_e4m3fn``: float8 is ``"float8"``) or a name that is no
        dtype (``"fp8"``); an invalid policy string; ``dtype`` disagrees
        with ``policy``; or a ``recipe`` or ``telemetry=True`` without
        ``dtype="float8"``.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> def f(x, w):
      ...   return jax.nn.log_softmax(x @ w)
      >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
      >>> jamp.autocast(f)(x, w).dtype  # the dtype f returns
      dtype('float32')
      >>> jaxpr = jax.make_jaxpr(jamp.autocast(f))(x, w)
      >>> [(e.primitive.name, str(e.outvars[0].aval.dtype)) for e in jaxpr.eqns
      ...  if e.primitive.name in ("dot_general", "exp", "log")]
      [('dot_general', 'bfloat16'), ('exp', 'float32'), ('log', 'float32')]
      >>> @jamp.autocast(dtype=jnp.float16)
      ... def g(x, w):
      ...   return x @ w
      >>> str(jax.make_jaxpr(g)(x, w).eqns[-2].outvars[0].aval.dtype)
      'float16'

      A float32 region inside an autocast function (``enabled=False``):

      >>> @jamp.autocast(enabled=False)
      ... def gram(x):
      ...   return x @ x.T  # stays float32 under autocast
      >>> h = jamp.autocast(lambda x: gram(x) + x @ x.T)
      >>> dots = [e for e in jax.make_jaxpr(h)(jnp.ones((2, 2))).eqns
      ...         if e.primitive.name == "dot_general"]
      >>> [str(e.outvars[0].aval.dtype) for e in dots]
      ['float32', 'bfloat16']
    """
    if fun is not None:
        _check_fun(fun, "autocast")
    low, policy, float8 = _resolve(dtype, policy)
    _check_recipe(recipe, float8, telemetry)
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"Expected a bool for `enabled`, got {enabled!r} instead.")
    if fun is None:
        kwargs = dict(dtype=dtype, policy=policy, enabled=enabled, recipe=recipe)
        given = {k: v for k, v in kwargs.items() if v is not None and (k, v) != ("enabled", True)}
        if telemetry:
            given["telemetry"] = True
        return _Decorator(autocast, _WRAPS_A_FUNCTION if enabled else _MARKS_A_FUNCTION, **given)
    if not enabled:
        if recipe is not None or telemetry:
            return _without_float8_args(fun, recipe, bool(telemetry))
        return autocast_disabled(fun)
    return _autocast(fun, low, policy, None, float8, recipe, bool(telemetry))


def _without_float8_args(fun: Callable, recipe: DelayedScaling | None, telemetry: bool) -> Callable:
    """``enabled=False`` with a recipe or telemetry: the signature kept, the state and the
    telemetry taken and ignored."""
    disabled = autocast_disabled(fun)
    k = len(_leading(recipe, telemetry))

    def ignoring(*args: Any, **kwargs: Any) -> Any:
        return disabled(*args[k:], **kwargs)

    return Float8Function(ignoring, disabled, recipe, telemetry)  # the inits find no product


def autocast_disabled(fun: Callable | None = None) -> Callable:
    """``autocast(fun, enabled=False)``: ``fun`` marked as a region an enclosing autocast
    leaves alone (see [`autocast`][jamp.autocast]'s ``enabled``). Its public name is
    deprecated; ``jamp.autocast(fun, enabled=False)`` is the spelling."""
    if fun is None:
        return _Decorator(autocast_disabled, _MARKS_A_FUNCTION)
    _check_fun(fun, "autocast_disabled")

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(SCOPE_DISABLED):
            return fun(*args, **kwargs)

    if isinstance(fun, (jax.custom_vjp, jax.custom_jvp)):  # the rule is defined on `fun`
        for name in [n for n in vars(fun) if not n.startswith("__")]:  # copied: fwd=None, ...
            del wrapped.__dict__[name]
        for name in ("defvjp", "defjvp", "defjvps"):
            if hasattr(type(fun), name):
                setattr(wrapped, name, getattr(fun, name))
    return wrapped


def _check_report_keywords(fun: Callable, args: tuple, kwargs: dict, **own: object) -> None:
    """A clear error when ``fun`` needs a ``dtype``/``policy`` the report took."""
    try:
        signature = inspect.signature(fun)
        bound = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature, or a call error fun will report
        return
    for name, value in own.items():
        param = signature.parameters.get(name)
        if (
            value is not None
            and param is not None
            and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
            and param.default is param.empty
            and name not in bound
        ):
            raise TypeError(
                f"Expected the argument `{name}` of `fun` to be given, got only "
                f"autocast_report's own `{name}=` (the autocast {name}) instead. Bind "
                f"fun's argument first: jamp.debug.autocast_report(functools.partial(fun, "
                f"{name}=...), *args, {name}=...)."
            )


def autocast_report(
    fun: Callable,
    *args: Any,
    dtype: DTypeLike | None = None,
    policy: Policy | str | None = None,
    **kwargs: Any,
) -> AutocastReport:
    """Traces ``autocast(fun)`` on the arguments and reports what ran in which dtype.

    Nothing is executed: the function is traced (twice: once as it is, once
    under ``jax.vjp``). The report counts, per primitive, the rule applied and
    the dtype it computed in, lists the primitives the table does not know
    (they ran as traced), and lists every value the backward pass saves with
    its dtype, shape, bytes and source line (``residuals``, the arguments
    excluded, with respect to every array argument). It is the tool to reach
    for when numerics look wrong, or memory high, under autocast.

    ``dtype=`` and ``policy=`` always belong to the report, never to ``fun``.
    To pass ``fun`` keyword arguments with those names, bind them first:
    ``autocast_report(functools.partial(fun, dtype=jnp.int32), x,
    dtype=jnp.float16)``. When ``fun`` requires such an argument and only the
    report's keyword is given, a ``TypeError`` says so.

    Args:
      fun: the function, as it would be passed to [`autocast`][jamp.autocast].
      *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      dtype: the low-precision dtype, as in [`autocast`][jamp.autocast]; ``"float8"``
        reports float8 products as ``dot_general`` in ``float8_e4m3fn``
        (with current scaling; delayed scaling runs the same dtypes).
      policy: optional policy, as in [`autocast`][jamp.autocast].
      **kwargs: its other keyword arguments.

    Returns:
      An [`AutocastReport`][jamp.debug.AutocastReport]; ``print`` it for a table.

    Raises:
      TypeError: as [`autocast`][jamp.autocast], or ``fun`` requires an argument named
        ``dtype`` or ``policy`` that only the report's own keyword supplies.
      ValueError: as [`autocast`][jamp.autocast].

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> report = jamp.debug.autocast_report(
      ...     lambda x: jax.nn.softmax(x @ x), jnp.ones((2, 2)), dtype=jnp.float16)
      >>> report.counts["dot_general"], report.counts["exp"]
      ({'float16': 1}, {'float32': 1})
      >>> sorted(report.residual_bytes)  # saved for the backward pass
      ['float16', 'float32']
    """
    _check_fun(fun, "debug.autocast_report")
    _check_report_keywords(fun, args, kwargs, dtype=dtype, policy=policy)
    low, policy, float8 = _resolve(dtype, policy)
    recorder = Recorder()
    wrapped = _autocast(fun, low, policy, recorder, float8)
    flat, dynamic = _flat(wrapped, args, kwargs, shapes=True)
    jax.make_jaxpr(flat)(*dynamic)
    rows = tuple(
        (prim, rule, dt, count) for (prim, rule, dt), count in sorted(recorder.counts.items())
    )
    residuals, note = _residuals(_autocast(fun, low, policy, None, float8), args, kwargs)
    return AutocastReport(
        dtype=low,
        rows=rows,
        unknown=tuple(sorted(recorder.unknown)),
        residuals=residuals,
        residuals_note=note,
    )


def _residuals(wrapped: Callable, args: tuple, kwargs: dict) -> tuple[tuple[Residual, ...], str]:
    """What ``jax.vjp`` of ``wrapped`` saves, with respect to its array arguments, which
    are excluded (as ``jax.ad_checkpoint.print_saved_residuals`` lists them)."""
    try:
        from jax._src.ad_checkpoint import saved_residuals
    except ImportError:  # pragma: no cover - depends on the jax version
        return (), "jax.ad_checkpoint.saved_residuals is not available in this jax"
    flat, dynamic = _flat(wrapped, args, kwargs, shapes=True)
    try:
        saved = saved_residuals(flat, *dynamic)
    except (TypeError, ValueError, NotImplementedError) as e:  # e.g. no derivative rule
        return (), (str(e).strip().splitlines() or [type(e).__name__])[0]
    groups: dict[tuple[str, tuple[int, ...], str], int] = {}
    for aval, source in saved:
        # jax types the residuals' avals as AbstractValue, which declares no dtype or shape
        dtype, shape = getattr(aval, "dtype", None), getattr(aval, "shape", ())
        if source.startswith("from the argument") or not hasattr(aval, "dtype"):
            continue
        key = (np.dtype(dtype).name, tuple(shape), source)
        groups[key] = groups.get(key, 0) + 1
    rows = [
        Residual(
            dtype=np.dtype(dt),
            shape=shape,
            count=count,
            nbytes=count * int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize,
            source=source,
        )
        for (dt, shape, source), count in groups.items()
    ]
    rows.sort(key=lambda r: (-r.nbytes, r.source))
    return tuple(rows), ""


def float8_init(fun: Callable, *args: Any, **kwargs: Any) -> dict[str, Float8State]:
    """The first float8 state of a delayed-scaling autocast function.

    ``fun`` is what ``jamp.autocast(f, "float8", recipe=jamp.float8.DelayedScaling(...))``
    returned; ``args`` and ``kwargs`` are ``f``'s arguments (arrays or
    ``jax.ShapeDtypeStruct``), without the state. ``f`` is traced, not run.
    The state holds one [`jamp.float8.Float8State`][] per float8 matrix product,
    keyed ``"<i>:<scope>"`` in program order (``scope`` is the product's name
    stack, e.g. a Flax module path, with ``.`` for ``/``: ``"0:MLP.Dense_0"``;
    ``"<i>:dot_general"`` without one), with an empty amax history and scales
    of 1, as Transformer Engine starts (0, "not measured yet", so that the
    first step uses current scales, with ``unmeasured="current"``: see
    [`jamp.float8.DelayedScaling`][]). A product inside a ``lax.scan`` of
    length ``n`` has ``n`` states, stacked along a leading axis; products
    inside ``while_loop``, ``cond`` and custom-derivative bodies use current
    scaling and have none.

    Args:
      fun: a function returned by [`autocast`][jamp.autocast] with ``dtype="float8"`` and
        a ``recipe``.
      *args: ``f``'s positional arguments after the state.
      **kwargs: ``f``'s keyword arguments.

    Returns:
      A dict ``{key: Float8State}``, to pass as ``fun``'s first argument.

    Raises:
      TypeError: ``fun`` is not a delayed-scaling autocast function.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> def loss(w, x):
      ...   return jnp.sum(x @ w)
      >>> f = jamp.autocast(loss, "float8", recipe=jamp.float8.DelayedScaling(amax_history_len=4))
      >>> w, x = jnp.full((3, 3), 0.5), jnp.ones((2, 3))
      >>> state = jamp.float8.init(f, w, x)
      >>> list(state), state["0:dot_general"].amax_history.shape
      (['0:dot_general'], (3, 4))
      >>> state, grads = jax.grad(f, argnums=(0, 1))(state, w, x)  # the next state
      >>> state["0:dot_general"].amax_history[:, 0]  # the amaxes of x, w and the gradient
      Array([1. , 0.5, 1. ], dtype=float32)
      >>> state["0:dot_general"].scale  # 448 / 1, 448 / 0.5, 57344 / 1: the next step's
      Array([  448.,   896., 57344.], dtype=float32)
    """
    if not isinstance(fun, Float8Function) or fun.recipe is None:
        raise TypeError(
            "Expected for `fun` a function returned by jamp.autocast(f, 'float8', "
            f"recipe=jamp.float8.DelayedScaling(...)), got {fun!r} instead; jamp.float8.init "
            "creates the state that such a function takes first."
        )
    closed, _, _ = _trace(fun.traced, args, kwargs, shapes=True)
    return init_states(sites(closed), fun.recipe)


def telemetry_init(fun: Callable, *args: Any, **kwargs: Any) -> dict[str, Telemetry]:
    """The telemetry argument of a float8 autocast function made with ``telemetry=True``.

    ``fun`` is what ``jamp.autocast(f, "float8", telemetry=True)`` returned
    (with a ``recipe`` or without); ``args`` and ``kwargs`` are ``f``'s
    arguments (arrays or ``jax.ShapeDtypeStruct``), without the state and
    the telemetry. ``f`` is traced, not run. The telemetry holds one
    [`jamp.float8.Telemetry`][] of zeros per float8 matrix product, with the
    keys of the delayed-scaling state (``"<i>:<scope>"``, see
    [`jamp.float8.init`][]); a product inside a ``lax.scan`` of length ``n``
    has ``n``, stacked along a leading axis; products inside ``while_loop``,
    ``cond`` and custom-derivative bodies have none (they report nothing).

    ``fun`` ignores the values of its telemetry argument: its *cotangent* is
    the step's telemetry. ``jax.grad`` (or ``jax.value_and_grad``) with
    respect to it returns the amax, scale and fractions underflowed and
    saturated of each product's operands and output gradient, as arrays, in
    the pass that computes the gradients: no host callback, no
    synchronisation. Pass the same zeros every step.

    Args:
      fun: a function returned by [`autocast`][jamp.autocast] with ``dtype="float8"`` and
        ``telemetry=True``.
      *args: ``f``'s positional arguments after the state and the telemetry.
      **kwargs: ``f``'s keyword arguments.

    Returns:
      A dict ``{key: Telemetry}`` of float32 zeros ``(..., 3)``, to pass as
      ``fun``'s first argument (its second, after the state, with a recipe).

    Raises:
      TypeError: ``fun`` is not a float8 autocast function with telemetry.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> def loss(w, x):
      ...   return jnp.sum(x @ w)
      >>> f = jamp.autocast(loss, "float8", telemetry=True)
      >>> w, x = jnp.full((3, 3), 0.5), jnp.ones((2, 3))
      >>> zeros = jamp.float8.telemetry_init(f, w, x)
      >>> list(zeros), zeros["0:dot_general"].amax.shape
      (['0:dot_general'], (3,))
      >>> stats, grads = jax.grad(f, argnums=(0, 1))(zeros, w, x)
      >>> stats["0:dot_general"].scale  # 448 / 1, 448 / 0.5, 57344 / 1
      Array([  448.,   896., 57344.], dtype=float32)
    """
    if not isinstance(fun, Float8Function) or not fun.telemetry:
        raise TypeError(
            "Expected for `fun` a function returned by jamp.autocast(f, 'float8', "
            f"telemetry=True), got {fun!r} instead; jamp.float8.telemetry_init creates the "
            "telemetry argument that such a function takes first (after the state, with a "
            "recipe)."
        )
    closed, _, _ = _trace(fun.traced, args, kwargs, shapes=True)
    return init_telemetry(sites(closed))
