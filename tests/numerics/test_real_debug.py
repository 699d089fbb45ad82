"""``jamp.debug`` on models as their users write them (issue 44): an NNX model whose state
holds dropout's typed PRNG key, a legacy ``PRNGKey`` argument, a non-finite constant, a
``GradScaler`` state, the dtype spellings ``jamp.autocast`` takes, and a gradient function
given instead of the loss."""

import logging

import equinox as eqx
import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _source import line_of as _line_of
from flax import nnx

import jamp

# ---------------------------------------------------------------- 1. PRNG keys


class DropoutMLP(nnx.Module):
    """nnx's own layers, as its examples write them: Linear, Dropout, Rngs."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.head = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        h = self.dropout(nnx.relu(self.hidden(x)))
        return self.head(h)


def _nnx_step():
    """The loss of an NNX model over its parameters, with the rest of its state (dropout's
    typed key and its counter) passed beside them, as nnx.split gives them."""
    model = DropoutMLP(nnx.Rngs(0, dropout=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    keys = [
        x for x in jax.tree_util.tree_leaves(rest) if jnp.issubdtype(x.dtype, jax.dtypes.extended)
    ]
    assert keys, "the model's state holds a typed key"

    def loss(params, rest, x):
        m = nnx.merge(graphdef, params, rest, copy=True)
        y = m(x)
        return jnp.mean(jnp.exp(y))  # overflows when y is large

    return loss, params, rest


def test_nnx_model_with_dropout_key_is_reported_and_located():
    """A typed key in an NNX model's state is carried through unwidened: the report runs,
    and the locator names the planted overflow (it crashed on the key before)."""
    loss, params, rest = _nnx_step()
    x = jax.random.normal(jax.random.PRNGKey(2), (8, 4))
    report = jamp.debug.precision_report(loss, params, rest, x, dtype=jnp.bfloat16)
    assert report.rows and np.isfinite(report.recipes[0].loss)
    assert any("hidden" in g.path and "kernel" in g.path for g in report.gradients)
    assert jamp.debug.locate_nonfinite(loss, params, rest, x) is None
    site = jamp.debug.locate_nonfinite(loss, params, rest, x * 1e4)
    assert site is not None and site.primitive == "exp" and not site.backward
    assert site.line.startswith(_line_of(loss, "jnp.exp"))


def test_legacy_prng_key_argument():
    """A legacy uint32 ``PRNGKey`` argument, turned into random numbers inside the step."""

    def loss(w, key, x):
        noise = jax.random.normal(key, (3, 2))
        return jnp.mean((x @ w) * noise)

    w, key, x = jnp.ones((4, 2)), jax.random.PRNGKey(0), jnp.ones((3, 4))
    report = jamp.debug.precision_report(loss, w, key, x, dtype=jnp.float16)
    assert report.rows and [g.path for g in report.gradients] == ["argument 0"]
    assert jamp.debug.locate_nonfinite(loss, w, key, x) is None
    typed = jax.random.key(0)
    assert jamp.debug.precision_report(loss, w, typed, x).rows
    assert jamp.debug.locate_nonfinite(loss, w, typed, x) is None


# ---------------------------------------------------------------- 3. a non-finite constant

INF_AND_ONE = jnp.array([jnp.inf, 1.0])


def test_a_non_finite_constant_is_located_at_its_first_use():
    """An inf in a captured array, or a literal, is the culprit: its first use is named
    (the locator said None, "finite", before), with its line."""

    def captured(w):
        return jnp.sum(w * INF_AND_ONE)

    def literal(w):
        h = jnp.sin(w)
        return jnp.sum(h * jnp.inf)

    for fun, text in [(captured, "INF_AND_ONE"), (literal, "jnp.inf")]:
        for f in (fun, jax.jit(fun)):
            site = jamp.debug.locate_nonfinite(f, jnp.ones(2))
            assert site is not None and site.constant and site.primitive == "mul"
            assert site.line.startswith(_line_of(fun, text)) and not site.backward
            assert "non-finite constant" in str(site)
    # A finite step with a masking inf constant is still finite.
    assert (
        jamp.debug.locate_nonfinite(lambda w: jnp.max(jnp.where(w > 0, w, -jnp.inf)), jnp.ones(2))
        is None
    )
    # An operation that makes an inf from finite inputs comes before a constant's use.
    site = jamp.debug.locate_nonfinite(
        lambda w: jnp.sum(jnp.exp(w) * INF_AND_ONE), jnp.full(2, 100.0)
    )
    assert site.primitive == "exp" and not site.constant


def test_locate_when_skipped_names_a_constant_not_the_arguments(caplog):
    """A step skipped by a non-finite constant logs the constant's first use; it said
    that the (finite) arguments were not finite before."""

    def loss(w):
        return jnp.sum(w * INF_AND_ONE)

    tx = jamp.loss_scaling(optax.sgd(0.1), jamp.no_loss_scale())
    w = jnp.ones(2)

    @jax.jit
    def step(w, opt_state):
        grads = jax.grad(loss)(w)
        updates, opt_state = tx.update(grads, opt_state, w)
        jamp.debug.locate_when_skipped(opt_state, loss, w)
        return optax.apply_updates(w, updates), opt_state

    with caplog.at_level(logging.WARNING, logger="jamp"):
        _, state = step(w, tx.init(w))
        jax.effects_barrier()
    assert not bool(state.last_finite)
    (record,) = caplog.records
    message = record.getMessage()
    assert "mul at" in message and "non-finite constant" in message, message
    assert _line_of(loss, "INF_AND_ONE") in message
    assert "arguments were not finite" not in message


# ---------------------------------------------------------------- 7. small ones


def test_locate_when_skipped_takes_a_grad_scaler_state(caplog):
    """A GradScaler state after ``step`` tells whether the step was skipped (it raised
    ``KeyError: 'last_finite'`` before); a state holding no check is refused clearly."""
    scaler = jamp.GradScaler(init_scale=1.0)
    tx = optax.sgd(0.1)

    def loss(w, x):
        return jnp.sum(jnp.exp(x * w))

    @jax.jit
    def iteration(state, w, opt_state, x):
        grads = jax.grad(lambda p: scaler.scale(state, loss(p, x)))(w)
        w, opt_state, state = scaler.step(state, tx, grads, opt_state, w)
        jamp.debug.locate_when_skipped(state, loss, w, x)
        return scaler.update(state), w, opt_state

    w = jnp.ones(3)
    state, opt_state = scaler.init(), tx.init(w)
    with caplog.at_level(logging.WARNING, logger="jamp"):
        state, w, opt_state = iteration(state, w, opt_state, jnp.ones(3))
        jax.effects_barrier()
        assert not caplog.records
        iteration(state, w, opt_state, jnp.full(3, 200.0))
        jax.effects_barrier()
    (record,) = caplog.records
    assert "exp at" in record.getMessage() and _line_of(loss, "jnp.exp") in record.getMessage()
    with pytest.raises(TypeError, match="GradScaler.step"):
        jamp.debug.locate_when_skipped(scaler.init(), loss, w, jnp.ones(3))


def test_precision_report_takes_the_dtype_names_autocast_takes():
    """``"bfloat16"`` (as ``jamp.autocast`` takes it) is accepted, and names the recipe as
    the dtype does; a float8 format is refused at the edge, pointing at ``"float8"``."""

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w, x = jnp.ones((4, 2)) * 0.3, jnp.ones((3, 4))
    by_dtype = jamp.debug.precision_report(loss, w, x, dtype=jnp.bfloat16)
    for name in ("bfloat16", "bf16", " BFloat16 "):
        report = jamp.debug.precision_report(loss, w, x, dtype=name)
        assert report.recipes[0].dtype == "bfloat16"
        assert report.recipes[0].loss == by_dtype.recipes[0].loss
    assert jamp.debug.precision_report(loss, w, x, dtype=["f16", "bfloat16"])["float16"].rows
    for f8 in (jnp.float8_e4m3fn, "float8_e5m2"):
        with pytest.raises(ValueError, match="dtype='float8'"):
            jamp.debug.precision_report(loss, w, x, dtype=f8)
    for bad in (jnp.float32, "fp8", jnp.int8, 3):
        with pytest.raises(ValueError, match="`dtype`"):
            jamp.debug.precision_report(loss, w, x, dtype=bad)


def test_a_gradient_function_is_refused_clearly():
    """``jax.grad(loss)`` given instead of the loss: a TypeError that says what to pass
    (jax's "Gradient only defined for scalar-output functions" before)."""

    def loss(w, x):
        return jnp.sum(jnp.exp(x @ w))

    w, x = jnp.ones((4, 2)), jnp.ones((3, 4))
    message = "pass the loss, as `jax.value_and_grad` takes it"
    with pytest.raises(TypeError, match=message):
        jamp.debug.locate_nonfinite(jax.grad(loss), w, x)
    with pytest.raises(TypeError, match=message):
        jamp.debug.precision_report(jax.grad(loss), w, x)
    with pytest.raises(TypeError, match=message):
        jamp.debug.locate_nonfinite(jax.grad(lambda p: loss(p["w"], x)), {"w": w})


# ---------------------------------------------------------------- 4. two heads on one input


class Encoder(flax.linen.Module):
    """Flax's VAE example's encoder: two Dense heads read one hidden layer."""

    latents: int = 8

    @flax.linen.compact
    def __call__(self, x):
        x = flax.linen.relu(flax.linen.Dense(32, name="fc1")(x))
        mean_x = flax.linen.Dense(self.latents, name="fc2_mean")(x)
        logvar_x = flax.linen.Dense(self.latents, name="fc2_logvar")(x)
        return mean_x, logvar_x


def test_each_head_s_weight_gradient_names_its_own_kernel():
    # Both heads' forward products read the same hidden layer: the backward product of
    # fc2_logvar was labelled with fc2_mean's kernel, the first product that read it.
    model = Encoder()
    x = jnp.linspace(-1.0, 1.0, 4 * 16, dtype=jnp.float32).reshape(4, 16)
    params = model.init(jax.random.key(0), x)

    def loss(params, x):
        mean, logvar = model.apply(params, x)
        return jnp.mean(mean**2) + jnp.mean(jnp.exp(logvar) - logvar)

    report = jamp.debug.precision_report(loss, params, x, dtype=jnp.bfloat16, top=1000)
    weight_rows = {
        row.path: row.role
        for row in report.recipes[0].rows
        if row.backward and row.role.startswith("weight gradient")
    }
    for head in ("fc1", "fc2_mean", "fc2_logvar"):
        assert f"['params']['{head}']['kernel']" in weight_rows[f"Encoder/{head}"], weight_rows


# ---------------------------------------------------------------- 2. a harmless mask's -inf


def _masked_block(params, x, attention_mask):
    """An attention block run in float16 (a Flax model's ``dtype=jnp.float16`` over
    float32 parameters) with its mask as transformers' Flax models make it: from the
    batch's ``attention_mask``, a bias of ``finfo(float32).min`` cast to the compute dtype,
    which float16 makes ``-inf`` (and the softmax 0); then an MLP."""
    half = {name: w.astype(jnp.float16) for name, w in params.items()}
    x = x.astype(jnp.float16)
    seq = x.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), bool))[None] & (attention_mask[:, None, :] > 0)
    bias = jax.lax.select(
        causal,
        jnp.full(causal.shape, 0.0, jnp.float32),
        jnp.full(causal.shape, jnp.finfo(jnp.float32).min, jnp.float32),
    ).astype(jnp.float16)
    scores = jnp.einsum("bqd,bkd->bqk", x @ half["q"], x @ half["k"]) + bias
    h = x + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), x @ half["v"])
    up = h @ half["up"]  # the planted overflow: float16's largest is 65504
    out = jax.nn.relu(up) @ half["down"]
    return jnp.mean(out.astype(jnp.float32) ** 2)


