"""Every variant the benchmarks compare, each written once (the hub; ``benchmarks/README.md``).

**Training steps** (``loss_scaling`` times them, ``gpu_compile`` compiles them): each
builder takes a :class:`models.Model` and returns ``(state, step)``; ``step(state, batch)
-> state`` is pure (not yet jitted) over ``state = (params, opt_state, mstate, extra)``:
``mstate`` the model's state (BatchNorm's statistics, kept on a skipped step), ``extra`` a
loss scale kept outside the optimizer state. Arrays give fresh buffers (donation deletes
what it is given), shape structs shape structs. On the optimizer step alone the batch is
the gradients. Every step runs ``optax.adamw(1e-3)``; a loss scale starts at ``2**15``.

**Precision variants of a loss** (:func:`precision_losses`) and **float8 variants of a
forward function** (:func:`float8_forwards`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jamp
from benchmarks.models import Model

LR = 1e-3
INIT_SCALE = 2.0**15
HALF = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
HISTORY = 16  # delayed scaling's amax history, in steps


def _init(model: Model, tx: Any, extra: Any = ()) -> tuple:
    """The first state: of shape structs, or of new buffers (donation deletes its input)."""
    leaves = jax.tree_util.tree_leaves(model.params)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return model.params, jax.eval_shape(tx.init, model.params), model.mstate, extra
    params, mstate = jax.tree_util.tree_map(
        lambda x: jnp.array(x, copy=True), (model.params, model.mstate)
    )
    return params, tx.init(params), mstate, extra


def _grads(model: Model, params: Any, ms: Any, batch: Any, scale: Callable) -> tuple:
    """(gradients of ``scale(loss)``, new model state); the batch itself for the optimizer."""
    if model.loss is None:
        return batch, ms

    def scaled(p: Any) -> tuple[jax.Array, Any]:
        loss, new = model.loss(p, ms, batch)
        return scale(loss), new

    return jax.grad(scaled, has_aux=True)(params)


def _keep(finite: jax.Array, new: Any, old: Any) -> Any:
    """The model state of a finite step, else the old one (docs/model-state.md)."""
    return jamp.compat.select_tree(finite, new, old) if jax.tree_util.tree_leaves(new) else new


# --------------------------------------------------------------------- training steps


def _optax(model: Model, tx: Any, scaled: bool = False, keep: bool = False) -> tuple:
    """A step of the Optax transformation ``tx``: the gradients of the loss (times the loss
    scale in ``tx``'s state with ``scaled``); with ``keep``, a step ``tx`` skipped keeps the
    model state too (``opt.last_finite``)."""

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, extra = state
        scale = functools.partial(jamp.scale, jamp.get_loss_scale(opt)) if scaled else None
        grads, new_ms = _grads(model, params, ms, batch, scale or (lambda x: x))
        updates, opt = tx.update(grads, opt, params)
        new_params = optax.apply_updates(params, updates)
        return new_params, opt, _keep(opt.last_finite, new_ms, ms) if keep else new_ms, extra

    return _init(model, tx), step


def plain(model: Model) -> tuple:
    """The unscaled step."""
    return _optax(model, optax.adamw(LR))


def loss_scaling(model: Model, skip: str = "auto", report_nonfinite: bool = False) -> tuple:
    """``jamp.loss_scaling(adamw, dynamic_loss_scale(2**15))``, the Optax form."""
    scale = jamp.dynamic_loss_scale(INIT_SCALE)
    tx = jamp.loss_scaling(optax.adamw(LR), scale, report_nonfinite=report_nonfinite, skip=skip)
    return _optax(model, tx, scaled=True, keep=True)


def grad_scaler(model: Model, skip: str = "auto") -> tuple:
    """``jamp.GradScaler``'s scale, step and update."""
    scaler = jamp.GradScaler(init_scale=INIT_SCALE, skip=skip)
    tx = optax.adamw(LR)

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, sc = state
        grads, new_ms = _grads(model, params, ms, batch, lambda x: scaler.scale(sc, x))
        params, opt, sc = scaler.step(sc, tx, grads, opt, params)
        new_ms = _keep(jnp.logical_not(scaler.found_inf(sc)), new_ms, ms)
        return params, opt, new_ms, scaler.update(sc)

    return _init(model, tx, scaler.init()), step


def value_and_grad(model: Model) -> tuple:
    """``jamp.value_and_grad`` + ``step_if_finite`` (the optimizer step alone:
    ``unscale_and_check`` + ``step_if_finite``, the same pure functions)."""
    tx = optax.adamw(LR)

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, ls = state
        if model.loss is None:
            grads, finite = jamp.unscale_and_check(ls, batch)
            new_ms, ls = ms, jamp.update(ls, finite)
        else:
            out = jamp.value_and_grad(model.loss, has_aux=True)(ls, params, ms, batch)
            grads, finite, new_ms, ls = out.grads, out.finite, out.aux, out.loss_scale
        params, opt = jamp.step_if_finite(finite, tx, grads, opt, params)
        return params, opt, _keep(finite, new_ms, ms), ls

    return _init(model, tx, jamp.dynamic_loss_scale(INIT_SCALE)), step


def multi_steps(model: Model) -> tuple:
    """One micro-step of ``jamp.multi_steps(jamp.loss_scaling(adamw), 4)``."""
    inner = jamp.loss_scaling(optax.adamw(LR), jamp.dynamic_loss_scale(INIT_SCALE))
    return _optax(model, jamp.multi_steps(inner, every_k_schedule=4), scaled=True)


def jmp_dynamic(model: Model, restart: bool = False) -> tuple:
    """jmp's ``DynamicLossScale``, ``all_finite`` and ``select_tree``. With ``restart`` the state
    keeps the scale alone and the counter restarts every step, as the GPU-compile rows of
    ``RESULTS.md`` were compiled: the growth period never completes, XLA folds it away."""
    import jmp

    tx = optax.adamw(LR)

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, extra = state
        ls = jmp.DynamicLossScale(extra) if restart else jmp.DynamicLossScale(*extra)
        grads, new_ms = _grads(model, params, ms, batch, ls.scale)
        grads = ls.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt = tx.update(grads, opt, params)
        new_params = optax.apply_updates(params, updates)
        params, opt, ms = jmp.select_tree(finite, (new_params, new_opt, new_ms), (params, opt, ms))
        ls = ls.adjust(finite)
        return params, opt, ms, ls.loss_scale if restart else (ls.loss_scale, ls.counter)

    scale = jnp.asarray(INIT_SCALE, jnp.float32)
    return _init(model, tx, scale if restart else (scale, jnp.zeros((), jnp.int32))), step


def apply_if_finite(model: Model) -> tuple:
    """``optax.apply_if_finite(adamw, 5)``: the update skipped on a non-finite gradient,
    no loss scale."""
    return _optax(
        model, optax.apply_if_finite(optax.adamw(LR), max_consecutive_errors=5), keep=True
    )


def flax_dynamic_scale(model: Model) -> tuple:
    """flax's ``DynamicScale``: its ``value_and_grad`` (on the optimizer step alone, the
    same unscale, per-leaf ``all(isfinite)`` and scale update on the given gradients),
    then ``jnp.where`` between the new state and the old."""
    from flax.training.dynamic_scale import DynamicScale

    tx = optax.adamw(LR)

    def unscale_check(ds: DynamicScale, grads: Any) -> tuple:
        # flax.training.dynamic_scale.DynamicScale.value_and_grad, after its jax.grad.
        grads = jax.tree_util.tree_map(lambda g: jnp.asarray(g, jnp.float32) / ds.scale, grads)
        finite = jnp.array(True)
        for g in jax.tree_util.tree_leaves(grads):
            finite &= jnp.all(jax.lax.is_finite(g))
        grow = ds.fin_steps == ds.growth_interval
        fin_scale = jnp.where(
            grow & finite, jnp.minimum(ds.scale * ds.growth_factor, 3.4e38), ds.scale
        )
        new_scale = jnp.where(finite, fin_scale, ds.scale * ds.backoff_factor)
        steps = jnp.where(grow | (~finite), 0, ds.fin_steps + 1)
        return ds.replace(fin_steps=steps, scale=new_scale), finite, grads

    def step(state: tuple, batch: Any) -> tuple:
        params, opt, ms, (scale, fin_steps) = state
        ds = DynamicScale(scale=scale, fin_steps=fin_steps)
        if model.loss is None:
            ds, finite, grads = unscale_check(ds, batch)
            new_ms = ms
        else:
            ds, finite, (_, new_ms), grads = ds.value_and_grad(model.loss, has_aux=True)(
                params, ms, batch
            )
        updates, new_opt = tx.update(grads, opt, params)
        new_params = optax.apply_updates(params, updates)

        def keep(new: Any, old: Any) -> Any:
            return jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)

        extra = (ds.scale, ds.fin_steps)
        return keep(new_params, params), keep(new_opt, opt), keep(new_ms, ms), extra

    extra = (jnp.asarray(INIT_SCALE, jnp.float32), jnp.zeros((), jnp.int32))
    return _init(model, tx, extra), step


