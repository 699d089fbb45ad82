"""Closing over the batch or passing it as an argument: the same arithmetic (issue #44, 7).

Flax's VAE example (``examples/vae``: an encoder of two Dense heads on one hidden layer, the
reparameterisation, a decoder; its loss is the binary cross-entropy of the logits plus the
KL divergence; here on 16x16 images) under ``jamp.autocast(..., bfloat16)``, its batch
closed over in one loss and an argument of the other. A closed-over array is a constant of
the traced program: autocast computes an operation on constants alone when it traces ``fun``
if its output has at most ``FOLD_MAX`` elements (a batch of 4 images of 16x16: its cast to
bfloat16), so the closed-over program can hold one ``convert_element_type`` fewer, the
cast's values the same. The gradients are the same bits, under ``jit``, whether the batch is
folded or not.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp._src.autocast.values import FOLD_MAX


class Encoder(nn.Module):
    latents: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="fc1")(x))
        return nn.Dense(self.latents, name="fc2_mean")(x), nn.Dense(
            self.latents, name="fc2_logvar"
        )(x)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, z):
        return nn.Dense(256, name="fc2")(nn.relu(nn.Dense(64, name="fc1")(z)))


class VAE(nn.Module):
    latents: int = 20

    def setup(self):
        self.encoder, self.decoder = Encoder(self.latents), Decoder()

    def __call__(self, x, z_rng):
        mean, logvar = self.encoder(x)
        z = mean + jax.random.normal(z_rng, logvar.shape) * jnp.exp(0.5 * logvar)
        return self.decoder(z), mean, logvar


@jax.vmap
def kl_divergence(mean, logvar):
    return -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar))


@jax.vmap
def binary_cross_entropy_with_logits(logits, labels):
    logits = nn.log_sigmoid(logits)
    return -jnp.sum(labels * logits + (1.0 - labels) * jnp.log(-jnp.expm1(logits)))


def _bits(tree):
    return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("batch_size", [4, 32])  # 4 x 256 <= FOLD_MAX < 32 x 256
def test_a_closed_over_batch_gives_the_gradients_of_a_batch_argument(batch_size):
    model, z_rng = VAE(), jax.random.key(3)
    batch = (jax.random.uniform(jax.random.key(1), (batch_size, 256)) > 0.5).astype(jnp.float32)
    params = jax.jit(model.init)({"params": jax.random.key(0)}, batch, jax.random.key(2))["params"]

    def loss(params, batch):
        recon, mean, logvar = model.apply({"params": params}, batch, z_rng)
        return (binary_cross_entropy_with_logits(recon, batch).mean()
                + kl_divergence(mean, logvar).mean())  # fmt: skip

    closed = jamp.autocast(lambda params: loss(params, batch), jnp.bfloat16)
    argument = jamp.autocast(loss, jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):  # the example's `1 + logvar`, `1.0 - labels`
        by_argument = jax.jit(jax.grad(argument))(params, batch)
        by_closure = jax.jit(jax.grad(closed))(params)
        converts = [
            str(jax.make_jaxpr(jax.grad(f))(*a)).count("convert_element_type")
            for f, a in ((argument, (params, batch)), (closed, (params,)))
        ]
    for a, b in zip(_bits(by_argument), _bits(by_closure), strict=True):
        np.testing.assert_array_equal(a, b)
    folded = batch.size <= FOLD_MAX
    assert converts[0] - converts[1] == (1 if folded else 0), converts
