"""The real models (:data:`REAL`): flax examples' lm1b and wmt, HF BERT, NNX's built-in
layers and Gemma, at the shapes :class:`Shapes` gives."""

from __future__ import annotations

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from benchmarks.models.base import DROPOUT_KEY, F32, Model, xent
from benchmarks.models.plain import digits_demo, load
from benchmarks.report import version

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


def gpt2(s: Shapes, examples: str) -> Model:
    del examples
    try:
        from transformers import FlaxGPT2LMHeadModel, GPT2Config
    except Exception as e:  # noqa: BLE001 - any failure to import is a reason to skip
        raise Skip(f"transformers' Flax GPT-2 is not importable: {type(e).__name__}: {e}") from e
    cfg = GPT2Config(vocab_size=s.vocab, n_positions=s.seq, n_embd=s.d, n_layer=s.layers,
                     n_head=s.heads, n_inner=s.mlp)  # fmt: skip
    f32 = FlaxGPT2LMHeadModel(cfg, seed=0, dtype=F32)

    def loss_at(dtype):
        m = f32 if dtype == F32 else FlaxGPT2LMHeadModel(cfg, dtype=dtype, _do_init=False)

        def loss(p, batch):
            (ids,) = batch
            return xent(m(ids, params=p, train=False).logits[:, :-1], ids[:, 1:])

        return loss

    return _real("HF FlaxGPT2LMHeadModel",
                 f"transformers {version('transformers')} `FlaxGPT2LMHeadModel`, random init: "
                 f"{s.text()}, next-token cross-entropy", f32.params, (_tokens(s, 8),),
                 loss_at)  # fmt: skip


def digits_cnn(s: Shapes, examples: str) -> Model:
    del examples
    demo = digits_demo()
    model, rng = demo.CNN(), np.random.default_rng(9)
    x = jnp.asarray(rng.random((demo.BATCH, 8, 8, 1)), F32)
    y = jnp.asarray(rng.integers(0, 10, demo.BATCH), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), x)

    def loss(p, b):
        return demo.loss_fn(model.apply, p, *b)

    return _real("digits CNN", f"`examples/train_digits.py`'s CNN and loss, batch {demo.BATCH}",
                 params, (x, y), lambda dtype: loss)  # fmt: skip


def gru_rnn(s: Shapes, examples: str) -> Model:
    del examples

    class GRU(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.RNN(nn.GRUCell(s.d))(x)
            return nn.Dense(1)(h[:, -1])

    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.standard_normal((s.batch, s.seq, 8)), F32)
    y = jnp.asarray(rng.standard_normal((s.batch, 1)), F32)
    params = jax.jit(GRU().init)(jax.random.key(0), x)

    def loss(p, b):
        return jnp.mean(jnp.square(GRU().apply(p, b[0]) - b[1]))

    return _real("linen nn.RNN(GRUCell)",
                 f"`nn.RNN(nn.GRUCell({s.d}))` under `scan` over {s.seq} steps of 8 features, "
                 f"batch {s.batch}, Dense 1, MSE", params, (x, y), lambda dtype: loss)  # fmt: skip


def eqx_mlp(s: Shapes, examples: str) -> Model:
    del examples
    try:
        import equinox as eqx
    except ImportError as e:
        raise Skip(f"equinox is not importable: {e}") from e
    model = eqx.nn.MLP(s.d, 10, s.mlp, 3, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((s.batch * s.seq, s.d)), F32)
    y = jnp.asarray(rng.integers(0, 10, s.batch * s.seq), jnp.int32)

    def loss(p, b):
        return xent(jax.vmap(eqx.combine(p, static))(b[0]), b[1])

    return _real("Equinox nn.MLP",
                 f"`eqx.nn.MLP({s.d}, 10, width_size={s.mlp}, depth=3)` (relu), vmapped over "
                 f"{s.batch * s.seq} rows, cross-entropy", params, (x, y),
                 lambda dtype: loss)  # fmt: skip


# ``REAL[key](shapes, flax_examples_dir)``: a real model, or :class:`Skip` saying why not.
REAL = {"lm1b": lm1b, "wmt": wmt, "bert": bert, "nnx": nnx_builtins, "gemma": gemma}
# The models ``jamp.debug``'s cost is measured on (``debug_cost``), by the same key.
DEBUG = {"gpt2": gpt2, "bert": bert, "nnx": nnx_builtins, "digits": digits_cnn,
         "eqx": eqx_mlp, "gru": gru_rnn}  # fmt: skip
