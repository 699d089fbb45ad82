"""Saved residuals of ``jamp.autocast`` on real public models, beside their own ``dtype=``.

    python -m benchmarks.real_models --flax-examples DIR   # every model, a few min on 2 cores
    python -m benchmarks.real_models --tiny                # seconds: a smoke test
    python -m benchmarks.real_models --flax-examples DIR --results FILE   # record it there

Models no one here wrote (issue #25 section 2), each built with float32 parameters and
run for a train step (dropout on, attention dropout 0.1 where the model has it) with a
float32 cross-entropy:

- flax's examples ``lm1b`` ``TransformerLM`` and ``wmt`` ``Transformer``
  (``DIR/lm1b/models.py``, ``DIR/wmt/models.py``), and ``gemma``'s NNX ``Transformer``
  (``DIR/gemma``, gemma3-like: post-attention and post-FFW RMSNorms, QK norm, grouped
  KV heads, a local sliding and a global layer). ``DIR`` is a checkout of flax's
  ``examples/`` folder; a model whose source is missing is skipped with the reason.
- transformers' ``FlaxBertForMaskedLM`` (random init from a small ``BertConfig``).
- a model of flax NNX's built-in layers: ``nnx.Embed``, ``nnx.MultiHeadAttention``
  (``dropout_rate=0.1``), ``nnx.LayerNorm``, ``nnx.Linear``, ``nnx.Dropout``.

On the same parameters, batch and dropout key, three variants of the loss: ``float32``;
``jamp.autocast bfloat16`` (``jamp.autocast(loss, jnp.bfloat16)`` of the float32 model);
``Flax dtype=bfloat16`` (the model built with its own ``dtype=jnp.bfloat16``, float32
parameters). Residuals are the bytes JAX saves for the backward pass
(``benchmarks.autocast_memory.residual_bytes``: ``saved_residuals``, the arguments
excluded); grad cosine is to float32's gradient, the worst leaf in brackets
(``benchmarks.autocast_memory.grad_cosines``). The diagnosis lists, from
``jamp.debug.autocast_report(...).residuals``, what autocast keeps beyond Flax: by dtype and
shape, then by source line for each shape with a surplus, and autocast's largest float32
residuals beside Flax's at the same line. A line "outside jax" is an op of a jax function
that autocast inlines (``jnp.where``, ``jax.random.bernoulli``), whose frames are jax's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from typing import Any

if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jamp
from benchmarks import sections
from benchmarks.autocast_memory import _by_dtype, _mib, _version, grad_cosines, residual_bytes

START, END = "<!-- real-models:start -->", "<!-- real-models:end -->"
VARIANTS = ("float32", "jamp.autocast bfloat16", "Flax dtype=bfloat16")
BF16 = jnp.bfloat16
TOP = 8
DROPOUT_KEY = 7


class Skip(Exception):
    """A model that cannot be built here; the message says why."""


@dataclasses.dataclass
class Model:
    name: str
    describe: str
    params: Any
    batch: tuple  # (*inputs, targets, dropout key)
    loss: Callable  # the float32 model's loss(params, batch)
    flax_loss: Callable  # the model built with dtype=bfloat16: loss(params, batch)


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


def shapes(tiny: bool) -> Shapes:
    return Shapes(64, 32, 2, 1, 64, 2, 16) if tiny else Shapes(1024, 256, 4, 2, 1024, 8, 128)


def xent(logits, targets):
    logits = logits.astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def _tokens(s: Shapes, seed: int) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(1, s.vocab, (s.batch, s.seq)), jnp.int32)


def _key() -> jax.Array:
    """The dropout key: an argument, as a train step's (a closed-over key's masks are constants)."""
    return jax.random.key(DROPOUT_KEY)


def _load(examples: str, rel: str, name: str):
    """A module of flax's examples, imported from ``examples/rel`` under a private name."""
    path = os.path.join(examples, rel)
    if not examples or not os.path.exists(path):
        raise Skip(f"no `{rel}` under --flax-examples {examples or '(not given)'}")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- models


def _linen(name, describe, module_of, args, targets) -> Model:
    """A linen model: ``module_of(dtype)``, applied to ``args``, cross-entropy on ``targets``."""
    from flax import linen as nn

    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    params = nn.meta.unbox(module_of(jnp.float32).init(keys, *args))

    def loss_of(m):
        def loss(p, batch):
            return xent(m.apply(p, *batch[:-2], rngs={"dropout": batch[-1]}), batch[-2])

        return loss

    return Model(name, describe, params, (*args, targets, _key()), loss_of(module_of(jnp.float32)),
                 loss_of(module_of(BF16)))  # fmt: skip


