"""Which leaf overflowed: on-device counts, asynchronous logging, and metrics for loggers."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.tree_util import KeyPath
from jax.typing import ArrayLike

from jamp._src.leaves import FLOAT, is_sharded, leaf_kind, selected
from jamp._src.types import Filter, PyTree
from jamp._src.validate import check_filter

logger = logging.getLogger("jamp")


class NonfiniteCount(NamedTuple):
    """Per-leaf counts of non-finite entries (int32 scalars on device)."""

    inf: jax.Array
    nan: jax.Array


# Leaves larger than this are counted a chunk at a time: XLA:CPU reduces a
# whole leaf through an int32 copy of it, which doubled a step's temporary
# memory (allocated on every call, whether the report runs or not).
_CHUNK = 1 << 16
_MAX_OFFSET = 2**31 - 1  # an element offset is an int32


def _count_flat(v: jax.Array) -> NonfiniteCount:
    inf = jnp.isinf(v)
    if jnp.issubdtype(v.dtype, jnp.complexfloating):
        inf = inf & jnp.logical_not(jnp.isnan(v))  # inf+nanj is one entry, counted as nan
    return NonfiniteCount(
        inf=jnp.sum(inf, dtype=jnp.int32),
        nan=jnp.sum(jnp.isnan(v), dtype=jnp.int32),
    )


Transform = Callable[[jax.Array], jax.Array] | None


def _count(
    path: KeyPath, leaf: object, transform: Transform = None, fn: str = "debug.nonfinite_report"
) -> NonfiniteCount:
    """The counts of ``transform(leaf)``, applied a chunk at a time (never to the whole leaf)."""
    if leaf_kind(path, leaf, fn) != FLOAT:
        zero = jnp.zeros((), jnp.int32)
        return NonfiniteCount(zero, zero)
    f = transform or (lambda v: v)
    leaf = jnp.asarray(leaf)
    if is_sharded(leaf):
        # JAX's explicit sharding mode: flattening or slicing a sharded
        # dimension is a type error. Each device reduces its own shard.
        return _count_flat(f(leaf))
    flat = leaf.ravel()
    full, rest = divmod(flat.size, _CHUNK)
    if full <= 1:
        return _count_flat(f(flat))
    if rest == 0:
        # A view of whole chunks (no copy), indexed by chunk: no element
        # offset, which would pass int32 in a leaf of 2**31 elements or more.
        chunks = flat.reshape(full, _CHUNK)
        chunk_at = lambda i: lax.dynamic_index_in_dim(chunks, i, 0, keepdims=False)  # noqa: E731
    elif flat.size <= _MAX_OFFSET:
        chunk_at = lambda i: lax.dynamic_slice(flat, (i * _CHUNK,), (_CHUNK,))  # noqa: E731
    else:
        # Element offsets would pass int32, and a view of the whole chunks
        # would be a copy: one reduction over the whole leaf instead.
        return _count_flat(f(flat))

    def add(i: jax.Array, c: NonfiniteCount) -> NonfiniteCount:
        return jax.tree.map(jnp.add, c, _count_flat(f(chunk_at(i))))

    # The first chunk starts the carry, so under shard_map it varies like the leaf.
    c = lax.fori_loop(1, full, add, _count_flat(f(flat[:_CHUNK])))
    if rest:
        c = jax.tree.map(jnp.add, c, _count_flat(f(flat[full * _CHUNK :])))
    return c


def nonfinite_report(tree: PyTree, *, filter: Filter = None) -> PyTree:
    """Per leaf of ``tree``, how many entries are inf and how many are NaN.

    Computed on device (no host sync); use it in a jitted step and log it, or
    let [`log_nonfinite`][jamp.debug.log_nonfinite] do that only on the steps that overflow.

    Args:
      tree: any pytree of arrays.
      filter: a predicate on leaves, such as ``eqx.is_inexact_array``: only
        the leaves it selects are counted; the others, whatever they are (an
        Equinox module's functions), become ``None`` in the report, as
        ``eqx.filter`` leaves them. By default every leaf must be an array or
        a number.

    Returns:
      A pytree of the same structure with a [`NonfiniteCount`][jamp.debug.NonfiniteCount] (int32
      scalars ``inf`` and ``nan``) in place of each array leaf; non-floating
      leaves count 0, ``None`` stays ``None``.

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> r = jamp.debug.nonfinite_report({"w": jnp.array([1.0, jnp.inf, jnp.nan, -jnp.inf])})
      >>> int(r["w"].inf), int(r["w"].nan)
      (2, 1)
    """
    check_filter(filter, "debug.nonfinite_report")
    return _report(tree, filter=filter)


def _report(
    tree: PyTree,
    transform: Transform = None,
    filter: Filter = None,
    fn: str = "debug.nonfinite_report",
) -> PyTree:
    def one(path: KeyPath, leaf: object) -> NonfiniteCount | None:
        return _count(path, leaf, transform, fn) if selected(filter, leaf) else None

    return jax.tree_util.tree_map_with_path(one, tree)


def _path_name(path: KeyPath) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def _emit(
    prefix: str, names: tuple[str, ...], members: np.ndarray, infs: np.ndarray, nans: np.ndarray
) -> None:
    """One log line per firing member: one line, unless the report ran under ``vmap``.

    ``members`` (bool, the ``vmap`` axes' shape, ``()`` outside ``vmap``) says
    which members to log; ``infs`` and ``nans`` have those axes in front.
    """
    members, infs, nans = np.asarray(members), np.asarray(infs), np.asarray(nans)
    for idx in np.ndindex(members.shape):
        if not members[idx]:
            continue
        parts = [
            f"{name}: {int(i)} inf, {int(n)} nan"
            for name, i, n in zip(names, infs[idx], nans[idx], strict=True)
            if int(i) or int(n)
        ]
        member = f"vmap member {idx[0] if len(idx) == 1 else idx}: " if idx else ""
        if parts:
            logger.warning("%s%snon-finite values in %s", prefix, member, "; ".join(parts))


def _sender(prefix: str, names: tuple[str, ...]) -> Callable[..., jax.Array]:
    """``send(fire, members, infs, nans)``: call back to the host only if ``fire``.

    Under ``vmap`` a ``lax.cond`` on a batched predicate becomes a select that
    runs both branches, so the callback would run on every step, once per
    member. Here a batched call fires once, only if any member does, with
    every member's counts; nested ``vmap``s recurse.
    """

    @jax.custom_batching.custom_vmap
    def send(fire: jax.Array, members: jax.Array, infs: jax.Array, nans: jax.Array) -> jax.Array:
        def callback() -> None:
            jax.debug.callback(functools.partial(_emit, prefix, names), members, infs, nans)

        lax.cond(fire, callback, lambda: None)
        return fire

    @send.def_vmap
    def _batched(
        axis_size: int, in_batched: list[bool], *args: jax.Array
    ) -> tuple[jax.Array, bool]:
        args = tuple(
            a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, b in zip(args, in_batched, strict=True)
        )
        fire, members, infs, nans = args
        out = send(jnp.any(fire), members, infs, nans)
        return jnp.broadcast_to(out, (axis_size,)), True

    return send


def log_nonfinite(
    tree: PyTree,
    *,
    every: int = 1,
    count: ArrayLike | None = None,
    prefix: str = "",
    filter: Filter = None,
) -> jax.Array:
    """Log the paths of leaves holding inf/NaN, only on steps that have them.

    Inside a jitted step, the counts are computed on device and, only when a
    leaf is non-finite, sent to Python's ``logging`` (logger ``"jamp"``,
    level WARNING) through an asynchronous ``jax.debug.callback``, e.g.
    ``params/Dense_3/kernel: 12 inf, 0 nan``. Clean steps never call back to
    the host, but they are not free: one pass over each leaf (a chunk of 2**16
    elements at a time for large leaves, so no copy of it is made), and, because
    the compiled step now contains a host callback, JAX dispatches it through
    its slower Python path instead of the C++ fast path (a fixed ~0.4 ms per
    call on this project's CPU benchmarks; see ``benchmarks/RESULTS.md``).

    Args:
      tree: the gradients (or any pytree of arrays).
      every: log only every ``every``-th overflow, counted by ``count``.
      count: an int scalar (e.g. ``opt_state.skipped_steps``) numbering the
        overflows; required when ``every > 1``.
      prefix: text put in front of the message (a model name, ``"grads: "``);
        a str, fixed when the function is traced.
      filter: a predicate on leaves, such as ``eqx.is_inexact_array``: only
        the leaves it selects are counted (see [`nonfinite_report`][jamp.debug.nonfinite_report]).

    Returns:
      A bool scalar: whether the tree was all finite.

    Examples:
      >>> import jax, jax.numpy as jnp, jamp
      >>> finite = jax.jit(jamp.debug.log_nonfinite)({"w": jnp.ones(2)})
      >>> bool(finite)
      True
    """
    if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= 2**31 - 1:
        shown = every if not isinstance(every, int) or abs(every) < 10**20 else "<20+ digits>"
        raise ValueError(
            f"Expected `every` to be an int >= 1, got every={shown!r:.60} instead (at most "
            "2**31 - 1: it divides an int32 count)."
        )
    if every > 1 and count is None:
        raise ValueError("Expected `count` (an int scalar numbering overflows) when `every` > 1.")
    if count is not None:
        _check_count(count)
    if not isinstance(prefix, str):
        raise TypeError(
            f"Expected `prefix` to be a str, got {type(prefix).__name__} instead; a traced step "
            "number cannot go into it (log it with jamp.metrics, or count=/every=)."
        )
    check_filter(filter, "debug.log_nonfinite")
    return log_counts(tree, every=every, count=count, prefix=prefix, filter=filter)


def _check_count(count: ArrayLike) -> None:
    """``count`` must be an integer scalar: a Python int or an integer 0-d array."""
    if isinstance(count, int) and not isinstance(count, bool):
        if not -(2**31) <= count <= 2**31 - 1:
            raise ValueError(
                f"Expected `count` to fit in an int32, got count={count!r:.40} instead."
            )
        return
    dtype = getattr(count, "dtype", None)
    if dtype is None or not np.issubdtype(np.dtype(dtype), np.integer):
        raise TypeError(
            "Expected `count` to be an integer scalar numbering the overflows (such as "
            f"opt_state.skipped_steps), got {count!r:.60} (type {type(count).__name__}) instead."
        )
    if np.shape(count) != ():
        raise ValueError(
            "Expected `count` to be a scalar (such as opt_state.skipped_steps), got an array of "
            f"shape {np.shape(count)} instead."
        )


def log_counts(
    tree: PyTree,
    *,
    every: int = 1,
    count: ArrayLike | None = None,
    prefix: str = "",
    transform: Transform = None,
    filter: Filter = None,
) -> jax.Array:
    """[`jamp.debug.log_nonfinite`][] of ``transform`` applied to each leaf, chunk by chunk."""
    report = _report(tree, transform, filter, "debug.log_nonfinite")
    flat, _ = jax.tree_util.tree_flatten_with_path(
        report, is_leaf=lambda x: isinstance(x, NonfiniteCount)
    )
    flat = [(p, c) for p, c in flat if isinstance(c, NonfiniteCount)]
    if not flat:
        return jnp.asarray(True)
    names = tuple(_path_name(p) for p, _ in flat)
    infs = jnp.stack([c.inf for _, c in flat])
    nans = jnp.stack([c.nan for _, c in flat])
    bad = jnp.any((infs + nans) > 0)
    fire = bad
    if every > 1:
        fire = fire & (jnp.asarray(count) % every == 0)

    _sender(prefix, names)(fire, fire, infs, nans)
    return jnp.logical_not(bad)
