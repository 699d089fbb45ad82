"""An Equinox MLP in float16 on scikit-learn's digits: jamp's loss scaling and autocast.

``eqx.nn.MLP`` goes into jamp as it is, under ``eqx.filter_jit``. Three modes
train the same model on the same batches:

``float32``
    the reference.
``float16``
    ``jamp.autocast(loss_fn, jnp.float16)``: the matrix products in float16,
    no loss scaling.
``float16+scaling``
    the same, with a dynamic loss scale.

Two styles write the step, with the same results (``--style``):

``filter`` (MPX's shape)
    ``jamp.filter_value_and_grad`` scales, differentiates the model's
    floating arrays, unscales, checks and updates the scale; then
    ``jamp.step_if_finite`` applies ``optax.adam`` unless the step overflowed.
``optax``
    ``jamp.loss_scaling(optax.adam(...))`` holds the scale in the optimizer
    state; the step is Equinox's own (``eqx.filter_value_and_grad``,
    ``optimizer.update``, ``eqx.apply_updates``) with the loss multiplied by
    ``jamp.scale``.

As in ``train_digits.py``, the cross-entropy is summed over the batch and
divided by the token count of a 4M-token global batch (2**22), so every
activation gradient is about 2**-22 times what a mean would give: float16
without scaling flushes most of them to zero (``underflow``: the fraction of
gradient entries nonzero in float32 that are zero in the mode's unscaled
gradients), and with a dynamic scale they survive. Adam does not mind the
overall size of the loss, so float32 trains as usual.

``--inject-inf-at K`` puts an inf into the batch of step K in every mode: the
step is skipped, the model and the optimizer state stay as they were, and the
scale backs off.

``python examples/equinox_mlp.py`` (a few seconds per mode on a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jamp

MODES = ("float32", "float16", "float16+scaling")
STYLES = ("filter", "optax")
GLOBAL_TOKENS = 2**22  # the loss is normalised by the tokens of a 4M-token global batch
BATCH = 64


def load_data(seed: int) -> tuple[np.ndarray, ...]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # 8x8 images, flattened to 64 features
    y = digits.target.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(x))
    x, y = x[perm], y[perm]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    """Summed cross-entropy over the batch, normalised by the global token count."""
    logits = jax.vmap(model)(x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
    return jnp.sum(ce) / GLOBAL_TOKENS


def loss_for(mode: str) -> Callable:
    return loss_fn if mode == "float32" else jamp.autocast(loss_fn, jnp.float16)


def loss_scale_for(mode: str) -> jamp.LossScaleState:
    if mode == "float16+scaling":
        return jamp.dynamic_loss_scale(growth_interval=100)
    return jamp.no_loss_scale()  # still skips a non-finite step


def filter_style(mode: str, model: eqx.nn.MLP, lr: float):
    """``jamp.filter_value_and_grad`` + ``jamp.step_if_finite``: the loss scale is carried."""
    loss = loss_for(mode)
    optimizer = optax.adam(lr)
    carry = (optimizer.init(eqx.filter(model, eqx.is_array)), loss_scale_for(mode))

    @eqx.filter_jit
    def train_step(model, carry, x, y):
        opt_state, loss_scale = carry
        out = jamp.filter_value_and_grad(loss)(loss_scale, model, x, y)
        model, opt_state = jamp.step_if_finite(
            out.finite, optimizer, out.grads, opt_state, model, filter=eqx.is_array
        )
        return model, (opt_state, out.loss_scale), out.value, out.finite

    return carry, train_step, lambda carry: carry[1], lambda carry: carry[0]


def optax_style(mode: str, model: eqx.nn.MLP, lr: float):
    """``jamp.loss_scaling``: the loss scale lives in the optimizer state."""
    loss = loss_for(mode)
    optimizer = jamp.loss_scaling(optax.adam(lr), loss_scale_for(mode))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        ls = jamp.get_loss_scale(opt_state)
        scaled, grads = eqx.filter_value_and_grad(lambda m: jamp.scale(ls, loss(m, x, y)))(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return (
            eqx.apply_updates(model, updates),
            opt_state,
            scaled / ls.scale,
            opt_state.last_finite,
        )

    return opt_state, train_step, jamp.get_loss_scale, lambda opt_state: opt_state.inner_state


@dataclasses.dataclass
class Result:
    mode: str
    losses: np.ndarray  # training cross-entropy per example, every step
    finite: np.ndarray  # whether each step was applied
    scales: np.ndarray  # loss scale after every step
    underflow: float  # at the first step
    test_accuracy: float
    unchanged: dict  # step -> (model unchanged, optimizer state unchanged), for skipped steps
    model: eqx.nn.MLP

    @property
    def skipped(self) -> int:
        return int(np.sum(~self.finite))

    @property
    def final_loss(self) -> float:
        return float(np.mean(self.losses[-20:]))


def same(a, b) -> bool:
    """Whether the array leaves of ``a`` and ``b`` are equal, bit for bit."""
    leaves_a = jax.tree.leaves(eqx.filter(a, eqx.is_array))
    leaves_b = jax.tree.leaves(eqx.filter(b, eqx.is_array))
    if len(leaves_a) != len(leaves_b):
        return False
    pairs = zip(leaves_a, leaves_b, strict=True)
    return all(bool(jnp.array_equal(x, y)) for x, y in pairs)


@eqx.filter_jit
def underflow_probe(loss: Callable, loss_scale, model, x, y) -> jax.Array:
    """Fraction of float32-nonzero gradient entries that are zero in this mode."""
    grads = jamp.filter_value_and_grad(loss)(loss_scale, model, x, y).grads
    reference = eqx.filter_grad(loss_fn)(model, x, y)
    pairs = list(zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True))
    lost = sum(jnp.sum((g == 0) & (r != 0)) for g, r in pairs)
    nonzero = sum(jnp.sum(r != 0) for _, r in pairs)
    return lost / jnp.maximum(nonzero, 1)


@eqx.filter_jit
def predict(model: eqx.nn.MLP, x: jax.Array) -> jax.Array:
    return jax.vmap(model)(x)


def train(mode: str, style: str, steps: int, seed: int, data, inject_inf_at: int = -1) -> Result:
    x_train, y_train, x_test, y_test = data
    model = eqx.nn.MLP(64, 10, width_size=64, depth=2, key=jax.random.PRNGKey(seed))
    carry, train_step, loss_scale_of, optimizer_state_of = (
        filter_style if style == "filter" else optax_style
    )(mode, model, 1e-3)
    batches = np.random.default_rng(seed).integers(0, len(x_train), (steps, BATCH))
    losses, finite, scales, unchanged = [], [], [], {}
    underflow = None
    for i in range(steps):
        xb, yb = x_train[batches[i]], y_train[batches[i]]
        if i == inject_inf_at:
            xb = xb.copy()
            xb[0, 0] = np.inf
        if i == 0:
            loss = loss_for(mode)
            underflow = float(underflow_probe(loss, loss_scale_of(carry), model, xb, yb))
        new_model, new_carry, loss, ok = train_step(model, carry, xb, yb)
        if i == inject_inf_at:
            unchanged[i] = (
                same(new_model, model),
                same(optimizer_state_of(new_carry), optimizer_state_of(carry)),
            )
        model, carry = new_model, new_carry
        losses.append(loss * (GLOBAL_TOKENS / BATCH))
        finite.append(ok)
        scales.append(loss_scale_of(carry).scale)
    logits = predict(model, x_test)
    return Result(
        mode=mode,
        losses=np.asarray(jax.device_get(losses), np.float64),
        finite=np.asarray(jax.device_get(finite), bool),
        scales=np.asarray(jax.device_get(scales), np.float64),
        underflow=underflow,
        test_accuracy=float(jnp.mean(jnp.argmax(logits, axis=-1) == y_test)),
        unchanged=unchanged,
        model=model,
    )


def table(results: Sequence[Result]) -> str:
    header = f"{'mode':<16}{'loss':>9}{'test acc':>10}{'skipped':>9}{'scale':>12}{'underflow':>11}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.mode:<16}{r.final_loss:>9.4f}{r.test_accuracy:>10.3f}{r.skipped:>9d}"
            f"{r.scales[-1]:>12.4g}{r.underflow:>11.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="training steps per mode")
    parser.add_argument("--seed", type=int, default=0, help="data split, init and batches")
    parser.add_argument("--style", choices=STYLES, default="filter", help="how the step is written")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated subset of {','.join(MODES)} (default: all)",
    )
    parser.add_argument(
        "--inject-inf-at", type=int, default=-1, help="put an inf into this step's batch"
    )
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    print(f"jax {jax.__version__} on {jax.default_backend()}; equinox {eqx.__version__}")
    data = load_data(args.seed)
    results = [
        train(mode, args.style, args.steps, args.seed, data, args.inject_inf_at) for mode in modes
    ]
    print(table(results))
    for r in results:
        for step, (model_kept, opt_kept) in r.unchanged.items():
            before = r.scales[step - 1] if step else float("nan")
            print(
                f"{r.mode}: step {step} skipped={not r.finite[step]}, model unchanged="
                f"{model_kept}, optimizer state unchanged={opt_kept}, scale {before:g} -> "
                f"{r.scales[step]:g}"
            )
    return results


if __name__ == "__main__":
    main()