def test_a_mask_made_infinite_and_then_zero_is_not_named():
    # In float16 the mask's cast is the first operation to make a non-finite value from
    # finite inputs (it was named, for GPT-2, BERT and T5), but the softmax makes its -inf
    # 0: it reaches neither the loss nor a gradient. The answer is the product whose inf
    # does.
    d, seq = 8, 6
    keys = jax.random.split(jax.random.key(0), 5)
    params = {n: 0.3 * jax.random.normal(k, (d, d)) for n, k in zip("qkv", keys, strict=False)}
    params["up"] = 0.3 * jax.random.normal(keys[3], (d, 4 * d))
    params["down"] = 0.3 * jax.random.normal(keys[4], (4 * d, d))
    x = jax.random.normal(jax.random.key(1), (2, seq, d))
    attention_mask = jnp.ones((2, seq), jnp.int32)
    step = _masked_block
    with jax.numpy_dtype_promotion("standard"):
        # The mask alone: the step is finite, nothing to name.
        assert jamp.debug.locate_nonfinite(step, params, x, attention_mask) is None
        # Each weight fits float16, their products with the block's output do not.
        planted = {**params, "up": jnp.full((d, 4 * d), 2e4, jnp.float32)}
        site = jamp.debug.locate_nonfinite(step, planted, x, attention_mask)
    assert site is not None
    assert (site.primitive, site.backward) == ("dot_general", False), str(site)
    assert site.line.startswith(_line_of(_masked_block, 'half["up"]') + " "), str(site)


