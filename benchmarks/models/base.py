"""The shared pieces of the benchmarks' models: :class:`Model` (float32 parameters, a
batch and a loss), the data and the losses, the dtypes and the dropout key."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

F32, BF16 = jnp.float32, jnp.bfloat16
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
DROPOUT_KEY = 7  # every dropout mask of a measured step comes from jax.random.key(7)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Model:
    """Float32 parameters, the model state, a batch and ``loss(params, mstate, batch) -> (float32
    loss, new mstate)`` (``None`` for the optimizer step alone, whose batch is the gradients);
    ``at(dtype, param_dtype)`` is the loss of the model built with its own ``dtype=``."""

    name: str
    describe: str
    params: Any
    batch: Any
    loss: Callable | None
    mstate: Any = dataclasses.field(default_factory=dict)
    at: Callable | None = None

    @property
    def n_params(self) -> int:
        return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(self.params)))

    @property
    def n_leaves(self) -> int:
        return len(jax.tree_util.tree_leaves(self.params))

    def scalar(self, loss: Callable | None = None) -> Callable:
        """``loss`` (this model's by default) as ``(params, batch) -> float32 loss``."""
        loss = self.loss if loss is None else loss
        return lambda p, batch: loss(p, self.mstate, batch)[0]

    def scalar_at(self, *dtypes: Any) -> Callable:
        """``at(*dtypes)`` as ``(params, batch) -> float32 loss``."""
        return self.scalar(self.at(*dtypes))


def shape_f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, F32)


def normal(seed: int, *shape: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, F32)


def sequences(b: int, t: int, d: int, seed: int | None = None) -> tuple:
    """(inputs, targets) of shape ``(b, t, d)``: standard normal from the seeds ``seed``
    and ``seed + 1``, or shape structs (``seed=None``)."""
    if seed is None:
        return shape_f32(b, t, d), shape_f32(b, t, d)
    return normal(seed, b, t, d), normal(seed + 1, b, t, d)


def images(b: int, size: int, seed: int | None = None) -> tuple:
    """(``(b, size, size, 3)`` images, ``b`` labels of 10 classes) from the seeds ``seed``,
    ``seed + 1``, or shape structs (``seed=None``)."""
    if seed is None:
        return shape_f32(b, size, size, 3), jax.ShapeDtypeStruct((b,), jnp.int32)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((b, size, size, 3)), F32)
    return x, jnp.asarray(np.random.default_rng(seed + 1).integers(0, 10, (b,)), jnp.int32)


def mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(out - y))


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits = logits.astype(F32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
