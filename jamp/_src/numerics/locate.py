"""``locate_nonfinite``: the first operation, forward then backward, whose output is not
finite while its inputs are."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp._src.autocast.interpreter import annotated_rules
from jamp._src.lookup import metrics
from jamp._src.loss_scale import LossScaleState
from jamp._src.numerics.loops import (
    LOOPS,
    Iterations,
    body,
    first_bad,
    inputs_of,
    label,
    loop_inputs,
)
from jamp._src.numerics.program import (
    Chunked,
    Op,
    Program,
    evaluate,
    fill_lines,
    flatten,
    forward_products,
    mark_linearization,
    module_paths,
    roles,
)

logger = logging.getLogger("jamp")


@dataclasses.dataclass(frozen=True)
class Operand:
    """One floating input of the located operation: its dtype and shape, its largest
    magnitude and the dtype's largest finite value."""

    dtype: str
    shape: tuple[int, ...]
    max_abs: float
    dtype_max: float

    def __str__(self) -> str:
        ratio = self.max_abs / self.dtype_max if self.dtype_max else float("nan")
        return (
            f"{self.dtype}{list(self.shape)}: max |x| {self.max_abs:.4g} "
            f"({ratio:.3g} of {self.dtype}'s largest, {self.dtype_max:.4g})"
        )


@dataclasses.dataclass(frozen=True)
class NonfiniteSite:
    """Where the first non-finite value of a step was made.

    Attributes:
      primitive: the operation (``dot_general``, ``exp``, ``log``, ``scan``...).
      line: the user's source line, ``file:line (function)``.
      path: the module path from the name stack (``CNN/Dense_0``); empty if none.
      backward: whether it is in the backward pass.
      role: for a product of the backward pass, which operand's gradient it computes
        (``"input gradient of the product at ..."`` or ``"weight gradient
        ['params']['Dense_0']['kernel'] of the product at ..."``); else empty.
      operands: its floating inputs' magnitudes against their dtype's largest value.
      nan: its outputs' NaN count; inf: their infinity count.
      index: its position in the program, forward then backward.
      argument: set instead of the rest when an argument of the function itself is not
        finite: its path.
      constant: whether no operation made a non-finite value from finite inputs, and
        this one is the first to read a non-finite constant (an array the function
        captured, or a literal) into a non-finite output: that constant's first use.
      iteration: for an operation inside a loop, the iteration that made the value,
        one per enclosing loop, outermost first: a ``scan``'s position in the arrays it
        scans (the layer of a scanned stack, the time step of a recurrent network, the
        same in the backward pass's reversed scan), a ``while``'s count of iterations
        before it, a ``cond``'s branch; None outside loops (``index`` is then the
        outermost loop's position).
      loops: for each enclosing loop, ``"iteration 3 of scan at model.py:12 (f)"``.
    """

    primitive: str
    line: str
    path: str
    backward: bool
    role: str
    operands: tuple[Operand, ...]
    nan: int
    inf: int
    index: int
    argument: str = ""
    constant: bool = False
    iteration: tuple[int, ...] | None = None
    loops: tuple[str, ...] = ()

    @property
    def pass_(self) -> str:
        return "backward" if self.backward else "forward"

    def __str__(self) -> str:
        if self.argument:
            return f"the argument {self.argument} is not finite: the step was given it"
        where = f"{self.primitive} at {self.line}" + (f" in {self.path}" if self.path else "")
        what = f"{self.pass_} pass" + (f", {self.role}" if self.role else "")
        what += "".join(f", {loop}" for loop in self.loops)
        if self.constant:
            made = (
                f"it reads a non-finite constant (an array the function captured, or a "
                f"literal) and made {self.nan} NaN and {self.inf} inf:"
            )
        else:
            made = f"it made {self.nan} NaN and {self.inf} inf from finite inputs:"
        lines = [f"the first non-finite value: {where} ({what}); {made}"]
        lines += [f"  {o}" for o in self.operands]
        return "\n".join(lines)


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _paths(args: Sequence[Any]) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    return [jax.tree_util.keystr(path[1:]) or f"argument {path[0].idx}" for path, _ in leaves]