# ---------------------------------------------------------------- 5. Equinox: which layer


def _eqx_mlp_loss():
    """Equinox's MLP (three Linear layers, one class name each in the name stack) under
    float16 autocast, its loss scaled by ``scale``."""
    mlp = eqx.nn.MLP(8, 4, width_size=16, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(1), (32, 8))

    def loss(p, x, scale):
        return jnp.mean(jax.vmap(eqx.combine(p, static))(x) ** 2) * scale

    return jamp.autocast(loss, jnp.float16), params, x


def test_equinox_layers_are_told_apart_by_their_parameters():
    # Equinox's name stack says eqx.nn.MLP/eqx.nn.Linear for every layer: each row now
    # also names its layer by the parameters' path in the argument.
    loss, params, x = _eqx_mlp_loss()
    # A backward overflow: the loss scaled by 1e7 makes the last layer's first backward
    # product overflow float16 while the forward pass stays finite.
    site = jamp.debug.locate_nonfinite(loss, params, x, 1e7)
    assert (site.primitive, site.pass_) == ("dot_general", "backward"), site
    assert site.path == "eqx.nn.MLP/eqx.nn.Linear (.layers[2])", site
    # A forward overflow planted in the middle layer's weight.
    hot = eqx.tree_at(lambda p: p.layers[1].weight, params, params.layers[1].weight * 1e5)
    site = jamp.debug.locate_nonfinite(loss, hot, x, 1.0)
    assert (site.primitive, site.pass_) == ("dot_general", "forward"), site
    assert site.path == "eqx.nn.MLP/eqx.nn.Linear (.layers[1])", site
    report = jamp.debug.precision_report(loss, params, x, 1.0, dtype=jnp.float16, top=1000)
    products = {r.path for r in report.rows if r.primitive == "dot_general" and not r.backward}
    assert products == {f"eqx.nn.MLP/eqx.nn.Linear (.layers[{i}])" for i in range(3)}, products
