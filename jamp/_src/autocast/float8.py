"""``jamp.autocast(fun, "float8")``: the interpreter's float8 rule and the delayed-scaling state.

In float8 mode every eligible ``dot_general`` (floating operands of float16,
bfloat16 or float32; none in a disabled region) runs as a float8 product
(``jamp/_src/float8/``); everything else follows the half-precision rules
of ``autocast.rules`` with the autocast dtype (bfloat16 unless a policy says
float16), which is also the dtype of the products' outputs. Convolutions stay
in that dtype: XLA has no float8 convolution that jamp can rely on.

With [`DelayedScaling`][jamp.float8.DelayedScaling], each such product owns a
[`Float8State`][jamp.float8.Float8State], kept in a dict keyed ``"<i>:<scope>"``
(``i`` counts the products in program order, ``scope`` is their name stack
with ``/`` written ``.``, e.g. ``"0:MLP.Dense_0"``). ``sites`` finds them,
statically, in the traced jaxpr, following the interpreter: into ``jit``, ``closed_call`` and
``checkpoint``; into ``scan`` bodies, where a product gets one state per
iteration (stacked along leading axes); not into ``while``, ``cond``,
``custom_jvp``/``custom_vjp`` bodies (their products run with current
scaling: a while loop cannot be differentiated, a branch not taken would
return a zero state, and a custom rule's body is traced more than once) nor
into disabled regions. The interpreter then finds each product's state by
the path of equations leading to it, so a body traced twice finds the same
states.

With ``telemetry=True`` the same sites own a [`Telemetry`][jamp.float8.Telemetry]
each (with the same keys, stacked the same way in scans), which ``SiteRule``
passes to the products that report it (``current_dot_telemetry``,
``delayed_dot_telemetry``); products elsewhere report nothing. Without it,
the products are those of the code before telemetry existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple
from typing import cast as static_cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jamp._src.autocast.handlers import kept_preferred_type
from jamp._src.autocast.higher_order import HIGHER_ORDER, scan_with
from jamp._src.autocast.interpreter import eval_closed
from jamp._src.autocast.rules import FLOAT8, FLOAT8_PRIMITIVES
from jamp._src.autocast.values import Context, Evaluated, Info, JaxprLike, Rule, Value, aval
from jamp._src.dtypes import E4M3, ELIGIBLE
from jamp._src.dtypes import FLOAT32 as F32
from jamp._src.float8.products import Spec, current_dot, delayed_dot
from jamp._src.float8.recipe import DelayedScaling, Float8State, check_values, init_state
from jamp._src.float8.telemetry import Telemetry, current_dot_telemetry, delayed_dot_telemetry
from jamp._src.jaxprs import BODIES, CUSTOM_RULES, MARKER, ClosedJaxpr, body_of

# Sub-computations the products inside of which get a state (as the interpreter evaluates
# them: with the same context); inside every other one but scan (while, cond, custom
# rules, any added later) products use current scaling.
_CALLS = frozenset(BODIES) - CUSTOM_RULES
_CURRENT_ONLY = frozenset(HIGHER_ORDER) - _CALLS - {"scan"}


def eligible(eqn: jex_core.JaxprEqn) -> bool:
    """Whether ``eqn`` runs in float8: a ``dot_general`` of float16/bfloat16/float32 operands.

    Decided from the traced dtypes, which autocast never moves in or out of
    that set, so ``sites`` and the interpreter agree.
    """
    if eqn.primitive.name not in FLOAT8_PRIMITIVES:
        return False
    pet = eqn.params.get("preferred_element_type")
    dtypes = [np.dtype(aval(v).dtype) for v in eqn.invars]
    return all(d in ELIGIBLE for d in dtypes) and (pet is None or np.dtype(pet) in ELIGIBLE)


def _out_dtype(eqn: jex_core.JaxprEqn, low: np.dtype) -> np.dtype:
    """The autocast dtype, unless the program asked for a wider ``preferred_element_type``
    than its inputs (``bf16 x bf16 -> f32``), as the ``lower`` rule does."""
    kept = kept_preferred_type(eqn, range(len(eqn.invars)))
    return low if kept is None else kept


def _spec(
    eqn: jex_core.JaxprEqn,
    invals: Sequence[Value],
    ctx: Context,
    recipe: DelayedScaling | None = None,
) -> Spec:
    lhs, rhs = invals
    return Spec(
        dimension_numbers=eqn.params["dimension_numbers"],
        out_dtype=_out_dtype(eqn, ctx.dtype),
        lhs_dtype=np.dtype(lhs.dtype),
        rhs_dtype=np.dtype(rhs.dtype),
        out_sharding=eqn.params.get("out_sharding"),
        recipe=recipe,
    )


def _finish(
    eqn: jex_core.JaxprEqn, out: jax.Array, infos: Sequence[Info], ctx: Context, rule: str
) -> Evaluated:
    if ctx.recorder is not None:
        ctx.recorder.add(eqn.primitive.name, rule, E4M3.name)
    kind = min(i.kind for i in infos)
    return [out], [Info(kind=kind, low=True)]  # a low activation, as a lower-rule output


def current_rule(
    eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
) -> Evaluated | None:
    """The float8 rule with current scaling: an eligible product runs in float8."""
    if not eligible(eqn):
        return None
    return _finish(eqn, current_dot(*invals, _spec(eqn, invals, ctx)), infos, ctx, FLOAT8)


# ---------------------------------------------------------------------------
# Delayed scaling: where the products are, and their states
# ---------------------------------------------------------------------------


class Site(NamedTuple):
    """A float8 product that owns a state."""

    key: str  # its key in the user's dict
    path: tuple[int, ...]  # ids of the equations from the traced jaxpr down to the product
    stack: tuple[int, ...]  # the lengths of the scans around it: its state's leading axes


def _jaxpr(value: JaxprLike) -> jex_core.Jaxpr:
    return value.jaxpr if isinstance(value, ClosedJaxpr) else value


def sites(closed: JaxprLike) -> list[Site]:
    """The products of ``closed`` that own a state, in program order (module docstring)."""
    found: list[Site] = []

    def walk(
        jaxpr: jex_core.Jaxpr,
        path: tuple[int, ...],
        stack: tuple[int, ...],
        scope: tuple[str, ...],
    ) -> None:
        for eqn in jaxpr.eqns:
            name_stack = str(eqn.source_info.name_stack)
            if MARKER in name_stack:  # a disabled region: runs as traced
                continue
            name = eqn.primitive.name
            here = (*scope, *([name_stack] if name_stack else []))
            if eligible(eqn):
                label = ".".join(here).replace("/", ".") or "dot_general"
                found.append(Site(f"{len(found)}:{label}", (*path, id(eqn)), stack))
            elif name in _CALLS:
                sub = static_cast(JaxprLike, body_of(eqn))
                call = eqn.params.get("name")
                inner = (*here, call) if isinstance(call, str) and call else here
                walk(_jaxpr(sub), (*path, id(eqn)), stack, inner)
            elif name == "scan":
                length = int(eqn.params["length"])
                walk(_jaxpr(eqn.params["jaxpr"]), (*path, id(eqn)), (*stack, length), here)

    walk(_jaxpr(closed), (), (), ())
    return found


def init_states(found: Sequence[Site], recipe: DelayedScaling) -> dict[str, Float8State]:
    return {site.key: init_state(recipe, site.stack) for site in found}


def _check_keys(
    value: object, found: Sequence[Site], kind: str, what: str, fix: str
) -> Mapping[str, Any]:
    """``value``, checked: a TypeError unless it is a mapping, a ValueError unless its keys
    are the sites' (one entry per float8 product)."""
    if not isinstance(value, Mapping):
        raise TypeError(f"Expected {kind}, got {type(value).__name__} instead; {fix}.")
    want, got = [s.key for s in found], list(value)
    if sorted(want) != sorted(got):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise ValueError(
            f"Expected {what} with one entry per float8 matrix product of the function, keys "
            f"{want}, got keys {got} instead (missing {missing}, unexpected {extra}); {fix}."
        )
    return value


