"""Recurrent models under autocast: at least as accurate as the plain bfloat16 cast (issue #35).

Three shapes from public examples, trained briefly in float32, then evaluated under ``jit``
on the same parameters and fresh batches three ways: float32 (the reference),
``jamp.autocast(loss, bfloat16)``, and the plain bfloat16 cast (parameters and inputs cast
to bfloat16, the loss computed in float32 from the bfloat16 logits):

- Equinox's ``train_rnn``: ``GRUCell(2, 16)`` scanned over 32 steps, a linear readout and a
  scalar bias, 200 Adam steps on sin/cos spirals (the issue's shape);
- Flax's ``examples/seq2seq``: an ``nn.LSTMCell`` encoder (``nn.RNN`` with
  ``seq_lengths``) and decoder (teacher forcing, ``Dense`` vocabulary logits), masked
  softmax cross-entropy on ``a+b=c`` strings;
- Flax's ``nnx_toy_examples/06``: Linear, BatchNorm, Dropout and gelu inside ``nnx.scan``
  over 6 layers.

The errors are the max ``|logit - float32|`` and, per parameter, ``|g - g32| / |g32|``.
One batch is a weak comparison: the GRU's bias gradient ``mean(sigmoid(z) - y)``
cancels (``sum|r| / |sum r|`` up to 117 on these models), so its error is a weighted mean
of the logits' errors times that factor, and a recurrent cell's leaves sum cotangents that
went back through every step; two methods with comparable errors rank either way on a
given batch. So each error is a geometric mean over fresh batches (and, for the GRU, over
six trainings), and autocast's must be at most the plain cast's, leaf by leaf; where a
single training may lose on a leaf the bound says so, with what was measured.

Before the fix the GRU's readout and scalar bias were 1.04x and 0.99x the plain cast's
pooled (4.6x on one training), and on models trained 600 steps (9 seeds, the benchmark's
figures in docs/autocast-design.md) every gradient lost to the plain cast's, by 1.2x (the readout,
weight_hh) to 5.3x (the scalar bias); ``nnx_scan_over_layers`` kept 0.814 of float32's residual
bytes at a gradient error of 0.054 (now 0.653 and 0.030).
"""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _autocast_helpers import BF16, F32
from _eqx_models import TrainRNN
from flax import linen as nn
from flax import nnx
from jax import lax

import jamp
from jamp._src.autocast.report import _residuals

pytestmark = pytest.mark.standard_promotion  # Adam trains the models (optax's bias correction)


def _to(tree, dtype):
    return jax.tree_util.tree_map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _geomean(rows):
    return np.exp(np.log(np.asarray(rows)).mean(axis=0))


_JITTED: dict = {}


def _jit(f, grad=None):
    """``jax.jit(f)`` or ``jax.jit(grad(f))``, compiled once per function (the GRU's six
    trainings share their functions: only the parameters change)."""
    if (f, grad) not in _JITTED:
        _JITTED[f, grad] = jax.jit(f if grad is None else grad(f))
    return _JITTED[f, grad]


def _errors(ref, ours, plain, params, batches, grad=jax.grad):
    """Per batch: [max |logit - float32|, each gradient leaf's relative error] for autocast
    and for the plain cast, as two arrays (batches x columns). ``ref``, ``ours`` and
    ``plain`` are each a pair (logits, loss) of functions of ``(params, *batch)``."""
    want_l, want_g = _jit(ref[0]), _jit(ref[1], grad)
    runs = [(_jit(f), _jit(g, grad)) for f, g in (ours, plain)]
    out: list[list] = [[], []]
    for batch in batches:
        z32 = want_l(params, *batch)
        g32 = jax.tree_util.tree_leaves(want_g(params, *batch))
        for rows, (lf, gf) in zip(out, runs, strict=True):
            z, g = lf(params, *batch), jax.tree_util.tree_leaves(gf(params, *batch))
            row = [float(jnp.max(jnp.abs(z.astype(F32) - z32)))]
            rows.append(row + [_rel(a, b) for a, b in zip(g, g32, strict=True)])
    return np.asarray(out[0]), np.asarray(out[1])