def _config(mod, s: Shapes, dtype):
    return mod.TransformerConfig(
        vocab_size=s.vocab, output_vocab_size=s.vocab, dtype=dtype, emb_dim=s.d,
        num_heads=s.heads, num_layers=s.layers, qkv_dim=s.d, mlp_dim=s.mlp, max_len=s.seq,
        dropout_rate=0.1, attention_dropout_rate=0.1, deterministic=False,
    )  # fmt: skip


def lm1b(s: Shapes, examples: str) -> Model:
    mod = _load(examples, "lm1b/models.py", "_flax_examples_lm1b_models")
    x = _tokens(s, 0)
    return _linen("lm1b TransformerLM",
                  f"flax examples/lm1b `TransformerLM`: {s.text()}, dropout 0.1 and attention "
                  "dropout 0.1, causal, next-token cross-entropy",
                  lambda dt: mod.TransformerLM(_config(mod, s, dt)), (x,), x)  # fmt: skip


def wmt(s: Shapes, examples: str) -> Model:
    mod = _load(examples, "wmt/models.py", "_flax_examples_wmt_models")
    x, y = _tokens(s, 1), _tokens(s, 2)
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
    f32 = FlaxBertForMaskedLM(cfg, seed=0, dtype=jnp.float32)
    low = FlaxBertForMaskedLM(cfg, dtype=BF16, _do_init=False)

    def loss_of(m):
        def loss(p, batch):
            ids, labels, key = batch
            return xent(m(ids, params=p, dropout_rng=key, train=True).logits, labels)

        return loss

    return Model("HF FlaxBertForMaskedLM",
                 f"transformers {_version('transformers')} `FlaxBertForMaskedLM`, random init: "
                 f"{s.text()}, hidden and attention dropout 0.1, cross-entropy at every position",
                 f32.params, (_tokens(s, 3), _tokens(s, 4), _key()), loss_of(f32),
                 loss_of(low))  # fmt: skip


def _nnx_model(name, describe, build, call, batch) -> Model:
    """An NNX model: ``build(dtype)``; ``call(module, batch, rngs)`` -> the loss."""
    from flax import nnx

    graph, params, rest = nnx.split(build(jnp.float32), nnx.Param, ...)
    low_graph = nnx.split(nnx.eval_shape(lambda: build(BF16)), nnx.Param, ...)[0]

    def loss_of(g, r):
        def loss(p, batch):
            return call(nnx.merge(g, p, r), batch[:-1], nnx.Rngs(dropout=batch[-1]))

        return loss

    return Model(name, describe, params, (*batch, _key()), loss_of(graph, rest),
                 loss_of(low_graph, rest))  # fmt: skip


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


BUILDERS = {"lm1b": lm1b, "wmt": wmt, "bert": bert, "nnx": nnx_builtins, "gemma": gemma}


# --------------------------------------------------------------------------- measurement


def residual_groups(loss: Callable, params: Any, batch: tuple) -> dict[tuple, tuple[int, int]]:
    """``{(dtype, shape, source): (count, bytes)}`` saved, as ``autocast_report`` groups them."""
    from jax._src.ad_checkpoint import saved_residuals

    out: dict[tuple, tuple[int, int]] = {}
    for aval, source in saved_residuals(loss, params, batch):
        if source.startswith("from the argument") or not hasattr(aval, "dtype"):
            continue
        key = (np.dtype(aval.dtype).name, tuple(aval.shape), source)
        count, nbytes = out.get(key, (0, 0))
        out[key] = (count + 1, nbytes + int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize)
    return out


