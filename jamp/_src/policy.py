"""Mixed-precision policies: which dtype parameters, computation and outputs use.

A [`Policy`][jamp.Policy] is three dtypes and three cast helpers. It is a frozen,
hashable dataclass (so it can be a static argument of ``jax.jit`` or a field
of a Flax module) and is built either directly or from a short string with
[`get_policy`][jamp.compat.get_policy], using jmp's grammar::

    "params=float32,compute=bfloat16,output=float32"
    "p=f32,c=bf16,o=f32"          # short keys and dtype names
    "c=f16"                       # missing parts: params float32,
                                  # compute follows params, output follows compute
    "bf16"                        # a bare dtype sets all three
    "half" / "full"               # float16 (bfloat16 on TPU) / float32 everywhere
    "mixed_float16"               # p=f32,c=f16,o=f32
    "mixed_bfloat16"              # p=f32,c=bf16,o=f32

Unlike jmp, every input is validated when the policy is built, with a message
that names the argument and lists what is accepted. The same rule holds for
every entry point (``parse_dtype``, ``Policy``, ``get_policy`` and
``jamp.autocast``'s ``dtype``): a value that is not a dtype, or a non-floating
dtype (``jnp.int32``, ``"int32"``), raises ``TypeError``; a name that is no
dtype (``"fp8"``) or an unsupported floating dtype (``"float8_e5m2"``) raises
``ValueError``. Supported are float16, bfloat16, float32 and float64.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jamp._src.dtypes import NAMES, check_dtype, describe, half_dtype, named
from jamp._src.types import PyTree

__all__ = ["Policy", "get_policy", "half_dtype", "parse_dtype"]

_KEYS = {
    "p": "param_dtype",
    "param": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}

_NAMED_POLICIES = {
    "mixed_float16": "p=f32,c=f16,o=f32",
    "mixed_bfloat16": "p=f32,c=bf16,o=f32",
}


def parse_dtype(value: DTypeLike, argname: str = "dtype") -> np.dtype:
    """A supported floating ``np.dtype`` from a dtype-like or one of the short names.

    Supported are float16, bfloat16, float32 and float64, given as dtypes
    (``jnp.bfloat16``, ``np.dtype("float32")``, ...) or by the names below.

    Args:
      value: a dtype or a name: ``bf16``/``bfloat16``, ``f16``/``float16``,
        ``f32``/``float32``/``full``, ``f64``/``float64`` or ``half``
        (float16, or bfloat16 on TPU). Case and surrounding spaces are ignored.
      argname: the argument name used in error messages.

    Returns:
      The ``np.dtype``.

    Raises:
      TypeError: ``value`` is not a dtype (``None``, ``3``, ...), or is a
        non-floating dtype, given as an object or a name (``jnp.int32``,
        ``"int32"``, ``jnp.complex64``).
      ValueError: ``value`` is a string that names no dtype (``"fp8"``), or a
        floating dtype other than the four supported (``"float8_e5m2"``,
        ``jnp.float8_e4m3fn``).

    Examples:
      >>> import jamp
      >>> jamp.compat.parse_dtype("bf16")
      dtype(bfloat16)
    """
    return check_dtype(value, f"`{argname}`")


def _cast_tree(tree: PyTree, dtype: np.dtype) -> PyTree:
    """Casts the floating array leaves of ``tree`` to ``dtype``; others untouched."""

    def cast(leaf: object) -> object:
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
            leaf.dtype, jnp.floating
        ):
            return leaf if leaf.dtype == dtype else leaf.astype(dtype)
        return leaf

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """The dtypes of parameters, of computation and of outputs.

    A frozen, hashable dataclass: use it as a static argument or a module
    field. The constructor validates and normalises its arguments to
    ``np.dtype``; [`get_policy`][jamp.compat.get_policy] builds one from a string.

    The cast helpers act on every floating array leaf of a pytree (``float16``,
    ``bfloat16``, ``float32``, ``float64``, ...). Integer, boolean and complex
    leaves, ``None`` and non-array leaves such as Python numbers are returned
    unchanged.

    Attributes:
      param_dtype: the dtype parameters are stored in.
      compute_dtype: the dtype computation runs in (the low-precision dtype of
        [`jamp.autocast`][]).
      output_dtype: the dtype of a function's floating outputs.
      reduce_dtype: the dtype [`jamp.autocast`][] makes the gradient of a parameter
        that a half product reads in, and so the dtype XLA sums it in across devices
        under FSDP or data parallelism (PyTorch FSDP2's ``reduce_dtype``): ``None``
        (the default) for float32 in a sharded program, ``float32`` everywhere, or
        ``compute_dtype`` to sum in half precision, for bandwidth
        (``docs/scaling-out.md``).

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> policy = jamp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
      >>> print(policy)
      p=float32,c=bfloat16,o=float32
      >>> policy.cast_to_compute({"w": jnp.ones(2), "step": jnp.int32(3)})["w"].dtype
      dtype(bfloat16)
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype
    reduce_dtype: np.dtype | None = None

    if TYPE_CHECKING:  # the constructor takes any dtype-like; __post_init__ makes it np.dtype

        def __init__(
            self,
            param_dtype: DTypeLike,
            compute_dtype: DTypeLike,
            output_dtype: DTypeLike,
            reduce_dtype: DTypeLike | None = None,
        ) -> None: ...

    def __post_init__(self) -> None:
        # Policy is static metadata, never a pytree node, so validating here is
        # safe (JAX never rebuilds it with placeholders).
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, parse_dtype(getattr(self, field), field))
        if self.reduce_dtype is not None:
            object.__setattr__(self, "reduce_dtype", parse_dtype(self.reduce_dtype, "reduce_dtype"))

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Casts the floating leaves of ``tree`` to ``param_dtype``."""
        return _cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Casts the floating leaves of ``tree`` to ``compute_dtype``."""
        return _cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Casts the floating leaves of ``tree`` to ``output_dtype``."""
        return _cast_tree(tree, self.output_dtype)

    def with_output_dtype(self, output_dtype: DTypeLike) -> Policy:
        """A copy of this policy with another ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        text = f"p={self.param_dtype.name},c={self.compute_dtype.name},o={self.output_dtype.name}"
        return text if self.reduce_dtype is None else f"{text},r={self.reduce_dtype.name}"


