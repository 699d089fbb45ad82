"""The plain-JAX models: the loss-scaling MLP and GPT (:func:`mlp`, :func:`gpt`), the
optimizer step alone, float8's MLP and GPT stack with every product through an
``einsum`` hook the per-tensor reference replaces, the character-level GPT and the
digits demo."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax import lax

import jamp
from benchmarks.models.base import BF16, E4M3, E5M2, F32, ROOT, Model, normal, shape_f32, xent

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
    params = {f"l{i}": {"w": shape_f32(n, m), "b": shape_f32(m)} for i in range(layers)}
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