@contextlib.contextmanager
def a_loss() -> Iterator[None]:
    """Around a trace of ``jax.value_and_grad(fun)``: jax's "Gradient only defined for
    scalar-output functions" said as the tools' misuse (a gradient function passed)."""
    try:
        yield
    except TypeError as e:
        if "scalar-output" not in str(e):
            raise
        raise TypeError(
            f"Expected `fun` to return the loss, a scalar (with has_aux=True, a pair (loss, "
            f"aux)): pass the loss, as `jax.value_and_grad` takes it, not a gradient function "
            f"such as jax.grad(loss). jax said: {e}"
        ) from None


def step_program(
    fun: Callable, args: Sequence[Any], argnums: int | Sequence[int], has_aux: bool
) -> tuple[Program, list[Any], list[str]]:
    """The flattened program of ``jax.value_and_grad(fun)``, its flat inputs and their
    paths."""
    grad = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    with a_loss(), annotated_rules():  # float8 products under their user's line and path
        closed, shape = jax.make_jaxpr(grad, return_shape=True)(*args)
    flat = jax.tree_util.tree_leaves(tuple(args))
    value = len(jax.tree_util.tree_leaves(shape[0]))  # the loss and its auxiliary data
    return fill_lines(mark_linearization(flatten(closed), value)), flat, _paths(args)


