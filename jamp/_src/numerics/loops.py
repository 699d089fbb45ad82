"""Inside loops: a ``scan``, a ``while`` or a ``cond`` of the flattened program, entered.

The flattened program keeps each loop one operation (``program.flatten``), so the step
compiles as it is. The body is flattened under the loop's name stack and pass
(``body``), so its operations carry their own source lines and module paths, and is
searched, or reported, as a program of its own:

- the locator, when a loop made the first non-finite value, runs it again from the
  inputs the step gave it: a scan's body iteration by iteration in the search's own
  chunks (``Iterations.run``), a while's in one compiled loop that stops at the first
  non-finite iteration (``first_bad``), a cond's taken branch; then searches that
  iteration's body;
- the report runs a scan, inside the step's program, as one scan of its body's paired
  chunk over the iterations (``Iterations.paired``), which returns every iteration's
  values; or, for a body of several chunks or with a scan of its own, runs the body
  after, one compiled run per iteration (``Iterations.run``).

An iteration is counted as the loop counts it: for a ``scan``, the position in the
arrays it scans (the layer of a scanned stack, the time step of a recurrent network),
the same in the backward pass's reversed scan; for a ``while``, how many iterations ran
before; for a ``cond``, the branch taken.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jamp._src.jaxprs import ClosedJaxpr, scan_counts
from jamp._src.numerics.program import (
    Chunked,
    Op,
    Program,
    compiler_options,
    fill_lines,
    flatten,
    wide_value,
)

# The loops jamp.debug enters.
LOOPS = frozenset({"scan", "while", "cond"})


def _closed(jaxpr: Any) -> ClosedJaxpr:
    return jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, ())


def _jaxpr(op: Op, branch: int = 0) -> ClosedJaxpr:
    """The body a loop operation runs: a scan's or a while's body, a cond's branch."""
    if op.name == "scan":
        return _closed(op.params["jaxpr"])
    if op.name == "while":
        return _closed(op.params["body_jaxpr"])
    return _closed(op.params["branches"][branch])


def body(op: Op, branch: int = 0) -> Program:
    """The body of loop ``op`` (a cond's ``branch``), flattened under its name stack and
    pass; an operation of the body with no source line of its own gets the nearest
    operation's of the body (``fill_lines``), else the loop's."""
    program = fill_lines(flatten(_jaxpr(op, branch), op.scope, op.backward))
    ops = [
        o if o.line != "?" else dataclasses.replace(o, line=op.line) for o in program.ops
    ]  # fmt: skip
    producer = {v: ops[o.index] for v, o in program.producer.items()}
    return Program(ops, program.consts, program.inputs, program.outputs, producer, program.source)


def label(op: Op, iteration: int) -> str:
    """``iteration 3 of scan at model.py:12 (f)``, ``branch 1 of cond at ...``."""
    what = "branch" if op.name == "cond" else "iteration"
    return f"{what} {iteration} of {op.name} at {op.line}"


