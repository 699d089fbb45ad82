"""``precision_report``: every operation of a step under autocast against the same step in
float32, on the same inputs: its error, what it flushes to zero, what it overflows, and
for float8 products their scales and saturation."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jamp._src.autocast.api import autocast
from jamp._src.dtypes import FLOAT8_ANY, FLOAT8_MODE, HALF, check_dtype, is_float8_mode
from jamp._src.jaxprs import MOVES
from jamp._src.numerics.locate import a_loss, step_program
from jamp._src.numerics.loops import Iterations, body
from jamp._src.numerics.program import (
    Chunked,
    Op,
    Program,
    compiler_options,
    evaluate_wide_op,
    forward_products,
    module_paths,
    narrow_free,
    roles,
    wide_value,
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One operation of the autocast step against float32.

    Attributes:
      index: its position in the program, forward then backward.
      primitive: the operation; line: the user's source line; path: the module path.
      backward: whether it is in the backward pass; role: for a product of the
        backward pass, which operand's gradient it computes.
      dtype: its output's dtype under autocast.
      error: relative error of its output against float32 (``||low - f32|| /
        ||f32||``), everything before it included.
      added: the error it adds itself: its output against the same operation computed
        in float32 on the values its inputs had (a cast's rounding, a float16
        product's accumulation), its inputs' own errors left out.
      underflow: the fraction of the values it would make nonzero in float32, from
        its inputs as they were, that it flushes to zero.
      overflow: how many of its outputs it makes infinite where float32, from its
        inputs as they were, stays finite.
      amax, scale, saturated: for a quantisation to float8, the largest magnitude of
        the tensor before scaling, its scale, and the fraction of its values clipped
        at the format's largest; else None (inside a loop, the largest over its
        iterations).
      loops: for an operation of a ``scan``'s body, the scans it is in, outermost first
        (``"scan at model.py:12 (f), 4 iterations"``): its figures are over all their
        iterations (its outputs' errors as those of one array holding every iteration's,
        its overflows summed), and ``index`` is the outermost scan's. Empty outside.
    """

    index: int
    primitive: str
    line: str
    path: str
    backward: bool
    role: str
    dtype: str
    error: float
    added: float
    underflow: float
    overflow: int
    amax: float | None = None
    scale: float | None = None
    saturated: float | None = None
    loops: tuple[str, ...] = ()

    @property
    def pass_(self) -> str:
        return "backward" if self.backward else "forward"


@dataclasses.dataclass(frozen=True)
class LeafError:
    """One parameter gradient leaf's relative error against float32, the fraction of its
    float32-nonzero entries that are zero, and how many are nonzero in float32."""

    path: str
    error: float
    underflow: float
    nonzero: int