def check_states(state: object, found: Sequence[Site], recipe: DelayedScaling) -> None:
    """A clear error unless ``state`` has one well-formed Float8State per site."""
    fix = "create it with jamp.float8.init(f, *args) from the function and arguments f takes"
    state = _check_keys(
        state,
        found,
        "a dict of jamp.float8.Float8State for the float8 state (the first argument of a "
        "delayed-scaling autocast function)",
        "a float8 state",
        fix,
    )
    h = recipe.amax_history_len
    for site in found:
        entry = state[site.key]
        shapes = {"amax_history": (*site.stack, 3, h), "scale": (*site.stack, 3)}
        ok = isinstance(entry, Float8State) and all(
            _is_array(getattr(entry, f), shape) for f, shape in shapes.items()
        )
        if not ok:
            described = _describe_entry(entry)
            raise ValueError(
                f"Expected a jamp.float8.Float8State of float32 arrays with shapes {shapes} for "
                f"float8 state entry {site.key!r} (amax_history_len={h}), got {described} "
                f"instead; {fix}."
            )
        check_values(entry, f"float8 state entry {site.key!r}", recipe)


def init_telemetry(found: Sequence[Site]) -> dict[str, Telemetry]:
    return {
        site.key: Telemetry(*(jnp.zeros((*site.stack, 3), F32) for _ in range(4))) for site in found
    }


def check_telemetry(telemetry: object, found: Sequence[Site]) -> None:
    """A clear error unless ``telemetry`` has one Telemetry of float32 arrays per site (their
    values are not read: only the cotangent matters)."""
    fix = (
        "create it with jamp.float8.telemetry_init(f, *args) from the function and arguments "
        "f takes"
    )
    telemetry = _check_keys(
        telemetry,
        found,
        "a dict of jamp.float8.Telemetry for the float8 telemetry (the argument before those "
        "of the function, after the state under delayed scaling)",
        "float8 telemetry",
        fix,
    )
    for site in found:
        entry, shape = telemetry[site.key], (*site.stack, 3)
        if not (isinstance(entry, Telemetry) and all(_is_array(x, shape) for x in entry)):
            described = _describe_entry(entry)
            raise ValueError(
                f"Expected a jamp.float8.Telemetry of four float32 arrays of shape {shape} for "
                f"float8 telemetry entry {site.key!r}, got {described} instead; {fix}."
            )


