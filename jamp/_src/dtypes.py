"""jamp's dtype vocabulary: the sets of dtypes its modules read, and the one parser of a
dtype argument.

Three families of names, each defined once:

- the dtypes autocast moves values between (``ELIGIBLE``) and the half-precision ones
  (``HALF``: autocast's low dtypes, the optimizer's narrow parameters and moments);
- float8: the two formats jamp computes and stores in (``E4M3`` forward, ``E5M2``
  backward: ``FLOAT8``), and every float8 format a traced program may hold
  (``FLOAT8_ANY``, which ``precision_report`` widens with the half ones: ``LOW``);
- the string ``"float8"`` (``FLOAT8_MODE``), autocast's and ``precision_report``'s
  ``dtype`` argument for float8 products, which names a recipe, not a dtype.

``check_dtype`` is the parser every entry point that takes a dtype argument reads
(``Policy``, ``parse_dtype``, ``get_policy``, ``jamp.autocast``'s ``dtype``): a value that
is not a dtype, or a non-floating dtype (``jnp.int32``, ``"int32"``), raises
``TypeError``; a name that is no dtype (``"fp8"``) or an unsupported floating dtype
(``"float8_e5m2"``) raises ``ValueError``. Supported are float16, bfloat16, float32 and
float64.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

BFLOAT16 = np.dtype(jnp.bfloat16)
FLOAT16 = np.dtype(jnp.float16)
FLOAT32 = np.dtype(jnp.float32)
FLOAT64 = np.dtype(jnp.float64)

# The half-precision dtypes: autocast's low dtypes, the optimizer's narrow parameters and
# stored moments. In this order (bfloat16 first) where they are listed.
HALF = (BFLOAT16, FLOAT16)
# The dtypes autocast moves a floating value between: never in or out of this set.
ELIGIBLE = frozenset({FLOAT16, BFLOAT16, FLOAT32})

E4M3 = np.dtype(jnp.float8_e4m3fn)  # float8 operands (the forward pass)
E5M2 = np.dtype(jnp.float8_e5m2)  # float8 gradients (the backward pass)
# The float8 formats jamp computes and stores in (products, block-scaled optimizer moments).
FLOAT8 = (E4M3, E5M2)
# Every float8 format a traced program may hold.
FLOAT8_ANY = frozenset(
    np.dtype(d)
    for d in (
        jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz,
        jnp.float8_e4m3b11fnuz,
    )
)  # fmt: skip
# The low-precision dtypes of a traced program: half and float8 (precision_report's widened).
LOW = frozenset(HALF) | FLOAT8_ANY

FLOAT8_MODE = "float8"  # autocast's and precision_report's dtype argument of float8 products


def is_float8_mode(dtype: object) -> bool:
    """Whether a ``dtype`` argument asks for float8 products (``"float8"``, any case)."""
    return isinstance(dtype, str) and dtype.strip().lower() == FLOAT8_MODE


def half_dtype() -> np.dtype:
    """The 16-bit floating dtype of the default backend.

    Returns:
      ``bfloat16`` on TPU, ``float16`` everywhere else (as jmp's ``half``).

    Examples:
      >>> import jax.numpy as jnp, jamp
      >>> jamp.compat.half_dtype() in (jnp.float16, jnp.bfloat16)
      True
    """
    return np.dtype(jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16)


# Short and long names accepted wherever a dtype is expected. "half" is
# resolved at call time (it depends on the default backend).
NAMES: dict[str, DTypeLike | None] = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "f32": jnp.float32,
    "float32": jnp.float32,
    "full": jnp.float32,
    "f64": jnp.float64,
    "float64": jnp.float64,
    "half": None,  # float16, or bfloat16 on TPU
}

# The dtypes a policy may hold. float8 and narrower formats need per-tensor
# scaling that a policy does not do, so they are rejected rather than silently
# used; jamp.autocast(fun, "float8") does it for matrix products.
SUPPORTED = (FLOAT16, BFLOAT16, FLOAT32, FLOAT64)
_SUPPORTED_NAMES = ", ".join(d.name for d in SUPPORTED)


def describe(value: object) -> str:
    if isinstance(value, str):
        return f"{value!r:.80}"
    return f"{value!r:.80} (type {type(value).__name__})"


def named(text: str) -> np.dtype | None:
    """The dtype a string names, or None.

    The short names above, or a dtype's full name (``"int32"``,
    ``"float8_e5m2"``); NumPy's codes and aliases (``"f4"``, ``"p"``) are not
    names.
    """
    key = text.strip().lower()
    if key in NAMES:
        found = NAMES[key]
        return half_dtype() if found is None else np.dtype(found)
    try:
        with warnings.catch_warnings():  # NumPy deprecates some one-letter aliases
            warnings.simplefilter("ignore")
            dtype = np.dtype(key)
    except Exception:  # NumPy parses some strings as code: "," is a SyntaxError
        return None
    return dtype if dtype.name == key else None


def check_dtype(value: Any, what: str) -> np.dtype:
    """A supported floating ``np.dtype`` from a dtype-like or a name, with ``what`` (e.g.
    "`dtype`") naming the argument in messages.

    One rule for every entry point: a value that is not a dtype at all, or a
    non-floating dtype (given as an object or by name, e.g. ``'int32'``), is a
    ``TypeError``; a string naming no dtype (``'fp8'``) or a floating dtype
    jamp does not support (``float8_e4m3fn``) is a ``ValueError``.
    """
    dtype = None
    if isinstance(value, str):
        dtype = named(value)
        if dtype is None:
            raise ValueError(
                f"Expected a dtype name for {what}, one of {sorted(NAMES)} (or a dtype "
                f"such as jnp.bfloat16), got {value!r:.80} instead."
            )
    elif isinstance(value, (np.ndarray, np.generic, jax.Array)):
        # np.dtype reads an array's `dtype` attribute: an array is not a dtype.
        raise TypeError(
            f"Expected a floating dtype for {what} (such as jnp.bfloat16), got an array of "
            f"dtype {np.dtype(value.dtype).name} and shape {np.shape(value)} instead; pass "
            "its dtype, `x.dtype`, if that is what you mean."
        )
    elif not (isinstance(value, bool) or value is None):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dtype = np.dtype(value)
        except Exception:  # a dict or a list is parsed as a structured dtype
            dtype = None
    if dtype is None:
        raise TypeError(
            f"Expected a floating dtype for {what} (such as jnp.bfloat16, jnp.float16, "
            f"jnp.float32, or one of {sorted(NAMES)}), got {describe(value)} instead."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"Expected a floating dtype for {what} (such as jnp.bfloat16, jnp.float16 or "
            f"jnp.float32), got {dtype.name} instead. Integer, boolean and complex dtypes "
            "cannot be used for mixed precision."
        )
    if dtype not in SUPPORTED:
        raise ValueError(
            f"Expected one of {_SUPPORTED_NAMES} for {what}, got {dtype.name} instead. "
            "Narrower floating formats such as float8 need per-tensor scaling, which jamp's "
            "policies do not do; for float8 matrix products, jamp.autocast(fun, 'float8') "
            "scales per tensor."
        )
    return dtype