# ---------------------------------------------------------------------------------------
# Equinox's train_rnn: a GRU over 32 steps, a linear readout and a scalar bias
# ---------------------------------------------------------------------------------------


_RNN = TrainRNN


def _spirals(n, key, steps=32):
    t = jnp.linspace(0, 2 * math.pi, steps)
    offset = jax.random.uniform(key, (n, 1), minval=0, maxval=2 * math.pi)
    x1, x2 = jnp.sin(t[None] + offset) / (1 + t[None]), jnp.cos(t[None] + offset) / (1 + t[None])
    y = jnp.ones((n, 1)).at[: n // 2].set(0)
    x1 = x1.at[: n // 2].multiply(-1)
    return jnp.stack([x1, x2], axis=-1), y


def _gru_logits(model, x):
    return jax.vmap(model)(x)


def _gru_loss(model, x, y):
    p = jax.nn.sigmoid(_gru_logits(model, x).astype(F32))  # as train_rnn: sigmoid, then log
    return -jnp.mean(y * jnp.log(p) + (1 - y) * jnp.log(1 - p))


@eqx.filter_jit
def _train_gru(model, opt_state, xs, ys, batches):
    """Adam steps on ``xs[b], ys[b]`` for each row ``b`` of ``batches``: one compiled scan
    (the Python loop of jitted steps that it replaced spent its time dispatching)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tx = optax.adam(3e-3)

    def step(carry, idx):
        p, s = carry
        grads = jax.grad(lambda p: _gru_loss(eqx.combine(p, static), xs[idx], ys[idx]))(p)
        updates, s = tx.update(grads, s)
        return (eqx.apply_updates(p, updates), s), None

    params, opt_state = lax.scan(step, (params, opt_state), batches)[0]
    return eqx.combine(params, static)


@functools.cache
def _trained_gru(seed, steps=200):
    """Equinox's train_rnn: batches of 32 from 10,000 spirals, a fresh permutation each
    epoch as its dataloader draws them (312 batches an epoch), ``steps`` Adam steps."""
    data_key, loader_key, model_key = jax.random.split(jax.random.key(seed), 3)
    xs, ys = _spirals(10_000, data_key)
    model = _RNN(model_key)
    per_epoch = xs.shape[0] // 32
    keys = [loader_key] + [
        jax.random.fold_in(loader_key, e) for e in range(1, -(-steps // per_epoch))
    ]
    orders = [jax.random.permutation(k, xs.shape[0])[: 32 * per_epoch] for k in keys]
    batches = jnp.concatenate(orders)[: 32 * steps].reshape(steps, 32)
    opt_state = optax.adam(3e-3).init(eqx.filter(model, eqx.is_inexact_array))
    return _train_gru(model, opt_state, xs, ys, batches)


def test_gru_is_at_least_as_accurate_as_the_plain_bfloat16_cast():
    """Six trainings of the issue's shape (seeds 0 to 5), eight fresh batches each."""
    x, y = _spirals(256, jax.random.key(1))
    order = jax.random.permutation(jax.random.key(2), 256)  # both classes in each batch
    batches = [(x[order[i : i + 32]], y[order[i : i + 32]]) for i in range(0, 256, 32)]
    ours, cast = [], []
    models = [eqx.partition(_trained_gru(seed), eqx.is_inexact_array) for seed in range(6)]
    static = models[0][1]  # the same for every seed: one set of functions, compiled once
    assert all(jax.tree.structure(s) == jax.tree.structure(static) for _, s in models)

    def on_params(f):
        return lambda p, *xs: f(eqx.combine(p, static), *xs)

    logits, loss = on_params(lambda m, x, y: _gru_logits(m, x)), on_params(_gru_loss)

    def plain(f):
        return lambda p, x, y: f(_to(p, BF16), x.astype(BF16), y)

    auto = (jamp.autocast(logits, BF16), jamp.autocast(loss, BF16))
    for params, _ in models:
        a, c = _errors((logits, loss), auto, (plain(logits), plain(loss)), params, batches)
        ours.append(a)
        cast.append(c)
    # Columns: logits, weight_ih, weight_hh, bias, bias_n, the readout, the scalar bias.
    per_seed = np.asarray([_geomean(a) / _geomean(c) for a, c in zip(ours, cast, strict=True)])
    pooled = _geomean(np.concatenate(ours)) / _geomean(np.concatenate(cast))
    # Pooled over the 48 batches, autocast's error over the plain cast's, leaf by leaf:
    # 0.44 0.46 0.42 0.52 0.56 0.94 0.34 (before the fix 0.69 0.72 0.65 0.71 0.75 1.04 0.99,
    # and the scalar bias 4.6 on seed 0).
    assert np.all(pooled <= 1.0), pooled
    # Per seed a leaf may still lose: each gradient sums, over 32 steps and a batch,
    # cotangents that went back through the recurrence, 0.2% to 3% off float32 for either
    # method and in either order batch by batch. Seed 4's readout 1.40, seed 5's gate
    # biases 1.58 and 1.49 and readout 1.44; every other leaf of every seed at most 1.03.
    assert np.all(per_seed <= 1.7), per_seed
    assert np.all(_geomean(np.concatenate(ours)) < 0.03), _geomean(np.concatenate(ours))


def test_a_gate_meeting_a_float32_carry_is_computed_in_float32():
    """The cause: the update gate z, rounded to bfloat16 (spacing 2**-8 near 1), then
    upcast to meet the float32 carry in ``z * h``. Now z is computed in float32 from its
    half input (its pre-activation, which the backward pass keeps), as is a new carry."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)) / 3, F32)
    a, h = jnp.full((4, 8), 2.0), jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)

    def gate(w, a, h):
        return jax.nn.sigmoid(a @ w) * h, jnp.tanh(a @ w)

    def carried(w, a, h):  # a scan whose new carry is a tanh: float32, not rounded
        return lax.scan(lambda h, _: (jnp.tanh(h @ w), None), a, None, length=2)[0]

    pre = (a.astype(BF16) @ w.astype(BF16)).astype(F32)  # the half pre-activation
    got, _ = jax.jit(jamp.autocast(gate, BF16))(w, a, h)
    np.testing.assert_array_equal(got, jax.nn.sigmoid(pre) * h)  # not sigmoid's bf16 rounding
    step = jnp.tanh((a.astype(BF16) @ w.astype(BF16)).astype(F32))
    want = jnp.tanh((step.astype(BF16) @ w.astype(BF16)).astype(F32))
    np.testing.assert_array_equal(jax.jit(jamp.autocast(carried, BF16))(w, a, h), want)
    # What the backward pass keeps is unchanged in kind: half values, no float32 gate.
    report = jamp.debug.autocast_report(lambda w, a, h: jnp.sum(gate(w, a, h)[0]), w, a, h,
                                        dtype=BF16)  # fmt: skip
    assert not any(r.dtype == F32 and r.shape == (4, 8) for r in report.residuals), report


# ---------------------------------------------------------------------------------------
# Flax's examples/seq2seq: LSTM encoder and decoder
# ---------------------------------------------------------------------------------------

_CHARS = "0123456789+= "
_VOCAB, _EOS, _IN, _OUT = len(_CHARS) + 2, 1, 8, 6  # pad 0, eos 1; "123+456" EOS; "=579" EOS


def _addition(rng, n):
    def encode(s):
        return [_CHARS.index(c) + 2 for c in s] + [_EOS]

    a, b = rng.integers(0, 1000, n), rng.integers(0, 1000, n)
    enc, dec = np.zeros((n, _IN), np.int32), np.zeros((n, _OUT), np.int32)
    for k in range(n):
        q, r = encode(f"{a[k]}+{b[k]}"), encode(f"={a[k] + b[k]}")
        enc[k, : len(q)], dec[k, : len(r)] = q, r
    return jax.nn.one_hot(enc, _VOCAB, dtype=F32), jax.nn.one_hot(dec, _VOCAB, dtype=F32)


def _lstm(features, param_dtype):
    """flax's LSTMCell; its orthogonal recurrent initialiser computed in float32 (jax 0.12's
    QR refuses bfloat16, and flax 0.12.12 runs the initialiser abstractly at apply time to
    check the shapes: the plain cast's bfloat16 model could not be applied)."""
    orthogonal = nn.initializers.orthogonal()

    def recurrent_init(key, shape, dtype=F32):
        return orthogonal(key, shape, F32).astype(dtype)

    return nn.LSTMCell(features, param_dtype=param_dtype, recurrent_kernel_init=recurrent_init)


class _Decoder(nn.RNNCellBase):
    features: int
    param_dtype: jnp.dtype = F32

    @nn.compact
    def __call__(self, carry, x):
        state, _ = carry
        state, y = _lstm(self.features, self.param_dtype)(state, x)
        logits = nn.Dense(_VOCAB, param_dtype=self.param_dtype)(y)
        token = jax.random.categorical(self.make_rng("lstm"), logits)  # as the example
        prediction = jax.nn.one_hot(token, _VOCAB, dtype=x.dtype)
        return (state, prediction), logits

    @property
    def num_feature_axes(self):
        return 1


class _Seq2seq(nn.Module):
    hidden: int = 32
    param_dtype: jnp.dtype = F32

    @nn.compact
    def __call__(self, enc, dec, tap=None):
        cell = _lstm(self.hidden, self.param_dtype)
        encoder = nn.RNN(cell, return_carry=True, name="encoder")
        decoder = nn.RNN(
            _Decoder(self.hidden, self.param_dtype),
            split_rngs={"params": False, "lstm": True},
            name="decoder",
        )
        lengths = jnp.argmax(jnp.argmax(enc, -1) == _EOS, -1)
        state, _ = encoder(enc, seq_lengths=lengths)
        if tap is not None:  # a zero added to the encoder's state: its gradient is d(state)
            state = jax.tree_util.tree_map(lambda s, t: s + t.astype(s.dtype), state, tap)
        return decoder(dec[:, :-1], initial_carry=(state, dec[:, 0]))


def _seq2seq_fns(model):
    def logits(params, tap, enc, dec):
        return model.apply(params, enc, dec, tap, rngs={"lstm": jax.random.key(1)})

    def loss(params, tap, enc, dec):
        z = logits(params, tap, enc, dec).astype(F32)
        labels = dec[:, 1:].astype(F32)
        mask = jnp.cumsum(labels[..., _EOS], -1) - labels[..., _EOS] < 1  # up to EOS
        ce = -jnp.sum(labels * jax.nn.log_softmax(z), -1)
        return jnp.sum(ce * mask) / jnp.sum(mask)

    return logits, loss


def _trained_seq2seq(seed, steps=200):
    rng = np.random.default_rng(seed)
    logits, loss = _seq2seq_fns(_Seq2seq())
    enc, dec = _addition(rng, 32)
    params = jax.jit(_Seq2seq().init)(
        {"params": jax.random.key(seed), "lstm": jax.random.key(1)}, enc, dec
    )
    tap = (jnp.zeros((32, 32)), jnp.zeros((32, 32)))
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state, enc, dec):
        grads = jax.grad(loss)(params, tap, enc, dec)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state, *_addition(rng, 32))
    return params, rng