@dataclasses.dataclass(frozen=True)
class RecipeReport:
    """One recipe's report: its rows worst first, each gradient leaf's error, the loss's
    error, and the temp memory XLA gives its compiled step."""

    dtype: str
    rows: tuple[Row, ...]
    gradients: tuple[LeafError, ...]
    loss: float
    loss_float32: float
    temp_bytes: int


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What [`jamp.debug.precision_report`][] found, recipe by recipe.

    ``str(report)`` is a table; ``report.recipes`` holds the figures, and
    ``report.rows`` / ``report.gradients`` those of its only recipe."""

    recipes: tuple[RecipeReport, ...]
    float32_temp_bytes: int
    top: int = 12

    def _only(self) -> RecipeReport:
        if len(self.recipes) != 1:
            raise ValueError("this report compares several recipes: read report.recipes")
        return self.recipes[0]

    @property
    def rows(self) -> tuple[Row, ...]:
        return self._only().rows

    @property
    def gradients(self) -> tuple[LeafError, ...]:
        return self._only().gradients

    def __getitem__(self, dtype: str) -> RecipeReport:
        for r in self.recipes:
            if r.dtype == dtype:
                return r
        raise KeyError(dtype)

    def __str__(self) -> str:
        lines = ["recipe     loss error  worst gradient leaf (error)           temp memory"]
        f32 = f"{self.float32_temp_bytes / 2**20:.2f} MiB"
        lines.append(f"{'float32':<10} {'-':>10}  {'-':<38} {f32}")
        for r in self.recipes:
            worst = max(r.gradients, key=lambda g: g.error, default=None)
            leaf = f"{worst.path} ({worst.error:.3g})" if worst else "-"
            err = abs(r.loss - r.loss_float32) / max(abs(r.loss_float32), 1e-30)
            lines.append(f"{r.dtype:<10} {err:>10.3g}  {leaf:<38} {r.temp_bytes / 2**20:.2f} MiB")
        for r in self.recipes:
            lines += ["", f"{r.dtype}: the {min(self.top, len(r.rows))} worst operations"]
            lines.append(
                f"{'op':<22} {'pass':<9} {'error':>8} {'added':>8} {'underflow':>9} "
                f"{'overflow':>8}  where"
            )
            for row in r.rows[: self.top]:
                where = f"{row.line} {row.path}".strip() + (f" [{row.role}]" if row.role else "")
                where += "".join(f" (in the {loop})" for loop in row.loops)
                f8 = "" if row.scale is None else (
                    f" amax {row.amax:.3g} scale {row.scale:.3g} saturated {row.saturated:.3g}"
                )  # fmt: skip
                lines.append(
                    f"{row.primitive + ' ' + row.dtype:<22} {row.pass_:<9} {row.error:>8.3g} "
                    f"{row.added:>8.3g} {row.underflow:>9.3g} {row.overflow:>8d}  {where}{f8}"
                )
        return "\n".join(lines)


def _quantisation(program: Program, cast: Op) -> list[Op]:
    """The operations of the float8 quantisation that ``cast`` ends: those of its name
    scope (``Op.quantize``, ``SCOPE_QUANTIZE``) that ``cast`` depends on."""
    found: dict[int, Op] = {}
    stack = [a for a in cast.ins if isinstance(a, int)]
    while stack:
        prod = program.producer.get(stack.pop())
        if prod is None or not prod.quantize or prod.index in found:
            continue
        found[prod.index] = prod
        stack.extend(a for a in prod.ins if isinstance(a, int))
    return [found[i] for i in sorted(found)]


def _float8_scales(program: Program) -> dict[int, tuple[int, int]]:
    """For each quantisation to float8 (``float8.products.quantize``: the cast to float8
    that ends the operations of its named scope, ``SCOPE_QUANTIZE``), the value ids of
    the scalar scale its input was multiplied by and of that product, before the clip."""
    out: dict[int, tuple[int, int]] = {}
    for op in program.ops:
        if not op.quantize or op.name != "convert_element_type":
            continue
        if np.dtype(op.params["new_dtype"]) not in FLOAT8_ANY:
            continue
        for prod in _quantisation(program, op):
            if prod.name != "mul":
                continue
            for i, aval in zip(prod.ins, prod.in_avals, strict=True):
                src = program.producer.get(i) if isinstance(i, int) else None
                if aval.shape == () and isinstance(i, int):
                    out[op.index] = (i, prod.outs[0])
                elif src is not None and src.name == "broadcast_in_dim":
                    if src.in_avals[0].shape == () and isinstance(src.ins[0], int):
                        out[op.index] = (src.ins[0], prod.outs[0])
    return out


def _relative(low: np.ndarray, ref: np.ndarray) -> float:
    """``||low - ref|| / ||ref||``: 0 where both are 0, inf where only ``ref`` is."""
    diff, norm = np.linalg.norm(low - ref), np.linalg.norm(ref)
    if norm > 0:
        return float(diff / norm)
    return float(np.inf) if diff > 0 else 0.0


def _flat32(values: Sequence[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(v).astype(np.float32).ravel() for v in values])


def _gradient_error(low: np.ndarray, ref: np.ndarray) -> list[float]:
    """A gradient leaf's error against float32, the fraction of its float32-nonzero
    entries that are zero, and how many are nonzero in float32."""
    nonzero = ref != 0
    with np.errstate(all="ignore"):
        flushed = np.sum(nonzero & (low == 0)) / max(int(np.sum(nonzero)), 1)
        return [_relative(low, ref), float(flushed), float(np.sum(nonzero))]


def _figures(outs: Sequence[Any], wide: Sequence[Any], here: Sequence[Any] | None) -> list[float]:
    """One operation's error, added error, underflow and overflow, from its floating
    outputs, their float32 reference and the operation itself in float32 on its inputs
    (None: its outputs, where it holds no low-precision dtype)."""
    low, ref = _flat32(outs), _flat32(wide)
    exact = low if here is None else _flat32(here)
    nonzero = exact != 0
    with np.errstate(all="ignore"):  # inf - inf: a NaN error, as in jnp
        return [
            _relative(low, ref),
            _relative(low, exact),
            float(np.sum(nonzero & (low == 0)) / max(int(np.sum(nonzero)), 1)),
            float(np.sum(np.isinf(low) & np.isfinite(exact))),
        ]


def _exact_here(op: Op, ins: Sequence[Any]) -> list[Any]:
    """``op`` computed in float32 on the values its inputs actually had: what it would
    give if it alone ran wide (its own rounding, flushing and overflow are the
    difference from its output)."""
    return evaluate_wide_op(op, [wide_value(x) for x in ins])


def _observer(program: Program) -> tuple[Any, Callable[[Op], Sequence[int]]]:
    """The observation of ``program``'s paired evaluation (``Chunked``), and the values of
    earlier operations it reads beside an operation's own (a float8 scale)."""
    scales = _float8_scales(program)

    def observe(
        op: Op, ins: Sequence[Any], outs: Sequence[Any], wide_ins: Any, wide_outs: Any, values: dict
    ) -> tuple[list[jax.Array], Any] | None:
        floats = [
            (o, w)
            for o, w in zip(outs, wide_outs, strict=True)
            if jnp.issubdtype(o.dtype, jnp.floating) and o.size
        ]
        if op.name in MOVES or op.name == "scan" or not floats:  # a scan's rows: its body's
            return None
        local = None  # the operation in float32 is the operation itself: its outputs
        if not narrow_free(op):
            local = [
                o for o, w in zip(_exact_here(op, ins), wide_outs, strict=True)
                if jnp.issubdtype(w.dtype, jnp.floating) and w.size
            ]  # fmt: skip
        f8 = None
        if op.index in scales:  # amax and clipping of the product before the clip
            scale_id, scaled_id = scales[op.index]
            scale = values[scale_id].astype(jnp.float32)
            y = jnp.abs(values[scaled_id].astype(jnp.float32))
            top = np.float32(jnp.finfo(op.params["new_dtype"]).max)
            f8 = jnp.stack([jnp.max(y) / scale, scale, jnp.mean(y > top)]).astype(jnp.float32)
        # The values themselves: their errors are summed on the host (_figures). A
        # reduction per operation here would be a loop of its own for XLA to compile,
        # minutes of compile on a small transformer.
        return [], ([o for o, _ in floats], [w for _, w in floats], local, f8)

    return observe, lambda op: scales.get(op.index, ())


