"""Every model the benchmarks run, each defined once (the hub; ``benchmarks/README.md``).

A :class:`Model` is float32 parameters (arrays, or shape structs for the GPU compile), a
batch and a loss; ``steps`` builds the training steps and precision variants from it.
Plain JAX: the loss-scaling MLP and GPT (:func:`mlp`, :func:`gpt`) and float8's MLP and
GPT stack, every product through an ``einsum`` hook the per-tensor reference replaces.
Flax modules at any ``dtype`` (:func:`flax_model`), the real models (:data:`REAL`), the
torch twins and the digits demo. The three GPTs are three models, not one written three
ways: each is the model recorded figures of ``RESULTS.md`` were measured on.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax import lax

import jamp
from benchmarks.report import version

F32, BF16 = jnp.float32, jnp.bfloat16
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
DROPOUT_KEY = 7  # every dropout mask of a measured step comes from jax.random.key(7)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Model:
    """Float32 parameters, the model state, a batch and ``loss(params, mstate, batch) -> (float32
    loss, new mstate)`` (``None`` for the optimizer step alone, whose batch is the gradients);
    ``at(dtype, param_dtype)`` is the loss of the model built with its own ``dtype=``."""

    name: str
    describe: str
    params: Any
    batch: Any
    loss: Callable | None
    mstate: Any = dataclasses.field(default_factory=dict)
    at: Callable | None = None

    @property
    def n_params(self) -> int:
        return int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(self.params)))

    @property
    def n_leaves(self) -> int:
        return len(jax.tree_util.tree_leaves(self.params))

    def scalar(self, loss: Callable | None = None) -> Callable:
        """``loss`` (this model's by default) as ``(params, batch) -> float32 loss``."""
        loss = self.loss if loss is None else loss
        return lambda p, batch: loss(p, self.mstate, batch)[0]

    def scalar_at(self, *dtypes: Any) -> Callable:
        """``at(*dtypes)`` as ``(params, batch) -> float32 loss``."""
        return self.scalar(self.at(*dtypes))


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, F32)


def normal(seed: int, *shape: int, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, F32)


def sequences(b: int, t: int, d: int, seed: int | None = None) -> tuple:
    """(inputs, targets) of shape ``(b, t, d)``: standard normal from the seeds ``seed``
    and ``seed + 1``, or shape structs (``seed=None``)."""
    if seed is None:
        return _f32(b, t, d), _f32(b, t, d)
    return normal(seed, b, t, d), normal(seed + 1, b, t, d)


def images(b: int, size: int, seed: int | None = None) -> tuple:
    """(``(b, size, size, 3)`` images, ``b`` labels of 10 classes) from the seeds ``seed``,
    ``seed + 1``, or shape structs (``seed=None``)."""
    if seed is None:
        return _f32(b, size, size, 3), jax.ShapeDtypeStruct((b,), jnp.int32)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((b, size, size, 3)), F32)
    return x, jnp.asarray(np.random.default_rng(seed + 1).integers(0, 10, (b,)), jnp.int32)


def mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(out - y))


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits = logits.astype(F32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


# --------------------------------------------------------------------- plain JAX: loss scaling


def mlp(sizes=(784, 2048, 2048, 2048, 1024, 10), batch=128, seed=0) -> Model:
    """The 12M-parameter MLP of the loss-scaling benchmark (relu, cross-entropy)."""
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"l{i}"] = {
            "w": jnp.asarray(rng.standard_normal((a, b), np.float32) / math.sqrt(a)),
            "b": jnp.zeros((b,), F32),
        }
    x = jnp.asarray(rng.standard_normal((batch, sizes[0]), np.float32))
    y = jnp.asarray(rng.integers(0, sizes[-1], (batch,)), jnp.int32)
    n = len(sizes) - 1

    def loss(p, ms, b):
        h, labels = b
        for i in range(n):
            h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            if i < n - 1:
                h = jax.nn.relu(h)
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1)), ms

    return Model("MLP", f"MLP {'-'.join(map(str, sizes))}, batch {batch}", params, (x, y), loss)


