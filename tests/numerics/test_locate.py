"""``jamp.debug.locate_nonfinite``: the first operation that makes an inf or a NaN from
finite inputs, on a seeded suite of injected faults in Flax, NNX and Equinox models,
jitted or not, with and without autocast; and ``locate_when_skipped`` inside a step."""

import logging

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _source import line_of as _line_of
from flax import nnx

import jamp

SEEDS = [0, 1, 2]


# ---------------------------------------------------------------- 1. a float16 activation


class FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name="hidden")(x))
        return nn.Dense(1, name="head")(h)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_float16_forward_activation_that_overflows(seed, jit):
    """Flax under float16 autocast, inputs of 3e4 to 6e4 (float16 holds them): the hidden
    layer's product overflows float16 in the forward pass; the operands' magnitudes say
    why."""
    model = FlaxMLP()
    x = 3e4 * (1 + jax.random.uniform(jax.random.key(seed), (8, 16)))
    params = model.init(jax.random.key(seed + 10), x)
    apply = jamp.autocast(model.apply, jnp.float16)

    def loss(p, x):
        return jnp.mean(apply(p, x).astype(jnp.float32) ** 2)

    site = jamp.debug.locate_nonfinite(jax.jit(loss) if jit else loss, params, x)
    assert site is not None and site.primitive == "dot_general" and not site.backward
    assert site.path == "FlaxMLP/hidden" and site.inf > 0
    assert site.line.startswith(_line_of(FlaxMLP.__call__, "hidden") + " ")
    big, weight = site.operands
    assert big.dtype == "float16" and big.max_abs > 1e4 and big.dtype_max == 65504.0
    assert weight.max_abs < 10


# ---------------------------------------------------------------- 2. an input gradient


class NNXTwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(4, 8, rngs=rngs)
        self.second = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        h = self.first(x)
        return self.second(h)


@pytest.mark.parametrize("seed", SEEDS)
def test_an_input_gradient_that_overflows_while_the_forward_is_finite(seed):
    """NNX under float16 autocast: a large loss factor and large second-layer weights make
    the second product's input gradient overflow float16 in the backward pass; the
    forward is finite, and so is that product's weight gradient."""
    model = NNXTwoLayers(nnx.Rngs(seed))
    model.second.kernel[...] = jnp.full((8, 8), 200.0)
    graphdef, params = nnx.split(model)
    x = 1e-3 * jax.random.uniform(jax.random.key(seed), (4, 4))

    def loss(params, x):
        out = jamp.autocast(lambda p, x: nnx.merge(graphdef, p)(x), jnp.float16)(params, x)
        return 1000.0 * jnp.sum(out.astype(jnp.float32))

    assert np.isfinite(float(loss(params, x)))
    site = jamp.debug.locate_nonfinite(jax.jit(loss), params, x)
    assert site is not None and site.primitive == "dot_general" and site.backward
    assert site.role.startswith("input gradient of the product at")
    assert site.role.endswith(
        _line_of(NNXTwoLayers.__call__, "self.second") + " (NNXTwoLayers.__call__)"
    )
    assert site.inf > 0


# ---------------------------------------------------------------- 3. a NaN in a weight gradient