def _paired(program: Program, cache: dict) -> Chunked:
    """``program``'s paired evaluation in chunks, each operation's figures computed in its
    chunk, beside it. A scan runs as one scan of its body's paired chunk, which gives
    its body's figures over the iterations (``Iterations.paired``); where its body is
    more than one chunk or holds a scan, the scan's inputs are kept, to run its body
    after, iteration by iteration (``_scan_entries``)."""
    observe, extra = _observer(program)
    keep = []
    for op in program.ops:
        if op.name == "scan" and not _iterations(op, cache).whole():
            keep += [a for a in op.ins if isinstance(a, int)]

    def inside(op: Op, env: dict, wide: dict) -> Any:
        if op.name != "scan" or not _iterations(op, cache).whole():
            return None
        return _iterations(op, cache).paired(*_scan_inputs(op, env, wide))

    return Chunked(program, paired=True, observe=observe, extra=extra, keep=keep, inside=inside)


def _scan_inputs(op: Op, env: dict, wide: dict) -> tuple[list[Any], list[Any]]:
    """Scan ``op``'s inputs from a paired run's values: as they are, and widened."""
    low = [a[1] if isinstance(a, tuple) else env[a] for a in op.ins]
    wides = [wide_value(a[1]) if isinstance(a, tuple) else wide[a] for a in op.ins]
    return low, wides