def test_seq2seq_lstm_is_at_least_as_accurate_as_the_plain_bfloat16_cast():
    """Seed 0; seeds 1 to 7 pass as well (measured)."""
    params, rng = _trained_seq2seq(0)
    tap = (jnp.zeros((32, 32)), jnp.zeros((32, 32)))
    logits, loss = _seq2seq_fns(_Seq2seq())
    b_logits, b_loss = _seq2seq_fns(_Seq2seq(param_dtype=BF16))

    def plain(g):
        return lambda p, t, e, d: g(_to(p, BF16), _to(t, BF16), e.astype(BF16), d.astype(BF16))

    def pairs(f):  # functions of ((params, tap), enc, dec)
        return lambda pt, e, d: f(*pt, e, d)

    auto = (jamp.autocast(logits, BF16), jamp.autocast(loss, BF16))
    ours, cast = _errors(
        (pairs(logits), pairs(loss)),
        (pairs(auto[0]), pairs(auto[1])),
        (pairs(plain(b_logits)), pairs(plain(b_loss))),
        (params, tap),
        [_addition(rng, 32) for _ in range(4)],
    )
    names = ["logits"] + [
        jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path((params, tap))
    ]
    ratio = dict(zip(names, _geomean(ours) / _geomean(cast), strict=True))
    cells = {k: r for k, r in ratio.items() if "LSTMCell_0" in k}
    rest = {k: r for k, r in ratio.items() if k not in cells}
    # The logits, the vocabulary projection and the cotangent the decoder sends to the
    # encoder's state (the tap: its c and h): at most the plain cast's.
    assert len(cells) == 24 and all(r <= 1.0 for r in rest.values()), rest
    # The LSTM cells' own leaves sum, over the steps, cotangents that went back through
    # the recurrence: the errors above (autocast's cotangent at the encoder's state is 1.5%
    # off float32, the plain cast's 2.3%) times transposed Jacobians that meet the
    # gradient's small components, per batch 0.5% to 6% for either, in either order. On
    # average autocast's are smaller (24 batches of a larger model: 0.55 to 0.70 of the
    # plain cast's for the decoder's, 0.77 to 1.12 for the encoder's); a leaf may be up
    # to 1.5x on four batches.
    assert np.exp(np.mean(np.log(list(cells.values())))) <= 1.0, cells
    assert all(r <= 1.5 for r in cells.values()), cells


