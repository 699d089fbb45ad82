"""What jamp reads of a jaxpr, the same way on every jax it supports.

The primitives' parameters change between jax releases: jax 0.12 describes a
``scan``'s operands by flat trees (``ft_in``: consts, carry, scanned; ``ft_out``:
carry, stacked) where jax 0.10 gave counts (``num_consts``, ``num_carry``), and
jax 0.12 wraps ``jax.nn.softmax`` in a ``custom_jvp`` (``jax_softmax_custom_jvp``
now defaults to on). Every walker of jaxprs in jamp (autocast's interpreter,
``jamp.debug``'s flattened program, float8's sites) reads them through here, and
shares this vocabulary:

- the call-like primitives and where each keeps its body (``CALLS``, ``REMATS``:
  ``BODIES``, ``body_of``), and every jaxpr any parameter holds, mapped
  (``map_jaxprs``);
- ``bind``, one primitive bound again on new operands;
- the name scopes autocast marks its regions with (``SCOPE_AUTOCAST``,
  ``SCOPE_DISABLED``, ``MARKER``) and float8's quantisation scope
  (``SCOPE_QUANTIZE``), a primitive's user line and module path
  (``user_line``, ``module_path``);
- the primitives that only move data (``MOVES``, ``RELAYOUTS``).

The primitive names are those jax 0.10.2 to 0.12.1 trace; a few older names
(``remat``, ``checkpoint``, ``core_call``) are kept, as they cost nothing. No
supported jax traces ``custom_vjp_call_jaxpr`` (it was ``custom_vjp_call``'s
older form, with its body in ``fun_jaxpr``): no walker lists it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias
from typing import cast as static_cast

import jax
import jax.core
from jax import lax
from jax.extend import core as jex_core

# jax 0.12 merged the closed jaxpr into ``Jaxpr``, which carries its constants, and keeps
# ``ClosedJaxpr`` as an alias of it (exported without the ``as`` form type checkers want).
ClosedJaxpr: TypeAlias = jex_core.ClosedJaxpr  # pyright: ignore[reportPrivateImportUsage]


def shaped(avals: Sequence[Any]) -> list[jax.core.ShapedArray]:
    """``avals`` (a jaxpr's ``in_avals`` or ``out_avals``) as the arrays they are in the
    jaxprs jamp walks: jax types them as ``AbstractValue``."""
    return [static_cast(jax.core.ShapedArray, a) for a in avals]


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's parameters: counts in jax 0.10,
    read from the operands' flat trees (``ft_in``) in jax 0.12."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


# Calls whose body takes the call's operands in order, and the parameter that holds it.
CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}
# The calls whose body has a custom derivative (``jax.custom_jvp``, ``jax.custom_vjp``).
CUSTOM_RULES = frozenset({"custom_jvp_call", "custom_vjp_call"})
# jax.checkpoint (``remat2`` in every supported jax; older names kept) and its body.
REMATS = {"remat": "jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}
# Every primitive whose body takes its operands in order: the calls and the rematerialised.
BODIES = {**CALLS, **REMATS}


def body_of(eqn: jex_core.JaxprEqn) -> jex_core.Jaxpr | ClosedJaxpr | None:
    """The body of a call-like equation (``BODIES``), as its parameter holds it; else
    ``None``."""
    key = BODIES.get(eqn.primitive.name)
    return eqn.params.get(key) if key else None


def map_jaxprs(params: dict[str, Any], fun: Callable[[ClosedJaxpr], ClosedJaxpr]) -> dict[str, Any]:
    """An equation's ``params`` with every jaxpr they hold replaced by ``fun`` of it, in
    parameter order: one held directly (a loop's body, a scatter's update, a reduction's
    computation; an open one closed, then opened again) or a tuple of closed ones (a
    conditional's branches). Any other parameter as it is."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, tuple) and value and all(isinstance(v, ClosedJaxpr) for v in value):
            out[key] = tuple(fun(v) for v in value)
        elif isinstance(value, ClosedJaxpr):
            out[key] = fun(value)
        elif isinstance(value, jex_core.Jaxpr):
            out[key] = fun(ClosedJaxpr(value, ())).jaxpr
        else:
            out[key] = value
    return out


def bind(primitive: jex_core.Primitive, vals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """``primitive`` bound on ``vals`` with an equation's ``params`` (as
    ``jax.core.eval_jaxpr`` does): its outputs, as a list."""
    out = primitive.bind(*vals, **primitive.get_bind_params(dict(params)))
    return list(out) if primitive.multiple_results else [out]


# The name scopes of autocast: the function it evaluates, and the regions it leaves as
# traced (``autocast(f, enabled=False)``); ``MARKER`` is a substring of both.
SCOPE_AUTOCAST = "jamp_autocast"
SCOPE_DISABLED = "jamp_autocast_disabled"
MARKER = "jamp_autocast"
# The scope each float8 quantisation's operations run under (the multiply by the scale,
# the clip and the cast): ``jamp.debug``'s report finds a quantisation by it. It must not
# hold ``MARKER``, which would make it a disabled region of autocast.
SCOPE_QUANTIZE = "jamp_float8_quantize"
_SCOPES = (SCOPE_AUTOCAST, SCOPE_DISABLED, SCOPE_QUANTIZE)

_LIBRARIES = tuple(
    os.sep + name + os.sep for name in ("jax", "jaxlib", "flax", "optax", "equinox", "jamp")
)


def user_line(source_info: Any) -> str:
    """``file:line (function)`` of the innermost frame outside jax and the libraries."""
    tb = getattr(source_info, "traceback", None)
    frames = list(getattr(tb, "frames", ()) or ())
    for frame in frames:
        name = frame.file_name
        if not any(lib in name for lib in _LIBRARIES) and "<frozen" not in name:
            return f"{os.path.basename(name)}:{frame.line_num} ({frame.function_name})"
    return "?"


def module_path(name_stack: str) -> str:
    """The name stack without its transformation wrappers, jamp's scopes and repeats:
    ``transpose(jvp(jamp_autocast))/CNN/Dense_0/CNN/Dense_0`` is ``CNN/Dense_0``."""
    parts = []
    for part in name_stack.split("/"):
        while "(" in part and part.endswith(")"):
            part = part[part.index("(") + 1 : -1]
        if part and part not in _SCOPES:
            parts.append(part)
    out: list[str] = []
    for part in parts:  # a nested scope repeats its parent's path: keep one
        if out and part in out:
            continue
        out.append(part)
    return "/".join(out)


# Primitives that only change an array's layout, its values untouched.
RELAYOUTS = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "copy", "copy_p"})
# Primitives that move or relabel values without computing: their error is their input's.
MOVES = RELAYOUTS | frozenset(
    {
        "broadcast_in_dim", "slice", "dynamic_slice", "dynamic_update_slice", "concatenate",
        "pad", "rev", "select_n", "stop_gradient", "optimization_barrier",
        "sharding_constraint", "device_put", "gather", "iota",
    }
)  # fmt: skip


def call_body(eqn: jex_core.JaxprEqn) -> jex_core.Jaxpr | None:
    """The body of a call (``CALLS``) whose inputs are the call's operands, in order; else
    ``None``."""
    key = CALLS.get(eqn.primitive.name)
    body = eqn.params.get(key) if key else None
    if body is None:
        return None
    body = body.jaxpr if isinstance(body, ClosedJaxpr) else body
    return body if len(body.invars) == len(eqn.invars) else None


def _closed(jaxpr: jex_core.Jaxpr | ClosedJaxpr) -> ClosedJaxpr:
    return jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, ())