def _scan_label(op: Op) -> str:
    """``scan at model.py:12 (f), 16 iterations``: what a row inside it names."""
    return f"{op.name} at {op.line}, {op.params['length']} iterations"


def _labels(program: Program, names: Sequence[str], cache: dict) -> tuple[dict, dict]:
    """``program``'s roles and module paths (one walk to the forward products), made once
    for every iteration that reports it (``cache``, by the program and its names)."""
    key = ("labels", id(program), tuple(names))
    if key not in cache:
        forwards = forward_products(program)
        cache[key] = roles(program, names, forwards), module_paths(program, names, forwards)
    return cache[key]


def _iterations(op: Op, cache: dict) -> Iterations:
    """Scan ``op``'s body and its paired chunks, made once (``cache``, by the operation)."""
    if id(op) not in cache:
        inner = body(op)
        cache[id(op)] = Iterations(op, inner, _paired(inner, cache))
    return cache[id(op)]


# One operation's row before its figures: the operation, its position in the step (its
# outermost loop's, inside one), its module path, role and loops, and its observed values.
Entry = tuple[Op, int, str, str, tuple[str, ...], Any]


def _entries(
    program: Program, names: Sequence[str], run: tuple[Chunked, dict, dict, list], cache: dict
) -> list[Entry]:
    """Each operation of ``program``'s paired run ``run`` (the chunks, the values they
    kept as they are and widened, and their observations) that gave values, a scan's
    body's operations in place of the scan, over all its iterations (``_scan_entries``)."""
    chunked, env, wide, seen = run
    named, modules = _labels(program, names, cache)
    given = dict(zip(program.inputs, names, strict=True))
    out: list[Entry] = []
    for op, (_, values) in zip(program.ops, chunked.observed(seen), strict=True):
        if op.name == "scan":
            inner = [given.get(a, "") if isinstance(a, int) else "" for a in op.ins]
            if values is not None:  # run inside the chunk: its body's
                its = _iterations(op, cache)
                got = _entries(its.body, inner, (its.chunked, {}, {}, values), cache)
                got = [(e[0], e[1], e[2], e[3], (_scan_label(op), *e[4]), e[5]) for e in got]
            else:
                got = _scan_entries(op, *_scan_inputs(op, env, wide), inner, cache)
            out += [(e[0], op.index, e[2], e[3], e[4], e[5]) for e in got]
        elif values is not None:
            out.append((op, op.index, modules[op.index], named.get(op.index, ""), (), values))
    return out


def _scan_entries(
    op: Op, ins: Sequence[Any], wide_ins: Sequence[Any], names: Sequence[str], cache: dict
) -> list[Entry]:
    """The entries of scan ``op``'s body, run iteration by iteration on its inputs (as they
    are and widened), each operation's values gathered over the iterations: the report
    sums its errors over them, as over one array."""
    its = _iterations(op, cache)  # the body compiled once, for every run of the scan
    where = _scan_label(op)
    gathered: dict[int, tuple[Entry, list[Any]]] = {}
    for _, _, env, wide, seen in its.run(ins, wide_ins):
        for entry in _entries(its.body, names, (its.chunked, env, wide, seen), cache):
            gathered.setdefault(id(entry[0]), (entry, []))[1].append(entry[5])
    out: list[Entry] = []
    for (o, index, path, role, loops, _), values in gathered.values():
        outs, wides, local, f8 = zip(*values, strict=True)
        merged = (
            [x for v in outs for x in v],
            [x for v in wides for x in v],
            None if local[0] is None else [x for v in local for x in v],
            None if f8[0] is None else np.max(np.stack(f8), axis=0),  # the largest
        )
        out.append((o, index, path, role, (where, *loops), merged))
    return out