# ---------------------------------------------------------------------------------------
# Flax's nnx_toy_examples/06: Linear, BatchNorm, Dropout, gelu in nnx.scan over layers
# ---------------------------------------------------------------------------------------


class _Block(nnx.Module):
    def __init__(self, dim, *, rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class _ScanMLP(nnx.Module):
    def __init__(self, dim, *, n_layers, rngs):
        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(axis_size=n_layers)
        def create_block(rngs):
            return _Block(dim, rngs=rngs)

        self.layers = create_block(rngs)

    def __call__(self, x):
        @nnx.scan
        def scan_fn(x, block):
            return block(x), None

        return scan_fn(x, self.layers)[0]


# The plain cast's BatchNorm writes its float32 running statistics into the bfloat16 state.
@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning")
def test_nnx_scan_over_layers_keeps_half_residuals_and_is_as_accurate_as_the_plain_cast():
    graphdef, params, rest = nnx.split(_ScanMLP(64, n_layers=6, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng = np.random.default_rng(0)
    x, y = (jnp.asarray(rng.standard_normal((16, 64)), F32) for _ in range(2))

    def loss(params, rest, x, y):
        return jnp.mean((nnx.merge(graphdef, params, rest)(x) - y) ** 2)

    def plain(params, rest, x, y):
        return loss(_to(params, BF16), _to(rest, BF16), x.astype(BF16), y.astype(BF16))

    ours, _ = _residuals(jamp.autocast(loss, BF16), (params, rest, x, y), {})
    f32, _ = _residuals(loss, (params, rest, x, y), {})
    ours_bytes, f32_bytes = sum(r.nbytes for r in ours), sum(r.nbytes for r in f32)
    # Before: 0.814 of float32's (the matmul's output plus its bias, into BatchNorm's
    # statistics, kept in float32, and the carried gelu's pieces in bfloat16). Now 0.653: the
    # sum is kept in bfloat16 and recomputed in float32 for the statistics, the carry
    # computed in float32. Autocast keeps 143,872 bytes on jax 0.10.2 and 0.12.1 alike;
    # float32 JAX keeps 220,160 on 0.10.2 but 195,584 on 0.12.1, whose tanh derivative
    # (gelu's) keeps the one factor 1 - tanh^2 where 0.10 kept tanh and 1 - tanh: 0.736.
    assert ours_bytes <= 143_872, ours_bytes
    assert ours_bytes / f32_bytes < (0.7 if f32_bytes == 220_160 else 0.75), f32_bytes

    def grads(f):  # the BatchNorm statistics and dropout keys are state: no gradient
        return jax.jit(jax.grad(f, argnums=(0, 1), allow_int=True))(params, rest, x, y)[0]

    def flat(tree):
        return np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(tree)])

    want = flat(grads(loss))
    ours, cast = _rel(flat(grads(jamp.autocast(loss, BF16))), want), _rel(flat(grads(plain)), want)
    # 0.030 against the plain cast's 0.057 (before: 0.054). Over eight initialisations
    # 0.53 to 1.11 of the plain cast's (geometric mean 0.92; before: 0.94 to 1.14, 0.99):
    # with a batch of 16 BatchNorm's statistics amplify any rounding, in either method.
    assert ours < 0.04 and ours <= 1.15 * cast, (ours, cast)


def test_a_trained_gru_s_bias_gradient_is_as_accurate_as_the_plain_cast_s():
    """Issue #42: at convergence the scalar bias's gradient, ``mean(sigmoid(z) - y)``, is a
    sum that cancels, where mixed precision hurts most; the test above measures models 200
    steps in. Trained 1,500 Adam steps (about five epochs; loss about 2e-4), seeds 0 to 2,
    on 1,024 fresh spirals: autocast's bias gradient is 0.22%, 6.1% and 0.74% off float32's,
    the plain bfloat16 cast's 8.6%, 144% and 2.4% (seeds 3 to 5: 1.5%, 3.5%, 1.1% against
    12%, 93% and 7.4%). What rounds the readout's input: autocast's readout matmul rounds the
    float32 carry to bfloat16, where the plain cast's promotes to a float32 matmul; a
    float32 readout made seed 0's bias 3.3% off, so the readout stays a bfloat16 matmul.
    (Until this test trained in one scan, its loop drew batches past the data's end: from
    step 313 on they were empty, and the models were 312 steps in, at a loss of 0.003 to
    0.007.)"""
    x, y = _spirals(1024, jax.random.key(1))
    models = [eqx.partition(_trained_gru(s, steps=1500), eqx.is_inexact_array) for s in range(3)]
    static = models[0][1]  # the same for every seed: each gradient compiles once
    assert all(jax.tree.structure(s) == jax.tree.structure(static) for _, s in models)

    def loss(p, x, y):
        return _gru_loss(eqx.combine(p, static), x, y)

    def plain(p, x, y):
        return loss(_to(p, BF16), x.astype(BF16), y)

    want, auto, cast_ = (jax.jit(jax.grad(f)) for f in (loss, jamp.autocast(loss, BF16), plain))
    ours, cast = [], []
    for params, _ in models:
        ref = want(params, x, y).bias[0]
        ours.append(abs(auto(params, x, y).bias[0] / ref - 1))
        cast.append(abs(cast_(params, x, y).bias[0] / ref - 1))
    assert all(a < c for a, c in zip(ours, cast, strict=True)), (ours, cast)
    assert _geomean(ours) <= 0.2 * _geomean(cast), (ours, cast)
    assert max(ours) < 0.08, ours