def _any_bad(values: Sequence[Any]) -> jax.Array:
    flags = [
        ~jnp.all(jnp.isfinite(x))
        for x in values
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.any(jnp.stack(flags)) if flags else jnp.array(False)


def _compiled(fun: Any, *args: Any) -> Any:
    return jax.jit(fun).lower(*args).compile(compiler_options())(*args)


def _scan_parts(op: Op, ins: Sequence[Any]) -> tuple[list, list, list]:
    consts, carry = scan_counts(op.params)
    ins = list(ins)
    return ins[:consts], ins[consts : consts + carry], ins[consts + carry :]


def first_bad(op: Op, ins: Sequence[Any]) -> tuple[int, list[Any]] | None:
    """The first iteration of a ``while`` or ``cond`` ``op``, run on its inputs ``ins``,
    whose outputs hold an inf or a NaN, and that iteration's inputs (its body's
    arguments); None if none. A cond's taken branch is its one iteration. (A scan's
    iterations: ``Iterations.run``.)"""
    if op.name == "cond":
        branches = op.params["branches"]
        index = int(np.clip(np.asarray(ins[0]), 0, len(branches) - 1))
        return index, list(ins[1:])
    fun = jex_core.jaxpr_as_fun(_jaxpr(op))
    # while: cond consts, body consts, carry
    nc, nb = int(op.params["cond_nconsts"]), int(op.params["body_nconsts"])
    test = jex_core.jaxpr_as_fun(_closed(op.params["cond_jaxpr"]))
    cconsts, bconsts, carry = list(ins[:nc]), list(ins[nc : nc + nb]), list(ins[nc + nb :])

    def run_while(cconsts: list, bconsts: list, carry: list) -> tuple:
        def go(s: tuple) -> jax.Array:
            return test(*cconsts, *s[1])[0] & ~s[3]

        def step(s: tuple) -> tuple:
            new = list(fun(*bconsts, *s[1]))
            return s[0] + 1, new, s[1], _any_bad(new)

        return lax.while_loop(go, step, (jnp.int32(0), carry, carry, jnp.array(False)))

    count, _, before, bad = _compiled(run_while, cconsts, bconsts, carry)
    if not bool(bad):
        return None
    return int(count) - 1, [*bconsts, *before]


@functools.partial(jax.jit, static_argnums=1)
def _unstack(arrays: Any, length: int) -> Any:
    """Each of ``arrays``' lists of scanned arrays, as ``length`` lists of slices."""
    return tuple([[x[k] for x in xs] for k in range(length)] for xs in arrays)


@dataclasses.dataclass
class Iterations:
    """A scan's iterations: its body (``body``) and the chunks that evaluate it
    (``chunked``, compiled once), run on each iteration's inputs (``run``) or
    as one scan over them (``paired``)."""

    op: Op
    body: Program
    chunked: Chunked

    def run(
        self, ins: Sequence[Any], wide_ins: Sequence[Any] | None = None
    ) -> Iterator[tuple[int, list[Any], dict, dict, list]]:
        """Per iteration, in the order the scan runs them: its index, its inputs, and the
        body's values and observations (``Chunked.run``'s) on them; with ``wide_ins`` (a
        paired ``chunked``) beside their widened twins, the carry passed on as it is and
        widened."""
        paired = wide_ins is not None
        consts, carry, xs = _scan_parts(self.op, ins)
        wconsts, wcarry, wxs = _scan_parts(self.op, wide_ins) if paired else ([], [], [])
        length, reverse = int(self.op.params["length"]), bool(self.op.params["reverse"])
        slices, wide_slices = _unstack((xs, wxs), length)  # one program, not one per slice
        for k in reversed(range(length)) if reverse else range(length):
            args = [*consts, *carry, *slices[k]]
            wide_args = [*wconsts, *wcarry, *wide_slices[k]] if paired else None
            env, wide, seen = self.chunked.run(args, wide_args=wide_args)
            yield k, args, env, wide, seen
            carry = self.chunked.outputs(env)[: len(carry)]
            if paired:
                wcarry = self.chunked.outputs(wide, True)[: len(wcarry)]

    def whole(self) -> bool:
        """Whether ``scanned`` can run the iterations: the body is one chunk and holds no
        scan of its own (whose inputs each iteration would have to keep)."""
        return len(self.chunked.bounds) == 1 and not loop_inputs(self.body, ("scan",))

    def paired(self, ins: Sequence[Any], wide_ins: Sequence[Any]) -> tuple[list, list, Any]:
        """Traced: the scan run as one ``scan`` of its body's paired chunk over the
        iterations (``whole``): its outputs, their widened twins, and the chunk's
        observations stacked over the iterations (in the order of the scanned arrays), as
        ``Chunked.run`` gives them for ``observed``."""
        body, chunked = self.body, self.chunked
        fun, reads, writes = chunked.traced(0), chunked.reads[0], chunked.writes[0]
        consts, carry, xs = _scan_parts(self.op, ins)
        wconsts, wcarry, wxs = _scan_parts(self.op, wide_ins)
        count, fixed = len(carry), dict(body.consts)

        def read(env: dict, wrote: dict, a: Any, wide: bool) -> Any:
            if isinstance(a, tuple):
                return wide_value(a[1]) if wide else a[1]
            return wrote[a] if a in wrote else env[a]

        def step(c: tuple, x: tuple) -> tuple[tuple, Any]:
            env = {**fixed, **dict(zip(body.inputs, [*consts, *c[0], *x[0]], strict=True))}
            wide = {k: wide_value(v) for k, v in fixed.items()}
            wide.update(zip(body.inputs, [*wconsts, *c[1], *x[1]], strict=True))
            outs, wide_outs, seen = fun([env[a] for a in reads], [wide[a] for a in reads])
            low = dict(zip(writes, outs, strict=True))
            wrote = dict(zip(writes, wide_outs, strict=True))
            new = [read(env, low, a, False) for a in body.outputs]
            wnew = [read(wide, wrote, a, True) for a in body.outputs]
            return (new[:count], wnew[:count]), (seen, new[count:], wnew[count:])

        reverse, length = bool(self.op.params["reverse"]), int(self.op.params["length"])
        last, (seen, ys, wide_ys) = lax.scan(
            step, (carry, wcarry), (xs, wxs), length=length, reverse=reverse
        )
        return [*last[0], *ys], [*last[1], *wide_ys], [seen]


def loop_inputs(program: Program, names: Sequence[str] = ("scan", "while", "cond")) -> list[Any]:
    """The value ids that ``program``'s loops (of ``names``) read, for ``Chunked(keep=)``."""
    return [a for op in program.ops if op.name in names for a in op.ins if isinstance(a, int)]


def inputs_of(program: Program, op: Op, env: dict[int, Any], args: Sequence[Any]) -> list[Any]:
    """The values ``op`` read in a run of ``program`` on ``args`` that left ``env``: from
    ``env`` where it kept them, else from a run of the operations before ``op``."""
    missing = [a for a in op.ins if isinstance(a, int) and a not in env]
    if missing:
        before = Program(
            program.ops[: op.index], program.consts, program.inputs, list(op.ins),
            program.producer, None,
        )  # fmt: skip
        chunked = Chunked(before)
        env = {**env, **chunked.run(args)[0]}
    return [a[1] if isinstance(a, tuple) else env[a] for a in op.ins]