def _recipe(
    fun: Callable, args: Sequence[Any], dtype: Any, argnums: Any, has_aux: bool
) -> RecipeReport:
    low_fun = autocast(fun, dtype)
    program, flat, paths = step_program(low_fun, args, argnums, has_aux)
    temp = _temp_of(jax.jit(jex_core.jaxpr_as_fun(program.source)).lower(*flat))
    # The paired evaluation in chunks (Chunked), each operation's figures computed in its
    # chunk, beside it: the values of earlier operations it reads (a float8 scale) too.
    cache: dict = {}
    chunked = _paired(program, cache)
    env, wide, seen = chunked.run(flat)
    outs, wides = jax.device_get((chunked.outputs(env), chunked.outputs(wide, True)))
    grads = [
        _gradient_error(_flat32([o]), _flat32([w]))
        for o, w in zip(outs, wides, strict=True)
        if jnp.issubdtype(o.dtype, jnp.floating) and o.size
    ]
    rows = []
    for op, index, path, role, loops, values in _entries(
        program, paths, (chunked, env, wide, seen), cache
    ):
        s, f8s = _figures(*values[:3]), values[3]
        out_dtype = next((str(np.dtype(a.dtype)) for a in op.out_avals), "")
        f8 = (
            {}
            if f8s is None
            else dict(amax=float(f8s[0]), scale=float(f8s[1]), saturated=float(f8s[2]))
        )
        rows.append(
            Row(
                index,
                op.name,
                op.line,
                path,
                op.backward,
                role,
                out_dtype,
                float(s[0]),
                float(s[1]),
                float(s[2]),
                int(s[3]),
                **f8,
                loops=loops,
            )  # fmt: skip
        )
    rows.sort(key=lambda r: (r.overflow > 0, max(r.added, r.underflow), -r.index), reverse=True)
    grad_paths = _gradient_paths(args, argnums)
    gradients = tuple(
        LeafError(p, float(g[0]), float(g[1]), int(g[2]))
        for p, g in zip(grad_paths, grads[-len(grad_paths) :], strict=True)
    ) if grad_paths else ()  # fmt: skip
    loss, loss32 = (float(np.asarray(v).reshape(-1)[0]) for v in (outs[0], wides[0]))
    return RecipeReport(_name(dtype), tuple(rows), gradients, loss, loss32, temp.result())


def _gradient_paths(args: Sequence[Any], argnums: int | Sequence[int]) -> list[str]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    out = []
    for n in nums:
        for path, x in jax.tree_util.tree_flatten_with_path(args[n])[0]:
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
                out.append(jax.tree_util.keystr(path) or f"argument {n}")
    return out


# The temp memory figures compile the float32 and the autocast step once more each: in a
# thread, one at a time, beside the report's own tracing, compile and run (XLA compiles
# without holding Python's lock).
_TEMPS = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jamp-temp")


def _temp_of(lowered: Any) -> concurrent.futures.Future[int]:
    """The temp memory XLA gives the compiled ``lowered``, compiled in the background: the
    tools' compile options (``compiler_options``) leave it as it is, and halve the
    compile."""
    options = compiler_options()  # asked here: its one probe compile is not in the thread

    def temp() -> int:
        analysis = lowered.compile(options).memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)

    return _TEMPS.submit(temp)


def _name(dtype: Any) -> str:
    return dtype if isinstance(dtype, str) else str(np.dtype(dtype))


def _float8_format(value: Any) -> np.dtype | None:
    """The float8 format ``value`` names (``jnp.float8_e4m3fn``, ``"float8_e5m2"``), or
    None."""
    if hasattr(value, "shape"):  # an array is no dtype (check_dtype says so)
        return None
    try:
        dtype = np.dtype(value.strip().lower() if isinstance(value, str) else value)
    except Exception:  # NumPy reads some strings as code, some objects as structures
        return None
    return dtype if dtype in FLOAT8_ANY else None