def _is_softmax(eqn: jex_core.JaxprEqn) -> bool:
    """Whether ``eqn`` is jax's own ``jax.nn.softmax`` under ``jax_softmax_custom_jvp``: a
    ``custom_jvp_call`` of the function ``_softmax`` whose body shifts by a ``reduce_max``
    (jax 0.12's default; jax 0.10 inlined the same body with ``stop_gradient`` on the max)."""
    if eqn.primitive.name != "custom_jvp_call" or eqn.params.get("num_consts", 0):
        return False
    body = _closed(eqn.params["call_jaxpr"])
    info = body.jaxpr.debug_info
    name = getattr(info, "func_name", "") or ""
    if body.consts or not name.endswith("_softmax"):
        return False
    names = [e.primitive.name for e in body.jaxpr.eqns]
    return "reduce_max" in names and "exp" in names and "div" in names


# From the reduce_max to the shift: max(-inf, .), the kept dimensions, a cast.
_KEEPS_MAX = frozenset({"max", "broadcast_in_dim", "reshape", "convert_element_type"})


@functools.cache
def _stop_gradient_eqn(dtype: Any, shape: tuple[int, ...]) -> jex_core.JaxprEqn:
    x = jax.ShapeDtypeStruct(shape, dtype)
    return jax.make_jaxpr(lax.stop_gradient)(x).jaxpr.eqns[0]


def inline_softmax(jaxpr: jex_core.Jaxpr) -> jex_core.Jaxpr:
    """``jaxpr`` with each ``custom_jvp_call`` of ``jax.nn.softmax`` replaced by its body,
    the max it shifts by under ``stop_gradient``: the form jax 0.10 traced
    (``_softmax_deprecated``), which has the same value and, by its derivative, the same
    gradient as the ``custom_jvp`` rule. Autocast recognises that form and gives the
    softmax its own rule (``autocast.residuals``). ``jaxpr`` itself when it has none."""
    if not any(_is_softmax(e) for e in jaxpr.eqns):
        return jaxpr
    eqns: list[jex_core.JaxprEqn] = []
    for eqn in jaxpr.eqns:
        if not _is_softmax(eqn):
            eqns.append(eqn)
            continue
        body = _closed(eqn.params["call_jaxpr"]).jaxpr
        # Fresh variables: the body of a cached trace can be shared by several calls.
        rename: dict[Any, Any] = dict(zip(body.invars, eqn.invars, strict=True))
        results = {  # the call's own outputs
            v: out
            for v, out in zip(body.outvars, eqn.outvars, strict=True)
            if not isinstance(v, jex_core.Literal)
        }  # the call's own outputs
        maxes: set[Any] = set()
        inner: list[jex_core.JaxprEqn] = []
        for e in body.eqns:
            invars = [v if isinstance(v, jex_core.Literal) else rename[v] for v in e.invars]
            if e.primitive.name == "sub" and not isinstance(e.invars[1], jex_core.Literal):
                if e.invars[1] in maxes:  # x - max(x): the max under stop_gradient
                    m = invars[1]
                    (a,) = shaped([m.aval])
                    sg = _stop_gradient_eqn(a.dtype, tuple(a.shape))
                    stopped = jex_core.Var(a)
                    inner.append(sg.replace(invars=[m], outvars=[stopped]))
                    invars[1] = stopped
            outvars = [results.get(v) or jex_core.Var(v.aval) for v in e.outvars]
            rename.update(zip(e.outvars, outvars, strict=True))
            name = e.primitive.name
            derived = any(v in maxes for v in e.invars if not isinstance(v, jex_core.Literal))
            if name == "reduce_max" or (name in _KEEPS_MAX and derived):
                maxes.update(e.outvars)
            inner.append(e.replace(invars=invars, outvars=outvars))
        eqns.extend(inner)
    return jaxpr.replace(eqns=eqns)
