"""The real-model accuracy gate's models: code written by others, composed as its users do.

Each builder returns a :class:`Case`: float32 parameters, a batch, ``loss``, the float32
loss ``(params, batch) -> scalar`` of the model as written, and ``loss_at(dtype)``, the
same of the model built with its own ``dtype=`` (``None`` where the model has no such
argument: Equinox's layers, the cross-entropy head). Every model is tiny (the gate runs in CI on two
cores), deterministic (no dropout) and seeded: the same parameters and batch for every
variant, in every run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

F32 = jnp.float32
VOCAB, D, HEADS, LAYERS, MLP_D, BATCH, SEQ = 128, 64, 4, 2, 128, 2, 16


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    describe: str
    params: Any
    batch: Any
    loss: Callable  # (params, batch) -> float32 scalar: the model as written
    loss_at: Callable | None = None  # dtype -> the loss of the model built with dtype=
    # transformers' code broadcasts ranks and mixes dtypes, which the suite's strict
    # promotion rejects: its models run under jax's default promotion.
    default_promotion: bool = False


def normal(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), F32)


def tokens(seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(1, VOCAB, (BATCH, SEQ)), jnp.int32)


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits = logits.astype(F32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(out.astype(F32) - y))


def _linen(name, describe, module_of, args, target):
    """A linen model: ``module_of(dtype)`` applied to ``args``, MSE against ``target``."""
    params = jax.jit(module_of(F32).init)(jax.random.key(0), *args)  # one compile

    def loss_at(dtype):
        m = module_of(dtype)
        return lambda p, batch: mse(m.apply(p, *batch[:-1]), batch[-1])

    return Case(name, describe, params, (*args, target), loss_at(F32), loss_at)


# --------------------------------------------------------------------- transformers' Flax models


def _hf(name, describe, cls, config, batch, call):
    """A transformers Flax model, random init (its ``init_weights`` from ``PRNGKey(0)``,
    jitted: one compile instead of an eager init), never downloaded; ``dtype=`` builds it
    without parameters and runs it on the float32 ones."""
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        f32 = cls(config, _do_init=False)
        init = jax.jit(f32.init_weights, static_argnums=1)
        params = init(jax.random.PRNGKey(0), f32.input_shape)

    def loss_at(dtype):
        m = f32 if dtype == F32 else cls(config, dtype=dtype, _do_init=False)
        return functools.partial(call, m)

    return Case(name, describe, params, batch, loss_at(F32), loss_at, True)


def _t5_on_current_jax() -> None:
    """transformers 4.57.6's Flax T5 calls ``jnp.clip(x, a_max=...)``, a keyword jax 0.10
    removed (``max=``): its module sees a ``jnp`` whose ``clip`` takes both. Nothing else
    of the model changes."""
    from transformers.models.t5 import modeling_flax_t5 as t5

    if getattr(t5.jnp, "_jamp_clip_shim", False):
        return

    class _Jnp:
        _jamp_clip_shim = True

        def __getattr__(self, name):
            return getattr(jnp, name)

        @staticmethod
        def clip(x, a_min=None, a_max=None, **kw):
            return jnp.clip(x, kw.pop("min", a_min), kw.pop("max", a_max), **kw)

    t5.jnp = _Jnp()


def gpt2() -> Case:
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=LAYERS, n_head=HEADS)
    ids = tokens(1)

    def call(m, p, batch):
        (ids,) = batch
        return xent(m(ids, params=p, train=False).logits[:, :-1], ids[:, 1:])

    return _hf("transformers FlaxGPT2LMHeadModel",
               f"GPT-2, random init: {LAYERS} layers, d {D}, {HEADS} heads, vocab {VOCAB}, "
               f"batch {BATCH}x{SEQ}, next-token cross-entropy",
               FlaxGPT2LMHeadModel, cfg, (ids,), call)  # fmt: skip


def bert() -> Case:
    from transformers import BertConfig, FlaxBertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, intermediate_size=MLP_D,
                     max_position_embeddings=SEQ)  # fmt: skip

    def call(m, p, batch):
        ids, labels = batch
        return xent(m(ids, params=p, train=False).logits, labels)

    return _hf("transformers FlaxBertForMaskedLM",
               f"BERT, random init: {LAYERS} layers, d {D}, {HEADS} heads, MLP {MLP_D}, vocab "
               f"{VOCAB}, batch {BATCH}x{SEQ}, cross-entropy at every position",
               FlaxBertForMaskedLM, cfg, (tokens(2), tokens(3)), call)  # fmt: skip


def t5() -> Case:
    from transformers import FlaxT5ForConditionalGeneration, T5Config

    _t5_on_current_jax()
    cfg = T5Config(vocab_size=VOCAB, d_model=D, d_kv=D // HEADS, d_ff=MLP_D, num_layers=LAYERS,
                   num_heads=HEADS, relative_attention_num_buckets=8,
                   relative_attention_max_distance=SEQ)  # fmt: skip
    labels = tokens(5)
    decoder_ids = jnp.concatenate([jnp.zeros_like(labels[:, :1]), labels[:, :-1]], axis=1)

    def call(m, p, batch):
        ids, dec, labels = batch
        return xent(m(ids, decoder_input_ids=dec, params=p, train=False).logits, labels)

    return _hf("transformers FlaxT5ForConditionalGeneration",
               f"T5 (encoder-decoder, relative position buckets, RMS norms), random init: "
               f"{LAYERS} layers each side, d {D}, {HEADS} heads, MLP {MLP_D}, vocab {VOCAB}, "
               f"batch {BATCH}x{SEQ}, teacher-forced cross-entropy",
               FlaxT5ForConditionalGeneration, cfg, (tokens(4), decoder_ids, labels),
               call)  # fmt: skip


# --------------------------------------------------------------------- Flax linen and NNX layers


class _PreLN(nn.Module):
    """A pre-LayerNorm residual MLP: LayerNorm (the fast variance, Flax's default), Dense,
    gelu, Dense."""

    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            h = nn.LayerNorm(use_fast_variance=True, dtype=self.dtype)(x)
            h = nn.Dense(4 * x.shape[-1], dtype=self.dtype)(h)
            x = x + nn.Dense(x.shape[-1], dtype=self.dtype)(nn.gelu(h))
        return nn.LayerNorm(dtype=self.dtype)(x)


def linen_layernorm() -> Case:
    return _linen("linen LayerNorm (fast variance)",
                  "two pre-LayerNorm residual blocks (`LayerNorm(use_fast_variance=True)`, "
                  "Dense 32-128, gelu, Dense 128-32), a final LayerNorm; x (16, 32) ~ N(0, 1), "
                  "MSE", lambda dt: _PreLN(dt), (normal(10, 16, 32),),
                  normal(11, 16, 32))  # fmt: skip


class _DenseLN(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(64, bias_init=nn.initializers.constant(8.0), dtype=self.dtype)(x)
        return nn.Dense(8, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(h))


def dense_layernorm_mean8() -> Case:
    return _linen("linen Dense -> LayerNorm, features of mean 8",
                  "Dense 32-64 whose bias starts at 8 (features of mean ~8, std ~1), "
                  "LayerNorm (fast variance), Dense 64-8; x (16, 32) ~ N(0, 1), MSE",
                  lambda dt: _DenseLN(dt), (normal(12, 16, 32),),
                  normal(13, 16, 8))  # fmt: skip


class _BNNet(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        bn = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9,
                               axis_name="batch", dtype=self.dtype)  # fmt: skip
        x = nn.relu(bn()(nn.Conv(8, (3, 3), use_bias=False, dtype=self.dtype)(x)))
        x = nn.relu(bn()(nn.Conv(8, (3, 3), use_bias=False, dtype=self.dtype)(x)))
        return nn.Dense(10, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


def batchnorm_axis_name() -> Case:
    x = normal(14, 4, 4, 8, 8, 3)  # 4 replicas of 4 images
    labels = jnp.asarray(np.random.default_rng(15).integers(0, 10, (4, 4)), jnp.int32)
    init = jax.vmap(_BNNet().init, in_axes=(None, 0), axis_name="batch")
    variables = jax.jit(init)(jax.random.key(0), x)
    params, stats = jax.tree.map(lambda a: a[0], (variables["params"], variables["batch_stats"]))

    def loss_at(dtype):
        model = _BNNet(dtype)

        def one(p, x, y):
            out, _ = model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
            return xent(out, y)

        per = jax.vmap(one, in_axes=(None, 0, 0), axis_name="batch")
        return lambda p, batch: jnp.mean(per(p, *batch))

    return Case("linen BatchNorm over axis_name",
                "Conv 3x3 (8) -> BatchNorm -> relu, twice, mean-pool, Dense 10; BatchNorm's "
                "statistics over `axis_name` across 4 replicas of 4 8x8x3 images under "
                "`jax.vmap(..., axis_name=)`, cross-entropy", params, (x, labels),
                loss_at(F32), loss_at)  # fmt: skip


class _CausalSelfAttention(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        return nn.MultiHeadDotProductAttention(num_heads=HEADS, dtype=self.dtype)(x, mask=mask)


def causal_attention() -> Case:
    return _linen("linen MultiHeadDotProductAttention, causal mask",
                  f"self-attention, {HEADS} heads, d {D}, `nn.make_causal_mask`, batch "
                  f"{BATCH}x{SEQ}, MSE", lambda dt: _CausalSelfAttention(dt),
                  (normal(16, BATCH, SEQ, D),), normal(17, BATCH, SEQ, D))  # fmt: skip


class _RNNModel(nn.Module):
    cell: str
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        cell = {"GRU": nn.GRUCell, "LSTM": nn.LSTMCell}[self.cell](32, dtype=self.dtype)
        h = nn.RNN(cell)(x)
        return nn.Dense(1, dtype=self.dtype)(h[:, -1])


def _rnn(kind: str, seed: int) -> Case:
    return _linen(f"linen nn.RNN({kind}Cell)",
                  f"`nn.RNN(nn.{kind}Cell(32))` over 16 steps of 8 features, batch 8, the last "
                  "output through Dense 1, MSE",
                  lambda dt: _RNNModel(kind, dt), (normal(seed, 8, 16, 8),),
                  normal(seed + 1, 8, 1))  # fmt: skip


def rnn_gru() -> Case:
    return _rnn("GRU", 18)


def rnn_lstm() -> Case:
    return _rnn("LSTM", 20)


def nnx_scan() -> Case:
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, dim, dtype, rngs):
            self.norm = nnx.LayerNorm(dim, dtype=dtype, rngs=rngs)
            self.linear = nnx.Linear(dim, dim, dtype=dtype, rngs=rngs)

        def __call__(self, x):
            return x + jax.nn.gelu(self.linear(self.norm(x)))

    class Stack(nnx.Module):
        def __init__(self, dim, n_layers, dtype, rngs):
            @nnx.split_rngs(splits=n_layers)
            @nnx.vmap(axis_size=n_layers)
            def create(rngs):
                return Block(dim, dtype, rngs)

            self.layers = create(rngs)

        def __call__(self, x):
            @nnx.scan
            def step(x, block):
                return block(x), None

            return step(x, self.layers)[0]

    def build(dtype):
        return Stack(32, 4, dtype, nnx.Rngs(0))

    graph, params, rest = nnx.split(build(F32), nnx.Param, ...)

    def loss_at(dtype):
        g = graph if dtype == F32 else nnx.split(nnx.eval_shape(lambda: build(dtype)),
                                                 nnx.Param, ...)[0]  # fmt: skip
        return lambda p, batch: mse(nnx.merge(g, p, rest)(batch[0]), batch[1])

    return Case("NNX nnx.scan over layers",
                "4 residual blocks (`nnx.LayerNorm`, `nnx.Linear` 32-32, gelu) created with "
                "`nnx.vmap` and run by `nnx.scan`; x (16, 32), MSE", params,
                (normal(22, 16, 32), normal(23, 16, 32)), loss_at(F32), loss_at)  # fmt: skip


# --------------------------------------------------------------------- Equinox's nn layers


def _eqx(name, describe, model, batch, loss):
    import equinox as eqx

    params, static = eqx.partition(model, eqx.is_inexact_array)
    return Case(name, describe, params, batch, lambda p, b: loss(eqx.combine(p, static), *b))


def eqx_mlp() -> Case:
    import equinox as eqx

    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(0))
    labels = jnp.asarray(np.random.default_rng(25).integers(0, 4, 32), jnp.int32)
    return _eqx("Equinox nn.MLP",
                "`eqx.nn.MLP(16, 4, width_size=64, depth=2)` (relu), vmapped over a batch of "
                "32, cross-entropy", model, (normal(24, 32, 16), labels),
                lambda m, x, y: xent(jax.vmap(m)(x), y))  # fmt: skip


def eqx_cnn() -> Case:
    import equinox as eqx

    k = jax.random.split(jax.random.key(0), 4)
    # Equinox's MNIST CNN example, smaller: Conv2d, MaxPool2d, relu, flatten, 3 Linears.
    model = eqx.nn.Sequential([
        eqx.nn.Conv2d(1, 3, kernel_size=4, key=k[0]),
        eqx.nn.MaxPool2d(kernel_size=2),
        eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Lambda(jnp.ravel),
        eqx.nn.Linear(3 * 8 * 8, 64, key=k[1]),
        eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Linear(64, 32, key=k[2]),
        eqx.nn.Lambda(jax.nn.relu),
        eqx.nn.Linear(32, 10, key=k[3]),
        eqx.nn.Lambda(jax.nn.log_softmax),
    ])  # fmt: skip
    labels = jnp.asarray(np.random.default_rng(27).integers(0, 10, 16), jnp.int32)

    def loss(m, x, y):  # the example's: -mean(log p[y])
        pred = jax.vmap(m)(x)
        return -jnp.mean(jnp.take_along_axis(pred.astype(F32), y[:, None], axis=1))

    return _eqx("Equinox nn.Conv2d CNN",
                "Equinox's MNIST CNN, smaller: Conv2d(1, 3, 4), MaxPool2d(2), relu, Linear "
                "192-64-32-10, log_softmax; 16 images 1x12x12, the example's cross-entropy",
                model, (normal(26, 16, 1, 12, 12), labels), loss)  # fmt: skip


def eqx_gru() -> Case:

    from tests._eqx_models import TrainRNN as RNN  # Equinox's train_rnn example

    def loss(m, x, y):  # as train_rnn: sigmoid, then log
        p = jax.nn.sigmoid(jax.vmap(m)(x).astype(F32))
        return -jnp.mean(y * jnp.log(p) + (1 - y) * jnp.log(1 - p))

    y = jnp.asarray(np.random.default_rng(29).integers(0, 2, (32, 1)), F32)
    return _eqx("Equinox nn.GRUCell scanned",
                "Equinox's train_rnn: `GRUCell(2, 16)` under `lax.scan` over 32 steps, a "
                "Linear readout and a scalar bias, 32 sequences, sigmoid then log",
                RNN(jax.random.key(0)), (normal(28, 32, 32, 2), y), loss)  # fmt: skip


# --------------------------------------------------------------------- a cross-entropy head


def ce_head(x, w, b, t):
    """optax's softmax cross-entropy on ``3 * (x @ w + b)`` (its targets the argmax)."""
    return optax.softmax_cross_entropy_with_integer_labels(3 * (x @ w + b[None]), t).mean()


def ce_draw(seed: int) -> tuple:
    """``((w, b), (x, t))``: x (16, 8), w (8, 4) * 4, b (4,) ~ N(0, 1), t = argmax(x @ w + b)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 8))
    w = rng.standard_normal((8, 4)) * 4
    b = rng.standard_normal(4)
    t = np.argmax(x @ w + b, axis=-1)
    f = functools.partial(jnp.asarray, dtype=F32)
    return (f(w), f(b)), (f(x), jnp.asarray(t, jnp.int32))


CE_DRAWS = 50

# name -> builder, in the table's order.
MODELS: dict[str, Callable[[], Case]] = {
    "gpt2": gpt2,
    "bert": bert,
    "t5": t5,
    "layernorm": linen_layernorm,
    "dense_layernorm_mean8": dense_layernorm_mean8,
    "batchnorm_axis_name": batchnorm_axis_name,
    "causal_attention": causal_attention,
    "rnn_gru": rnn_gru,
    "rnn_lstm": rnn_lstm,
    "nnx_scan": nnx_scan,
    "eqx_mlp": eqx_mlp,
    "eqx_cnn": eqx_cnn,
    "eqx_gru": eqx_gru,
}