def locate_nonfinite(
    fun: Callable,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> NonfiniteSite | None:
    """Name the first operation of a step whose output is not finite from finite inputs.

    Runs ``jax.value_and_grad(fun, argnums)`` on ``args`` one operation at a time,
    in program order (the forward pass, then the backward pass), as one compiled
    program that counts each floating value's infs and NaNs (about the step's own size
    and compile), and returns the first operation whose floating output holds an inf or a
    NaN while its floating inputs are all finite: where the overflow or the NaN was
    made, not where it arrived. Only a non-finite value that reaches the loss or a
    gradient through non-finite values counts: a ``-inf`` that a later operation makes
    finite again (a float16 attention mask, which the softmax makes 0) is passed over.
    ``fun`` may be jitted, run under ``jamp.autocast``
    or hold ``jamp.autocast`` regions; Flax, NNX and Equinox models alike (the module
    path comes from the name stack, where the framework writes one).

    For that operation it gives its primitive, the user's source line, the module
    path, the pass, for a product of the backward pass which operand's gradient it
    computes, and each input's largest magnitude against its dtype's largest value:
    why it overflowed. When a loop made it (a ``scan``, ``while`` or ``cond``), the
    loop runs again iteration by iteration and the site is the operation inside, with
    the iteration (``NonfiniteSite.iteration``: the layer of a scanned stack, a time
    step).

    Args:
      fun: the loss, as ``jax.value_and_grad`` takes it.
      *args: its arguments, as in the failing step.
      argnums: the arguments to differentiate (default 0).
      has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
      A [`NonfiniteSite`][jamp.debug.NonfiniteSite], or None when the loss and the
      gradients are finite. When an argument itself is not finite, the site names it
      (``argument``).

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> def loss(w, x):
      ...     h = jnp.exp(x @ w)  # overflows for large x @ w
      ...     return jnp.mean(h)
      >>> site = jamp.debug.locate_nonfinite(loss, jnp.ones((3, 2)), jnp.full((4, 3), 40.0))
      >>> site.primitive, site.backward
      ('exp', False)
    """
    if not callable(fun):
        raise TypeError(f"Expected `fun` to be callable, got {type(fun).__name__} instead.")
    program, flat, paths = step_program(fun, args, argnums, has_aux)
    floating = [(path, x) for path, x in zip(paths, flat, strict=True) if _floating(x)]
    finite = jax.jit(lambda xs: [jnp.all(jnp.isfinite(x)) for x in xs])([x for _, x in floating])
    for (path, _), ok in zip(floating, jax.device_get(finite), strict=True):
        if not ok:
            return NonfiniteSite("", "", "", False, "", (), 0, 0, -1, argument=path)
    return search(program, flat, paths)


def _host(x: Any) -> np.ndarray:
    """``x`` in NumPy, a format NumPy has no arithmetic of (bfloat16, float8) as float32,
    which holds its every value."""
    a = np.asarray(x)
    return a if a.dtype.kind in "fc" else a.astype(np.float32)


def nonfinite_counts(op: Op, ins: Sequence[Any], outs: Sequence[Any], *_: Any) -> tuple[list, None]:
    """Traced, in a chunk: each floating output's NaN and inf counts, as terms to sum, and
    its largest magnitude, a term to take the maximum of (``Chunked(maxima=1)``)."""
    rows = [
        jnp.stack([t.astype(jnp.float32).ravel() for t in (jnp.isnan(x), jnp.isinf(x), jnp.abs(x))])
        for x in outs
        if _floating(x)
    ]
    return rows, None


def search(
    program: Program, flat: Sequence[Any], paths: Sequence[str], chunked: Chunked | None = None
) -> NonfiniteSite | None:
    """``first_nonfinite``'s answer, found with one flag per floating value: the program
    runs in chunks (``Chunked``), each value's flag computed where it is made, and the
    walk over the flags (which operation made a non-finite value from finite inputs,
    which of those reach the outputs) runs here, in NumPy. The located operation's
    counts and magnitudes come from the same run: each value's NaN and inf counts and
    largest magnitude, summed and maximised beside its flag. When that operation is a
    loop whose inputs are finite, its iterations run again (``loops.first_bad``) and
    the first whose outputs are not finite is searched the same way: the site is the
    operation inside, with the iteration."""
    chunked = chunked or Chunked(
        program, observe=nonfinite_counts, maxima=1, keep=loop_inputs(program)
    )
    env, _, seen = chunked.run(flat)
    bad: dict[int, bool] = {}  # value id -> whether it holds an inf or a NaN
    for i, x in zip(program.inputs, flat, strict=True):
        if _floating(x):
            bad[i] = False  # locate_nonfinite named a non-finite argument before
    for i, x in program.consts.items():
        if _floating(x):
            bad[i] = not np.all(np.isfinite(_host(x)))
    stats: dict[int, np.ndarray] = {}  # value id -> its NaN count, inf count, max |x|
    for op, (sums, _) in zip(program.ops, chunked.observed(seen), strict=True):
        floating = [v for v, aval in zip(op.outs, op.out_avals, strict=True) if _floating(aval)]
        stats.update(zip(floating, sums, strict=True))
    bad.update((v, bool(n[0] + n[1] > 0)) for v, n in stats.items())

    def bad_at(a: Any) -> bool | None:  # None: not a floating value
        if isinstance(a, tuple):
            return not np.all(np.isfinite(_host(a[1]))) if _floating(a[1]) else None
        return bad.get(a)

    made, from_constant = [], []
    for op in program.ops:
        flags = [(bad_at(a), isinstance(a, tuple) or a in program.consts) for a in op.ins]
        clean = not any(f for f, _ in flags if f is not None)
        constant_bad = any(f for f, const in flags if f is not None and const)
        constant_clean = not any(f for f, const in flags if f is not None and not const)
        out_bad = any(bad.get(v, False) for v in op.outs)
        made.append(clean and out_bad)
        from_constant.append(constant_bad and constant_clean and out_bad)
    finite = not any(bad_at(a) for a in program.outputs)
    reaches = np.array(_reaching(program, bad, False), bool)
    flags, constants = np.array(made, bool), np.array(from_constant, bool)
    if np.any(flags & reaches):
        flags = flags & reaches
    if np.any(constants & reaches):
        constants = constants & reaches
    constant = not np.any(flags) and bool(np.any(constants))
    if finite or not (np.any(flags) or constant):
        return None
    first = int(np.argmax(constants) if constant else np.argmax(flags))
    op, known = program.ops[first], dict(zip(program.inputs, flat, strict=True))
    counts = [int(sum(stats[v][j] for v in op.outs if v in stats)) for j in (0, 1)]
    magnitudes = []
    for a, aval in zip(op.ins, op.in_avals, strict=True):
        if not (_floating(aval) and np.prod(aval.shape)):
            continue
        if isinstance(a, int) and a in stats:  # an operation's output: its maximum, counted
            magnitudes.append(float(stats[a][2]))
        else:  # an argument, a constant or a literal, read here
            x = a[1] if isinstance(a, tuple) else known.get(a, program.consts.get(a))
            magnitudes.append(float(np.max(np.abs(_host(x)))))
    if op.name in LOOPS and not constant:
        try:
            inner = _inside(program, op, env, flat, paths)
        except (TypeError, ValueError):  # a loop jax will not run again as jamp writes it
            inner = None  # (a carry's types changed by an iteration): the loop is the site
        if inner is not None:
            return inner
    return site(program, paths, True, first, counts, magnitudes, constant)


def _inside(
    program: Program, op: Op, env: dict[int, Any], flat: Sequence[Any], paths: Sequence[str]
) -> NonfiniteSite | None:
    """The site inside loop ``op`` (finite inputs, non-finite outputs): its first
    iteration with a non-finite output, searched as a program of its own; None when no
    iteration is found (the outputs' non-finite values came otherwise). A scan's body
    runs iteration by iteration in the search's own compiled chunks, until one is not
    finite (a while's runs in a loop of its own, a cond's taken branch once)."""
    ins = inputs_of(program, op, env, flat)
    named = dict(zip(program.inputs, paths, strict=True))
    given = op.ins[1:] if op.name == "cond" else op.ins
    if op.name == "while":  # the body reads the body's constants and the carry
        given = given[int(op.params["cond_nconsts"]) :]
    names = [named.get(a, "") if isinstance(a, int) else "" for a in given]
    chunked, inner = None, body(op) if op.name == "scan" else None
    if inner is not None:
        chunked = Chunked(inner, observe=nonfinite_counts, maxima=1, keep=loop_inputs(inner))
        found = None
        for iteration, args, values, _, _ in Iterations(op, inner, chunked).run(ins):
            outs = jax.device_get(chunked.outputs(values))
            if any(_floating(x) and not np.all(np.isfinite(_host(x))) for x in outs):
                found = iteration, args
                break
    else:
        found = first_bad(op, ins)
    if found is None:
        return None
    iteration, args = found
    if inner is None:
        inner = body(op, iteration if op.name == "cond" else 0)
    where = search(inner, args, names, chunked)
    if where is None:
        return None
    return dataclasses.replace(
        where,
        index=op.index,
        iteration=(iteration, *(where.iteration or ())),
        loops=(label(op, iteration), *where.loops),
    )


def first_nonfinite(program: Program, flat_args: Sequence[Any]) -> tuple[jax.Array, ...]:
    """Traced: whether the step's value or gradients are not finite and some operation made
    a non-finite value, the first one's index, its NaN and inf counts, its floating inputs'
    magnitudes, and whether it is a constant's first use.

    The first operation that made a non-finite value from finite inputs, and whose
    non-finite output reaches a non-finite value or gradient through non-finite values,
    is the answer: a non-finite value that later operations make finite again (a mask's
    ``-inf`` that the softmax makes 0) is passed over. When there is none, the first
    that read a non-finite constant or literal (its other floating inputs finite) into a
    non-finite output that reaches: the constant is the culprit, and that operation its
    first use. Where no such operation reaches (a path the walk cannot follow), the first
    that made one."""
    made, from_constant, counts, magnitudes = [], [], [], []
    bad: dict[int, jax.Array] = {}  # value id -> whether it holds an inf or a NaN

    def observe(op: Op, ins: Sequence[Any], outs: Sequence[Any], *_: Any) -> None:
        clean = constant_clean = jnp.array(True)
        constant_bad = jnp.array(False)
        for a, x in zip(op.ins, ins, strict=True):
            if _floating(x):
                ok = jnp.all(jnp.isfinite(x))
                clean = clean & ok
                if isinstance(a, tuple) or a in program.consts:  # a literal, a constant
                    constant_bad = constant_bad | ~ok
                else:
                    constant_clean = constant_clean & ok
        for v, x in zip(op.outs, outs, strict=True):
            if _floating(x):
                bad[v] = ~jnp.all(jnp.isfinite(x))
        floats_out = [x for x in outs if _floating(x)]
        nan = sum((jnp.sum(jnp.isnan(x)) for x in floats_out), jnp.int32(0))
        inf = sum((jnp.sum(jnp.isinf(x)) for x in floats_out), jnp.int32(0))
        made.append(clean & (nan + inf > 0))
        from_constant.append(constant_bad & constant_clean & (nan + inf > 0))
        counts.append(jnp.stack([nan, inf]).astype(jnp.int32))
        sizes = [jnp.max(jnp.abs(x)).astype(jnp.float32) for x in ins if _floating(x) and x.size]
        magnitudes.append(sizes)

    outs, _ = evaluate(program, flat_args, observe=observe)
    finite = jnp.array(True)
    for x in outs:
        if _floating(x):
            finite = finite & jnp.all(jnp.isfinite(x))
    if not made:
        no = jnp.array(False)
        return no, jnp.int32(0), jnp.zeros(2, jnp.int32), jnp.zeros((0,)), no
    width = max((len(m) for m in magnitudes), default=0)
    table = jnp.stack(
        [
            jnp.stack(m + [jnp.float32(0)] * (width - len(m))) if width else jnp.zeros((0,))
            for m in magnitudes
        ]
    )
    reaches = jnp.stack(_reaching(program, bad))
    flags, constants = jnp.stack(made), jnp.stack(from_constant)
    flags = jnp.where(jnp.any(flags & reaches), flags & reaches, flags)
    constants = jnp.where(jnp.any(constants & reaches), constants & reaches, constants)
    constant = ~jnp.any(flags) & jnp.any(constants)
    first = jnp.where(constant, jnp.argmax(constants), jnp.argmax(flags)).astype(jnp.int32)
    # A step whose value and gradients are finite has nothing to locate (a masked inf,
    # such as a safe division's other branch, is no fault).
    found = (jnp.any(flags) | constant) & ~finite
    return found, first, jnp.stack(counts)[first], table[first], constant


def _reaching(program: Program, bad: dict[int, Any], no: Any = None) -> list[Any]:
    """Per operation: whether one of its non-finite outputs reaches a non-finite output of
    the program (the value or a gradient) through non-finite values only, walked back from
    the outputs in reverse program order. Traced (``bad`` holds traced flags, ``no`` is
    None) or on the host (Python bools, ``no`` False)."""
    false = jnp.array(False) if no is None else no
    reach: dict[int, Any] = {v: bad[v] for v in program.outputs if isinstance(v, int) and v in bad}
    out: list[Any] = []
    for op in reversed(program.ops):
        mine = false
        for v in op.outs:
            if v in reach:
                mine = mine | reach[v]
        out.append(mine)
        for a in op.ins:
            if isinstance(a, int) and a in bad:
                reach[a] = reach.get(a, false) | (bad[a] & mine)
    return out[::-1]


def site(
    program: Program,
    paths: Sequence[str],
    found: Any,
    first: Any,
    counts: Any,
    magnitudes: Any,
    constant: Any = False,
) -> NonfiniteSite | None:
    """The ``NonfiniteSite`` of ``first_nonfinite``'s result, or None."""
    if not bool(found):
        return None
    op = program.ops[int(first)]
    floats = [a for a in op.in_avals if jnp.issubdtype(a.dtype, jnp.inexact) and np.prod(a.shape)]
    operands = tuple(
        Operand(str(np.dtype(a.dtype)), tuple(a.shape), float(m), float(jnp.finfo(a.dtype).max))
        for a, m in zip(floats, np.asarray(magnitudes), strict=False)
    )
    forwards = forward_products(program)  # one walk for both
    role = roles(program, paths, forwards).get(op.index, "")
    path = module_paths(program, paths, forwards)[op.index]
    nan, inf = (int(c) for c in np.asarray(counts))
    return NonfiniteSite(
        op.name, op.line, path, op.backward, role, operands, nan, inf, op.index,
        constant=bool(constant),
    )  # fmt: skip


def _skipped(opt_state: Any) -> jax.Array:
    """Whether the step that returned ``opt_state`` was skipped: its ``last_finite`` (a
    ``jamp.loss_scaling`` state, or a ``jamp.value_and_grad`` result), or for a
    ``GradScaler`` state the inf checks ``GradScaler.step`` recorded in it."""
    infs = getattr(opt_state, "found_infs", None)
    if isinstance(opt_state, LossScaleState) and isinstance(infs, tuple):  # GradScaler's
        if not infs:
            raise TypeError(
                "Expected `opt_state` to be the GradScaler state that GradScaler.step (or "
                "unscale) returned, holding its inf check, got one that holds none (a state "
                "from GradScaler.init or GradScaler.update): pass the state step returned, "
                "before update."
            )
        return jnp.any(jnp.stack([jnp.asarray(x, bool) for x in infs]))
    found = metrics(opt_state)
    if "last_finite" not in found:
        raise TypeError(
            "Expected `opt_state` to be the optimizer state of a jamp.loss_scaling step, a "
            "GradScaler state after GradScaler.step, or a jamp.value_and_grad result, got "
            f"{type(opt_state).__name__}, which does not record whether the step was "
            "finite (a bare loss-scale state does not)."
        )
    return jnp.logical_not(found["last_finite"])


def locate_when_skipped(
    opt_state: Any,
    fun: Callable,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> None:
    """Inside a jitted step: when the step ``jamp.loss_scaling`` just took was skipped,
    find the first non-finite operation of ``fun`` on ``args`` and log it.

    Call it after ``tx.update`` with the new optimizer state and the step's loss and
    arguments (or after ``GradScaler.step`` with the state it returned, before
    ``GradScaler.update``). On a skipped step it runs
    [`locate_nonfinite`][jamp.debug.locate_nonfinite]'s search on the device, in a
    branch of the step, and logs the site (logger ``"jamp"``, a warning) through a
    callback that only formats it: the first non-finite argument, else the first
    operation that made a non-finite value, else that ``fun`` is finite on ``args``.
    A step that is not skipped takes the other branch: it computes nothing and calls
    nothing. The step holds one conditional more, which XLA:GPU runs by reading its
    predicate on the host (a synchronisation per step, as
    ``jamp.loss_scaling(skip="cond")``): keep it for debugging runs.
    """
    skipped = _skipped(opt_state)
    program, flat, paths = step_program(fun, args, argnums, has_aux)
    floating = [i for i, x in enumerate(flat) if _floating(x)]

    def report(argument_finite: Any, *found: Any) -> None:
        finite = np.asarray(argument_finite)
        bad = [paths[i] for i, ok in zip(floating, finite, strict=True) if not ok]
        if bad:
            found_site = NonfiniteSite("", "", "", False, "", (), 0, 0, -1, argument=bad[0])
        else:
            found_site = site(program, paths, *found)
        if found_site is None:
            name = getattr(fun, "__name__", "fun")
            logger.warning(
                "skipped step: %s's arguments are finite, and so are its value and "
                "gradients when run on them here: the non-finite values that skipped the "
                "step were not made by %s (the loss scale's product overflowed, or the "
                "gradients the optimizer received were not these)",
                name,
                name,
            )
        else:
            logger.warning("skipped step: %s", found_site)

    def search(a: list[Any]) -> None:
        finite = [jnp.all(jnp.isfinite(a[i])) for i in floating]
        argument_finite = jnp.stack(finite) if finite else jnp.zeros((0,), bool)
        jax.debug.callback(report, argument_finite, *first_nonfinite(program, a))

    jax.lax.cond(skipped, search, lambda a: None, flat)
