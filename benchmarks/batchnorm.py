"""BatchNorm across replicas: autocast against Flax's dtype over many initialisations (a spoke).

Issue #35: flax's imagenet ResNet18 and ResNet50, their BatchNorm over
``axis_name="batch"`` (the statistics are ``pmean``s across the replicas, as under
``pmap``), eight replicas under ``vmap``; at each initialisation (a new key, a new batch)
the parameters' gradient in float32, under ``jamp.autocast(bfloat16)`` and with the
modules built with ``dtype=bfloat16``, and each one's cosine to float32's. One
initialisation says little (these nets amplify any rounding chaotically at init); the
section reports the paired difference over all of them.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import jamp
from benchmarks.measure import grad_cosines
from benchmarks.models import BF16
from benchmarks.report import emit, header

START, END = "<!-- batchnorm:start -->", "<!-- batchnorm:end -->"
REPLICAS, PER_REPLICA = 8, 4


class _Basic(nn.Module):  # flax examples/imagenet/models.py, ResNetBlock
    filters: int
    conv: Callable
    norm: Callable
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x):
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(x)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(self.conv(self.filters, (3, 3))(y))
        if x.shape != y.shape:
            x = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(x)
            x = self.norm(name="norm_proj")(x)
        return nn.relu(x + y)


class _Bottleneck(_Basic):  # BottleneckResNetBlock
    @nn.compact
    def __call__(self, x):
        y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
        y = self.conv(self.filters * 4, (1, 1))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if x.shape != y.shape:
            x = self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(x)
            x = self.norm(name="norm_proj")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):  # flax examples/imagenet/models.py, ResNet
    stages: tuple
    block: type
    filters: int = 64
    classes: int = 10
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9,
                                 epsilon=1e-5, dtype=self.dtype, axis_name="batch")  # fmt: skip
        x = conv(self.filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.max_pool(nn.relu(norm(name="bn_init")(x)), (3, 3), (2, 2), padding="SAME")
        for i, n in enumerate(self.stages):
            for j in range(n):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block(self.filters * 2**i, conv, norm, strides)(x)
        x = nn.Dense(self.classes, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))
        return jnp.asarray(x, self.dtype)


MODELS = {"resnet18": ((2, 2, 2, 2), _Basic), "resnet50": ((3, 4, 6, 3), _Bottleneck)}


def _loss(model: nn.Module) -> Callable:
    """The mean cross-entropy of every replica's batch, BatchNorm over all of them."""

    def one(params, stats, x, y):
        variables = {"params": params, "batch_stats": stats}
        out, _ = model.apply(variables, x, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), y).mean()

    per = jax.vmap(one, in_axes=(None, None, 0, 0), axis_name="batch")
    return lambda params, stats, x, y: jnp.mean(per(params, stats, x, y))


def measure(key: str, inits: int, size: int, filters: int, log: Callable, tiny=False):
    """Per initialisation, autocast's and Flax's gradient cosine to float32's (tiny: 2 blocks)."""
    stages, block = MODELS[key] if not tiny else ((1, 1), MODELS[key][1])
    build = functools.partial(ResNet, stages, block, filters)
    f32 = _loss(build())
    grads = [
        jax.jit(jax.grad(f)) for f in (f32, jamp.autocast(f32, BF16), _loss(build(dtype=BF16)))
    ]
    init = jax.jit(jax.vmap(build().init, in_axes=(None, 0), axis_name="batch"))
    rows = []
    for seed in range(inits):
        rng = np.random.default_rng(seed)
        x = jnp.asarray(rng.standard_normal((REPLICAS, PER_REPLICA, size, size, 3)), jnp.float32)
        y = jnp.asarray(rng.integers(0, 10, (REPLICAS, PER_REPLICA)), jnp.int32)
        variables = jax.tree.map(lambda a: a[0], init(jax.random.key(seed), x))
        args = (variables["params"], variables["batch_stats"], x, y)
        ref, ours, flax = (g(*args) for g in grads)
        rows.append((grad_cosines(ours, ref)[0], grad_cosines(flax, ref)[0]))
        log(f"{key} init {seed}: cosine autocast {rows[-1][0]:.5f}, Flax {rows[-1][1]:.5f}")
    return np.array(rows)


def section(results: dict, args: argparse.Namespace, elapsed: float) -> str:
    L = [START, "## BatchNorm across replicas: autocast against Flax's dtype", "",
         *header(" ".join(["python -m benchmarks", *args.argv]), elapsed, ("jax", "flax")), "",
         f"Flax's imagenet ResNets (BatchNorm over `axis_name`), {REPLICAS} replicas of "
         f"{PER_REPLICA} images {args.size}x{args.size} under `vmap`, {args.filters} filters "
         "at the stem: the cosine of the whole parameter gradient to float32's at each "
         "initialisation, and autocast's minus Flax's, paired (the standard error over "
         "initialisations).", "",
         "| model | inits | autocast | Flax dtype=bfloat16 | difference | autocast closer |",
         "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for key, rows in results.items():
        d = rows[:, 0] - rows[:, 1]
        se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
        closer, ties = int(np.sum(d > 5e-6)), int(np.sum(np.abs(d) <= 5e-6))
        L.append(f"| {key} | {len(rows)} | {rows[:, 0].mean():.5f} | {rows[:, 1].mean():.5f} "
                 f"| {d.mean():+.6f} ± {se:.6f} | {closer} (ties {ties}) |")  # fmt: skip
    return "\n".join([*L, END])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", default="resnet18,resnet50", help="resnet18,resnet50")
    ap.add_argument("--inits", type=int, default=16, help="initialisations per model")
    ap.add_argument("--size", type=int, default=64, help="image side")
    ap.add_argument("--filters", type=int, default=64, help="the stem's width (flax's: 64)")


def run(args: argparse.Namespace, log: Callable[[str], None]) -> str:
    if args.tiny:  # two stages of one block: a smoke test
        args.inits, args.size, args.filters = 2, 16, 4
    t0 = time.perf_counter()
    results = {}
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        if key not in MODELS:
            raise SystemExit(f"--models: unknown model {key!r}; choose from {','.join(MODELS)}")
        results[key] = measure(key, args.inits, args.size, args.filters, log, args.tiny)
    return emit(args, section(results, args, time.perf_counter() - t0), START, END)