def _recipe_dtype(value: Any) -> Any:
    """``value`` as ``jamp.autocast`` reads it: ``"float8"`` (its float8 mode, in any
    case), or bfloat16 or float16 given as a dtype or by one of the names autocast takes
    (``"bf16"``, ``"bfloat16"``, ``"float16"``, ``"half"``...); anything else is a
    ``ValueError`` naming ``dtype``."""
    if is_float8_mode(value):
        return FLOAT8_MODE
    expected = (
        "Expected `dtype` to be jnp.bfloat16, jnp.float16 (or a name jamp.autocast takes, "
        "such as 'bfloat16' or 'bf16'), 'float8' or a list of them"
    )
    float8 = _float8_format(value)
    if float8 is not None:
        raise ValueError(
            f"{expected}, got the float8 format {float8.name}: a step cannot run in float8 "
            "alone. Write dtype='float8' for jamp.autocast's float8 mode (matrix products in "
            "float8, scaled per tensor: e4m3 forward, e5m2 backward)."
        )
    try:
        dtype = check_dtype(value, "`dtype`")
    except (TypeError, ValueError) as e:
        raise ValueError(f"{expected}, got {value!r:.80}: {e}") from None
    if dtype not in HALF:
        raise ValueError(f"{expected}, got {dtype.name}.")
    return dtype


def precision_report(
    fun: Callable,
    *args: Any,
    dtype: Any = jnp.bfloat16,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    top: int = 12,
) -> PrecisionReport:
    """Where low precision loses accuracy in a step: each operation under ``jamp.autocast``
    against float32, on the same inputs.

    Runs ``jax.value_and_grad(jamp.autocast(fun, dtype))`` on ``args`` one operation at
    a time, and beside it the same program with every low-precision dtype widened to
    float32, which is the float32 step exactly (conversions become identities). For
    each operation of the forward and the backward pass it reports the user's source
    line and module path, the pass (for a product of the backward pass, which operand's
    gradient), the relative error against float32 (everything before it included), the
    error it adds itself, the fraction of float32-nonzero values it flushes to zero,
    the infinities it makes, and for a quantisation to float8 its amax, scale and
    saturated fraction. Rows are sorted worst first. Each parameter gradient's error,
    leaf by leaf, and the temp memory of the float32 and the autocast step's compiled
    programs come beside them. A ``scan``'s rows are its body's operations, each over all
    its iterations (``Row.loops``). Both runs are one compiled program (``Chunked``), which
    returns each operation's values; the figures are summed from them on the host, so
    the program is the step's size, twice or three times over, and compiles in a few
    times the step's own compile (``python -m benchmarks debug-cost``).

    Args:
      fun: the loss, as ``jax.value_and_grad`` takes it (float32 arithmetic: autocast
        is applied here).
      *args: its arguments.
      dtype: ``jnp.bfloat16``, ``jnp.float16`` (or a name ``jamp.autocast`` takes:
        ``"bfloat16"``, ``"bf16"``, ``"float16"``...), ``"float8"`` (autocast's float8
        mode), or a list of them to compare recipes side by side. A float8 format
        (``jnp.float8_e4m3fn``) is refused: write ``"float8"``.
      argnums: the arguments to differentiate (default 0); has_aux: as in jax.
      top: how many rows ``str(report)`` prints per recipe.

    Returns:
      A [`PrecisionReport`][jamp.debug.PrecisionReport]: ``print`` it, or read its
      ``rows`` and ``gradients``.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> def loss(w, x):
      ...     return jnp.sum(x @ w) * 2.0**-26
      >>> w, x = jnp.ones((4, 2)), jnp.ones((8, 4))
      >>> report = jamp.debug.precision_report(loss, w, x, dtype=jnp.float16)
      >>> worst = report.rows[0]
      >>> worst.primitive, worst.backward, worst.underflow
      ('convert_element_type', True, 1.0)
    """
    if not callable(fun):
        raise TypeError(f"Expected `fun` to be callable, got {type(fun).__name__} instead.")
    dtypes = list(dtype) if isinstance(dtype, (list, tuple)) else [dtype]
    if not dtypes:
        raise ValueError("Expected `dtype` to name at least one recipe, got an empty list.")
    chosen = [_recipe_dtype(d) for d in dtypes]
    step = jax.jit(jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux))
    with a_loss():
        temp = _temp_of(step.lower(*args))
    recipes = tuple(_recipe(fun, args, d, argnums, has_aux) for d in chosen)
    return PrecisionReport(recipes, temp.result(), top)
