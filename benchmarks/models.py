"""The two benchmark models, in plain JAX: a 12M-parameter MLP and a small GPT.

Parameters are float32 pytrees (dicts of arrays); ``loss(params, batch)``
returns a float32 scalar. ``compute_dtype`` casts params and activations for
the matrix products (used by the GPU half-precision speed-up check).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Model:
    name: str
    params: Any  # float32 pytree
    batch: Any
    loss: Callable[[Any, Any], jax.Array]  # (params, batch) -> float32 scalar
    n_params: int
    n_leaves: int
    describe: str


def _count(params: Any) -> tuple[int, int]:
    leaves = jax.tree_util.tree_leaves(params)
    return int(sum(x.size for x in leaves)), len(leaves)


# --------------------------------------------------------------------- MLP


def mlp(
    sizes=(784, 2048, 2048, 2048, 1024, 10), batch=128, seed=0, compute_dtype=jnp.float32
) -> Model:
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        params[f"l{i}"] = {
            "w": jnp.asarray(rng.standard_normal((a, b), np.float32) / math.sqrt(a)),
            "b": jnp.zeros((b,), jnp.float32),
        }
    x = jnp.asarray(rng.standard_normal((batch, sizes[0]), np.float32))
    y = jnp.asarray(rng.integers(0, sizes[-1], (batch,)), jnp.int32)
    n = len(sizes) - 1

    def loss(p, b):
        h, labels = b
        h = h.astype(compute_dtype)
        for i in range(n):
            h = h @ p[f"l{i}"]["w"].astype(compute_dtype) + p[f"l{i}"]["b"].astype(compute_dtype)
            if i < n - 1:
                h = jax.nn.relu(h)
        logits = h.astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))

    npar, nleaf = _count(params)
    return Model(
        "MLP", params, (x, y), loss, npar, nleaf, f"MLP {'-'.join(map(str, sizes))}, batch {batch}"
    )


# --------------------------------------------------------------------- GPT


def gpt(
    vocab=8192, d=256, layers=6, heads=4, seq=64, batch=4, seed=0, compute_dtype=jnp.float32
) -> Model:
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.02):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale)

    params: dict[str, Any] = {"wte": w(vocab, d), "wpe": w(seq, d)}
    for i in range(layers):
        params[f"h{i}"] = {
            "ln1_g": jnp.ones((d,), jnp.float32),
            "ln1_b": jnp.zeros((d,), jnp.float32),
            "qkv_w": w(d, 3 * d),
            "qkv_b": jnp.zeros((3 * d,), jnp.float32),
            "proj_w": w(d, d),
            "proj_b": jnp.zeros((d,), jnp.float32),
            "ln2_g": jnp.ones((d,), jnp.float32),
            "ln2_b": jnp.zeros((d,), jnp.float32),
            "fc_w": w(d, 4 * d),
            "fc_b": jnp.zeros((4 * d,), jnp.float32),
            "out_w": w(4 * d, d),
            "out_b": jnp.zeros((d,), jnp.float32),
        }
    params["lnf_g"] = jnp.ones((d,), jnp.float32)
    params["lnf_b"] = jnp.zeros((d,), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)
    cd = compute_dtype

    def ln(x, g, b):
        x32 = x.astype(jnp.float32)
        mu = jnp.mean(x32, -1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mu), -1, keepdims=True)
        return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(cd)

    def loss(p, toks):
        inp, tgt = toks[:, :-1], toks[:, 1:]
        B, T = inp.shape
        h = (p["wte"][inp] + p["wpe"][:T]).astype(cd)
        mask = jnp.tril(jnp.ones((T, T), bool))
        for i in range(layers):
            q = p[f"h{i}"]
            a = ln(h, q["ln1_g"], q["ln1_b"])
            qkv = a @ q["qkv_w"].astype(cd) + q["qkv_b"].astype(cd)
            qkv = qkv.reshape(B, T, 3, heads, d // heads)
            qq, kk, vv = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            att = jnp.einsum("bthd,bshd->bhts", qq, kk).astype(jnp.float32) / math.sqrt(d // heads)
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1).astype(cd)
            o = jnp.einsum("bhts,bshd->bthd", att, vv).reshape(B, T, d)
            h = h + o @ q["proj_w"].astype(cd) + q["proj_b"].astype(cd)
            a = ln(h, q["ln2_g"], q["ln2_b"])
            m = jax.nn.gelu(a @ q["fc_w"].astype(cd) + q["fc_b"].astype(cd))
            h = h + m @ q["out_w"].astype(cd) + q["out_b"].astype(cd)
        h = ln(h, p["lnf_g"], p["lnf_b"])
        logits = (h @ p["wte"].astype(cd).T).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))

    npar, nleaf = _count(params)
    return Model(
        "GPT",
        params,
        tokens,
        loss,
        npar,
        nleaf,
        f"GPT d={d}, {layers} layers, {heads} heads, vocab {vocab}, seq {seq}, batch {batch}",
    )


def tiny_mlp(compute_dtype=jnp.float32) -> Model:
    return mlp(sizes=(16, 32, 10), batch=4, compute_dtype=compute_dtype)


def tiny_gpt(compute_dtype=jnp.float32) -> Model:
    return gpt(vocab=64, d=16, layers=1, heads=2, seq=8, batch=2, compute_dtype=compute_dtype)
