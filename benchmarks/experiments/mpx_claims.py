"""What docs/equinox.md says about MPX, checked against MPX itself (and jamp beside it).

pip install mixed-precision-for-JAX   # not a dependency of jamp; checked with 0.1.8
python -m benchmarks.experiments.mpx_claims

Every claim is an assert; the script prints what it saw.
"""

import jax
import jax.numpy as jnp
import mpx

import jamp

print("mixed-precision-for-JAX", mpx.__version__)
f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731  MPX asserts 0-d arrays

# 1. The gradient (and the loss) of a growth step is halved: MPX unscales with the new scale.
model = {"w": f32(1.0)}
loss = lambda m: 3.0 * m["w"]  # noqa: E731  the gradient is 3 at every step
scaling = mpx.DynamicLossScaling(f32(2.0**8), f32(1.0), period=2)
ls = jamp.dynamic_loss_scale(2.0**8, growth_interval=2)
mpx_grads, jamp_grads = [], []
for _ in range(4):
    value, scaling, finite, grads = mpx.filter_value_and_grad(loss, scaling)(model)
    out = jamp.filter_value_and_grad(loss)(ls, model)
    ls = out.loss_scale
    mpx_grads.append(float(grads["w"]))
    jamp_grads.append(float(out.grads["w"]))
print("gradient per step, period 2: MPX", mpx_grads, "jamp", jamp_grads)
assert mpx_grads == [3.0, 1.5, 3.0, 1.5] and jamp_grads == [3.0] * 4

# 2. The scale is clamped at float16's largest value, which is not a power of two.
s = mpx.DynamicLossScaling(f32(2.0**15), f32(1.0), period=1)
grown = [float((s := s.adjust(jnp.bool_(True))).loss_scaling) for _ in range(2)]
state = jamp.dynamic_loss_scale(2.0**15, growth_interval=1)
jamp_grown = [float((state := jamp.update(state, jnp.bool_(True))).scale) for _ in range(2)]
print("growth from 2**15: MPX", grown, "jamp", jamp_grown)
assert grown == [65504.0, 65504.0] and jamp_grown == [2.0**16, 2.0**17]

# 3. The scale is applied in float16: a float16 loss of 2 at the initial scale 65504 is inf,
#    and so is the loss MPX reports, while its gradients are finite.
model = {"w": jnp.full((4,), 0.5, jnp.float32)}
loss = lambda m: jnp.sum(m["w"])  # noqa: E731  2.0, computed in float16 after MPX's cast
value, _, finite, _ = mpx.filter_value_and_grad(
    loss, mpx.DynamicLossScaling(mpx.FLOAT16_MAX, f32(1.0))
)(model)
out = jamp.filter_value_and_grad(jamp.autocast(loss, jnp.float16))(jamp.dynamic_loss_scale(), model)
print("loss 2.0 at the initial scale: MPX reports", float(value), "jamp", float(out.value))
assert float(value) == float("inf") and bool(finite) and float(out.value) == 2.0

# 4. set_half_precision_datatype with a string does nothing.
mpx.set_half_precision_datatype("bfloat16")
print("after set_half_precision_datatype('bfloat16'):", mpx.half_precision_datatype())
assert mpx.half_precision_datatype() is jnp.float16
mpx.set_half_precision_datatype(jnp.bfloat16)
assert mpx.half_precision_datatype() is jnp.bfloat16
mpx.set_half_precision_datatype(jnp.float16)

# 5. Strict dtype promotion: MPX's adjust multiplies an int32 counter by a bool.
jax.config.update("jax_numpy_dtype_promotion", "strict")
try:
    mpx.DynamicLossScaling(f32(2.0), f32(1.0)).adjust(jnp.bool_(True))
    raised = None
except Exception as e:
    raised = type(e).__name__
print("strict promotion: MPX's adjust raises", raised)
assert raised == "TypePromotionError"
jamp.update(jamp.dynamic_loss_scale(2.0), jnp.bool_(True))  # jamp's does
print("every claim holds")