# --------------------------------------------------------------------- precision variants


def precision_losses(at: Callable, dtypes=("bfloat16",), jmp_policy: bool = False) -> dict:
    """``name -> loss`` on the same float32 parameters, from a model's ``at(dtype,
    param_dtype)``: ``float32``, and per dtype ``jamp.autocast <dtype>`` (of the float32
    loss), ``Flax dtype=<dtype>`` and, with ``jmp_policy``, ``jmp policy <dtype>`` (jmp's
    ``p=f32,c=<dtype>,o=f32`` on the model built with ``param_dtype=<dtype>``)."""
    out = {"float32": at()}
    for name in dtypes:
        dt = HALF[name]
        out[f"jamp.autocast {name}"] = jamp.autocast(out["float32"], dt)
        out[f"Flax dtype={name}"] = at(dt)
        if jmp_policy:
            out[f"jmp policy {name}"] = _jmp_policy(at(None, dt), name)
    return out


def _jmp_policy(loss: Callable, name: str) -> Callable:
    import jmp

    policy = jmp.get_policy(f"p=f32,c={name},o=f32")

    def cast(p: Any, *rest: Any) -> Any:  # (params, [mstate,] (inputs, targets))
        *mstate, (x, y) = rest
        return loss(policy.cast_to_compute(p), *mstate, (policy.cast_to_compute(x), y))

    return cast


