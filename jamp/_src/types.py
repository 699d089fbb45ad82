"""jamp's type vocabulary, after optax's ``_src/base.py``.

The names say what a tree is for; statically each is as wide as a pytree of
arrays can be (a tree of arrays is not a type a checker can follow through
``jax.tree_util``), so they document an argument without constraining it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias, TypeGuard

import jax
import jax.core

PyTree: TypeAlias = Any
"""Any pytree: arrays and numbers in tuples, lists, dicts, dataclasses, modules."""

Params: TypeAlias = PyTree
"""The parameters an optimizer updates (an Equinox module, with a filter)."""

Updates: TypeAlias = PyTree
"""What an optimizer returns, to be added to the parameters (``optax.apply_updates``)."""

Grads: TypeAlias = PyTree
"""Gradients, of a scaled loss (before ``unscale``) or of the loss."""

OptState: TypeAlias = PyTree
"""An optimizer's state: Optax's, or one holding jamp's (``ScaledOptimizerState``)."""

AxisName: TypeAlias = str | tuple[str, ...]
"""The name of a ``shard_map``/``pmap`` axis, or a tuple of them."""

Filter: TypeAlias = Callable[[Any], Any] | None
"""A predicate on leaves, such as ``eqx.is_inexact_array``; ``None`` takes every leaf."""

Scalar: TypeAlias = jax.Array
"""A 0-d device array: a flag, a counter, a scale."""


def is_tracer(x: object) -> TypeGuard[jax.core.Tracer]:
    """Whether ``x`` is being traced (under ``jit``, ``grad``, ``vmap``...): it has no value to
    read, so a check of its value waits for the traced computation, or is left out."""
    return isinstance(x, jax.core.Tracer)