def gpt(vocab=8192, d=256, layers=6, heads=4, seq=64, batch=4, seed=0) -> Model:
    """The loss-scaling benchmark's GPT: a language model, every product with a bias."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.02):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale)

    params: dict[str, Any] = {"wte": w(vocab, d), "wpe": w(seq, d)}
    for i in range(layers):
        params[f"h{i}"] = {
            "ln1_g": jnp.ones((d,), F32),
            "ln1_b": jnp.zeros((d,), F32),
            "qkv_w": w(d, 3 * d),
            "qkv_b": jnp.zeros((3 * d,), F32),
            "proj_w": w(d, d),
            "proj_b": jnp.zeros((d,), F32),
            "ln2_g": jnp.ones((d,), F32),
            "ln2_b": jnp.zeros((d,), F32),
            "fc_w": w(d, 4 * d),
            "fc_b": jnp.zeros((4 * d,), F32),
            "out_w": w(4 * d, d),
            "out_b": jnp.zeros((d,), F32),
        }
    params["lnf_g"] = jnp.ones((d,), F32)
    params["lnf_b"] = jnp.zeros((d,), F32)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)

    def ln(x, g, b):
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b

    def loss(p, ms, toks):
        inp, tgt = toks[:, :-1], toks[:, 1:]
        B, T = inp.shape
        h = p["wte"][inp] + p["wpe"][:T]
        mask = jnp.tril(jnp.ones((T, T), bool))
        for i in range(layers):
            q = p[f"h{i}"]
            qkv = ln(h, q["ln1_g"], q["ln1_b"]) @ q["qkv_w"] + q["qkv_b"]
            qkv = qkv.reshape(B, T, 3, heads, d // heads)
            qq, kk, vv = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            att = jnp.einsum("bthd,bshd->bhts", qq, kk) / math.sqrt(d // heads)
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
            o = jnp.einsum("bhts,bshd->bthd", att, vv).reshape(B, T, d)
            h = h + o @ q["proj_w"] + q["proj_b"]
            m = jax.nn.gelu(ln(h, q["ln2_g"], q["ln2_b"]) @ q["fc_w"] + q["fc_b"])
            h = h + m @ q["out_w"] + q["out_b"]
        h = ln(h, p["lnf_g"], p["lnf_b"])
        logp = jax.nn.log_softmax(h @ p["wte"].T)
        return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1)), ms

    describe = f"GPT d={d}, {layers} layers, {heads} heads, vocab {vocab}, seq {seq}, batch {batch}"
    return Model("GPT", describe, params, tokens, loss)


def optimizer(n: int = 1024, m: int = 1024, layers: int = 12) -> Model:
    """The optimizer step alone (no loss): ``layers`` weights of ``n x m`` and biases."""
    params = {f"l{i}": {"w": _f32(n, m), "b": _f32(m)} for i in range(layers)}
    describe = (
        f"the optimizer step alone: {2 * layers} leaves ({layers} x {n}x{m} + {layers} x {m})"
    )
    return Model("optimizer", describe, params, params, None)


# --------------------------------------------------------------------- plain JAX: float8


def _qdq(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` rounded to ``dtype`` with a per-tensor scale from its amax, back in float32."""
    big = float(jnp.finfo(dtype).max)
    x = x.astype(F32)
    scale = big / jnp.maximum(jnp.max(jnp.abs(x)), big * 2.0**-126)
    return jnp.clip(x * scale, -big, big).astype(dtype).astype(F32) / scale


@jax.custom_vjp
def _q_operand(x: jax.Array) -> jax.Array:
    return _qdq(x, E4M3)


_q_operand.defvjp(lambda x: (_qdq(x, E4M3), None), lambda _, g: (g,))  # straight through


@jax.custom_vjp
def _q_grad(y: jax.Array) -> jax.Array:
    return y


_q_grad.defvjp(lambda y: (y, None), lambda _, g: (_qdq(g, E5M2),))


def reference_einsum(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """A float8 product written out: e4m3 operands, an e5m2 output gradient, float32 math."""
    return _q_grad(jnp.einsum(subscripts, _q_operand(a), _q_operand(b)))


def reference_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type
    return _q_grad(lax.dot_general(_q_operand(lhs), _q_operand(rhs), dimension_numbers))


def mlp_params(sizes: tuple[int, ...], seed: int = 0) -> dict:
    return {
        f"l{i}": {"w": normal(seed + i, a, b, scale=a**-0.5), "b": jnp.zeros(b, F32)}
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True))
    }


