"""A user's typed training steps, type-checked against jamp's public API.

Not collected and not run: ``test_typing.py`` runs pyright on it, so an annotation of
jamp's that is wrong for a user (a GradScaler method that loses the state's class, a
decorator that erases a signature) fails the suite.
"""

from collections.abc import Callable
from typing import Any, assert_type

import jax
import jax.numpy as jnp
import optax

import jamp

Params = dict[str, jax.Array]


def loss(params: Params, x: jax.Array) -> jax.Array:
    return jnp.mean((x @ params["w"]) ** 2)


params: Params = {"w": jnp.ones((3, 2))}
x = jnp.ones((4, 3))

# The pure functions and the loss-scale state.
scale_state = jamp.dynamic_loss_scale(init_scale=2.0**15)
assert_type(scale_state, jamp.LossScaleState)
grads = jax.grad(lambda p: jamp.scale(scale_state, loss(p, x)))(params)
finite = jamp.all_finite(grads)
assert_type(finite, jax.Array)
assert_type(jamp.update(scale_state, finite), jamp.LossScaleState)

# The Optax wrapper.
tx = jamp.loss_scaling(optax.adam(1e-3))
assert_type(tx, optax.GradientTransformationExtraArgs)
opt_state = tx.init(params)
assert_type(jamp.get_loss_scale(opt_state), jamp.LossScaleState)
updates, opt_state = tx.update(grads, opt_state, params)
new_params = optax.apply_updates(params, updates)  # optax types it as its ArrayTree

# The GradScaler mirror: its state keeps its class through the loop.
scaler = jamp.GradScaler(init_scale=1024.0)
state = scaler.init()
assert_type(state, jamp.GradScalerState)
sgd = optax.sgd(0.1)
sgd_state = sgd.init(params)
grads = jax.grad(lambda p: scaler.scale(state, loss(p, x)))(params)
grads, state = scaler.unscale(state, grads)
assert_type(state, jamp.GradScalerState)
params, sgd_state, state = scaler.step(state, sgd, grads, sgd_state, params)
assert_type(state, jamp.GradScalerState)
assert_type(scaler.found_inf(state), jax.Array)
state = scaler.update(state)
assert_type(state, jamp.GradScalerState)
assert_type(state.stage, str)
assert_type(scaler.set_growth_interval(state, 100), jamp.GradScalerState)
assert_type(scaler.get_scale(state), jax.Array)

# A plain loss-scale state: a disabled scaler hands it back as it came.
_, plain = scaler.unscale(scale_state, grads)
assert_type(plain, jamp.LossScaleState)
assert_type(scaler.update(scale_state), jamp.LossScaleState)


# autocast keeps the signature of the function it wraps.
def forward(params: Params, x: jax.Array) -> jax.Array:
    return x @ params["w"]


half_forward = jamp.autocast(forward, jnp.float16)
assert_type(half_forward, Callable[..., Any])
y = half_forward(params, x)


@jamp.autocast(dtype=jnp.bfloat16)
def decorated(params: Params, x: jax.Array) -> jax.Array:
    return x @ params["w"]


z = decorated(params, x)
