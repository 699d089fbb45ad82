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

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import jax
import numpy as np
from jax.typing import DTypeLike

from jamp._src.autocast.float8_api import float8_init, telemetry_init
from jamp._src.autocast.rules import RULES
from jamp._src.autocast.transform import (
    Float8Function,
    check_fun,
    check_recipe,
    leading_args,
    resolve,
    resolve_reduce_dtype,
    transform,
)
from jamp._src.float8.recipe import DelayedScaling
from jamp._src.jaxprs import SCOPE_DISABLED
from jamp._src.policy import Policy

__all__ = [
    "RULES",
    "autocast",
    "autocast_disabled",
    "float8_init",  # jamp.float8.init's home is autocast.float8_api
    "telemetry_init",
]

P = ParamSpec("P")
R = TypeVar("R")


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
    reduce_dtype: DTypeLike | None = None,
) -> Callable:
    """Runs ``fun`` with matrix products in ``dtype`` and sensitive ops in float32.

    ``autocast`` is a function transformation, the JAX analogue of
    ``torch.autocast``. It traces ``fun`` to a jaxpr and evaluates it with an
    interpreter that applies one table of rules (``RULES`` in
    ``jamp/_src/autocast/rules.py``, explained in ``docs/autocast.md``):

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
      reduce_dtype: the dtype of the gradient of a parameter (float32, or half) that a
        half product reads (a matrix product's operand, a convolution's kernel), and so
        the dtype XLA sums it in across devices under FSDP or data parallelism (PyTorch
        FSDP2's ``MixedPrecisionPolicy(reduce_dtype=)``).
        ``float32``: its transposed product accumulates into float32 from the same half
        operands, and the reduce-scatter or all-reduce is float32. The low-precision
        dtype: the half product's own transpose, summed in half precision, for half the
        bytes on the wire. ``None`` (the default, or the policy's ``reduce_dtype``):
        float32 in a sharded program (the product's operands on a mesh of more than one
        device, or under ``shard_map``), the half product's transpose on one device
        (``docs/scaling-out.md``).

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
        check_fun(fun, "autocast")
    low, policy, float8 = resolve(dtype, policy)
    check_recipe(recipe, float8, telemetry)
    reduce = resolve_reduce_dtype(reduce_dtype, low, policy)
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"Expected a bool for `enabled`, got {enabled!r} instead.")
    if fun is None:
        kwargs = dict(dtype=dtype, policy=policy, enabled=enabled, recipe=recipe,
                      reduce_dtype=reduce_dtype)  # fmt: skip
        given = {k: v for k, v in kwargs.items() if v is not None and (k, v) != ("enabled", True)}
        if telemetry:
            given["telemetry"] = True
        return _Decorator(autocast, _WRAPS_A_FUNCTION if enabled else _MARKS_A_FUNCTION, **given)
    if not enabled:
        if recipe is not None or telemetry:
            return _without_float8_args(fun, recipe, bool(telemetry))
        return autocast_disabled(fun)
    return transform(fun, low, policy, None, float8, recipe, bool(telemetry), reduce)


def _without_float8_args(fun: Callable, recipe: DelayedScaling | None, telemetry: bool) -> Callable:
    """``enabled=False`` with a recipe or telemetry: the signature kept, the state and the
    telemetry taken and ignored."""
    disabled = autocast_disabled(fun)
    k = len(leading_args(recipe, telemetry))

    def ignoring(*args: Any, **kwargs: Any) -> Any:
        return disabled(*args[k:], **kwargs)

    return Float8Function(ignoring, disabled, recipe, telemetry)  # the inits find no product


def autocast_disabled(fun: Callable | None = None) -> Callable:
    """``autocast(fun, enabled=False)``: ``fun`` marked as a region an enclosing autocast
    leaves alone (see [`autocast`][jamp.autocast]'s ``enabled``). Its public name is
    deprecated; ``jamp.autocast(fun, enabled=False)`` is the spelling."""
    if fun is None:
        return _Decorator(autocast_disabled, _MARKS_A_FUNCTION)
    check_fun(fun, "autocast_disabled")

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
