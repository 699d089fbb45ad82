"""``master_weights``: bfloat16 parameters with an exact, stochastic or compensated master.

The user's parameters are stored in bfloat16 (or float16) and used as they are by the
forward pass. The wrapped optimizer sees float32 gradients and float32 parameters (the
master) and returns float32 updates; the wrapper rounds the new parameters back and
returns the updates that ``optax.apply_updates`` turns into exactly that rounding.
What the state keeps beside the parameters decides how much of the master survives:
its 16 low bits (``"exact"``), a compensation buffer (``"kahan"``), a counter for
stochastic rounding (``"stochastic"``), or nothing (``"nearest"``).
"""

from __future__ import annotations

from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jamp._src.leaves import is_integer
from jamp._src.loss_scaling import checked_inner
from jamp._src.optimizer.rounding import (
    PARAMETERS,
    merge,
    random_bits,
    reach,
    round_to,
    same_bits,
    split,
    step_key,
)
from jamp._src.types import OptState, Params, PyTree, Updates
from jamp._src.validate import (
    check_gradients,
    check_own_state,
    check_params,
    check_updates,
)

ROUNDINGS = ("exact", "stochastic", "kahan", "nearest")
# The parameters' and the stored moments' narrow dtypes (float8 moments are stored in blocks).
NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_FN = "master_weights"


class MasterWeightsState(NamedTuple):
    """The state of [`jamp.master_weights`][]. Field names are unique, for
    ``optax.tree.get``.

    Attributes:
      optimizer_state: the wrapped optimizer's state, made for float32 parameters.
      residual: what the parameters lack of the float32 master, a tree shaped as the
        parameters: int16 low bits (``"exact"``), a compensation of the parameters'
        dtype (``"kahan"``), or ``None`` (``"stochastic"``, ``"nearest"``). Leaves
        that are not bfloat16 or float16 are their own master and hold ``None``.
      rounding_count: uint32 scalar, the steps rounded stochastically so far (the
        random bits' counter); ``None`` unless ``rounding="stochastic"``.
    """

    optimizer_state: OptState
    residual: PyTree
    rounding_count: jax.Array | None


def is_low(leaf: object) -> bool:
    """Whether ``leaf`` is a bfloat16 or float16 array: a parameter with a master."""
    return getattr(leaf, "dtype", None) in NARROW


def master_of(p: jax.Array, r: jax.Array | None) -> jax.Array:
    """The float32 master of parameter ``p`` and its residual ``r``: ``p`` itself when it
    is not bfloat16 or float16; merged with int16 low bits (``"exact"``); plus a
    compensation of its own dtype (``"kahan"``); widened when there is no residual."""
    if not is_low(p):
        return p
    if r is None:
        return p.astype(jnp.float32)
    if r.dtype == jnp.int16:
        return merge(p, r)
    # No compensation leaves the parameter as it is: -0.0 + 0.0 would be 0.0.
    wide = p.astype(jnp.float32)
    return jnp.where(r == jnp.zeros((), r.dtype), wide, wide + r.astype(jnp.float32))


def check_rounding(rounding: object, allowed: tuple[str, ...], name: str = "rounding") -> str:
    if not isinstance(rounding, str):
        raise TypeError(
            f"Expected `{name}` to be one of {', '.join(map(repr, allowed))}, got "
            f"{type(rounding).__name__} instead."
        )
    if rounding not in allowed:
        raise ValueError(
            f"Expected `{name}` to be one of {', '.join(map(repr, allowed))}, got {rounding!r}."
        )
    return rounding


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not is_integer(seed):
        raise TypeError(f"Expected `seed` to be a Python int, got {type(seed).__name__} instead.")
    if not 0 <= int(seed) < 2**32:
        raise ValueError(f"Expected `seed` to be in [0, 2**32), got {seed}.")
    return int(seed)


def _check_parameters(params: Params, rounding: str) -> None:
    check_params(params, _FN)
    leaves = jax.tree_util.tree_leaves(params)
    if not any(map(is_low, leaves)):
        raise ValueError(
            "`jamp.master_weights` expected `params` to hold bfloat16 (or float16) parameters, "
            "got none: it keeps a float32 master for low-precision parameters, so store them "
            "in bfloat16 (Flax `param_dtype=jnp.bfloat16`, or "
            "`jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)`); float32 leaves pass "
            "through as their own master."
        )
    if rounding == "exact" and any(getattr(x, "dtype", None) == jnp.float16 for x in leaves):
        raise TypeError(
            "`jamp.master_weights(rounding='exact')` expected bfloat16 parameters, got float16 "
            "ones: the exact recipe keeps float32's 16 low bits, and only bfloat16 is float32's "
            "top half. For float16 parameters use rounding='kahan' (the same 4 bytes per "
            "parameter) or 'stochastic' (2), or store them in bfloat16."
        )