class EqxSafeSqrt(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        # A "safe" square root whose gradient is NaN where it is masked: the derivative
        # 0.5 / sqrt(w) is inf at w = 0, and the mask multiplies it by 0.
        return jnp.sum(jnp.where(self.w > 0, jnp.sqrt(self.w), 0.0) * x)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_nan_in_a_weight_gradient(seed):
    """Equinox: the masked square root's gradient is NaN at the masked weight, though the
    loss is finite. The first non-finite value is its derivative, ``0.5 / sqrt(0)``,
    which JAX computes beside the forward pass for the backward one: a backward ``div``
    at the square root's line."""
    w = jax.random.uniform(jax.random.key(seed), (6,), minval=0.5).at[seed].set(0.0)
    model = EqxSafeSqrt(w)

    @eqx.filter_jit
    def loss(model, x):
        return model(x)

    x = jnp.ones(6)
    assert np.isfinite(float(loss(model, x)))
    assert np.isnan(np.asarray(eqx.filter_grad(loss)(model, x).w)[seed])
    site = jamp.debug.locate_nonfinite(loss, model, x)
    assert site is not None and site.backward and site.primitive == "div" and site.inf == 1
    assert site.line.startswith(_line_of(EqxSafeSqrt.__call__, "jnp.sqrt") + " ")


# ---------------------------------------------------------------- 4. log(0)


@pytest.mark.parametrize("seed", SEEDS)
def test_log_of_zero_in_the_loss(seed):
    """A cross-entropy written by hand, on a probability that is exactly 0: the loss's
    log is -inf in the forward pass."""
    logits = jax.random.normal(jax.random.key(seed), (4, 3))
    labels = jnp.arange(4) % 3

    def loss(logits, labels):
        probs = jax.nn.softmax(logits) * (jnp.arange(3) != seed % 3).astype(jnp.float32)[None, :]
        picked = jnp.take_along_axis(probs, labels[:, None], axis=1)
        return -jnp.mean(jnp.log(picked))

    site = jamp.debug.locate_nonfinite(loss, logits, labels)
    assert site is not None and site.primitive == "log" and not site.backward
    assert site.line.startswith(_line_of(loss, "jnp.log") + " ") and site.inf >= 1
    assert site.operands[0].max_abs > 0  # finite inputs: some probabilities are nonzero


# ---------------------------------------------------------------- 5. a stale float8 scale


def test_a_stale_delayed_float8_scale_saturates_and_the_report_shows_it():
    """A delayed-scaling state whose scales were measured on values 1e6 times smaller:
    jamp's quantisation saturates finite values at the format's largest instead of
    overflowing, so the step stays finite (``locate_nonfinite`` finds nothing to name),
    and ``precision_report`` shows the product's operand clipped at the format's
    largest with the stale scale."""
    x = jax.random.normal(jax.random.key(0), (16, 32))
    w = jax.random.normal(jax.random.key(1), (32, 8)) / 6

    def mlp(w, x):
        return x @ w

    recipe = jamp.float8.DelayedScaling(amax_history_len=4)
    fast = jamp.autocast(mlp, "float8", recipe=recipe)
    state = jamp.float8.init(fast, w, x)
    # Scales measured on values 1e6 times smaller (finfo.max / amax with a tiny amax).
    state = {k: s._replace(scale=jnp.full((3,), 1e6 * 448.0)) for k, s in state.items()}

    def loss(w, x, state):
        return jnp.sum(fast(state, w, x).astype(jnp.float32) ** 2)

    assert jamp.debug.locate_nonfinite(loss, w, x, state) is None
    report = jamp.debug.precision_report(lambda w, x: jnp.sum(mlp(w, x) ** 2), w, x, dtype="float8")
    del report  # current scaling: nothing saturates (the stale case is delayed, above)
    stale = jamp.debug.precision_report(loss, w, x, state, dtype=jnp.bfloat16)
    clipped = [r for r in stale.rows if r.saturated is not None]
    assert clipped and max(r.saturated for r in clipped) > 0.9
    assert any(r.scale == pytest.approx(1e6 * 448.0) for r in clipped)


# ---------------------------------------------------------------- inside a step


def test_locate_when_skipped_logs_the_site_on_skipped_steps_only(caplog):
    """Inside a jitted step under loss_scaling: a clean step logs nothing; a skipped step
    logs the first non-finite operation."""

    def loss(w, x):
        return jnp.sum(jnp.exp(x @ w))

    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.no_loss_scale())

    @jax.jit
    def step(w, opt_state, x):
        grads = jax.grad(loss)(w, x)
        updates, opt_state = tx.update(grads, opt_state, w)
        jamp.debug.locate_when_skipped(opt_state, loss, w, x)
        return optax.apply_updates(w, updates), opt_state

    w = jnp.ones((3, 2))
    with caplog.at_level(logging.WARNING, logger="jamp"):
        _, state = step(w, tx.init(w), jnp.ones((4, 3)))
        jax.effects_barrier()
        assert bool(state.last_finite) and not caplog.records
        _, state = step(w, state, jnp.full((4, 3), 40.0))
        jax.effects_barrier()
    assert not bool(state.last_finite)
    (record,) = caplog.records
    assert "the first non-finite value: exp at" in record.getMessage()
    assert _line_of(loss, "jnp.exp") in record.getMessage()


def test_finite_steps_and_non_finite_arguments():
    """A finite step gives None; an argument that is already non-finite is named."""
    assert jamp.debug.locate_nonfinite(lambda w: jnp.sum(w**2), jnp.ones(3)) is None
    site = jamp.debug.locate_nonfinite(
        lambda p, x: jnp.sum(p["w"] * x), {"w": jnp.ones(2)}, jnp.array([1.0, jnp.nan])
    )
    assert site is not None and site.argument == "argument 1"
    assert "argument 1 is not finite" in str(site)
    with pytest.raises(TypeError, match="`fun`"):
        jamp.debug.locate_nonfinite(3, jnp.ones(3))  # type: ignore[arg-type]


def test_a_masked_inf_in_a_finite_step_is_no_fault():
    """A division by zero that a ``where`` discards, in a step whose loss and gradients
    are finite: nothing to locate."""

    def loss(w):
        inverse = jax.lax.stop_gradient(1.0 / w)  # 1/0 = inf, discarded by the where
        return jnp.sum(jnp.where(w != 0, inverse, 0.0) + w**2)

    assert jamp.debug.locate_nonfinite(loss, jnp.array([0.0, 2.0])) is None
