"""``low_precision_state``: any Optax optimizer's floating state, stored narrower between
steps and widened before the optimizer runs to the dtypes its own ``init`` gives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jamp._src.dtypes import FLOAT8, HALF
from jamp._src.loss_scaling import checked_inner
from jamp._src.optimizer.master import (
    check_rounding,
    check_seed,
)
from jamp._src.optimizer.quantize import (
    MIN_SIZE,
    BlockQuantized,
    dequantize,
    padded_shape,
    quantize,
)
from jamp._src.optimizer.rounding import MOMENTS, random_bits, round_to, step_key
from jamp._src.types import OptState, Params, Updates
from jamp._src.validate import (
    check_counter,
    check_own_state,
    check_state_matches,
    diagnosing,
    refuse_counter,
)

# The fields of Optax's states that hold squares (positive, spanning many decades): their
# 8-bit and float8 codes never round a positive value to zero.
POSITIVE_FIELDS = frozenset(
    {"nu", "nu_max", "sum_of_squares", "v", "v_row", "v_col", "e_g", "e_x", "grad_sq"}
)
_KINDS = (
    "jnp.bfloat16, jnp.float16, '8bit' (block-quantised), jnp.float8_e4m3fn or "
    "jnp.float8_e5m2 (block-scaled)"
)


class LowPrecisionState(NamedTuple):
    """The state of [`jamp.low_precision_state`][]. Field names are unique, for
    ``optax.tree.get``.

    Attributes:
      stored_state: the wrapped optimizer's state with each chosen field stored
        narrower: a bfloat16 or float16 array, or a
        ``jamp.optimizer.BlockQuantized`` (8-bit codes or float8, blocks of 256 with
        a float32 absmax each).
      storage_count: uint32 scalar, the steps stored so far (the stochastic
        rounding's counter); ``None`` with ``rounding="nearest"``.
    """

    stored_state: OptState
    storage_count: jax.Array | None


def _param_paths(params: object) -> frozenset[tuple[object, ...]]:
    """The key paths of ``params``' leaves: where each sits inside a per-parameter field."""
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: x is None)[0]
    return frozenset(tuple(path) for path, _ in leaves)


def _names(path: jax.tree_util.KeyPath, params: frozenset[tuple[object, ...]]) -> list[str]:
    """The field names (a NamedTuple's fields, a dict's keys) on ``path`` above the
    parameters' own keys, outermost first."""
    path = tuple(path)
    for start in range(len(path) + 1):
        if path[start:] in params:
            path = path[:start]
            break
    names = (getattr(entry, "name", getattr(entry, "key", None)) for entry in path)
    return [name for name in names if isinstance(name, str)]


def _field(
    path: jax.tree_util.KeyPath, dtypes: Mapping[str, object], params: frozenset[tuple[object, ...]]
) -> str | None:
    """The state field ``dtypes`` chooses on ``path`` (a NamedTuple's field, a dict's key),
    or None. The names are read above the parameters' own keys: a parameter named ``nu``
    inside adam's ``mu`` is in ``mu``, and one named ``trace`` in MultiSteps'
    ``acc_grads`` is in no chosen field."""
    for name in reversed(_names(path, params)):
        if name in dtypes:
            return name
    return None