def get_policy(spec: str | Policy) -> Policy:
    """Builds a [`Policy`][jamp.Policy] from a string such as ``"p=f32,c=bf16,o=f32"``.

    The grammar is jmp's. The string is a comma-separated list of
    ``key=dtype`` parts with keys ``params``/``param``/``p``,
    ``compute``/``c`` and ``output``/``o``; dtypes are spelled ``bfloat16``/
    ``bf16``, ``float16``/``f16``, ``float32``/``f32``/``full``,
    ``float64``/``f64`` or ``half`` (float16, or bfloat16 on TPU). Missing
    parts default to: params ``float32``, compute follows params, output
    follows compute. A bare dtype (``"bf16"``, ``"half"``, ``"full"``) sets all
    three. ``"mixed_float16"`` and ``"mixed_bfloat16"`` keep parameters and
    outputs in float32 and compute in the 16-bit dtype. Spaces and case are
    ignored.

    Args:
      spec: the policy string, or a [`Policy`][jamp.Policy] (returned unchanged).

    Returns:
      The [`Policy`][jamp.Policy].

    Raises:
      TypeError: ``spec`` is neither a string nor a ``Policy``, or it names a
        non-floating dtype (``"c=int32"``), as [`jamp.compat.parse_dtype`][] does.
      ValueError: an unknown key or dtype name (``"c=fp8"``), a floating dtype
        other than float16, bfloat16, float32 and float64
        (``"c=float8_e5m2"``), a repeated key, or an empty string; the
        message lists the valid names.

    Examples:
      >>> import jamp
      >>> print(jamp.compat.get_policy("params=float32,compute=bfloat16,output=float32"))
      p=float32,c=bfloat16,o=float32
      >>> print(jamp.compat.get_policy("c=f16"))
      p=float32,c=float16,o=float16
      >>> print(jamp.compat.get_policy("mixed_bfloat16"))
      p=float32,c=bfloat16,o=float32
    """
    return parse_policy(spec, "spec")


def parse_policy(spec: str | Policy, argname: str) -> Policy:
    """[`get_policy`][jamp.compat.get_policy], naming the argument ``argname`` in its messages."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            "Expected a policy string such as 'p=f32,c=bf16,o=f32' or a jamp.Policy for "
            f"`{argname}`, got {describe(spec)} instead."
        )
    text = spec.replace(" ", "").lower()
    text = _NAMED_POLICIES.get(text, text)
    valid_dtypes = sorted(NAMES)
    valid_policies = sorted(_NAMED_POLICIES)

    def dtype_of(name: str, what: str) -> np.dtype:
        return check_dtype(name, f"{what} in policy {spec!r:.80}")

    if not text:
        raise ValueError(
            f"Expected a non-empty policy string for `{argname}` such as 'p=f32,c=bf16,o=f32', "
            f"one of {valid_policies}, or a dtype name in {valid_dtypes}, got {spec!r} instead."
        )
    if "=" not in text and "," not in text:
        if named(text) is None:
            raise ValueError(
                f"Expected a policy string for `{argname}` such as 'p=f32,c=bf16,o=f32', a named "
                f"policy in {valid_policies} or a dtype name in {valid_dtypes}, got {spec!r:.80} "
                "instead."
            )
        dtype = dtype_of(text, "the dtype")
        return Policy(dtype, dtype, dtype)

    found: dict[str, np.dtype] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(
                f"Expected 'key=dtype' parts (keys {sorted(_KEYS)}) in policy {spec!r:.80} "
                f"(`{argname}`), got "
                f"{part!r} instead. A bare dtype is only allowed on its own, e.g. 'bf16'."
            )
        if key not in _KEYS:
            raise ValueError(
                f"Expected a policy key, one of {sorted(_KEYS)}, in policy {spec!r:.80} "
                f"(`{argname}`), got "
                f"{key!r} instead."
            )
        field = _KEYS[key]
        if field in found:
            raise ValueError(
                f"Expected each of params, compute and output at most once in policy "
                f"{spec!r:.80} (`{argname}`), got {field.removesuffix('_dtype')} twice instead."
            )
        found[field] = dtype_of(value, field)
    param = found.get("param_dtype", np.dtype(jnp.float32))
    compute = found.get("compute_dtype", param)
    output = found.get("output_dtype", compute)
    return Policy(param, compute, output)
