"""``master_weights``: bfloat16 parameters with an exact, stochastic or compensated master.

The user's parameters are stored in bfloat16 (or float16) and used as they are by the
forward pass. The wrapped optimizer sees float32 gradients and float32 parameters (the
master) and returns float32 updates; the wrapper rounds the new parameters back and
returns the updates that ``optax.apply_updates`` turns into exactly that rounding.
What the state keeps beside the parameters decides how much of the master survives:
its 16 low bits (``"exact"``), a compensation buffer (``"kahan"``), a counter for
stochastic rounding (``"stochastic"``), or nothing (``"nearest"``). A fingerprint of
each parameter the add will give tells the next step whether something else moved it.
"""

from __future__ import annotations

from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jamp._src.dtypes import HALF
from jamp._src.leaves import find_nodes, is_integer
from jamp._src.loss_scaling import ScaledOptimizerState, checked_inner
from jamp._src.optimizer.rounding import (
    PARAMETERS,
    checksum,
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
    check_counter,
    check_gradients,
    check_own_state,
    check_params,
    check_state_matches,
    check_updates,
    diagnosing,
    refuse_counter,
)

ROUNDINGS = ("exact", "stochastic", "kahan", "nearest")
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
      params_checksum: with ``"exact"`` and ``"kahan"``, a tree shaped as the
        parameters: for each bfloat16 or float16 leaf, a uint32 fingerprint of 256 of
        its elements, spread over it, as the last update's add gives them (``None`` for
        the other leaves); ``None`` with ``"stochastic"`` and ``"nearest"``, whose
        parameters are their whole master.
      restarted_steps: int32 scalar, the steps whose parameters, at some leaf's
        fingerprinted elements, were not the ones the previous update's add gives:
        something else moved them (a transformation chained after ``master_weights``, a
        parameter changed between steps). That leaf's master restarted at the
        parameter as given. ``None`` with ``"stochastic"`` and ``"nearest"``.
        [`jamp.metrics`][] reports it.
    """

    optimizer_state: OptState
    residual: PyTree
    rounding_count: jax.Array | None
    params_checksum: PyTree
    restarted_steps: jax.Array | None


def is_low(leaf: object) -> bool:
    """Whether ``leaf`` is a bfloat16 or float16 array: a parameter with a master."""
    return getattr(leaf, "dtype", None) in HALF


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


def _refuse_loss_scaling_inside(state: OptState) -> None:
    """A ValueError if ``inner``'s state holds a ``jamp.loss_scaling`` state."""
    if find_nodes(state, ScaledOptimizerState):
        raise ValueError(
            "`jamp.master_weights` expected `inner` to be the optimizer of the float32 master, "
            "got one holding a jamp.loss_scaling state: inside master_weights a skipped step "
            "still runs the wrapper (its stochastic-rounding counter advances) and the loss "
            "scaling sees gradients already widened. Put the loss scaling outside: "
            "`jamp.loss_scaling(jamp.master_weights(inner))`."
        )


def float32_updates_add() -> bool:
    """Whether ``bfloat16 + float32`` promotes where the step is traced: under JAX's
    standard promotion ``optax.apply_updates`` adds a float32 update to a bfloat16
    parameter in float32 and casts the sum back; strict promotion refuses the add."""
    try:
        jnp.result_type(jnp.bfloat16, jnp.float32)
    except jax.dtypes.TypePromotionError:
        return False
    return True


