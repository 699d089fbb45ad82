"""What the precision experiments measure of a loss (the hub): the bytes it saves for the
backward pass, its gradient against float32's, XLA's temp memory for its step."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def residual_groups(loss: Callable, params: Any, batch: Any) -> dict[tuple, tuple[int, int]]:
    """``{(dtype, shape, source): (count, bytes)}`` saved for the backward pass, the
    arguments excluded (``saved_residuals``), as ``jamp.debug.autocast_report`` groups them."""
    from jax._src.ad_checkpoint import saved_residuals

    out: dict[tuple, tuple[int, int]] = {}
    for aval, source in saved_residuals(loss, params, batch):
        if source.startswith("from the argument") or not hasattr(aval, "dtype"):
            continue
        key = (np.dtype(aval.dtype).name, tuple(aval.shape), source)
        count, nbytes = out.get(key, (0, 0))
        out[key] = (count + 1, nbytes + int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize)
    return out


def residual_bytes(loss: Callable, params: Any, batch: Any) -> dict[str, int]:
    """Bytes saved for the backward pass, by dtype, the arguments excluded."""
    out: dict[str, int] = {}
    for (dtype, _, _), (_, nbytes) in residual_groups(loss, params, batch).items():
        out[dtype] = out.get(dtype, 0) + nbytes
    return out


def compile_step(loss: Callable, params: Any, batch: Any) -> tuple[Callable, int]:
    """The compiled ``jax.value_and_grad`` of ``loss`` and XLA's temp bytes for it."""
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile()
    analysis = compiled.memory_analysis()
    temp = int(getattr(analysis, "temp_size_in_bytes", -1)) if analysis is not None else -1
    return compiled, temp


def flat(tree: Any) -> list[np.ndarray]:
    return [np.asarray(g, np.float64).ravel() for g in jax.tree_util.tree_leaves(tree)]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    return float(a @ b / max(na * nb, 1e-300))


def rel_err(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def grad_cosines(grads: Any, reference: Any) -> tuple[float, float]:
    """(cosine of all leaves flattened, worst single leaf's cosine).

    The worst leaf is taken among leaves whose float32 gradient has at least
    1e-3 of the largest leaf's norm: a gradient that is zero in exact
    arithmetic (attention's key bias, by softmax's shift invariance) is
    float32 rounding noise, and its cosine means nothing.
    """
    g, r = flat(grads), flat(reference)
    whole = cosine(np.concatenate(g), np.concatenate(r))
    top = max(np.linalg.norm(b) for b in r)
    worst = min(
        (cosine(a, b) for a, b in zip(g, r, strict=True) if np.linalg.norm(b) >= 1e-3 * top),
        default=whole,
    )
    return whole, worst


def finite(tree: Any) -> bool:
    return all(bool(np.all(np.isfinite(g))) for g in flat(tree))


def compare(model: Any, losses: dict[str, Callable], log: Callable[[str], None]) -> dict:
    """``name -> row`` for each ``loss(params, batch)`` on ``model``'s parameters and batch:
    the residuals by dtype, XLA's temp bytes for its step, the gradient's cosine to the first
    loss's (float32's) and its worst leaf's, whether it is finite, and the loss."""
    rows, reference = {}, None
    for name, loss in losses.items():
        t0 = time.perf_counter()
        res = residual_bytes(loss, model.params, model.batch)
        compiled, temp = compile_step(loss, model.params, model.batch)
        value, grads = compiled(model.params, model.batch)
        reference = grads if reference is None else reference
        whole, worst = grad_cosines(grads, reference)
        rows[name] = dict(name=name, residuals=res, temp=temp, cosine=whole, worst=worst,
                          finite=finite(grads), loss=float(value))  # fmt: skip
        took = time.perf_counter() - t0
        log(f"  {model.name} {name}: {sum(res.values()) / 2**20:.2f} MiB residuals, "
            f"{temp / 2**20:.1f} MiB temp, cosine {whole:.5f} ({took:.1f} s)")  # fmt: skip
    return rows