def _is_array(x: Any, shape: tuple[int, ...]) -> bool:  # any leaf: duck-typed
    """Whether ``x`` is a float32 array (or tracer) of ``shape``."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and np.dtype(dtype) == F32 and tuple(np.shape(x)) == shape


def _describe_entry(entry: Any) -> tuple[tuple[str, tuple[int, ...]] | str, ...] | str:
    """What a state or telemetry entry holds, for an error message: each field's dtype and
    shape, or the entry's type when it is not a tuple."""
    return tuple(_describe(x) for x in entry) if isinstance(entry, tuple) else type(entry).__name__


def _describe(x: Any) -> tuple[str, tuple[int, ...]] | str:  # any leaf: duck-typed
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return (np.dtype(x.dtype).name, tuple(np.shape(x)))
    return type(x).__name__


@dataclasses.dataclass(frozen=True)
class SiteRule:
    """The float8 rule of products that own a site: delayed scaling's state, telemetry, or
    both. Each product finds its values by its path: ``(amax_history, scale)`` with a
    recipe, then the four fields of its ``Telemetry`` with telemetry."""

    values: Mapping[tuple[int, ...], tuple[Value, ...]]  # path -> the values of its site
    recipe: DelayedScaling | None
    telemetry: bool = False
    prefix: tuple[int, ...] = ()

    def __call__(
        self, eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
    ) -> Evaluated | None:
        name = eqn.primitive.name
        path = (*self.prefix, id(eqn))
        if eligible(eqn):
            return _finish(eqn, self._product(eqn, invals, ctx, path), infos, ctx, FLOAT8)
        if name in _CALLS:
            inner = dataclasses.replace(ctx, rule=dataclasses.replace(self, prefix=path))
            return self._recurse(eqn, invals, infos, inner)
        if name in _CURRENT_ONLY:
            return self._recurse(eqn, invals, infos, dataclasses.replace(ctx, rule=current_rule))
        if name == "scan":
            return self._scan(eqn, invals, infos, ctx, path)
        return None

    def _product(
        self, eqn: jex_core.JaxprEqn, invals: list[Value], ctx: Context, path: tuple[int, ...]
    ) -> jax.Array:
        spec = _spec(eqn, invals, ctx, self.recipe)
        values = self.values[path]
        if self.recipe is None:  # telemetry only
            return current_dot_telemetry(*invals, _telemetry(values), spec)
        history, scale, *fields = values
        if not self.telemetry:
            return delayed_dot(*invals, history, scale, spec)
        return delayed_dot_telemetry(*invals, history, scale, _telemetry(fields), spec)

    def _recurse(
        self, eqn: jex_core.JaxprEqn, invals: list[Value], infos: list[Info], ctx: Context
    ) -> Evaluated:
        if ctx.recorder is not None:
            ctx.recorder.add(eqn.primitive.name, "recurse", "-")
        return HIGHER_ORDER[eqn.primitive.name](eqn, invals, infos, ctx, eval_closed)

    def _scan(
        self,
        eqn: jex_core.JaxprEqn,
        invals: list[Value],
        infos: list[Info],
        ctx: Context,
        path: tuple[int, ...],
    ) -> Evaluated:
        """Each iteration gets its slice of the stacked values of the products inside."""
        inside = [p for p in self.values if p[: len(path)] == path]
        sizes = [len(self.values[p]) for p in inside]
        extra = [x for p in inside for x in self.values[p]]
        starts = np.cumsum([0, *sizes])

        def body_ctx(ctx: Context, slices: list[Value]) -> Context:
            values = {p: tuple(slices[starts[i] : starts[i + 1]]) for i, p in enumerate(inside)}
            rule = dataclasses.replace(self, values=values, prefix=path)
            return dataclasses.replace(ctx, rule=rule)

        if ctx.recorder is not None:
            ctx.recorder.add("scan", "recurse", "-")
        return scan_with(eqn, invals, infos, ctx, eval_closed, extra, body_ctx)


def _telemetry(fields: Sequence[Value]) -> Telemetry:
    """A site's four values as the Telemetry they came from (arrays, or their tracers)."""
    return Telemetry(*static_cast("list[jax.Array]", fields))


def site_rule(
    found: Sequence[Site],
    recipe: DelayedScaling | None,
    state: Mapping[str, Float8State] | None,
    telemetry: Mapping[str, Telemetry] | None,
) -> Rule:
    """The rule of a function with a state (``recipe``), telemetry, or both; the checks
    (``check_states``, ``check_telemetry``) made each entry a NamedTuple of arrays."""
    values: dict[tuple[int, ...], tuple[Value, ...]] = {}
    for site in found:
        own = () if state is None else tuple(state[site.key])
        values[site.path] = own + (() if telemetry is None else tuple(telemetry[site.key]))
    return SiteRule(values, recipe, telemetry is not None)
