"""Mixed precision on a small CNN: what float16 loses to underflow, and what loss scaling wins back.

Trains the same Flax CNN on scikit-learn's bundled 8x8 digits (nothing is
downloaded) in five modes and compares them:

``float32``
    the reference.
``float16``
    matrix products and convolutions in float16 via ``jamp.autocast``, no
    loss scaling.
``float16+scaling``
    the same, with ``jamp.loss_scaling`` and a dynamic loss scale.
``bfloat16``
    ``jamp.autocast(..., jnp.bfloat16)``, no loss scaling.
``float8``
    ``jamp.autocast(..., "float8")``: the dense layers' matrix products in
    float8 (``float8_e4m3fn`` forward, ``float8_e5m2`` gradients) with a scale
    per tensor, the convolutions and everything else in bfloat16; no loss
    scaling.

The modes are the rows of ``MODES``: a compute dtype and a loss scale each,
so a new one is one more row.

The configuration, and why it is honest
---------------------------------------
Why the loss is normalised this way: a large language-model run normalises
its loss so, and it is what makes float16 lose gradients. The cross-entropy
is *summed* over the micro-batch and divided by the number of tokens in the
global batch, here ``2**22`` (4M tokens per optimizer step, a common
pretraining batch), so that every micro-batch and every device adds its
share of one global mean. Each example's contribution to the gradient, and
so every per-example activation gradient in the backward pass, carries that
factor 2**-22 ≈ 2.4e-7. Adam is invariant to the overall scale of the loss,
so float32 trains as well as it does with a plain mean. float16 does not:
its smallest normal number is 6.1e-5 and its smallest subnormal 6e-8, so in
the backward pass of the float16 matrix products most activation gradients
flush to zero or keep only one or two significant bits. Adam turns what
survives into full-size steps and training degrades. With dynamic loss
scaling (``jamp.dynamic_loss_scale(growth_interval=50)``: PyTorch's defaults
except a shorter growth interval, as this run is short) the loss is
multiplied by 2**16 and more, the activation gradients sit in float16's
normal range, and the scaled run matches float32. bfloat16 has float32's
exponent range, so it needs no scaling. Neither does float8, whose range is
narrower still (``float8_e5m2``'s smallest subnormal is 2**-16): each
tensor is scaled so that its own largest value maps to the format's
largest, which is loss scaling done per tensor, every step.

The scale doubles every 50 finite steps until the scaled gradients overflow
float16 (near 2**35 here): that step's gradients are inf, ``loss_scaling``
skips it (the parameters and Adam's state are kept) and halves the scale,
which then climbs again. The plot's loss-scale panel marks every skipped
step; a long run with PyTorch's ``growth_interval=2000`` saws the same way,
only slower. ``--init-scale`` and ``--growth-interval`` change the start and
the pace.

Every mode uses ``jamp.loss_scaling`` around the same ``optax.adam(1e-3)``
(with ``jamp.no_loss_scale()`` for the modes without scaling), so
``jamp.metrics(opt_state)`` is logged the same way for all of them and a
non-finite step is skipped rather than applied in every mode.

Columns of the table: ``loss`` is the training cross-entropy per example,
averaged over the last 50 steps; ``test acc`` the accuracy on the 397 held-out
digits, computed with the mode's own forward pass; ``skipped`` the steps whose
gradients were not finite; ``scale`` the final loss scale; ``underflow`` the
fraction of gradient entries that are nonzero in float32 but exactly zero in
the mode's (unscaled) gradients, measured on the same parameters and batch
every ``--log-every`` steps and averaged; ``ms/step`` the training step time
without compilation and without these measurements (on a CPU float16 is
emulated, so it is slower there; on a GPU it is faster).

Run ``python examples/train_digits.py`` (about a minute on two CPU cores;
unchanged on a GPU). The loss curves, the underflow fraction and the
loss-scale trajectory are saved to ``runs/digits.png`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from sklearn.datasets import load_digits
from tqdm.auto import tqdm

import jamp

GLOBAL_TOKENS = 2**22  # the loss is normalised by the tokens of a 4M-token global batch
BATCH = 64


def no_scaling(args: argparse.Namespace) -> jamp.LossScaleState:
    return jamp.no_loss_scale()


def dynamic_scaling(args: argparse.Namespace) -> jamp.LossScaleState:
    return jamp.dynamic_loss_scale(args.init_scale, growth_interval=args.growth_interval)


@dataclasses.dataclass(frozen=True)
class Mode:
    """A row of the comparison: the dtype of the matrix products, the loss scale, the style."""

    compute_dtype: Any  # None: the model as written, in float32; "float8": float8 products
    loss_scale: Callable[[argparse.Namespace], jamp.LossScaleState]
    style: dict  # matplotlib keyword arguments of the mode's lines


# float32 is drawn wide and pale so the modes that match it stay visible on top of it.
MODES = {
    "float32": Mode(None, no_scaling, dict(color="0.6", lw=4.0)),
    "float16": Mode(jnp.float16, no_scaling, dict(color="tab:red", lw=1.5)),
    "float16+scaling": Mode(jnp.float16, dynamic_scaling, dict(color="tab:blue", lw=1.5, ls="--")),
    "bfloat16": Mode(jnp.bfloat16, no_scaling, dict(color="tab:green", lw=1.5, ls=":")),
    "float8": Mode("float8", no_scaling, dict(color="tab:purple", lw=1.5, ls="-.")),
}


class CNN(nn.Module):
    """Two convolutions and two dense layers: 8x8x1 images to 10 logits."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