def _is_floating(x: object) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _check_fields_exist(state: OptState, dtypes: Mapping[str, object], params: frozenset) -> None:
    """A ValueError naming each field of ``dtypes`` that holds no floating leaf of
    ``state`` (a misspelt name, or adam's names around momentum's ``trace``), and the
    floating fields ``state`` has: such a field would stay float32 without a word."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    on_paths = [_names(path, params) for path, x in leaves if _is_floating(x)]
    missing = [name for name in dtypes if not any(name in names for names in on_paths)]
    if not missing:
        return
    fields = sorted({names[-1] for names in on_paths if names})
    has = (
        f"the floating fields of its state are {', '.join(map(repr, fields))}"
        if fields
        else "its state has no floating field to store"
    )
    raise ValueError(
        f"`jamp.low_precision_state` expected each field `dtypes` names to hold floating "
        f"state of `inner`, got {', '.join(map(repr, missing))}, which "
        f"{'match' if len(missing) > 1 else 'matches'} none: {has} (optax.adam's are 'mu' "
        "and 'nu', momentum's 'trace'). Name those fields, or leave this wrapper out."
    )


def _check_dtypes(dtypes: object) -> dict[str, object]:
    if not isinstance(dtypes, Mapping) or not dtypes:
        raise TypeError(
            "Expected `dtypes` to be a non-empty dict from a state field's name to how it is "
            f'stored (e.g. {{"mu": jnp.bfloat16, "nu": "8bit"}}), got {dtypes!r:.80} instead.'
        )
    out: dict[str, object] = {}
    for name, kind in dtypes.items():
        if not isinstance(name, str):
            raise TypeError(f"Expected `dtypes`' keys to be field names (str), got {name!r}.")
        if kind == "8bit":
            out[name] = "8bit"
            continue
        try:
            dtype = jnp.dtype(cast(jnp.dtype, kind))
        except TypeError:
            dtype = None
        if dtype not in HALF + FLOAT8:
            raise ValueError(
                f"Expected `dtypes[{name!r}]` to be one of {_KINDS}, got {kind!r}. float32 is "
                "what the state already is: leave the field out."
            )
        if dtype == jnp.float16 and name in POSITIVE_FIELDS:
            raise ValueError(
                f"Expected `dtypes[{name!r}]` to be jnp.bfloat16, '8bit', a float8 dtype, or "
                f"left out (float32), got jnp.float16: {name!r} holds squares of gradients, "
                "which span twice the decades the gradients do, and float16's range (6e-8 to "
                "65504) does not hold them: gradients near 1e-4 square below its smallest "
                "value and are stored as 0 (adam's step then divides by eps), gradients near "
                "1e3 square past its largest and become inf (the step stops). bfloat16 has "
                "float32's range; the 8-bit code and float8 scale each block of 256."
            )
        out[name] = dtype
    return out


def low_precision_state(
    inner: optax.GradientTransformation,
    dtypes: Mapping[str, object] | None = None,
    rounding: str = "stochastic",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Store an optimizer's floating state narrower between steps.

    Before ``inner`` runs, each chosen field is widened to the dtype ``inner``'s own
    ``init`` gives it (float32 over float32 parameters; over bfloat16 parameters the
    bfloat16 ``inner`` keeps unwrapped, so the updates keep the parameters' dtype);
    after, it is stored again as ``dtypes`` says. Fields are chosen by name (adam's ``mu`` and
    ``nu``, momentum's ``trace``, adafactor's ``v_row``), wherever they sit in the
    state, so this wraps any Optax optimizer. Between steps the state takes exactly
    the bytes its dtypes say (``docs/optimizer-memory.md`` measures them). A name
    that holds no floating leaf of ``inner``'s state is refused at ``init``, naming
    the fields it has: it would keep everything float32 without a word.

    Each field is stored as one of:

    - ``jnp.bfloat16`` or ``jnp.float16``: rounded stochastically by default. With
      round-to-nearest, adam's ``nu`` stalls: at ``b2 = 0.999`` its change per step,
      ``(1 - b2) * g**2``, is below half a bfloat16 ulp of ``nu`` once the gradients
      are steady. float16 is refused for a field of squares (``nu``, and the other
      fields of squares Optax names): its range, 6e-8 to 65504, holds gradients but
      not their squares (at 1e-4 they are stored as 0, at 1e3 they overflow).
    - ``"8bit"``: blocks of 256 values with a float32 absmax each (1.016 bytes per
      value), in a log code suited to the field: signed for a first moment (eight
      levels an octave, down to ``2**-15.75`` of the block's absmax), and for a
      second moment (``nu``, and the other fields of squares Optax names) a positive
      code down to ``2**-31.75`` that never rounds a positive value to zero.
    - ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``: blocks of 256, each scaled so its
      absmax is the format's largest value (a block of values too tiny for that
      scale keeps the least scale that does). A second moment never rounds to zero;
      in ``e5m2`` it is held as it is (its subnormals reach ``2**-31.8`` of the
      absmax), in ``e4m3fn`` as its square root (held as it is, its reach of
      ``2**-17.8`` made the step of a gradient under about 1/480 of its block's
      largest too small, by up to 98% at ``2**-15`` of it). To nearest, adam's
      step is then within 6.7% (``e4m3fn``) or 6.9% (``e5m2``) of float32's for
      every element whose gradient is at least ``2**-14.5`` of its block's
      largest; stochastically, within 14.3% or 15.5%.

    Leaves under 4,096 elements stay float32 when ``"8bit"`` or float8 is chosen
    (bitsandbytes and torchao do the same): their blocks would save nothing.

    Args:
      inner: the optimizer, e.g. ``optax.adamw(1e-3)``.
      dtypes: field name to storage; defaults to ``{"mu": jnp.bfloat16, "nu":
        jnp.bfloat16}``.
      rounding: ``"stochastic"`` (default; unbiased, from bits hashed from ``seed``,
        the step and each element's index) or ``"nearest"``.
      seed: the stochastic rounding's seed, an int in ``[0, 2**32)``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      ``jamp.optimizer.LowPrecisionState``; extra keyword arguments go to ``inner``.

    Examples:
      >>> import jax.numpy as jnp, optax, jamp
      >>> tx = jamp.low_precision_state(optax.sgd(0.1, momentum=0.9), {"trace": jnp.bfloat16})
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> state.stored_state[0].trace["w"].dtype
      dtype(bfloat16)
    """
    inner = checked_inner(inner)
    chosen = _check_dtypes({"mu": jnp.bfloat16, "nu": jnp.bfloat16} if dtypes is None else dtypes)
    check_rounding(rounding, ("stochastic", "nearest"))
    seed = check_seed(seed)
    inner = optax.with_extra_args_support(inner)

    def store(state: OptState, count: jax.Array | None, params: frozenset) -> OptState:
        index = iter(range(1 << 30))
        key = None if count is None else step_key(seed, MOMENTS, count)

        def leaf(path: jax.tree_util.KeyPath, x: object) -> object:
            i = next(index)
            name = _field(path, chosen, params)
            if name is None or not isinstance(x, jax.Array | jax.ShapeDtypeStruct):
                return x
            if not jnp.issubdtype(x.dtype, jnp.floating):
                return x
            kind = chosen[name]
            x = cast(jax.Array, x).astype(jnp.float32)
            if kind in HALF:
                bits = None if key is None else random_bits(key, i, x.shape)
                return round_to(x, cast(jnp.dtype, kind), bits)
            if x.size < MIN_SIZE:
                return x
            bits = None if key is None else random_bits(key, i, padded_shape(x.shape))
            code = "positive" if name in POSITIVE_FIELDS else "signed"
            dtype = jnp.dtype(jnp.uint8) if kind == "8bit" else cast(jnp.dtype, kind)
            return quantize(x, code, dtype, bits)

        return jax.tree_util.tree_map_with_path(leaf, state)

    def widen(state: OptState, params: frozenset, own: dict) -> OptState:
        """The stored state in the dtypes ``inner``'s own ``init`` gives (``own``, by
        path): float32 over float32 parameters, and over bfloat16 ones the bfloat16
        ``inner`` itself keeps, so ``inner`` computes as it would unwrapped."""

        def leaf(path: jax.tree_util.KeyPath, x: object) -> object:
            if isinstance(x, BlockQuantized):
                return dequantize(x).astype(own.get(path, jnp.float32))
            if _field(path, chosen, params) is not None and getattr(x, "dtype", None) in HALF:
                return cast(jax.Array, x).astype(own.get(path, jnp.float32))
            return x

        return jax.tree_util.tree_map_with_path(
            leaf, state, is_leaf=lambda x: isinstance(x, BlockQuantized)
        )

    def init_fn(params: Params) -> LowPrecisionState:
        count = None if rounding == "nearest" else jnp.zeros((), jnp.uint32)
        paths = _param_paths(params)
        state = inner.init(params)
        _check_fields_exist(state, chosen, paths)
        return LowPrecisionState(store(state, None, paths), count)

    def update_fn(
        updates: Updates,
        state: LowPrecisionState,
        params: Params | None = None,
        **extra_args: object,
    ) -> tuple[Updates, LowPrecisionState]:
        check_own_state(state, LowPrecisionState, "LowPrecisionState")
        fn = "jamp.low_precision_state(...).update"
        if rounding == "stochastic":
            why = "rounding='stochastic' counts its steps"
            check_counter(state.storage_count, jnp.uint32, "state.storage_count", why)
        else:
            refuse_counter(state.storage_count, "state.storage_count", "rounding='nearest'")
        # The stored state against init's, for the parameters (or, without them, the
        # gradients, which have their shapes).
        like = updates if params is None else params
        stored, name = state.stored_state, "state.stored_state"
        init = lambda p: init_fn(p).stored_state  # noqa: E731
        check_state_matches(stored, init, like, name, fn, strict=False)
        paths = _param_paths(updates)
        own = {
            path: x.dtype
            for path, x in jax.tree_util.tree_leaves_with_path(jax.eval_shape(inner.init, like))
            if hasattr(x, "dtype")
        }
        with diagnosing(fn, stored, name, init, like, updates, params):
            new_updates, new_state = inner.update(
                updates, widen(stored, paths, own), params, **extra_args
            )
        # The key comes from the new count: one small kernel makes both.
        count = state.storage_count
        if count is not None:
            count = count + jnp.ones((), jnp.uint32)
        stored = store(new_state, count, paths)
        return new_updates, LowPrecisionState(stored, count)

    return optax.GradientTransformationExtraArgs(
        cast(optax.TransformInitFn, init_fn), cast(optax.TransformUpdateExtraArgsFn, update_fn)
    )