def measure(model: Model, log: Callable[[str], None]) -> dict:
    losses = {"float32": model.loss, "jamp.autocast bfloat16": jamp.autocast(model.loss, BF16),
              "Flax dtype=bfloat16": model.flax_loss}  # fmt: skip
    rows, reference = {}, None
    for name, loss in losses.items():
        t0 = time.perf_counter()
        res = residual_bytes(loss, model.params, model.batch)
        value, grads = jax.jit(jax.value_and_grad(loss))(model.params, model.batch)
        reference = grads if reference is None else reference
        whole, worst = grad_cosines(grads, reference)
        finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
        rows[name] = dict(residuals=res, cosine=whole, worst=worst, finite=finite,
                          loss=float(value))  # fmt: skip
        log(f"  {model.name} {name}: {sum(res.values()) / 2**20:.2f} MiB residuals, cosine "
            f"{whole:.5f} ({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    report = jamp.debug.autocast_report(model.loss, model.params, model.batch, dtype=BF16)
    ours = {(np.dtype(r.dtype).name, r.shape, r.source): (r.count, r.nbytes)
            for r in report.residuals}  # fmt: skip
    flax = residual_groups(model.flax_loss, model.params, model.batch)
    note = report.residuals_note
    listed, counted = sum(n for _, n in ours.values()), sum(rows[VARIANTS[1]]["residuals"].values())
    if listed != counted:  # the report and residual_bytes trace the same function
        note += f" the report lists {listed} bytes, residual_bytes counts {counted}"
    return dict(rows=rows, ours=ours, flax=flax, note=note.strip())


# --------------------------------------------------------------------------- report


def short(source: str, examples: str) -> str:
    """A residual's source with the install and checkout prefixes taken off."""
    if examples:
        source = source.replace(os.path.abspath(examples).rstrip("/") + "/", "examples/")
    source = re.sub(r"/\S*/site-packages/", "", source)
    source = re.sub(r"from \S*/(benchmarks/real_models\.py)", r"from \1", source)
    source = source.replace("output of ", "").replace(" from ", " at ")
    return source + "(no source line outside jax)" if source.endswith(" at ") else source


def _shape(dtype: str, shape: tuple) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def _by_shape(groups: dict) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for (dt, shape, _), (_, nbytes) in groups.items():
        out[(dt, shape)] = out.get((dt, shape), 0) + nbytes
    return out


def diagnosis(result: dict, examples: str) -> list[str]:
    ours, flax = result["ours"], result["flax"]
    a, f = _by_shape(ours), _by_shape(flax)
    diff = sorted(((a.get(k, 0) - f.get(k, 0), k) for k in set(a) | set(f)), reverse=True)
    more = [(d, k) for d, k in diff if d > 0][:TOP]
    less = [(d, k) for d, k in diff if d < 0][-TOP:][::-1]
    total = sum(n for _, n in ours.values()) - sum(n for _, n in flax.values())
    L = [f"Autocast keeps {_mib(abs(total))} MiB {'more' if total >= 0 else 'less'} than Flax "
         "dtype=bfloat16. By dtype and shape, where autocast keeps more (and, after them, "
         "where it keeps less):", "",
         "| dtype[shape] | autocast MiB | Flax MiB | autocast - Flax |",
         "| --- | ---: | ---: | ---: |"]  # fmt: skip
    for d, k in more + less:
        L.append(f"| {_shape(*k)} | {_mib(a.get(k, 0))} | {_mib(f.get(k, 0))} | "
                 f"{'+' if d > 0 else '-'}{_mib(abs(d))} |")  # fmt: skip
    L += ["", "Where the surplus is kept: for each shape above that autocast keeps more of, "
          "in any dtype, the source lines where autocast and Flax differ, largest difference "
          "first (count: autocast's, then Flax's):", "",
          "| dtype[shape] | primitive at source | count | autocast MiB | Flax MiB |",
          "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
    for shape in dict.fromkeys(k[1] for _, k in more):  # each shape once, in order
        keys = [g for g in set(ours) | set(flax) if g[1] == shape]
        keys = [g for g in keys if ours.get(g, (0, 0)) != flax.get(g, (0, 0))]
        keys.sort(key=lambda g: (-abs(ours.get(g, (0, 0))[1] - flax.get(g, (0, 0))[1]), g))
        for g in keys[: 2 * TOP]:
            (count, n), (fcount, fn) = ours.get(g, (0, 0)), flax.get(g, (0, 0))
            L.append(f"| {_shape(*g[:2])} | {short(g[2], examples)} | {count}, {fcount} | "
                     f"{_mib(n)} | {_mib(fn)} |")  # fmt: skip
    f32 = [(n, c, k) for k, (c, n) in ours.items() if k[0] == "float32"]
    f32.sort(key=lambda t: (-t[0], t[2][2]))
    L += ["", f"Autocast's largest float32 residuals ({_mib(sum(t[0] for t in f32))} MiB "
          "float32 in all), and what Flax keeps at the same dtype, shape and source:", "",
          "| dtype[shape] | count | MiB | Flax MiB | primitive at source |",
          "| --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    for n, count, (dt, shape, src) in f32[:TOP]:
        theirs = flax.get((dt, shape, src), (0, 0))[1]
        L.append(f"| {_shape(dt, shape)} | {count} | {_mib(n)} | {_mib(theirs)} | "
                 f"{short(src, examples)} |")  # fmt: skip
    if result["note"]:
        L += ["", f"autocast_report: {result['note']}"]
    return L + [""]


def section(args, models: list[Model], results: dict, skipped: list, elapsed: float) -> str:
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    cmd = "python -m benchmarks.real_models" + (" --tiny" if args.tiny else "")
    cmd += f" --flax-examples {args.flax_examples}" if args.flax_examples else ""
    L = [START, "## Autocast on real models: saved residuals beside Flax's module dtype "
         "(`benchmarks/real_models.py`)", "",
         f"- command: `{cmd}`; date {now}; {elapsed:.0f} s",
         f"- jax {jax.__version__}, flax {_version('flax')}, transformers "
         f"{_version('transformers')}; backend {jax.default_backend()}, {os.cpu_count()} CPUs; "
         f"python {platform.python_version()}",
         "- every variant from the same float32 parameters, batch and dropout key, a train "
         "step (dropout on) with a float32 cross-entropy; residuals: bytes saved for the "
         "backward pass (`saved_residuals`, arguments excluded); grad cosine to float32's "
         "(worst leaf in brackets). The module docstring defines the variants.", ""]  # fmt: skip
    summary = ["### Summary (issue #25: autocast's residuals <= Flax dtype=bfloat16's)", "",
               "| model | float32 MiB | autocast x float32 | Flax dtype x float32 | "
               "autocast x Flax | met |", "| --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    body: list[str] = []
    for model in models:
        result = results[model.name]
        base = sum(result["rows"]["float32"]["residuals"].values())
        r = {k: sum(row["residuals"].values()) / base for k, row in result["rows"].items()}
        ours, theirs = r["jamp.autocast bfloat16"], r["Flax dtype=bfloat16"]
        met = "yes" if ours <= theirs + 1e-9 else "**no**"
        summary.append(f"| {model.name} | {_mib(base)} | {ours:.3f} | {theirs:.3f} | "
                       f"{ours / theirs:.3f} | {met} |")  # fmt: skip
        body += [f"### {model.name}: {model.describe}", "",
              "| variant | residual MiB (by dtype) | ratio to float32 | grad cosine [worst leaf] "
              "| loss |", "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
        for name in VARIANTS:
            row = result["rows"][name]
            total = sum(row["residuals"].values())
            cos = f"{row['cosine']:.5f} [{row['worst']:.4f}]" + ("" if row["finite"] else " NaN")
            body.append(f"| {name} | {_mib(total)} ({_by_dtype(row['residuals'])}) | "
                     f"{r[name]:.3f} | {cos} | {row['loss']:.5g} |")  # fmt: skip
        body += [""] + diagnosis(result, args.flax_examples)
    L += summary + [""] + body
    if skipped:
        L += ["### Not run", ""] + [f"- {name}: {why}" for name, why in skipped] + [""]
    return "\n".join(L + [END])


# --------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.real_models``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--flax-examples", default="",
                    help="a checkout of flax's examples/ folder (lm1b, wmt, gemma)")  # fmt: skip
    ap.add_argument("--models", default=",".join(BUILDERS),
                    help=f"comma-separated subset of {','.join(BUILDERS)}")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test in seconds")
    ap.add_argument("--out", default="", help="also write the markdown section to this file")
    ap.add_argument("--results", default="",
                    help="splice the section into this file between its markers")  # fmt: skip
    return ap


def run(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    t0, s = time.perf_counter(), shapes(args.tiny)
    models, results, skipped = [], {}, []
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        if key not in BUILDERS:
            raise SystemExit(f"--models: unknown model {key!r}; choose from {','.join(BUILDERS)}")
        try:
            model = BUILDERS[key](s, args.flax_examples)
        except Skip as e:
            skipped.append((key, str(e)))
            log(f"{key}: skipped: {e}")
            continue
        log(f"{model.name}: {model.describe}")
        results[model.name] = measure(model, log)
        models.append(model)
    return section(args, models, results, skipped, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> str:
    args = parser().parse_args(argv)
    return sections.emit(args, run(args, sections.log), START, END)


if __name__ == "__main__":
    main()
