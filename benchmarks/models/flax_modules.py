"""The Flax modules at any ``dtype`` (:func:`flax_model`): the GPT blocks, the GroupNorm
CNN, the attention blocks with dropout, the ResNet."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from benchmarks.models.base import DROPOUT_KEY, F32, Model, images, mse, sequences, xent

# --------------------------------------------------------------------- Flax modules


class Block(nn.Module):
    """A pre-LayerNorm transformer block; the residual stream is whatever comes in."""

    heads: int
    dtype: Any = None
    param_dtype: Any = F32
    attention: Callable = nn.dot_product_attention  # Flax's attention_fn

    @nn.compact
    def __call__(self, x, mask):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = nn.LayerNorm(**kw)(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, deterministic=True, attention_fn=self.attention, **kw
        )(h, mask=mask)
        x = x + h
        h = nn.LayerNorm(**kw)(x)
        h = nn.Dense(4 * x.shape[-1], **kw)(h)
        h = nn.gelu(h)
        h = nn.Dense(x.shape[-1], **kw)(h)
        return x + h


class GPTStack(nn.Module):
    layers: int
    heads: int
    dtype: Any = None
    param_dtype: Any = F32
    attention: Callable = nn.dot_product_attention

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        for _ in range(self.layers):
            x = Block(self.heads, self.dtype, self.param_dtype, self.attention)(x, mask)
        return x


class CNN(nn.Module):
    features: tuple[int, ...]
    groups: int
    dtype: Any = None
    param_dtype: Any = F32

    @nn.compact
    def __call__(self, x):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        for i, f in enumerate(self.features):
            x = nn.Conv(f, (3, 3), strides=1 if i == 0 else 2, **kw)(x)
            x = nn.GroupNorm(num_groups=self.groups, **kw)(x)
            x = nn.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(10, **kw)(x)


class DropoutBlock(nn.Module):
    """LayerNorm, causal self-attention with dropout on its probabilities, a residual."""

    heads: int
    dtype: Any = None
    param_dtype: Any = F32
    rate: float = 0.1

    @nn.compact
    def __call__(self, x):
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, dropout_rate=self.rate, deterministic=False, **kw
        )(nn.LayerNorm(**kw)(x), mask=mask)
        return x + h


class GQABlock(nn.Module):
    """LayerNorm, causal attention with grouped KV heads written as Gemma writes it
    (flax examples/gemma: the probabilities reshaped to ``(B, T, K, G, S)`` for ``p @ v``),
    dropout on the probabilities, a residual."""

    heads: int
    kv_heads: int
    dtype: Any = None
    param_dtype: Any = F32
    rate: float = 0.1

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        n, k = self.heads, self.kv_heads
        hd, g = d // n, n // k
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=False)
        h = nn.LayerNorm(dtype=self.dtype, param_dtype=self.param_dtype)(x)
        q = nn.DenseGeneral((n, hd), **kw)(h).reshape(b, t, k, g, hd)
        key, value = nn.DenseGeneral((k, hd), **kw)(h), nn.DenseGeneral((k, hd), **kw)(h)
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, key).reshape(b, t, n, t) * hd**-0.5
        causal = jnp.tril(jnp.ones((t, t), bool))[None, :, None, :]
        logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
        probs = nn.Dropout(self.rate, deterministic=False)(jax.nn.softmax(logits, axis=-1))
        out = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(b, t, k, g, t), value)
        return x + nn.DenseGeneral(d, axis=(-2, -1), **kw)(out.reshape(b, t, n, hd))


class ResBlock(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        bn = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9)
        h = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
        h = nn.relu(bn()(h))
        h = bn()(nn.Conv(self.features, (3, 3), use_bias=False)(h))
        if x.shape[-1] != self.features or self.strides != 1:
            x = bn()(nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + h)


class ResNet(nn.Module):
    stages: tuple[int, ...]
    blocks: int = 2

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(self.stages[0], (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9)(x))
        for i, f in enumerate(self.stages):
            for j in range(self.blocks):
                x = ResBlock(f, 2 if (i > 0 and j == 0) else 1)(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def flax_model(name, describe, module, batch, head, rngs=False) -> Model:
    """A Flax module's :class:`Model`: ``module(dtype=None, param_dtype=float32)`` applied to
    ``batch[0]``, ``head(float32 outputs, batch[1])`` its loss; its parameters from
    ``jax.random.key(0)`` (shape structs for a batch of shape structs), its other
    collections (BatchNorm's statistics) the model state. With ``rngs`` the module takes a
    dropout key: ``jax.random.key(1)`` at init, ``DROPOUT_KEY`` in the loss."""
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    keys, x = keys if rngs else keys["params"], batch[0]
    if isinstance(x, jax.ShapeDtypeStruct):
        variables = jax.eval_shape(lambda: module().init(keys, jnp.zeros(x.shape, x.dtype)))
    else:
        variables = module().init(keys, x)
    kw = {"rngs": {"dropout": jax.random.key(DROPOUT_KEY)}} if rngs else {}

    def at(dtype=None, param_dtype=F32):
        m = module() if (dtype, param_dtype) == (None, F32) else module(dtype, param_dtype)

        def loss(p, ms, batch):
            x, y = batch
            if ms:
                out, new = m.apply({"params": p, **ms}, x, mutable=list(ms), **kw)
            else:
                out, new = m.apply({"params": p}, x, **kw), {}
            return head(out.astype(F32), y), new

        return loss

    mstate = {k: v for k, v in variables.items() if k != "params"}
    return Model(name, describe, variables["params"], batch, at(), mstate, at)


def gpt_stack(d: int, heads: int, layers: int, b: int, t: int, seed: int | None = None,
              attention: Callable = nn.dot_product_attention) -> Model:  # fmt: skip
    """``layers`` Flax pre-LayerNorm blocks (causal self-attention, gelu MLP), MSE loss;
    ``attention`` is the attention heads' ``attention_fn``."""
    describe = f"{layers} Flax GPT blocks, d {d}, {heads} heads, batch {b}x{t}, MSE loss"
    return flax_model("GPT", describe, lambda dt=None, pdt=F32: GPTStack(layers, heads, dt, pdt,
                      attention), sequences(b, t, d, seed), mse)  # fmt: skip


def cnn(feats: tuple, groups: int, b: int, size: int, seed: int | None = None) -> Model:
    """Conv 3x3 + bias, GroupNorm, relu per feature count; mean pool, Dense(10), cross-entropy."""
    describe = (
        f"3 x (Conv 3x3 + bias, GroupNorm({groups}), relu), features {feats}, "
        f"{size}x{size}x3 images, batch {b}, cross-entropy"
    )
    return flax_model("CNN", describe, lambda dt=None, pdt=F32: CNN(feats, groups, dt, pdt),
                      images(b, size, seed), xent)  # fmt: skip


def dropout_block(d: int, heads: int, b: int, t: int, seed: int | None = None) -> Model:
    describe = f"one dropout block, d {d}, {heads} heads, batch {b}x{t}"
    return flax_model("Attention+dropout", describe,
                      lambda dt=None, pdt=F32: DropoutBlock(heads, dt, pdt),
                      sequences(b, t, d, seed), mse, rngs=True)  # fmt: skip


def gqa_block(d: int, heads: int, kv: int, b: int, t: int, seed: int | None = None) -> Model:
    describe = (
        f"one grouped-KV attention block with dropout, d {d}, {heads} query heads over {kv} "
        f"KV heads, batch {b}x{t}"
    )
    return flax_model("GQA", describe, lambda dt=None, pdt=F32: GQABlock(heads, kv, dt, pdt),
                      sequences(b, t, d, seed), mse, rngs=True)  # fmt: skip


def resnet(stages: tuple, blocks: int, size: int, b: int) -> Model:
    """A Flax ResNet with BatchNorm (float32 only: no ``dtype``), shape structs."""
    describe = (
        f"Flax ResNet with BatchNorm: {len(stages)} stages {stages} of {blocks} basic blocks, "
        f"{size}x{size}x3 images, batch {b}, cross-entropy"
    )
    return flax_model("ResNet", describe, lambda: ResNet(stages, blocks), images(b, size), xent)
