"""``autocast`` as a transformation of a function: its arguments resolved, the function
traced, and its jaxpr evaluated by the interpreter (``transform``); a float8 function with
a state or telemetry (``Float8Function``), which takes them first.

The decorator (``autocast.api``), the report (``autocast.report``) and float8's entry
points (``autocast.float8_api``) all go through here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, NoReturn
from typing import cast as static_cast

import jax
import numpy as np
from jax.typing import DTypeLike

from jamp._src.autocast.float8 import (
    check_states,
    check_telemetry,
    current_rule,
    site_rule,
    sites,
)
from jamp._src.autocast.interpreter import eval_closed
from jamp._src.autocast.values import Context, Info, Recorder, Rule, Value, cast, is_float
from jamp._src.dtypes import BFLOAT16, HALF, check_dtype, is_float8_mode
from jamp._src.float8.recipe import DelayedScaling, Float8State
from jamp._src.float8.telemetry import Telemetry
from jamp._src.jaxprs import SCOPE_AUTOCAST, ClosedJaxpr
from jamp._src.policy import Policy, parse_policy
from jamp._src.types import PyTree

_DEFAULT = BFLOAT16  # autocast's dtype when neither dtype nor policy is given


def is_array(leaf: object) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def check_fun(fun: object, name: str) -> None:
    if not callable(fun):
        raise TypeError(
            f"Expected a callable for `fun` of jamp.{name}, got {fun!r} "
            f"(type {type(fun).__name__}) instead."
        )


def _low_dtype(value: DTypeLike, what: str) -> np.dtype:
    dtype = check_dtype(value, what)
    if dtype not in HALF:
        raise ValueError(
            f"Expected float16 or bfloat16 for {what} of jamp.autocast (its low-precision "
            f"dtype), got {dtype.name} instead. To run a function as written, use "
            "enabled=False or call it directly."
        )
    return dtype


def resolve(
    dtype: DTypeLike | None, policy: Policy | str | None
) -> tuple[np.dtype, Policy | None, bool]:
    """The low-precision dtype, the policy and whether it is float8 mode.

    ``dtype=None`` means "not given"; in float8 mode the low-precision dtype
    (of everything but the float8 products) is bfloat16 or the policy's.
    """
    float8 = is_float8_mode(dtype)
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


def resolve_reduce_dtype(
    reduce_dtype: DTypeLike | None, low: np.dtype, policy: Policy | None
) -> np.dtype | None:
    """The dtype of the weight-gradient products that XLA sums across devices: float32 or
    the low-precision dtype ``low`` (``reduce_dtype`` given, or the policy's); ``None`` when
    neither gives one (the default: float32 in a sharded program)."""
    if reduce_dtype is None and policy is not None:
        reduce_dtype = policy.reduce_dtype
    if reduce_dtype is None:
        return None
    wanted = check_dtype(reduce_dtype, "`reduce_dtype`")
    if wanted not in (np.dtype(np.float32), low):
        raise ValueError(
            f"Expected `reduce_dtype` float32 or the low-precision dtype {low.name}, got "
            f"{wanted.name} instead: the weight gradients are summed across devices in "
            "float32 (the default), or in the dtype the products run in."
        )
    return wanted


def check_recipe(recipe: object, float8: bool, telemetry: object = False) -> None:
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


def flattened(fun: Callable, args: tuple, kwargs: dict, shapes: bool = False):
    """``fun`` as a function of the array leaves of ``(args, kwargs)``, and those leaves.

    Array leaves are traced (and ``jax.ShapeDtypeStruct`` with ``shapes``);
    other leaves (Python numbers, booleans, strings, ...) are passed to
    ``fun`` unchanged, so ``fun`` can branch on them as it would without
    autocast.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    mask = [
        is_array(leaf) or (shapes and isinstance(leaf, jax.ShapeDtypeStruct)) for leaf in leaves
    ]
    dynamic = [leaf for leaf, is_dyn in zip(leaves, mask, strict=True) if is_dyn]

    def flat_fun(*xs: jax.Array) -> PyTree:
        it = iter(xs)
        full = [next(it) if is_dyn else leaf for leaf, is_dyn in zip(leaves, mask, strict=True)]
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fun(*a, **k)

    return flat_fun, dynamic


def trace(fun: Callable, args: tuple, kwargs: dict, shapes: bool = False):
    """``fun``'s closed jaxpr, output shapes and dynamic arguments (see ``flattened``)."""
    flat_fun, dynamic = flattened(fun, args, kwargs, shapes)
    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dynamic)
    return closed, out_shape, dynamic


def transform(
    fun: Callable,
    low: np.dtype,
    policy: Policy | None,
    recorder: Recorder | None,
    float8: bool = False,
    recipe: DelayedScaling | None = None,
    telemetry: bool = False,
    reduce_dtype: np.dtype | None = None,
):
    def run(
        closed: ClosedJaxpr, out_shape: PyTree, dynamic: list[Value], rule: Rule | None
    ) -> PyTree:
        ctx = Context(dtype=low, recorder=recorder, rule=rule, reduce_dtype=reduce_dtype)
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
        leading = leading_args(recipe, telemetry)

        def with_sites(*args: Any, **kwargs: Any) -> PyTree:
            _check_leading(fun, leading, args, kwargs)
            first, args = args[: len(leading)], args[len(leading) :]
            closed, out_shape, dynamic = trace(fun, args, kwargs)
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
        closed, out_shape, dynamic = trace(fun, args, kwargs)
        return run(closed, out_shape, dynamic, current_rule if float8 else None)

    return wrapped


def leading_args(recipe: DelayedScaling | None, telemetry: bool) -> tuple[str, ...]:
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
        k = len(leading_args(self.recipe, self.telemetry))

        def call(*args: Any, **kwargs: Any) -> PyTree:
            return self._call(*args[:k], obj, *args[k:], **kwargs)

        bound = functools.partial(self.traced, obj)
        return Float8Function(call, bound, self.recipe, self.telemetry)