def master_weights(
    inner: optax.GradientTransformation,
    *,
    rounding: str = "exact",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Store the parameters in bfloat16 and optimize a float32 master of them.

    The user's parameters are bfloat16 (or float16) and are used as they are by the
    forward pass: Flax ``param_dtype=jnp.bfloat16``, NNX, Equinox, or a cast tree.
    ``inner`` sees float32 gradients and float32 parameters (the master) and returns
    float32 updates. The wrapper rounds the new master to the parameters' dtype and
    returns updates of that dtype, such that a plain ``optax.apply_updates(params,
    updates)`` gives that rounding, under strict dtype promotion: the train step does
    not change. Leaves that are float32 (a norm's scale kept wide) are their own master
    and pass straight through.

    ``rounding`` decides what the state keeps beside each bfloat16 parameter:

    - ``"exact"``: the master's 16 low bits (int16): 4 bytes per parameter for the
      master. The parameter is the master rounded to nearest, ties away from zero,
      and parameter and low bits are the float32 master bit for bit
      (Transformer Engine's ``store_param_remainders``). Given the same gradients the
      master moves exactly as a float32 parameter would, with one exception: a step
      larger than where the parameter lands (it crosses zero, or lands nearer to
      zero than the step's size) may have no bfloat16 update that
      ``optax.apply_updates`` can add to reach it; that parameter takes the nearest
      value the add reaches and its master restarts there (`docs/optimizer-memory.md`
      measures how often).
    - ``"stochastic"``: nothing but a step counter: 2 bytes per parameter. The
      write-back rounds up or down at random, unbiased (``E[p] = master``), from
      bits hashed from ``seed``, the step and each element's index: reproducible
      from the seed and the same under any sharding.
    - ``"kahan"``: a compensation buffer of the parameters' dtype: 4 bytes per
      parameter. It holds what rounding lost and adds it back next step (optimi's
      Kahan-compensated bfloat16).
    - ``"nearest"``: nothing; the write-back rounds to nearest. Updates smaller than
      half a bfloat16 ulp (``2**-9`` relative) are lost, so training stalls as the
      learning rate decays: the baseline that shows why the others exist.

    float16 parameters work with ``"stochastic"``, ``"kahan"`` and ``"nearest"``;
    ``"exact"`` refuses them (float16 is not float32's top half).

    Inside [`jamp.loss_scaling`][] a skipped step leaves the parameters, the
    residual, the counter and the inner state bit for bit as they were.

    Args:
      inner: the optimizer of the float32 master, e.g. ``optax.adamw(1e-3)``;
        [`jamp.low_precision_state`][] around it stores its moments narrower.
      rounding: ``"exact"`` (default), ``"stochastic"``, ``"kahan"`` or ``"nearest"``.
      seed: the stochastic rounding's seed, an int in ``[0, 2**32)``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      ``jamp.optimizer.MasterWeightsState``; extra keyword arguments go to ``inner``.
      Its ``update`` needs ``params``.

    Examples:
      >>> import jax.numpy as jnp, optax, jamp
      >>> params = {"w": jnp.ones(3, jnp.bfloat16)}
      >>> tx = jamp.master_weights(optax.sgd(2.0**-12))
      >>> state = tx.init(params)
      >>> grads = {"w": jnp.ones(3, jnp.bfloat16)}
      >>> for _ in range(12):  # each step is below half a bfloat16 ulp of 1.0
      ...     updates, state = tx.update(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params["w"]  # the master is 1 - 12 * 2**-12; to nearest, 1 - 2**-8
      Array([0.996094, 0.996094, 0.996094], dtype=bfloat16)
    """
    inner = checked_inner(inner)
    check_rounding(rounding, ROUNDINGS)
    seed = check_seed(seed)
    inner = optax.with_extra_args_support(inner)

    def residual_of(p: jax.Array) -> jax.Array | None:
        if not is_low(p) or rounding in ("stochastic", "nearest"):
            return None
        return jnp.zeros(p.shape, jnp.int16 if rounding == "exact" else p.dtype)

    def init_fn(params: Params) -> MasterWeightsState:
        _check_parameters(params, rounding)
        residual = jax.tree.map(residual_of, params)
        masters = jax.tree.map(master_of, params, residual, is_leaf=lambda x: x is None)
        count = jnp.zeros((), jnp.uint32) if rounding == "stochastic" else None
        return MasterWeightsState(inner.init(masters), residual, count)

    def update_fn(
        updates: Updates,
        state: MasterWeightsState,
        params: Params | None = None,
        **extra_args: object,
    ) -> tuple[Updates, MasterWeightsState]:
        if params is None:
            raise ValueError(
                "`jamp.master_weights(...).update` expected `params`, got None: it rounds the "
                "new parameters from them. Call `tx.update(grads, state, params)`."
            )
        check_own_state(state, MasterWeightsState, "MasterWeightsState")
        check_gradients(updates, _FN)
        check_updates(updates, params, "jamp.master_weights(...).update")
        return run(updates, state, params, **extra_args)

    def run(
        grads: Updates, state: MasterWeightsState, params: Params, **extra_args: object
    ) -> tuple[Updates, MasterWeightsState]:
        treedef = jax.tree.structure(params)
        leaves = treedef.flatten_up_to(params)
        residual = treedef.flatten_up_to(state.residual)
        masters = [master_of(p, r) for p, r in zip(leaves, residual, strict=True)]
        wide = [
            g.astype(jnp.float32) if is_low(p) and g is not None else g
            for p, g in zip(leaves, treedef.flatten_up_to(grads), strict=True)
        ]
        deltas, inner_state = inner.update(
            treedef.unflatten(wide), state.optimizer_state, treedef.unflatten(masters), **extra_args
        )
        # The key comes from the new count: one small kernel makes both.
        count = state.rounding_count
        if count is not None:
            count = count + jnp.ones((), jnp.uint32)
        key = None if count is None else step_key(seed, PARAMETERS, count)
        out, new_residual = [], []
        for i, (p, r, m, d) in enumerate(
            zip(leaves, residual, masters, treedef.flatten_up_to(deltas), strict=True)
        ):
            if not is_low(p) or d is None:
                out.append(d)
                new_residual.append(r)
                continue
            new = m + d.astype(jnp.float32)  # the float32 step, as apply_updates adds it
            if rounding == "exact":
                target, low = split(new)
            elif key is not None:
                target, low = round_to(new, p.dtype, random_bits(key, i, p.shape)), None
            else:
                target, low = new.astype(p.dtype), None
            update, landed = reach(p, target)
            if low is not None:  # exact: where no update reaches the target, the master
                # restarts where the add lands
                low = jnp.where(same_bits(landed, target), low, jnp.zeros_like(low))
            elif rounding == "kahan":
                low = (new - landed.astype(jnp.float32)).astype(p.dtype)
            out.append(update)
            new_residual.append(low)
        return treedef.unflatten(out), MasterWeightsState(
            inner_state, treedef.unflatten(new_residual), count
        )

    return optax.GradientTransformationExtraArgs(
        cast(optax.TransformInitFn, init_fn), cast(optax.TransformUpdateExtraArgsFn, update_fn)
    )


def master_params(params: Params, opt_state: OptState) -> Params:
    """The float32 master of bfloat16 ``params``, from the ``MasterWeightsState`` found
    anywhere in ``opt_state`` (inside ``jamp.loss_scaling``, ``optax.chain``, a
    ``TrainState``'s ``opt_state``): what to export at the end of training.

    ``"exact"`` gives the master bit for bit (parameter and low bits), ``"kahan"`` the
    parameter plus its compensation, ``"stochastic"`` and ``"nearest"`` the parameters
    widened (they keep no more). float32 leaves come back as they are.

    Examples:
      >>> import jax.numpy as jnp, optax, jamp
      >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
      >>> tx = jamp.loss_scaling(jamp.master_weights(optax.sgd(2.0**-12)), jamp.no_loss_scale())
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> params["w"], jamp.optimizer.master_params(params, state)["w"]
      (Array([1, 1], dtype=bfloat16), Array([0.99975586, 0.99975586], dtype=float32))
    """
    found = [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MasterWeightsState))
        if isinstance(x, MasterWeightsState)
    ]
    if len(found) != 1:
        raise ValueError(
            "`jamp.optimizer.master_params` expected `opt_state` to hold one "
            f"MasterWeightsState (the state of a jamp.master_weights), found {len(found)}."
        )
    residual = jax.tree.structure(params).flatten_up_to(found[0].residual)
    leaves = [master_of(p, r) for p, r in zip(jax.tree.leaves(params), residual, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)
