"""A traced program flattened into one list of operations, each with where it came from,
and evaluated one operation at a time, as it is or with every low-precision dtype
widened to float32.

The program of ``jax.value_and_grad(fun)`` holds the forward pass, then the backward
pass (whose operations carry ``transpose(...)`` in their name stack). Calls that only
group operations (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``,
``closed_call``) are inlined, so every primitive is one ``Op`` with a global index
in program order; loops and conditionals (``scan``, ``while``, ``cond``) stay one
operation each (``loops`` enters them after, when the tools need their insides).
``Chunked`` evaluates the list under ``jax.jit`` in chunks of consecutive operations
(one for a small model's step), each a compiled program that returns what the tools
observe of its operations.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jamp._src.autocast.values import shard_map_like
from jamp._src.dtypes import LOW
from jamp._src.jaxprs import (
    MOVES,
    SCOPE_QUANTIZE,
    ClosedJaxpr,
    bind,
    body_of,
    map_jaxprs,
    module_path,
    shaped,
    user_line,
)


@dataclasses.dataclass(frozen=True)
class Op:
    """One primitive of the flattened program.

    ``ins`` and ``outs`` are value ids (ints) or, for a literal input, ``("lit",
    value)``; ``line`` is the user's source line; ``path`` the module path of the name
    stack (``CNN/Dense_0``); ``backward`` whether it is in the backward pass;
    ``quantize`` whether it is one of a float8 quantisation's operations (its name stack
    holds ``SCOPE_QUANTIZE``); ``scope`` its whole name stack (a loop's body is flattened
    under its loop's)."""

    index: int
    primitive: jex_core.Primitive
    params: dict[str, Any]
    ins: tuple[Any, ...]
    outs: tuple[int, ...]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    line: str
    path: str
    backward: bool
    quantize: bool = False
    scope: str = ""

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclasses.dataclass
class Program:
    """The flattened program: its operations, constants, inputs and outputs (value ids),
    and the jaxpr it was flattened from (``source``)."""

    ops: list[Op]
    consts: dict[int, Any]
    inputs: list[int]
    outputs: list[Any]
    producer: dict[int, Op]
    source: ClosedJaxpr | None = None


def flatten(closed: ClosedJaxpr, stack: str = "", backward: bool = False) -> Program:
    """``closed`` as one list of operations, grouping calls inlined. A loop's body is
    flattened under the loop's name stack (``stack``) and pass (``backward``)."""
    ops: list[Op] = []
    consts: dict[int, Any] = {}
    producer: dict[int, Op] = {}
    counter = iter(range(1 << 62))

    def atom(env: dict, a: Any) -> Any:
        if isinstance(a, jex_core.Literal):  # as an array of its type (not a Python float)
            return ("lit", np.asarray(a.val, getattr(a.aval, "dtype", None)))
        return env[a]

    def walk(jaxpr: jex_core.Jaxpr, env: dict, stack: str) -> None:
        for eqn in jaxpr.eqns:
            here = "/".join(s for s in (stack, str(eqn.source_info.name_stack)) if s)
            sub = body_of(eqn)  # a call or a remat: inlined
            if sub is not None:
                inner = sub if isinstance(sub, ClosedJaxpr) else ClosedJaxpr(sub, ())
                sub_env: dict = {}
                for v, c in zip(inner.jaxpr.constvars, inner.consts, strict=True):
                    sub_env[v] = i = next(counter)
                    consts[i] = c
                args = [atom(env, a) for a in eqn.invars]
                for v, a in zip(inner.jaxpr.invars, args[-len(inner.jaxpr.invars) :], strict=True):
                    sub_env[v] = a
                walk(inner.jaxpr, sub_env, here)
                for v, o in zip(eqn.outvars, inner.jaxpr.outvars, strict=True):
                    env[v] = atom(sub_env, o)
                continue
            outs = []
            for v in eqn.outvars:
                env[v] = i = next(counter)
                outs.append(i)
            op = Op(
                index=len(ops),
                primitive=eqn.primitive,
                params=dict(eqn.params),
                ins=tuple(atom(env, a) for a in eqn.invars),
                outs=tuple(outs),
                in_avals=tuple(a.aval for a in eqn.invars),
                out_avals=tuple(v.aval for v in eqn.outvars),
                line=user_line(eqn.source_info),
                path=module_path(here),
                backward=backward or "transpose(" in here,
                quantize=SCOPE_QUANTIZE in re.split(r"[/()]", here),
                scope=here,
            )
            ops.append(op)
            for i in outs:
                producer[i] = op

    env: dict = {}
    for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
        env[v] = i = next(counter)
        consts[i] = c
    inputs = []
    for v in closed.jaxpr.invars:
        env[v] = i = next(counter)
        inputs.append(i)
    walk(closed.jaxpr, env, stack)
    outputs = [atom(env, v) for v in closed.jaxpr.outvars]
    return Program(ops, consts, inputs, outputs, producer, closed)


# ------------------------------------------------------------------- evaluation


def is_low(dtype: Any) -> bool:
    """Whether ``dtype`` is a floating dtype narrower than float32. A PRNG key's dtype
    (``key<fry>``), which NumPy cannot read, is not: keys, like integers and bools, are
    carried through unwidened."""
    if jnp.issubdtype(dtype, jax.dtypes.extended):
        return False
    return np.dtype(dtype) in LOW


def _wide(dtype: Any) -> Any:
    return np.dtype(np.float32) if is_low(dtype) else dtype


def wide_value(x: Any) -> Any:
    dtype = getattr(x, "dtype", None)
    return x.astype(jnp.float32) if dtype is not None and is_low(dtype) else x


def _widened_params(op: Op) -> dict[str, Any] | None:
    """``op``'s parameters with every low-precision dtype widened, or None when the
    operation cannot run on float32 values (it reinterprets bits)."""
    if op.name == "bitcast_convert_type":
        return None
    params = dict(op.params)
    for key in ("preferred_element_type", "new_dtype", "dtype"):
        if params.get(key) is not None and is_low(params[key]):
            params[key] = _wide(params[key])
    return params


def narrow_free(op: Op) -> bool:
    """Whether ``op`` holds no low-precision dtype (in its values, its parameters or a
    sub-program) and is no rounding: its widened evaluation is the operation itself."""
    if op.name in ("reduce_precision", "shard_map", "bitcast_convert_type"):
        return False
    avals = (*op.in_avals, *op.out_avals)
    if any(is_low(a.dtype) for a in avals if hasattr(a, "dtype")):
        return False
    found: list[Any] = []
    map_jaxprs(op.params, lambda j: found.append(j) or j)
    low_params = [k for k in ("preferred_element_type", "new_dtype", "dtype")
                  if op.params.get(k) is not None and is_low(op.params[k])]  # fmt: skip
    return not found and not low_params


Observe = Callable[
    [Op, Sequence[Any], Sequence[Any], Sequence[Any] | None, Sequence[Any] | None], None
]


def _widened_jaxpr(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` traced anew from its widened evaluation, on widened inputs."""
    program = flatten(closed)
    shapes = [jax.ShapeDtypeStruct(a.shape, _wide(a.dtype)) for a in shaped(closed.in_avals)]
    return jax.make_jaxpr(lambda *xs: evaluate_wide(program, xs))(*shapes)


def evaluate_wide_op(op: Op, ins: Sequence[Any]) -> list[Any]:
    """One operation on widened values: a conversion to a narrower float is the
    identity, a loop, a conditional or a scatter runs its widened sub-programs; an
    operation that reinterprets bits runs as it is, on its inputs narrowed back, and is
    widened after."""
    if op.name == "convert_element_type" and is_low(op.params["new_dtype"]):
        if jnp.issubdtype(ins[0].dtype, jnp.floating):
            return [ins[0]]
    if op.name == "reduce_precision":  # a rounding to a narrower format, kept in float32
        return [ins[0]]
    if op.name == "shard_map":  # its body widened, under the same shard_map (collectives)
        body = flatten(ClosedJaxpr(op.params["jaxpr"], ()))
        fn = shard_map_like(op.params, lambda *xs: tuple(evaluate_wide(body, xs)))
        return [wide_value(o) for o in fn(*ins)]
    params = _widened_params(op)
    if params is not None:
        # a sub-program (a loop's body, a scatter's update) traced anew on widened values
        params = map_jaxprs(params, _widened_jaxpr)
        try:
            return [wide_value(o) for o in bind(op.primitive, ins, params)]
        except (TypeError, ValueError):
            pass
    narrow = [
        x.astype(aval.dtype) if getattr(x, "dtype", None) != getattr(aval, "dtype", None) else x
        for x, aval in zip(ins, op.in_avals, strict=True)
    ]
    return [wide_value(o) for o in bind(op.primitive, narrow, op.params)]


def _read(env: dict[int, Any], a: Any, widen: bool) -> Any:
    if isinstance(a, tuple):  # a literal
        return wide_value(a[1]) if widen else a[1]
    return env[a]


def evaluate_wide(program: Program, args: Sequence[Any]) -> list[Any]:
    """``program`` with every low-precision dtype widened to float32."""
    env: dict[int, Any] = {k: wide_value(v) for k, v in program.consts.items()}
    for i, a in zip(program.inputs, args, strict=True):
        env[i] = wide_value(a)
    for op in program.ops:
        outs = evaluate_wide_op(op, [_read(env, a, True) for a in op.ins])
        env.update(zip(op.outs, outs, strict=True))
    return [_read(env, a, True) for a in program.outputs]


def _run_op(
    op: Op, env: dict[int, Any], wide: dict[int, Any], paired: bool
) -> tuple[list[Any], list[Any], list[Any] | None, list[Any] | None]:
    """One operation on ``env``'s values (and, ``paired``, on ``wide``'s widened ones),
    its outputs written back: its inputs and outputs, and their widened twins or None."""
    ins = [_read(env, a, False) for a in op.ins]
    outs = bind(op.primitive, ins, op.params)
    env.update(zip(op.outs, outs, strict=True))
    wide_ins = wide_outs = None
    if paired:
        wide_ins = [_read(wide, a, True) for a in op.ins]
        wide_outs = evaluate_wide_op(op, wide_ins)
        wide.update(zip(op.outs, wide_outs, strict=True))
    return ins, outs, wide_ins, wide_outs


def evaluate(
    program: Program,
    args: Sequence[Any],
    *,
    paired: bool = False,
    observe: Observe | None = None,
) -> tuple[list[Any], list[Any] | None]:
    """Run ``program`` on ``args`` one operation at a time.

    With ``paired``, also run it with every low-precision dtype widened to float32
    (conversions to a narrower float become identities, ``preferred_element_type``
    float32, loops and conditionals on widened sub-programs), on the same inputs: the
    float32 reference of every operation. ``observe(op, ins, outs, wide_ins,
    wide_outs)`` sees each operation's values. Returns the outputs, and the widened
    outputs when ``paired``.
    """
    env: dict[int, Any] = dict(program.consts)
    wide: dict[int, Any] = {k: wide_value(v) for k, v in program.consts.items()}
    for i, a in zip(program.inputs, args, strict=True):
        env[i] = a
        wide[i] = wide_value(a)
    for op in program.ops:
        ins, outs, wide_ins, wide_outs = _run_op(op, env, wide, paired)
        if observe is not None:
            observe(op, ins, outs, wide_ins, wide_outs)
    outputs = [_read(env, a, False) for a in program.outputs]
    return outputs, ([_read(wide, a, True) for a in program.outputs] if paired else None)


# ------------------------------------------------------------------- evaluation in chunks

# Operations per compiled chunk. XLA's compile time grows faster than a program's size
# (a 2-layer GPT-2's step with a check per operation, as one program, compiled for
# minutes): chunks of this size keep each program small, and their compiles add up to
# about the step's own (benchmarks/debug_cost.py measures it).
CHUNK = 4096
# How the tools compile: without the backend's code optimisations (LLVM's, on the CPU),
# which take most of a compile and change no value of IEEE arithmetic (XLA sets no
# fast-math), nor the temp memory (buffer assignment precedes code generation).
COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}
# And, where XLA:CPU still has them (jaxlib 0.10; 0.12 has only its MLIR fusion emitters),
# its elemental kernel emitters: the same HLO program, its fusions' kernels emitted in
# about a third of the time at this optimisation level (the report's paired program on
# GPT-2: 4.2 s against 1.4 s). A kernel's float32 arithmetic may contract a product and a
# sum where the other emitter does not (one ulp), which no figure of the tools depends on.
# XLA:GPU ignores the option. Unless XLA_FLAGS names it: then the user's choice holds.
_ELEMENTAL = {"xla_cpu_use_fusion_emitters": False}


@functools.cache
def compiler_options() -> dict[str, Any]:
    """The options the tools compile their programs with (``COMPILER_OPTIONS``, and the
    elemental emitters where the installed XLA takes that option: asked once, by a
    compile of a one-operation program)."""
    options = dict(COMPILER_OPTIONS)
    if "xla_cpu_use_fusion_emitters" in os.environ.get("XLA_FLAGS", ""):
        return options
    try:
        jax.jit(jnp.negative).lower(np.float32(0)).compile({**options, **_ELEMENTAL})
    except Exception:  # jaxlib 0.12: "No such compile option" (a JaxRuntimeError)
        return options
    return {**options, **_ELEMENTAL}


ChunkObserve = Callable[
    [Op, Sequence[Any], Sequence[Any], Sequence[Any] | None, Sequence[Any] | None, dict],
    "tuple[list[Any], Any] | None",
]


class Chunked:
    """``program`` evaluated in chunks of ``size`` consecutive operations, each chunk one
    jitted function of the values it reads from before it, returning the values read
    after it (a value is dropped after its last reader) and what ``observe`` gives for
    each of its operations.

    ``observe(op, ins, outs, wide_ins, wide_outs, wide)`` is traced in the chunk and
    returns None or ``(sums, other)``: ``sums`` a list of ``(k, n)`` float32 arrays, terms
    to be summed over their ``n`` elements, and ``other`` arrays (a pytree) or None.
    Every sum of a chunk is one segmented sum over the terms of all its operations (the
    last ``maxima`` rows of each array a segmented maximum instead), and
    ``finish`` maps the ``(sums, k)`` totals to their figures, all at once: a reduction
    per operation would be a loop of its own for XLA to compile (CPU compiles each,
    and a check per value multiplies the step's compile time several times over).
    ``wide`` maps value ids to the chunk's widened values (with ``paired``), holding
    those of ``extra(op)`` too: the values an observation reads beside the operation's
    own. Each chunk compiles once, on its first run; a later run, whole or stopped
    early, reuses it. The values ``keep`` names stay live to the end of a ``run`` (a
    loop's inputs, which ``jamp.debug`` enters after). ``inside(op, env, wide)``, with
    ``paired``, may run an operation itself (a scan, iteration by iteration): None, or
    its outputs, their widened twins and what stands for its observation."""

    def __init__(
        self,
        program: Program,
        *,
        paired: bool = False,
        observe: ChunkObserve | None = None,
        extra: Callable[[Op], Sequence[int]] = lambda op: (),
        finish: Callable[[jax.Array], jax.Array] = lambda sums: sums,
        maxima: int = 0,
        size: int = CHUNK,
        keep: Sequence[Any] = (),
        inside: Callable[[Op, dict, dict], Any] | None = None,
    ) -> None:
        self.program, self.paired, self.observe, self.size = program, paired, observe, size
        self.finish, self.maxima, self.inside = finish, maxima, inside
        ops = program.ops
        self.bounds = [(s, min(s + size, len(ops))) for s in range(0, len(ops), size)]
        reads: list[list[int]] = []
        last: dict[int, int] = {}  # value id -> the last chunk that reads it
        for c, (lo, hi) in enumerate(self.bounds):
            made: set[int] = set()
            mine: dict[int, None] = {}
            for op in ops[lo:hi]:
                for a in (*op.ins, *extra(op)):
                    if isinstance(a, int) and a not in made:
                        mine[a] = None
                        last[a] = c
                made.update(op.outs)
            reads.append(list(mine))
        end = len(self.bounds)
        for a in (*program.outputs, *keep):
            if isinstance(a, int):
                last[a] = end
        self.reads, self.last, self.extra = reads, last, extra
        self.writes = [
            [v for op in ops[lo:hi] for v in op.outs if last.get(v, -1) > c]
            for c, (lo, hi) in enumerate(self.bounds)
        ]
        self._compiled: dict[int, Callable] = {}
        self.lowered: dict[int, Any] = {}  # chunk -> its lowered program (jax.stages.Lowered)
        self._counts: dict[int, list[int]] = {}

    def _body(self, c: int) -> Any:  # a jitted function (its .lower)
        return jax.jit(self.traced(c))

    def traced(self, c: int) -> Callable[[list[Any], list[Any]], tuple[list, list, Any]]:
        """Chunk ``c`` as a function to trace: from the values it reads (``reads[c]``, as
        they are and widened) to those it writes (``writes[c]``) and its observations."""
        lo, hi = self.bounds[c]
        ops, reads, writes = self.program.ops[lo:hi], self.reads[c], self.writes[c]
        paired, observe, finish, maxima = self.paired, self.observe, self.finish, self.maxima
        inside = self.inside

        def body(values: list[Any], wides: list[Any]) -> tuple[list, list, Any]:
            env = dict(zip(reads, values, strict=True))
            wide = dict(zip(reads, wides, strict=True)) if paired else {}
            terms: list[jax.Array] = []
            counts, others = [], []
            for op in ops:
                got = None if inside is None else inside(op, env, wide)
                if got is not None:  # run by ``inside``, observed beside
                    outs, wide_outs, other = got
                    env.update(zip(op.outs, outs, strict=True))
                    wide.update(zip(op.outs, wide_outs, strict=True))
                    sums, other = [], other
                else:
                    ins, outs, wide_ins, wide_outs = _run_op(op, env, wide, paired)
                    seen = (
                        None
                        if observe is None
                        else observe(op, ins, outs, wide_ins, wide_outs, wide)
                    )
                    sums, other = seen if seen is not None else ([], None)
                terms.extend(sums)
                counts.append(len(sums))
                others.append(other)
            totals = None
            if terms:
                sizes = [t.shape[1] for t in terms]
                segment = np.repeat(np.arange(len(terms), dtype=np.int32), sizes)
                flat = jnp.concatenate(terms, axis=1) if len(terms) > 1 else terms[0]
                k, n = flat.shape[0] - maxima, len(terms)
                parts = [jax.ops.segment_sum(flat[:k].T, segment, n, indices_are_sorted=True)]
                if maxima:
                    parts.append(
                        jax.ops.segment_max(flat[k:].T, segment, n, indices_are_sorted=True)
                    )
                totals = finish(jnp.concatenate(parts, axis=1) if maxima else parts[0])
            self._counts[c] = counts  # at trace time: how many sums each operation gave
            out = (totals, others)
            return [env[v] for v in writes], [wide[v] for v in writes] if paired else [], out

        return body

    def run(
        self,
        args: Sequence[Any],
        *,
        until: int | None = None,
        wide_args: Sequence[Any] | None = None,
    ) -> tuple[dict[int, Any], dict[int, Any], list[Any]]:
        """Evaluate the chunks on ``args`` (all, or up to the one holding operation
        ``until``; with ``paired``, beside ``wide_args``, by default ``args`` widened).
        Returns the values live after the last chunk run (by id; the widened
        ones too with ``paired``) and what the observations gave, for ``observed``."""
        program = self.program
        env: dict[int, Any] = dict(program.consts)
        env.update(zip(program.inputs, args, strict=True))
        wide = {k: wide_value(v) for k, v in env.items()} if self.paired else {}
        if self.paired and wide_args is not None:
            wide.update(zip(program.inputs, wide_args, strict=True))
        seen: list[Any] = []
        for c, (lo, _) in enumerate(self.bounds):
            if until is not None and lo > until:
                break
            values = [env[a] for a in self.reads[c]]
            wides = [wide[a] for a in self.reads[c]] if self.paired else []
            if c not in self._compiled:
                self.lowered[c] = self._body(c).lower(values, wides)
                self._compiled[c] = self.lowered[c].compile(compiler_options())
            outs, wide_outs, got = self._compiled[c](values, wides)
            env.update(zip(self.writes[c], outs, strict=True))
            if self.paired:
                wide.update(zip(self.writes[c], wide_outs, strict=True))
            seen.append(got)
            for a in self.reads[c]:  # drop what no later chunk reads
                if self.last.get(a, -1) <= c:
                    env.pop(a, None)
                    wide.pop(a, None)
        return env, wide, seen

    def lower_first(self, args: Sequence[Any]) -> Any:
        """The first chunk's program on ``args``, lowered, not compiled (to read it)."""
        env = {**self.program.consts, **dict(zip(self.program.inputs, args, strict=True))}
        values = [env[a] for a in self.reads[0]]
        wides = [wide_value(v) for v in values] if self.paired else []
        return self._body(0).lower(values, wides)

    def observed(self, seen: list[Any]) -> list[tuple[list[np.ndarray], Any]]:
        """Per operation (of the chunks ``run`` ran): its ``finish``-ed sums, one row per
        term array its observation gave, and its other arrays, fetched to the host."""
        out: list[tuple[list[np.ndarray], Any]] = []
        for c, (totals, others) in enumerate(jax.device_get(seen)):
            at = 0
            for n, other in zip(self._counts[c], others, strict=True):
                out.append(([totals[at + j] for j in range(n)], other))
                at += n
        return out

    def outputs(self, env: dict[int, Any], widened: bool = False) -> list[Any]:
        """The program's outputs from a whole ``run``'s values."""
        return [_read(env, a, widened) for a in self.program.outputs]


# ------------------------------------------------------------------- what a product's gradient is

_PRODUCTS = ("dot_general", "conv_general_dilated")
# Walked through when finding where a product's operand came from.
_PASS_THROUGH = MOVES | {"convert_element_type", "mul", "div", "clamp", "max", "min", "neg"}


def _ancestors(program: Program, start: Any, limit: int = 64) -> list[int]:
    """``start`` and the values it came from through moves, casts and scalings (the
    operand's own chain, not the scale's): a bounded walk up one input each time."""
    out: list[int] = []
    a = start
    while isinstance(a, int) and len(out) < limit:
        out.append(a)
        op = program.producer.get(a)
        if op is None or op.name not in _PASS_THROUGH:
            break
        # Follow the input shaped as the output (a scale is a scalar, a bound too).
        shaped = [
            i
            for i, aval in zip(op.ins, op.in_avals, strict=True)
            if isinstance(i, int)
            and getattr(aval, "shape", None)
            and jnp.issubdtype(aval.dtype, jnp.inexact)
        ]
        if not shaped:
            break
        # Not a scale broadcast to the operand's shape.
        own = [
            i for i in shaped if getattr(program.producer.get(i), "name", "") != "broadcast_in_dim"
        ]
        a = (own or shaped)[0]
    return out


def forward_products(program: Program) -> dict[int, tuple[Op, int]]:
    """For each matrix product or convolution of the backward pass, the forward product it
    differentiates and the position (0 left, 1 right) of the forward operand it shares.

    Products that share an operand (a VAE's two heads on one hidden layer) are told
    apart by where they were written: a backward product belongs to the forward product
    of its own module path and line (JAX gives a transposed operation the forward one's
    name stack and source), else the nearest that shares its operand."""
    operand_of: dict[int, list[tuple[Op, int]]] = {}
    for op in program.ops:
        if op.name in _PRODUCTS and not op.backward:
            for position, a in enumerate(op.ins[:2]):
                for v in _ancestors(program, a):
                    operand_of.setdefault(v, []).append((op, position))
    out: dict[int, tuple[Op, int]] = {}
    for op in program.ops:
        if op.name not in _PRODUCTS or not op.backward:
            continue
        for a in op.ins[:2]:
            found = [f for v in _ancestors(program, a) for f in operand_of.get(v, ())]
            if found:
                # The first of the closest: max keeps the first of equal keys.
                out[op.index] = max(
                    found, key=lambda f: (f[0].path == op.path, f[0].line == op.line)
                )
                break
    return out


def roles(
    program: Program,
    input_names: Sequence[str],
    forwards: dict[int, tuple[Op, int]] | None = None,
) -> dict[int, str]:
    """For each matrix product or convolution of the backward pass, which operand's
    gradient it computes: ``"input gradient"`` (the forward product's left operand) or
    ``"weight gradient"`` (its right), with the parameter's name when the right operand
    is one of the function's arguments (``input_names``, by input position); the forward
    product is ``forward_products``' (``forwards``, when the caller has it)."""
    named = dict(zip(program.inputs, input_names, strict=True))
    out: dict[int, str] = {}
    forwards = forward_products(program) if forwards is None else forwards
    for index, (forward, position) in forwards.items():
        if position == 1:  # multiplied by the forward's right operand: the left's gradient
            out[index] = f"input gradient of the product at {forward.line}"
        else:
            right = next(
                (named[v] for v in _ancestors(program, forward.ins[1]) if v in named), None
            )
            what = f" {right}" if right else ""
            out[index] = f"weight gradient{what} of the product at {forward.line}"
    return out


_LAST_KEY = re.compile(r"(\.[A-Za-z_]\w*|\[[^\]]*\])$")


def _parent(name: str) -> str:
    """A parameter's module: its path in the argument pytree without the last key
    (``.layers[1].weight`` -> ``.layers[1]``); empty for a whole argument."""
    if name.startswith("argument "):
        return ""
    return _LAST_KEY.sub("", name)


def module_paths(
    program: Program,
    input_names: Sequence[str],
    forwards: dict[int, tuple[Op, int]] | None = None,
) -> dict[int, str]:
    """Each operation's module path, told apart by its parameters where the name stack
    cannot: Equinox writes class names (``eqx.nn.MLP/eqx.nn.Linear``), one path for every
    layer, and a function with no module writes none. An operation that reads a
    parameter (through moves, casts and scalings) belongs to that parameter's module
    (its path in the argument pytree without the leaf's key), one that reads none to the
    module of its first operand's producer of the same name-stack path, a product of the
    backward pass to its forward product's (``forward_products``, or ``forwards``); where a
    name-stack path is shared by operations of two modules, or is empty, the module is
    added (``eqx.nn.MLP/eqx.nn.Linear (.layers[1])``). Other paths are kept as written."""
    parents = {v: _parent(n) for v, n in zip(program.inputs, input_names, strict=True)}
    forwards = forward_products(program) if forwards is None else forwards
    module: dict[int, str] = {}  # op index -> its parameter's module
    for op in program.ops:
        found = ""
        if op.index in forwards:  # a backward product: its forward product's module
            found = module.get(forwards[op.index][0].index, "")
        for a in () if found else op.ins:
            found = next((parents[v] for v in _ancestors(program, a) if parents.get(v)), "")
            if found:
                break
        if not found:  # no parameter read: its first operand's module, in the same path
            for a in op.ins:
                producer = program.producer.get(a) if isinstance(a, int) else None
                if producer is not None and producer.path == op.path:
                    found = module.get(producer.index, "")
                    break
        if found:
            module[op.index] = found
    shared: dict[str, set[str]] = {}
    for op in program.ops:
        if op.index in module:
            shared.setdefault(op.path, set()).add(module[op.index])
    ambiguous = {p for p, modules in shared.items() if len(modules) > 1 or not p}
    out = {}
    for op in program.ops:
        m = module.get(op.index, "")
        if m and op.path in ambiguous:
            out[op.index] = f"{op.path} ({m})" if op.path else m
        else:
            out[op.index] = op.path
    return out


def mark_linearization(program: Program, primal_outputs: int) -> Program:
    """``program`` with the forward pass's derivative computations marked backward.

    JAX computes some of a gradient's factors while it runs the forward pass (the
    derivative of ``sqrt`` at the point, ``0.5 / sqrt(x)``); they do not reach the
    function's value, only its gradient. An operation of the forward pass from which
    none of the first ``primal_outputs`` outputs (the value, and its auxiliary data)
    is reached is one of them: it belongs to the backward pass."""
    primal: set[int] = set()
    stack = [a for a in program.outputs[:primal_outputs] if isinstance(a, int)]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        op = program.producer.get(v)
        if op is None or op.backward:
            continue
        primal.add(op.index)
        stack.extend(a for a in op.ins if isinstance(a, int))
    ops = [
        op if op.backward or op.index in primal else dataclasses.replace(op, backward=True)
        for op in program.ops
    ]
    producer = {i: ops[op.index] for i, op in program.producer.items()}
    return Program(ops, program.consts, program.inputs, program.outputs, producer, program.source)


def fill_lines(program: Program, depth: int = 16) -> Program:
    """``program`` with a source line for each operation that has none (``?``: a cast or
    a loop that ``jamp.autocast`` traced, a derivative's broadcast, a rounding): the line
    of the nearest operation it reads from, else of the nearest that reads it, within
    ``depth`` steps."""
    if all(op.line != "?" for op in program.ops):
        return program
    readers: dict[int, list[Op]] = {}
    for op in program.ops:
        for a in op.ins:
            if isinstance(a, int):
                readers.setdefault(a, []).append(op)

    lines = [op.line for op in program.ops]

    def nearest(op: Op, step: Callable[[Op], list[Op]]) -> str:
        frontier, seen = [op], {op.index}
        for _ in range(depth):
            frontier = [n for o in frontier for n in step(o) if n.index not in seen]
            seen.update(n.index for n in frontier)
            found = next((lines[n.index] for n in frontier if lines[n.index] != "?"), None)
            if found or not frontier:
                return found or "?"
        return "?"

    def before(op: Op) -> list[Op]:
        return [program.producer[a] for a in op.ins if isinstance(a, int) and a in program.producer]

    def after(op: Op) -> list[Op]:
        return [n for v in op.outs for n in readers.get(v, ())]

    # The producers' lines in program order, then the readers' in reverse: each pass
    # reads the lines the operations it meets were given before.
    for op in program.ops:
        if lines[op.index] == "?":
            lines[op.index] = nearest(op, before)
    for op in reversed(program.ops):
        if lines[op.index] == "?":
            lines[op.index] = nearest(op, after)
    ops = [op if op.line == lines[op.index] else dataclasses.replace(op, line=lines[op.index])
           for op in program.ops]  # fmt: skip
    producer = {v: ops[op.index] for v, op in program.producer.items()}
    return Program(ops, program.consts, program.inputs, program.outputs, producer, program.source)