def _where(path: jax.tree_util.KeyPath) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def _check_state(state: MasterWeightsState, params: Params, rounding: str, fn: str) -> None:
    """The parts of ``state`` that ``master_weights`` keeps itself, against ``params``: the
    residual and the fingerprints shaped as the parameters, each leaf of the dtype and
    shape ``init`` gives it, and the counters. Static: it raises eagerly and while traced."""
    checked = rounding in ("exact", "kahan")
    none_leaf = lambda x: x is None  # noqa: E731
    paths, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=none_leaf)
    names = ("residual", "params_checksum") if checked else ("residual",)
    for name in names:
        tree = getattr(state, name)
        if jax.tree_util.tree_structure(tree, is_leaf=none_leaf) != treedef:
            raise ValueError(
                f"`{fn}` expected `state.{name}` to be shaped as `params` (structure "
                f"{str(treedef):.200}), got {str(jax.tree_util.tree_structure(tree)):.200}: "
                "the state was made for other parameters. Pass the state from "
                "`tx.init(params)` for these parameters."
            )
    residual = jax.tree_util.tree_leaves(state.residual, is_leaf=none_leaf)
    sums = jax.tree_util.tree_leaves(state.params_checksum, is_leaf=none_leaf)
    if not checked:
        why = f"rounding={rounding!r} keeps no fingerprint"
        refuse_counter(state.params_checksum, "state.params_checksum", why)
        refuse_counter(state.restarted_steps, "state.restarted_steps", why)
        sums = [None] * len(paths)
    for (path, p), r, c in zip(paths, residual, sums, strict=True):
        where, low = _where(path), is_low(p)
        if checked and c is not None and not low:
            raise TypeError(
                f"`{fn}` expected `params{where}` to be bfloat16 (or float16), as when the "
                f"state was made, got {getattr(p, 'dtype', type(p).__name__)} instead: an add "
                "that does not cast back to the parameter's dtype (`eqx.apply_updates` is "
                "`p + u`; master_weights' exact updates are float32 under standard "
                "promotion) widened it. Apply the updates with `optax.apply_updates`, which "
                "casts the sum back to the parameter's dtype."
            )
        if checked and c is None and low:
            raise TypeError(
                f"`{fn}` expected `params{where}` to be {p.dtype} only where the state was "
                "made for a bfloat16 or float16 parameter, got one where it was made for "
                "another dtype. Pass the state from `tx.init(params)` for these parameters."
            )
        if c is not None:
            check_counter(c, jnp.uint32, f"state.params_checksum{where}", "a fingerprint")
        want = None
        if low and checked:
            want = jnp.dtype(jnp.int16) if rounding == "exact" else jnp.dtype(p.dtype)
        if want is None:
            refuse_counter(r, f"state.residual{where}", f"rounding={rounding!r} keeps none")
            continue
        if getattr(r, "dtype", None) != want:
            got = "None" if r is None else f"{type(r).__name__} of {getattr(r, 'dtype', None)}"
            raise TypeError(
                f"`{fn}` expected `state.residual{where}` to be a {want} array (what "
                f"rounding={rounding!r} keeps), got {got} instead. Pass the state from "
                "`tx.init(params)` of this transformation."
            )
        if tuple(r.shape) != tuple(p.shape):
            raise ValueError(
                f"`{fn}` expected `state.residual{where}` to have the parameter's shape "
                f"{tuple(p.shape)}, got {tuple(r.shape)}: it would broadcast into a wrong "
                "master. Pass the state from `tx.init(params)` for these parameters."
            )
    if rounding == "stochastic":
        check_counter(state.rounding_count, jnp.uint32, "state.rounding_count", "the steps")
    else:
        refuse_counter(state.rounding_count, "state.rounding_count", "no stochastic rounding")
    if checked:
        check_counter(state.restarted_steps, jnp.int32, "state.restarted_steps", "a count")


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
    returns the updates such that a plain ``optax.apply_updates(params, updates)``
    gives that rounding: the train step does not change. Leaves that are float32 (a
    norm's scale kept wide) are their own master and pass straight through.

    ``rounding`` decides what the state keeps beside each bfloat16 parameter:

    - ``"exact"``: the master's 16 low bits (int16): 4 bytes per parameter for the
      master. The parameter is the master rounded to nearest, ties away from zero,
      and parameter and low bits are the float32 master bit for bit
      (Transformer Engine's ``store_param_remainders``). Given the same gradients the
      master moves exactly as a float32 parameter would. Its updates are float32
      under JAX's standard promotion: the difference of two bfloat16 numbers is
      exact in float32 (unless one is ``2**16`` times the other), so the add lands
      on the rounding. Under strict promotion, where ``optax.apply_updates`` refuses
      ``bfloat16 + float32``, they are bfloat16, and a step longer than where the
      parameter lands (it crosses zero, or lands near it) may have no bfloat16
      update that reaches it: that parameter takes the nearest value the add reaches
      and its master restarts there (`docs/optimizer-memory.md` measures how often).
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

    The updates of ``"stochastic"``, ``"kahan"`` and ``"nearest"`` are of the
    parameters' dtype. float16 parameters work with those three; ``"exact"``
    refuses them (float16 is not float32's top half).

    ``master_weights`` must be the last transformation of a chain: the master is
    rounded to the parameters that its own updates give. With ``"exact"`` and
    ``"kahan"`` the state keeps a fingerprint of 256 elements of each bfloat16
    leaf as those updates leave them, and counts in ``restarted_steps`` the steps
    whose parameters differ there (a transformation chained after it); that leaf's
    master restarts at the parameters it is given. [`jamp.metrics`][] reports the
    count.

    Inside [`jamp.loss_scaling`][] a skipped step leaves the parameters, the
    residual, the counters and the inner state bit for bit as they were; the other
    nesting, ``master_weights(loss_scaling(...))``, is refused.

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
    fn = "jamp.master_weights(...).update"
    # The recipes with a state beside the parameters check that nothing else moved them.
    checked = rounding in ("exact", "kahan")

    def residual_of(p: jax.Array) -> jax.Array | None:
        if not is_low(p) or rounding in ("stochastic", "nearest"):
            return None
        return jnp.zeros(p.shape, jnp.int16 if rounding == "exact" else p.dtype)

    def init_fn(params: Params) -> MasterWeightsState:
        _check_parameters(params, rounding)
        residual = jax.tree.map(residual_of, params)
        masters = jax.tree.map(master_of, params, residual, is_leaf=lambda x: x is None)
        inner_state = inner.init(masters)
        _refuse_loss_scaling_inside(inner_state)
        count = jnp.zeros((), jnp.uint32) if rounding == "stochastic" else None
        if not checked:
            return MasterWeightsState(inner_state, residual, count, None, None)
        sums = jax.tree.map(lambda p: checksum(p) if is_low(p) else None, params)
        return MasterWeightsState(inner_state, residual, count, sums, jnp.zeros((), jnp.int32))

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
        check_params(params, _FN)
        check_gradients(updates, _FN)
        # The gradients are flattened as the parameters are: another structure is refused.
        check_updates(updates, params, fn, strict=True)
        _check_state(state, params, rounding, fn)
        masters = jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32) if is_low(p) else p, params
        )
        inner_state, name = state.optimizer_state, "state.optimizer_state"
        check_state_matches(inner_state, inner.init, masters, name, fn, strict=False)
        with diagnosing(fn, inner_state, name, inner.init, masters, updates, params):
            return run(updates, state, params, **extra_args)

    def run(
        grads: Updates, state: MasterWeightsState, params: Params, **extra_args: object
    ) -> tuple[Updates, MasterWeightsState]:
        treedef = jax.tree.structure(params)
        leaves = treedef.flatten_up_to(params)
        residual, moved = restart(params, state)
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
        float32_updates = rounding == "exact" and float32_updates_add()
        restarted = [m for m in moved if m is not None]
        out, new_residual, new_sums = [], [], []
        for i, (p, r, m, d) in enumerate(
            zip(leaves, residual, masters, treedef.flatten_up_to(deltas), strict=True)
        ):
            if not is_low(p) or d is None:
                out.append(d)
                new_residual.append(r)
                new_sums.append(checksum(p) if checked and is_low(p) else None)
                continue
            new = m + d.astype(jnp.float32)  # the float32 step, as apply_updates adds it
            if rounding == "exact":
                target, low = split(new)
            elif key is not None:
                target, low = round_to(new, p.dtype, random_bits(key, i, p.shape)), None
            else:
                target, low = new.astype(p.dtype), None
            if float32_updates:  # exact in float32 unless one is 2**16 times the other
                stay = same_bits(p, target)
                wide_step = target.astype(jnp.float32) - p.astype(jnp.float32)
                update = jnp.where(stay, jnp.array(-0.0, jnp.float32), wide_step)
                landed = (p.astype(jnp.float32) + update).astype(p.dtype)
            else:
                update, landed = reach(p, target)
            if low is not None:  # exact: where no update reaches the target, the master
                # restarts where the add lands
                low = jnp.where(same_bits(landed, target), low, jnp.zeros_like(low))
            elif rounding == "kahan":
                low = (new - landed.astype(jnp.float32)).astype(p.dtype)
            out.append(update)
            new_residual.append(low)
            new_sums.append(checksum(landed) if checked else None)
        if not checked:
            return treedef.unflatten(out), MasterWeightsState(
                inner_state, treedef.unflatten(new_residual), count, None, None
            )
        restarts = cast(jax.Array, state.restarted_steps)
        if restarted:
            restarts = restarts + jnp.any(jnp.stack(restarted)).astype(jnp.int32)
        return treedef.unflatten(out), MasterWeightsState(
            inner_state,
            treedef.unflatten(new_residual),
            count,
            treedef.unflatten(new_sums),
            restarts,
        )

    return optax.GradientTransformationExtraArgs(
        cast(optax.TransformInitFn, init_fn), cast(optax.TransformUpdateExtraArgsFn, update_fn)
    )


def restart(params: Params, state: MasterWeightsState) -> tuple[list, list]:
    """The residual of each leaf of ``params``, and whether something else moved the leaf
    since the last update (``None`` where the state keeps no fingerprint). A moved leaf
    restarts its master at the parameter as given: the low bits or compensation the
    state kept belong to another value, and merged with this one would be a master the
    optimizer never reached (above its start, while sgd descends)."""
    treedef = jax.tree.structure(params)
    leaves, residual = treedef.flatten_up_to(params), treedef.flatten_up_to(state.residual)
    if state.params_checksum is None:
        return residual, [None] * len(leaves)
    sums = treedef.flatten_up_to(state.params_checksum)
    moved = [None if c is None else checksum(p) != c for p, c in zip(leaves, sums, strict=True)]
    kept = [
        r if m is None or r is None else jnp.where(m, jnp.zeros_like(r), r)
        for r, m in zip(residual, moved, strict=True)
    ]
    return kept, moved


def master_params(params: Params, opt_state: OptState) -> Params:
    """The float32 master of bfloat16 ``params``, from the ``MasterWeightsState`` found
    anywhere in ``opt_state`` (inside ``jamp.loss_scaling``, ``optax.chain``, a
    ``TrainState``'s ``opt_state``): what to export at the end of training.

    ``"exact"`` gives the master bit for bit (parameter and low bits), ``"kahan"`` the
    parameter plus its compensation, ``"stochastic"`` and ``"nearest"`` the parameters
    widened (they keep no more). float32 leaves come back as they are, and so, widened,
    does a leaf that something other than the last update moved (its master restarts
    there, as the next update's would).

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
    found = [x for _, x in find_nodes(opt_state, MasterWeightsState)]
    if len(found) != 1:
        raise ValueError(
            "`jamp.optimizer.master_params` expected `opt_state` to hold one "
            f"MasterWeightsState (the state of a jamp.master_weights), found {len(found)}."
        )
    treedef = jax.tree.structure(params)
    leaves = treedef.flatten_up_to(params)
    residual, _ = restart(params, found[0])
    masters = [master_of(p, r) for p, r in zip(leaves, residual, strict=True)]
    return treedef.unflatten(masters)
