"""Training-step variants: the plain Optax step, jamp's two forms, and the peers.

Every builder returns ``(state, step)``: ``step(state, batch) -> state`` is a
pure Python function (not yet jitted) whose ``state`` holds params, the
optimizer state and any loss-scale state. ``make_jit`` jits it with the whole
state donated (params and optimizer state are updated in place).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jamp

LR = 1e-3
INIT_SCALE = 2.0**15


def fresh(tree: Any) -> Any:
    """A copy with new buffers (donation deletes the ones it is given)."""
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)


def _adamw() -> optax.GradientTransformation:
    return optax.adamw(LR)


# ------------------------------------------------------------------ variants


def _optax_step(model, tx):
    """An unscaled step through the Optax transformation ``tx``."""
    params = fresh(model.params)

    def step(state, batch):
        params, opt_state = state
        grads = jax.grad(model.loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return (params, tx.init(params)), step


def plain(model):
    return _optax_step(model, _adamw())


def jamp_loss_scaling(model, report_nonfinite=False, skip="cond"):
    tx = jamp.loss_scaling(
        _adamw(),
        jamp.dynamic_loss_scale(INIT_SCALE),
        report_nonfinite=report_nonfinite,
        skip=skip,
    )
    params = fresh(model.params)

    def step(state, batch):
        params, opt_state = state
        ls = jamp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: jamp.scale(ls, model.loss(p, batch)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return (params, tx.init(params)), step


def jamp_grad_scaler(model, step_fn=None, skip="cond"):
    """``jamp.GradScaler``'s step and update; or an experiment's ``step_fn``, which takes
    ``scaler.step``'s arguments and returns ``(params, opt_state, found_inf)``."""
    scaler = jamp.GradScaler(init_scale=INIT_SCALE, skip=skip)
    tx = _adamw()
    params = fresh(model.params)

    def step(state, batch):
        params, opt_state, sc = state
        grads = jax.grad(lambda p: scaler.scale(sc, model.loss(p, batch)))(params)
        if step_fn is None:
            params, opt_state, sc = scaler.step(sc, tx, grads, opt_state, params)
            return params, opt_state, scaler.update(sc)
        params, opt_state, found_inf = step_fn(sc, tx, grads, opt_state, params)
        return params, opt_state, jamp.update(sc, jnp.logical_not(found_inf))

    return (params, tx.init(params), scaler.init()), step


def jmp_dynamic(model):
    import jmp

    tx = _adamw()
    params = fresh(model.params)
    ls0 = jmp.DynamicLossScale(jnp.asarray(INIT_SCALE, jnp.float32))

    def step(state, batch):
        params, opt_state, ls = state
        grads = jax.grad(lambda p: ls.scale(model.loss(p, batch)))(params)
        grads = ls.unscale(grads)
        finite = jmp.all_finite(grads)
        ls = ls.adjust(finite)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt), (params, opt_state))
        return params, opt_state, ls

    return (params, tx.init(params), ls0), step


def flax_dynamic_scale(model):
    from flax.training.dynamic_scale import DynamicScale

    tx = _adamw()
    params = fresh(model.params)
    ds0 = DynamicScale(scale=INIT_SCALE)  # flax's documented usage (Python scalars)

    def step(state, batch):
        params, opt_state, ds = state
        ds, finite, _, grads = ds.value_and_grad(model.loss)(params, batch)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)

        def keep(new, old):
            return jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)

        return keep(new_params, params), keep(new_opt, opt_state), ds

    return (params, tx.init(params), ds0), step


def optax_apply_if_finite(model):
    return _optax_step(model, optax.apply_if_finite(_adamw(), max_consecutive_errors=5))


VARIANTS: dict[str, Callable] = {
    "plain (f32 optax.adamw)": plain,
    "jamp.loss_scaling": jamp_loss_scaling,
    "jamp.loss_scaling(report_nonfinite=True)": functools.partial(
        jamp_loss_scaling, report_nonfinite=True
    ),
    "jamp.loss_scaling(skip='select')": functools.partial(jamp_loss_scaling, skip="select"),
    "jamp.GradScaler.step": jamp_grad_scaler,
    "jamp.GradScaler(skip='select').step": functools.partial(jamp_grad_scaler, skip="select"),
    "jmp DynamicLossScale + select_tree": jmp_dynamic,
    "flax DynamicScale + where": flax_dynamic_scale,
    "optax.apply_if_finite (no scaling)": optax_apply_if_finite,
}


def make_jit(step: Callable, donate: bool = True, counter: list | None = None) -> Callable:
    """``jax.jit(step)`` with the state donated; ``counter`` counts Python traces."""
    if counter is not None:
        inner = step

        def step(state, batch):  # noqa: F811
            counter.append(1)
            return inner(state, batch)

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def make_flat_jit(step: Callable, state: Any, donate: bool = True) -> tuple[Callable, list]:
    """``step`` over the flat list of state leaves, jitted, and those leaves.

    Used for ``.lower().compile()``: lowering a tree state rebuilds every node
    from placeholder ``ArgInfo`` leaves, which jmp's ``DynamicLossScale``
    rejects in its ``__post_init__``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(state)

    def flat(leaves, batch):
        out = step(jax.tree_util.tree_unflatten(treedef, leaves), batch)
        return jax.tree_util.tree_leaves(out)

    return jax.jit(flat, donate_argnums=(0,) if donate else ()), leaves