def float8_forwards(forward: Callable, reference: Callable | None = None,
                    attention: bool = False) -> dict[str, tuple[str, Callable]]:  # fmt: skip
    """``name -> (kind, forward)``: kind ``plain`` takes ``forward``'s arguments, ``delayed``
    a float8 state first (``jamp.float8.init``). ``benchmarks/float8.py`` defines each;
    ``attention`` adds the one whose ``forward(..., attention_dtype=bfloat16)``."""
    measuring = jamp.float8.DelayedScaling(HISTORY, unmeasured="current")
    out = {
        "float32": ("plain", forward),
        "bfloat16": ("plain", jamp.autocast(forward, jnp.bfloat16)),
        "float8 current": ("plain", jamp.autocast(forward, "float8")),
        "float8 delayed": (
            "delayed", jamp.autocast(forward, "float8", recipe=jamp.float8.DelayedScaling(HISTORY))
        ),
        "float8 delayed, unmeasured='current'": (
            "delayed", jamp.autocast(forward, "float8", recipe=measuring)
        ),
    }  # fmt: skip
    if attention:
        attend = functools.partial(forward, attention_dtype=jnp.bfloat16)
        out["float8, attention in bfloat16"] = ("plain", jamp.autocast(attend, "float8"))
    if reference is not None:
        out["per-tensor reference"] = ("plain", reference)
    return out


def mlp_train_step(dtype: Any, d: int = 1024, hidden: int = 4096, batch: int = 2048,
                   recipe: Any = None) -> tuple[Callable, tuple, int]:  # fmt: skip
    """``(step, args, n)``: a train step of the MLP ``d -> hidden -> d`` (relu), batch
    ``batch``, ``jax.value_and_grad`` of the mean squared error under ``jamp.autocast(.,
    dtype)`` (``"float8"``: a ``recipe`` makes it take the state first), then SGD; ``args``
    are shape structs, the parameters at ``n`` (donate them)."""
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    params, x, y = {"w1": spec(d, hidden), "w2": spec(hidden, d)}, spec(batch, d), spec(batch, d)

    def mse(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        h = jax.nn.relu(x @ params["w1"])
        return jnp.mean(jnp.square((h @ params["w2"]).astype(jnp.float32) - y))

    f = jamp.autocast(mse, dtype, **({"recipe": recipe} if recipe is not None else {}))
    lead = [] if recipe is None else [jax.eval_shape(lambda: jamp.float8.init(f, params, x, y))]
    n, tx = len(lead), optax.sgd(1e-2)

    def step(*args: Any) -> tuple:
        value, grads = jax.value_and_grad(f, argnums=tuple(range(n + 1)))(*args)
        updates, _ = tx.update(grads[n], tx.init(args[n]), args[n])
        return optax.apply_updates(args[n], updates), value, grads[:n]  # the next state

    return step, (*lead, params, x, y), n