def mlp_forward(params: dict, x: jax.Array, einsum: Callable = jnp.einsum) -> jax.Array:
    """float8's MLP: gelu, biases."""
    n = len(params)
    for i in range(n):
        x = einsum("bi,io->bo", x, params[f"l{i}"]["w"]) + params[f"l{i}"]["b"][None, :]
        if i < n - 1:
            x = jax.nn.gelu(x)
    return x


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-6) * g + b


def gpt_params(d: int, layers: int, seed: int = 0) -> dict:
    out = {}
    for i in range(layers):
        s = seed + 10 * i
        out[f"h{i}"] = {
            "ln1": (jnp.ones(d, F32), jnp.zeros(d, F32)),
            "qkv": normal(s, d, 3 * d, scale=d**-0.5),
            "proj": normal(s + 1, d, d, scale=d**-0.5),
            "ln2": (jnp.ones(d, F32), jnp.zeros(d, F32)),
            "fc": normal(s + 2, d, 4 * d, scale=d**-0.5),
            "fc_b": jnp.zeros(4 * d, F32),
            "out": normal(s + 3, 4 * d, d, scale=(4 * d) ** -0.5),
        }
    return out


def gpt_forward(
    params: dict, x: jax.Array, heads: int, einsum: Callable = jnp.einsum, attention_dtype=None
) -> jax.Array:
    """float8's GPT block stack: x (batch, time, d) float32 residual stream -> same shape."""
    b, t, d = x.shape
    causal = jnp.tril(jnp.ones((t, t), bool))

    def attend(q, k, v):
        scores = einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // heads)
        scores = jnp.where(causal[None, None], scores, jnp.finfo(scores.dtype).min)
        return einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)

    if attention_dtype is not None:  # a nested autocast: the innermost setting wins
        attend = jamp.autocast(attend, attention_dtype)
    for i in range(len(params)):
        p = params[f"h{i}"]
        h = layer_norm(x, *p["ln1"])
        q, k, v = jnp.split(einsum("btd,de->bte", h, p["qkv"]), 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
        x = x + einsum("btd,de->bte", attend(q, k, v).reshape(b, t, d), p["proj"])
        h = layer_norm(x, *p["ln2"])
        h = jax.nn.gelu(einsum("btd,df->btf", h, p["fc"]) + p["fc_b"][None, None, :])
        x = x + einsum("btf,fd->btd", h, p["out"])
    return x


def bf16_einsum(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """A product of bfloat16 operands with a float32 result (the forward of mixed precision)."""
    return jnp.einsum(subscripts, a.astype(BF16), b.astype(BF16), preferred_element_type=F32)


def char_gpt(d: int, layers: int, heads: int, seq: int, seed: int = 0) -> tuple[dict, Callable]:
    """The optimizer-memory GPT: (float32 params, ``loss(params, tokens (b, seq + 1))``).

    Byte tokens (vocab 256), learned positions, float8's block stack (:func:`gpt_forward`)
    with every product in bfloat16 (:func:`bf16_einsum`) on a float32 residual stream, a
    final LayerNorm and the tied embedding as the head; the mean cross-entropy."""
    params = {"wte": normal(seed + 1000, 256, d, scale=0.02), "blocks": gpt_params(d, layers, seed),
              "wpe": normal(seed + 1001, seq, d, scale=0.02),
              "lnf": (jnp.ones(d, F32), jnp.zeros(d, F32))}  # fmt: skip

    def loss(p: dict, tokens: jax.Array) -> jax.Array:
        inp, tgt = tokens[:, :-1], tokens[:, 1:]
        x = p["wte"][inp].astype(F32) + p["wpe"][: inp.shape[1]].astype(F32)
        x = gpt_forward(p["blocks"], x, heads, einsum=bf16_einsum)
        return xent(bf16_einsum("btd,vd->btv", layer_norm(x, *p["lnf"]), p["wte"]), tgt)

    return params, loss


def load(path: str, name: str) -> Any:
    """The module at ``path``, imported as ``name`` (its dataclasses look themselves up)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digits_demo() -> Any:
    """The module ``examples/train_digits.py``: its data, CNN, batch and loss normaliser."""
    return sys.modules.get("train_digits") or load(
        f"{ROOT}/examples/train_digits.py", "train_digits"
    )


class ReferenceCNN(nn.Module):
    """The digits demo's CNN (same parameter tree), its dense products through the reference."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64, dot_general=reference_dot_general)(x))
        return nn.Dense(10, dot_general=reference_dot_general)(x)


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


# --------------------------------------------------------------------- torch twins


def torch_mlp(sizes):
    """The MLP in torch (relu), for the loss-scaling benchmark's PyTorch rows."""
    import torch

    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def torch_gpt(d, heads, layers, b, t):
    """The GPT stack in torch: (blocks, forward() -> loss, inputs)."""
    import torch
    import torch.nn.functional as F
    from torch import nn as tnn

    class TBlock(tnn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = tnn.LayerNorm(d), tnn.LayerNorm(d)
            self.q, self.k, self.v, self.o = (tnn.Linear(d, d) for _ in range(4))
            self.fc, self.out = tnn.Linear(d, 4 * d), tnn.Linear(4 * d, d)

        def forward(self, x, mask):
            h = self.ln1(x)
            q, k, v = (m(h).view(b, t, heads, d // heads).transpose(1, 2)
                       for m in (self.q, self.k, self.v))  # fmt: skip
            a = (q / (d // heads) ** 0.5) @ k.transpose(-1, -2)
            a = torch.softmax(a.masked_fill(~mask, torch.finfo(a.dtype).min), dim=-1)
            x = x + self.o((a @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    torch.manual_seed(0)
    blocks = tnn.ModuleList(TBlock() for _ in range(layers))
    mask = torch.tril(torch.ones(t, t, dtype=torch.bool))
    x, y = torch.randn(b, t, d), torch.randn(b, t, d)

    def forward():
        h = x
        for blk in blocks:
            h = blk(h, mask)
        return ((h.float() - y) ** 2).mean()

    return blocks, forward, (x, y, mask)


def torch_cnn(feats, groups, b, size):
    """The CNN in torch: (model, forward() -> loss, inputs)."""
    import torch
    from torch import nn as tnn

    torch.manual_seed(0)
    layers, c = [], 3
    for i, f in enumerate(feats):
        layers += [tnn.Conv2d(c, f, 3, stride=1 if i == 0 else 2, padding=1),
                   tnn.GroupNorm(groups, f), tnn.ReLU()]  # fmt: skip
        c = f
    body, head = tnn.Sequential(*layers), tnn.Linear(c, 10)
    model = tnn.ModuleList([body, head])
    x, labels = torch.randn(b, 3, size, size), torch.randint(0, 10, (b,))

    def forward():
        logits = head(body(x).mean(dim=(2, 3)))
        return torch.nn.functional.cross_entropy(logits.float(), labels)

    return model, forward, (x, labels)


# --------------------------------------------------------------------- real models


class Skip(Exception):
    """A model that cannot be built here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Shapes:
    vocab: int
    d: int
    heads: int
    layers: int
    mlp: int
    batch: int
    seq: int

    def text(self) -> str:
        return (f"{self.layers} layers, d {self.d}, {self.heads} heads, MLP {self.mlp}, "
                f"vocab {self.vocab}, batch {self.batch}x{self.seq}")  # fmt: skip


def _tokens(s: Shapes, seed: int) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(1, s.vocab, (s.batch, s.seq)), jnp.int32)


def _key() -> jax.Array:
    """The dropout key: an argument, as a train step's (a closed-over key's masks are constants)."""
    return jax.random.key(DROPOUT_KEY)


def _example(examples: str, rel: str):
    """A module of flax's examples, imported from ``examples/rel`` under a private name."""
    if not examples or not os.path.exists(os.path.join(examples, rel)):
        raise Skip(f"no `{rel}` under --flax-examples {examples or '(not given)'}")
    return load(os.path.join(examples, rel), "_flax_examples_" + rel.replace("/", "_")[:-3])


def _real(name, describe, params, batch, loss_at) -> Model:
    """A real model: ``loss_at(dtype)`` is ``(params, batch) -> loss`` of the model built with
    that ``dtype`` (float32 for ``None``)."""

    def at(dtype=None):
        loss = loss_at(dtype or F32)
        return lambda p, ms, batch: (loss(p, batch), ms)

    return Model(name, describe, params, batch, at(), {}, at)


def _linen(name, describe, module_of, args, targets) -> Model:
    """A linen model: ``module_of(dtype)``, applied to ``args``, cross-entropy on ``targets``."""
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    params = nn.meta.unbox(module_of(F32).init(keys, *args))

    def loss_at(dtype):
        m = module_of(dtype)
        return lambda p, batch: xent(m.apply(p, *batch[:-2], rngs={"dropout": batch[-1]}),
                                     batch[-2])  # fmt: skip

    return _real(name, describe, params, (*args, targets, _key()), loss_at)


def _config(mod, s: Shapes, dtype):
    return mod.TransformerConfig(
        vocab_size=s.vocab, output_vocab_size=s.vocab, dtype=dtype, emb_dim=s.d,
        num_heads=s.heads, num_layers=s.layers, qkv_dim=s.d, mlp_dim=s.mlp, max_len=s.seq,
        dropout_rate=0.1, attention_dropout_rate=0.1, deterministic=False,
    )  # fmt: skip


def lm1b(s: Shapes, examples: str) -> Model:
    mod, x = _example(examples, "lm1b/models.py"), _tokens(s, 0)
    return _linen("lm1b TransformerLM",
                  f"flax examples/lm1b `TransformerLM`: {s.text()}, dropout 0.1 and attention "
                  "dropout 0.1, causal, next-token cross-entropy",
                  lambda dt: mod.TransformerLM(_config(mod, s, dt)), (x,), x)  # fmt: skip


def wmt(s: Shapes, examples: str) -> Model:
    mod, x, y = _example(examples, "wmt/models.py"), _tokens(s, 1), _tokens(s, 2)
    return _linen("wmt Transformer",
                  f"flax examples/wmt `Transformer` (encoder-decoder): {s.text()} each side, "
                  "dropout 0.1 and attention dropout 0.1, cross-entropy on the targets",
                  lambda dt: mod.Transformer(_config(mod, s, dt)), (x, y), y)  # fmt: skip


def bert(s: Shapes, examples: str) -> Model:
    del examples
    try:
        from transformers import BertConfig, FlaxBertForMaskedLM
    except Exception as e:  # noqa: BLE001 - any failure to import is a reason to skip
        raise Skip(f"transformers' Flax BERT is not importable: {type(e).__name__}: {e}") from e
    cfg = BertConfig(vocab_size=s.vocab, hidden_size=s.d, num_hidden_layers=s.layers,
                     num_attention_heads=s.heads, intermediate_size=s.mlp,
                     max_position_embeddings=s.seq, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1)  # fmt: skip
    f32 = FlaxBertForMaskedLM(cfg, seed=0, dtype=F32)

    def loss_at(dtype):
        m = f32 if dtype == F32 else FlaxBertForMaskedLM(cfg, dtype=dtype, _do_init=False)

        def loss(p, batch):
            ids, labels, key = batch
            return xent(m(ids, params=p, dropout_rng=key, train=True).logits, labels)

        return loss

    return _real("HF FlaxBertForMaskedLM",
                 f"transformers {version('transformers')} `FlaxBertForMaskedLM`, random init: "
                 f"{s.text()}, hidden and attention dropout 0.1, cross-entropy at every position",
                 f32.params, (_tokens(s, 3), _tokens(s, 4), _key()), loss_at)  # fmt: skip


def _nnx_model(name, describe, build, call, batch) -> Model:
    """An NNX model: ``build(dtype)``; ``call(module, batch, rngs)`` -> the loss."""
    from flax import nnx

    graph, params, rest = nnx.split(build(F32), nnx.Param, ...)

    def loss_at(dtype):
        g = graph if dtype == F32 else nnx.split(nnx.eval_shape(lambda: build(dtype)),
                                                 nnx.Param, ...)[0]  # fmt: skip
        return lambda p, batch: call(nnx.merge(g, p, rest), batch[:-1],
                                     nnx.Rngs(dropout=batch[-1]))  # fmt: skip

    return _real(name, describe, params, (*batch, _key()), loss_at)


def nnx_builtins(s: Shapes, examples: str) -> Model:
    del examples
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, dtype, rngs):
            d = s.d
            self.ln1, self.ln2 = (nnx.LayerNorm(d, dtype=dtype, rngs=rngs) for _ in range(2))
            self.attn = nnx.MultiHeadAttention(s.heads, d, dropout_rate=0.1, decode=False,
                                               keep_rngs=False, dtype=dtype, rngs=rngs)  # fmt: skip
            self.fc1 = nnx.Linear(d, s.mlp, dtype=dtype, rngs=rngs)
            self.fc2 = nnx.Linear(s.mlp, d, dtype=dtype, rngs=rngs)
            self.drop = nnx.Dropout(0.1)

        def __call__(self, x, mask, rngs):
            x = x + self.drop(self.attn(self.ln1(x), mask=mask, deterministic=False, rngs=rngs),
                              rngs=rngs)  # fmt: skip
            h = self.drop(nnx.gelu(self.fc1(self.ln2(x))), rngs=rngs)
            return x + self.drop(self.fc2(h), rngs=rngs)

    class LM(nnx.Module):
        def __init__(self, dtype, rngs):
            self.embed = nnx.Embed(s.vocab, s.d, dtype=dtype, rngs=rngs)
            self.blocks = nnx.List([Block(dtype, rngs) for _ in range(s.layers)])
            self.norm = nnx.LayerNorm(s.d, dtype=dtype, rngs=rngs)
            self.head = nnx.Linear(s.d, s.vocab, dtype=dtype, rngs=rngs)

        def __call__(self, tokens, rngs):
            x, mask = self.embed(tokens), nnx.make_causal_mask(tokens)
            for block in self.blocks:
                x = block(x, mask, rngs)
            return self.head(self.norm(x))

    def call(m, batch, rngs):
        tokens, targets = batch
        return xent(m(tokens, rngs), targets)

    return _nnx_model("NNX built-ins",
                      f"flax NNX `Embed`, pre-LN blocks of `MultiHeadAttention(dropout_rate=0.1)`,"
                      f" `LayerNorm`, `Linear`, gelu, `Dropout(0.1)`: {s.text()}, causal, "
                      "cross-entropy", lambda dt: LM(dt, nnx.Rngs(0)), call,
                      (_tokens(s, 5), _tokens(s, 6)))  # fmt: skip


def gemma(s: Shapes, examples: str) -> Model:
    folder = os.path.join(examples, "gemma")
    if not examples or not os.path.exists(os.path.join(folder, "transformer.py")):
        raise Skip(f"no `gemma/transformer.py` under --flax-examples {examples or '(not given)'}")
    sys.path.insert(0, folder)  # gemma's modules import each other by their bare names
    try:
        import transformer as gt
        import transformer_cfg as tc
    except ImportError as e:
        raise Skip(f"examples/gemma does not import here: {e}") from e
    finally:
        sys.path.remove(folder)
    from flax import nnx

    kinds = (tc.AttentionType.LOCAL_SLIDING, tc.AttentionType.GLOBAL)

    def build(dtype):
        cfg = tc.TransformerConfig(
            num_layers=s.layers, num_embed=s.vocab, embed_dim=s.d, hidden_dim=s.mlp,
            num_heads=s.heads, head_dim=s.d // s.heads, num_kv_heads=max(s.heads // 2, 1),
            final_logit_softcap=None, use_post_attn_norm=True, use_post_ffw_norm=True,
            use_qk_norm=True, attention_types=kinds * s.layers, sliding_window_size=s.seq // 2,
            dtype=dtype, dropout_rate=0.1,
        )  # fmt: skip
        return gt.Transformer(cfg, rngs=nnx.Rngs(params=0))

    def call(m, batch, rngs):
        (tokens,) = batch
        present = jnp.ones(tokens.shape, jnp.bool_)
        logits, _ = m(tokens, gt.build_positions_from_mask(present), None,
                      gt.make_causal_attn_mask(present), rngs=rngs)  # fmt: skip
        return xent(logits[:, :-1], tokens[:, 1:])

    return _nnx_model("Gemma (NNX)",
                      f"flax examples/gemma `Transformer`, gemma3-like (post-attention and "
                      f"post-FFW RMSNorm, QK norm, {max(s.heads // 2, 1)} KV heads, local "
                      f"sliding + global layers): {s.text()}, dropout 0.1 (attention "
                      "probabilities, MLP, residual), next-token cross-entropy",
                      build, call, (_tokens(s, 7),))  # fmt: skip


# ``REAL[key](shapes, flax_examples_dir)``: a real model, or :class:`Skip` saying why not.
REAL = {"lm1b": lm1b, "wmt": wmt, "bert": bert, "nnx": nnx_builtins, "gemma": gemma}