@dataclasses.dataclass
class Result:
    mode: str
    losses: np.ndarray  # training cross-entropy per example, every step
    probe_steps: np.ndarray
    underflow: np.ndarray  # underflow fraction at each probe
    scales: np.ndarray  # loss scale after every step
    skipped_at: np.ndarray  # the steps whose gradients were not finite (skipped)
    test_accuracy: float
    skipped: int
    ms_per_step: float

    @property
    def final_loss(self) -> float:
        return float(np.mean(self.losses[-50:]))


def load_data(seed: int) -> tuple[np.ndarray, ...]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    y = digits.target.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = x[perm], y[perm]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def forward_for(mode: str, model: nn.Module) -> Callable:
    dtype = MODES[mode].compute_dtype
    return model.apply if dtype is None else jamp.autocast(model.apply, dtype)


def loss_fn(apply: Callable, params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Summed cross-entropy over the micro-batch, normalised by the global token count."""
    logits = apply(params, x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
    return jnp.sum(ce) / GLOBAL_TOKENS


def train(mode: str, args: argparse.Namespace, data, progress: bool = True) -> Result:
    steps, seed, log_every = args.steps, args.seed, args.log_every
    x_train, y_train, x_test, y_test = data
    model = CNN()
    apply = forward_for(mode, model)
    params = model.init(jax.random.PRNGKey(seed), x_train[:1])
    tx = jamp.loss_scaling(optax.adam(1e-3), MODES[mode].loss_scale(args))
    opt_state = tx.init(params)

    def grads_as_optimizer_sees_them(params, opt_state, x, y):
        ls = jamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: jamp.scale(ls, loss_fn(apply, p, x, y)))(params)
        return loss / ls.scale, grads

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = grads_as_optimizer_sees_them(params, opt_state, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss * (GLOBAL_TOKENS / BATCH)

    @jax.jit
    def underflow_probe(params, opt_state, x, y):
        """Fraction of float32-nonzero gradient entries that are zero in this mode."""
        _, grads = grads_as_optimizer_sees_them(params, opt_state, x, y)
        grads = jamp.unscale(jamp.get_loss_scale(opt_state), grads)
        reference = jax.grad(lambda p: loss_fn(model.apply, p, x, y))(params)
        lost = sum(
            jnp.sum((g == 0) & (r != 0))
            for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True)
        )
        nonzero = sum(jnp.sum(r != 0) for r in jax.tree.leaves(reference))
        return lost / jnp.maximum(nonzero, 1)

    rng = np.random.default_rng(seed)  # every mode sees the same batches
    batches = rng.integers(0, len(x_train), (steps, BATCH))
    losses, scales, finite, probe_steps, underflow = [], [], [], [], []
    train_seconds, timed_steps = 0.0, 0
    bar = tqdm(range(steps), desc=f"{mode:>15}", disable=not progress, leave=True)
    for i in bar:
        xb, yb = x_train[batches[i]], y_train[batches[i]]
        if i % log_every == 0:
            probe_steps.append(i)
            underflow.append(float(underflow_probe(params, opt_state, xb, yb)))
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, xb, yb)
        loss.block_until_ready()
        if i > 0:  # step 0 compiles
            train_seconds += time.perf_counter() - start
            timed_steps += 1
        losses.append(loss)
        scales.append(jamp.get_loss_scale(opt_state).scale)
        finite.append(opt_state.last_finite)
        if (i + 1) % log_every == 0 or i + 1 == steps:
            logged = jax.device_get(jamp.metrics(opt_state))
            bar.set_postfix(
                loss=f"{float(loss):.3f}",
                scale=f"{float(logged['loss_scale']):.0f}",
                skipped=int(logged["skipped_steps"]),
                underflow=f"{underflow[-1]:.2f}",
            )
    bar.close()
    logits = jax.jit(apply)(params, x_test)
    accuracy = float(jnp.mean(jnp.argmax(logits, axis=-1) == y_test))
    return Result(
        mode=mode,
        losses=np.asarray(jax.device_get(losses), np.float64),
        probe_steps=np.asarray(probe_steps),
        underflow=np.asarray(underflow),
        scales=np.asarray(jax.device_get(scales), np.float64),
        skipped_at=np.flatnonzero(~np.asarray(jax.device_get(finite), bool)),
        test_accuracy=accuracy,
        skipped=int(opt_state.skipped_steps),
        ms_per_step=1e3 * train_seconds / max(timed_steps, 1),
    )


def table(results: Sequence[Result]) -> str:
    header = (
        f"{'mode':<16}{'loss':>9}{'test acc':>10}{'skipped':>9}{'scale':>12}"
        f"{'underflow':>11}{'ms/step':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.mode:<16}{r.final_loss:>9.4f}{r.test_accuracy:>10.3f}{r.skipped:>9d}"
            f"{r.scales[-1]:>12.4g}{np.mean(r.underflow):>11.3f}{r.ms_per_step:>9.2f}"
        )
    return "\n".join(lines)


def plot(results: Sequence[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_uf, ax_scale) = plt.subplots(1, 3, figsize=(15, 5))
    for r in results:
        window = max(1, min(25, len(r.losses) // 10))
        smooth = np.convolve(r.losses, np.ones(window) / window, mode="valid")
        steps = np.arange(window - 1, len(r.losses))
        style = MODES[r.mode].style
        ax_loss.plot(steps, smooth, label=r.mode, **style)
        ax_uf.plot(r.probe_steps, r.underflow, label=r.mode, marker=".", **style)
        ax_scale.plot(np.arange(len(r.scales)), r.scales, label=r.mode, **style)
        if len(r.skipped_at):  # an overflow: the step is skipped and the scale halved
            before = np.where(r.skipped_at > 0, r.scales[r.skipped_at - 1], r.scales[0] * 2)
            ax_scale.scatter(
                r.skipped_at,
                before,
                marker="x",
                color=style.get("color"),
                zorder=3,
                label=f"{r.mode}: {len(r.skipped_at)} skipped",
            )
    ax_loss.set(
        title=f"training loss ({window}-step mean)",
        xlabel="step",
        ylabel="cross-entropy per example",
        yscale="log",
    )
    ax_uf.set(
        title="gradient entries lost to underflow",
        xlabel="step",
        ylabel="fraction of float32-nonzero entries that are 0",
        ylim=(-0.02, 1.02),
    )
    ax_scale.set(
        title="loss scale\n(x: an overflow; the step is skipped, the scale halved)",
        xlabel="step",
        ylabel="scale",
        yscale="log",
    )
    ax_scale.set_yscale("log", base=2)
    for ax in (ax_loss, ax_uf, ax_scale):
        ax.grid(True, alpha=0.3)
    ax_loss.legend()
    ax_uf.legend()
    # Below the climbing scale, above the unscaled modes' 1.
    ax_scale.legend(loc="lower right", bbox_to_anchor=(1.0, 0.08), fontsize=8)
    tokens = int(np.log2(GLOBAL_TOKENS))
    fig.suptitle(f"8x8 digits CNN, loss normalised by 2**{tokens} tokens, Adam")
    fig.text(
        0.5,
        0.01,
        f"Why the loss is normalised so: as in LLM pretraining, the summed cross-entropy is "
        f"divided by the tokens of the 2**{tokens}-token global batch, so every gradient "
        f"carries a factor 2**-{tokens},\nfar below float16's smallest normal number (2**-14) "
        "and well inside bfloat16's range: float16 needs the loss scaled up, bfloat16 does not, "
        "float8 scales each tensor itself.",
        ha="center",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {unknown or text!r}; choose from {', '.join(MODES)}"
        )
    return modes


def main(argv: Sequence[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="The module docstring explains the configuration and every column.",
    )
    parser.add_argument("--steps", type=int, default=1500, help="training steps per mode")
    parser.add_argument("--seed", type=int, default=0, help="data split, init and batches")
    parser.add_argument(
        "--modes",
        type=parse_modes,
        default=list(MODES),
        help=f"comma-separated subset of {','.join(MODES)} (default: all)",
    )
    parser.add_argument(
        "--init-scale",
        type=float,
        default=2.0**16,
        help="float16+scaling's first loss scale (PyTorch's default, 65536)",
    )
    parser.add_argument(
        "--growth-interval",
        type=int,
        default=50,
        help="float16+scaling's finite steps between doublings of the scale (PyTorch: 2000)",
    )
    parser.add_argument("--out", default="runs/digits.png", help="where to write the plot")
    parser.add_argument(
        "--log-every",
        type=int,
        default=50,
        help="steps between progress-bar metrics and underflow measurements",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.log_every < 1 or args.growth_interval < 1:
        parser.error("--steps, --log-every and --growth-interval must be >= 1")

    print(f"jax {jax.__version__} on {jax.default_backend()}; {args.steps} steps per mode")
    data = load_data(args.seed)
    results = [train(mode, args, data, progress=not args.no_progress) for mode in args.modes]
    print()
    print(table(results))
    plot(results, args.out)
    print(f"\nplot written to {args.out}")
    return results


if __name__ == "__main__":
    main()
