"""``locate_nonfinite``: the first operation, forward then backward, whose output is not
finite while its inputs are."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp._src.autocast.interpreter import annotated_rules
from jamp._src.lookup import metrics
from jamp._src.numerics.program import (
    Op,
    Program,
    evaluate,
    flatten,
    mark_linearization,
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

    @property
    def pass_(self) -> str:
        return "backward" if self.backward else "forward"

    def __str__(self) -> str:
        if self.argument:
            return f"the argument {self.argument} is not finite: the step was given it"
        where = f"{self.primitive} at {self.line}" + (f" in {self.path}" if self.path else "")
        what = f"{self.pass_} pass" + (f", {self.role}" if self.role else "")
        lines = [
            f"the first non-finite value: {where} ({what}); it made {self.nan} NaN and "
            f"{self.inf} inf from finite inputs:"
        ]
        lines += [f"  {o}" for o in self.operands]
        return "\n".join(lines)


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _paths(args: Sequence[Any]) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tuple(args))[0]
    return [jax.tree_util.keystr(path[1:]) or f"argument {path[0].idx}" for path, _ in leaves]


def step_program(
    fun: Callable, args: Sequence[Any], argnums: int | Sequence[int], has_aux: bool
) -> tuple[Program, list[Any], list[str]]:
    """The flattened program of ``jax.value_and_grad(fun)``, its flat inputs and their
    paths."""
    grad = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    with annotated_rules():  # float8 products under their user's line and module path
        closed, shape = jax.make_jaxpr(grad, return_shape=True)(*args)
    flat = jax.tree_util.tree_leaves(tuple(args))
    value = len(jax.tree_util.tree_leaves(shape[0]))  # the loss and its auxiliary data
    return mark_linearization(flatten(closed), value), flat, _paths(args)


def locate_nonfinite(
    fun: Callable,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> NonfiniteSite | None:
    """Name the first operation of a step whose output is not finite from finite inputs.

    Runs ``jax.value_and_grad(fun, argnums)`` on ``args`` one operation at a time,
    in program order (the forward pass, then the backward pass), as one compiled
    program, and returns the first operation whose floating output holds an inf or a
    NaN while its floating inputs are all finite: where the overflow or the NaN was
    made, not where it arrived. ``fun`` may be jitted, run under ``jamp.autocast``
    or hold ``jamp.autocast`` regions; Flax, NNX and Equinox models alike (the module
    path comes from the name stack, where the framework writes one).

    For that operation it gives its primitive, the user's source line, the module
    path, the pass, for a product of the backward pass which operand's gradient it
    computes, and each input's largest magnitude against its dtype's largest value:
    why it overflowed. Loops and conditionals are one operation each.

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
    for path, x in zip(paths, flat, strict=True):
        if _floating(x) and not bool(jnp.all(jnp.isfinite(x))):
            return NonfiniteSite("", "", "", False, "", (), 0, 0, -1, argument=path)
    found, first, counts, magnitudes = jax.device_get(
        jax.jit(lambda a: first_nonfinite(program, a))(flat)
    )
    return site(program, paths, found, first, counts, magnitudes)


def first_nonfinite(program: Program, flat_args: Sequence[Any]) -> tuple[jax.Array, ...]:
    """Traced: whether the step's value or gradients are not finite and some operation made
    a non-finite value from finite inputs, the first one's index, its NaN and inf counts,
    and its floating inputs' magnitudes."""
    made, counts, magnitudes = [], [], []

    def observe(op: Op, ins: Sequence[Any], outs: Sequence[Any], *_: Any) -> None:
        clean = jnp.array(True)
        for x in ins:
            if _floating(x):
                clean = clean & jnp.all(jnp.isfinite(x))
        floats_out = [x for x in outs if _floating(x)]
        nan = sum((jnp.sum(jnp.isnan(x)) for x in floats_out), jnp.int32(0))
        inf = sum((jnp.sum(jnp.isinf(x)) for x in floats_out), jnp.int32(0))
        made.append(clean & (nan + inf > 0))
        counts.append(jnp.stack([nan, inf]).astype(jnp.int32))
        sizes = [jnp.max(jnp.abs(x)).astype(jnp.float32) for x in ins if _floating(x) and x.size]
        magnitudes.append(sizes)

    outs, _ = evaluate(program, flat_args, observe=observe)
    finite = jnp.array(True)
    for x in outs:
        if _floating(x):
            finite = finite & jnp.all(jnp.isfinite(x))
    if not made:
        return jnp.array(False), jnp.int32(0), jnp.zeros(2, jnp.int32), jnp.zeros((0,))
    width = max((len(m) for m in magnitudes), default=0)
    table = jnp.stack(
        [
            jnp.stack(m + [jnp.float32(0)] * (width - len(m))) if width else jnp.zeros((0,))
            for m in magnitudes
        ]
    )
    flags = jnp.stack(made)
    first = jnp.argmax(flags).astype(jnp.int32)
    # A step whose value and gradients are finite has nothing to locate (a masked inf,
    # such as a safe division's other branch, is no fault).
    return jnp.any(flags) & ~finite, first, jnp.stack(counts)[first], table[first]


def site(
    program: Program, paths: Sequence[str], found: Any, first: Any, counts: Any, magnitudes: Any
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
    role = roles(program, paths).get(op.index, "")
    nan, inf = (int(c) for c in np.asarray(counts))
    return NonfiniteSite(op.name, op.line, op.path, op.backward, role, operands, nan, inf, op.index)


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
    arguments. On a skipped step it runs [`locate_nonfinite`][jamp.debug.locate_nonfinite]'s
    search on the device, in a branch of the step, and logs the site (logger
    ``"jamp"``, a warning) through a callback that only formats it. A step that is
    not skipped takes the other branch: it computes nothing and calls nothing. The
    step holds one conditional more, which XLA:GPU runs by reading its predicate on
    the host (a synchronisation per step, as ``jamp.loss_scaling(skip="cond")``):
    keep it for debugging runs.
    """
    skipped = jnp.logical_not(metrics(opt_state)["last_finite"])
    program, flat, paths = step_program(fun, args, argnums, has_aux)

    def report(found: Any, first: Any, counts: Any, magnitudes: Any) -> None:
        found_site = site(program, paths, found, first, counts, magnitudes)
        if found_site is None:
            name = getattr(fun, "__name__", "fun")
            logger.warning(
                "skipped step: no operation of %s made a non-finite value from finite "
                "inputs; its arguments were not finite",
                name,
            )
        else:
            logger.warning("skipped step: %s", found_site)

    def search(a: list[Any]) -> None:
        jax.debug.callback(report, *first_nonfinite(program, a))

    jax.lax.cond(skipped, search, lambda a: None, flat)
