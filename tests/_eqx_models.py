"""Equinox models shared by test files, written as Equinox's examples write them."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax


class TrainRNN(eqx.Module):
    """Equinox's ``train_rnn`` example: a ``GRUCell(2, 16)`` scanned over the sequence, a
    linear readout and a scalar bias."""

    cell: eqx.nn.GRUCell
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, key):
        ckey, lkey = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(2, 16, key=ckey)
        self.linear = eqx.nn.Linear(16, 1, use_bias=False, key=lkey)
        self.bias = jnp.zeros(1)

    def __call__(self, xs):
        def step(h, x):
            return self.cell(x, h), None

        h, _ = lax.scan(step, jnp.zeros((16,), xs.dtype), xs)
        return self.linear(h) + self.bias
