"""A user's typed training steps, type-checked against jamp's public API.

Not collected and not run: ``test_typing.py`` runs pyright on it, so an annotation of
jamp's that is wrong for a user (a GradScaler method that loses the state's class, a
decorator that erases a signature) fails the suite.
"""

from collections.abc import Callable
from typing import Any, assert_type

import jax
import jax.numpy as jnp
import numpy as np
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

# The GradScaler mirror: its state keeps its class through the loop (a name per stage,
# so each method's return type is checked, not a narrowed variable's).
scaler = jamp.GradScaler(init_scale=1024.0)
state0 = scaler.init()
assert_type(state0, jamp.GradScalerState)
sgd = optax.sgd(0.1)
sgd_state = sgd.init(params)
scaled_grads = jax.grad(lambda p: scaler.scale(state0, loss(p, x)))(params)
unscaled, state1 = scaler.unscale(state0, scaled_grads)
assert_type(state1, jamp.GradScalerState)
params2, sgd_state2, state2 = scaler.step(state1, sgd, unscaled, sgd_state, params)
assert_type(state2, jamp.GradScalerState)
assert_type(scaler.found_inf(state2), jax.Array)
state3 = scaler.update(state2)
assert_type(state3, jamp.GradScalerState)
assert_type(state3.stage, str)
assert_type(scaler.set_growth_interval(state3, 100), jamp.GradScalerState)
assert_type(scaler.get_scale(state3), jax.Array)

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

# The namespaces: float8's delayed scaling, the debug reports, the jmp/flax helpers.
recipe = jamp.float8.DelayedScaling(amax_history_len=4)
delayed = jamp.autocast(forward, "float8", recipe=recipe)
float8_state = jamp.float8.init(delayed, params, x)
assert_type(float8_state, dict[str, jamp.float8.Float8State])
assert_type(float8_state["0:dot_general"].scale, jax.Array)
watched = jamp.autocast(forward, "float8", recipe=recipe, telemetry=True)
telemetry = jamp.float8.telemetry_init(watched, params, x)
assert_type(telemetry, dict[str, jamp.float8.Telemetry])
assert_type(telemetry["0:dot_general"].underflow, jax.Array)
assert_type(jamp.float8.telemetry_metrics(telemetry), dict[str, jax.Array])
report = jamp.debug.autocast_report(forward, params, x, dtype=jnp.float16)
assert_type(report, jamp.debug.AutocastReport)
assert_type(report.counts, dict[str, dict[str, int]])
assert_type(report.residual_bytes, dict[str, int])
assert_type(jamp.debug.nonfinite_report(grads), Any)  # a tree of NonfiniteCount, as grads
assert_type(jamp.debug.log_nonfinite(grads, prefix="grads: "), jax.Array)
policy = jamp.compat.get_policy("p=f32,c=bf16,o=f32")
assert_type(policy, jamp.Policy)
assert_type(policy.compute_dtype, np.dtype)
assert_type(jamp.Policy(jnp.float32, "bf16", np.dtype("float32")), jamp.Policy)
assert_type(policy.with_output_dtype(jnp.bfloat16), jamp.Policy)
assert_type(jamp.compat.parse_dtype("bf16"), np.dtype)
assert_type(jamp.compat.half_dtype(), np.dtype)
flax_state = jamp.compat.from_flax_dynamic_scale({"fin_steps": 0, "scale": 2.0**15})
assert_type(flax_state, jamp.LossScaleState)
