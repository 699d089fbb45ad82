"""Shared pieces of tests/integration/test_reliability.py (not a test module).

A seeded fault schedule, a small Flax MLP, and jitted training loops that run
a whole chunk of steps inside one ``lax.scan`` and record per-step flags, so
thousands of steps take well under a second on CPU.

Every loop takes an ``omit`` flag per step: an omitted step is an exact no-op
(``lax.cond`` hands the carry back untouched). The reference runs use the
same compiled program with the faulty steps omitted, so "the run that simply
omitted the faulty steps" is computed by identical code.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jamp

# Kinds of fault, per step.
CLEAN = 0
GRAD = 1  # one element of one gradient leaf (single device: the scaled grads
# loss_scaling receives; data parallel: one replica's local grads, before the mean)
LOSS = 2  # the loss (data parallel: one replica's loss)
REDUCED = 3  # data parallel only: one replica's copy of the already-averaged grads
KIND_NAMES = {GRAD: "gradient leaf", LOSS: "loss", REDUCED: "one replica, after the all-reduce"}
POISONS = (np.float32(np.inf), np.float32(-np.inf), np.float32(np.nan))
POISON_NAMES = ("+inf", "-inf", "nan")

FEATURES, HIDDEN, ROWS = 8, 32, 16


@dataclasses.dataclass
class Schedule:
    """Per-step fault plan; every array has one entry per step."""

    kind: np.ndarray  # int32, CLEAN / GRAD / LOSS / REDUCED
    poison: np.ndarray  # float32, the injected value (+inf, -inf, nan; 1.0 when clean)
    leaf: np.ndarray  # int32, which gradient leaf
    elem: np.ndarray  # int32, which element of it (taken modulo its size)
    replica: np.ndarray  # int32, which replica (data parallel)
    bursts: list  # (first step, length)

    @property
    def n(self) -> int:
        return len(self.kind)

    @property
    def faulty(self) -> np.ndarray:
        return self.kind != CLEAN

    def arrays(self, omit: np.ndarray | None = None, *, faults: bool = True) -> dict:
        """The scan inputs; ``faults=False`` gives the same steps with nothing injected."""
        kind = self.kind if faults else np.zeros_like(self.kind)
        return dict(
            t=np.arange(self.n, dtype=np.int32),
            kind=kind.astype(np.int32),
            poison=np.where(kind == CLEAN, np.float32(1.0), self.poison).astype(np.float32),
            leaf=self.leaf,
            elem=self.elem,
            replica=self.replica,
            omit=np.zeros(self.n, bool) if omit is None else np.asarray(omit, bool),
        )

    def counts(self, names: dict | None = None) -> dict:
        """Injected faults by kind and by value."""
        out = {}
        for k, name in (names or KIND_NAMES).items():
            for v, vname in enumerate(POISON_NAMES):
                sel = self.kind == k
                if k != CLEAN and sel.any():
                    p = self.poison[sel]
                    hit = np.isnan(p) if vname == "nan" else p == POISONS[v]
                    if hit.sum():
                        out[f"{name}: {vname}"] = int(hit.sum())
        return out


def fault_schedule(seed, n_steps, fault_end, kinds, n_leaves, *, max_burst=200, n_replicas=8):
    """Bursts of 1..max_burst consecutive faulty steps separated by clean gaps.

    The first bursts are forced to cover the edge cases: one of exactly
    ``max_burst`` steps, a single-step fault, and two bursts one clean step
    apart. No fault starts at or after ``fault_end``.
    """
    rng = np.random.default_rng(seed)
    kind = np.zeros(n_steps, np.int32)
    poison = np.ones(n_steps, np.float32)
    leaf = rng.integers(0, n_leaves, n_steps).astype(np.int32)
    elem = rng.integers(0, 2**20, n_steps).astype(np.int32)
    replica = rng.integers(0, n_replicas, n_steps).astype(np.int32)
    forced = [(max_burst, 30), (1, 1), (3, 20)]
    bursts = []
    t = int(rng.integers(10, 40))
    while True:
        if forced:
            length, gap = forced.pop(0)
        else:
            long = rng.random() < 0.35
            length = int(rng.integers(1, max_burst + 1)) if long else int(rng.integers(1, 8))
            gap = int(rng.integers(1, 120))
        if t + length > fault_end:
            break
        kind[t : t + length] = rng.choice(np.asarray(kinds, np.int32), length)
        poison[t : t + length] = rng.choice(np.asarray(POISONS), length)
        bursts.append((t, length))
        t += length + gap
    return Schedule(kind, poison, leaf, elem, replica, bursts)


# ------------------------------------------------------------------ the model


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(HIDDEN)(x))
        return nn.Dense(1)(h)[:, 0]


MODEL = MLP()
_W_TRUE = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)


def init_params(seed=0):
    return MODEL.init(jax.random.key(seed), jnp.zeros((1, FEATURES), jnp.float32))


def batch(t, replica=0):
    """Step ``t``'s rows (for one replica): generated on device, nothing to transfer."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(1234), t), replica)
    x = jax.random.normal(key, (ROWS, FEATURES), jnp.float32)
    y = jnp.sin(x @ jnp.asarray(_W_TRUE))
    return x, y


def loss_fn(params, x, y):
    return jnp.mean(jnp.square(MODEL.apply(params, x) - y))


def inject(grads, on, leaf, elem, value):
    """Set one element of gradient leaf ``leaf`` to ``value`` when ``on``."""
    leaves, treedef = jax.tree.flatten(grads)
    out = []
    for i, g in enumerate(leaves):
        flat = g.reshape(-1)
        j = elem % jnp.int32(flat.size)
        hit = on & (leaf == i)
        flat = flat.at[j].set(jnp.where(hit, value.astype(g.dtype), flat[j]))
        out.append(flat.reshape(g.shape))
    return jax.tree.unflatten(treedef, out)


def tree_isfinite(tree):
    """Whether every floating leaf is finite, checked with plain jnp (not jamp)."""
    flags = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(flags))


def apply_unless_omitted(tx, params, opt_state, grads, omit):
    """One soak step: the update, or an exact no-op for an omitted step; and its record."""

    def take():
        updates, new_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state

    params, opt_state = lax.cond(omit, lambda: (params, opt_state), take)
    rec = dict(
        scale=jamp.get_loss_scale(opt_state).scale,
        applied=opt_state.last_finite,
        state_finite=tree_isfinite((params, opt_state)),
    )
    return (params, opt_state), rec


def n_leaves(params) -> int:
    return len(jax.tree.leaves(params))


# ------------------------------------------------------ single-device loop


def make_chunk_runner(tx):
    """``run(params, opt_state, sched) -> (params, opt_state, records)``, jitted.

    One ``lax.scan`` over the chunk. Records per step: the loss scale after
    the step, ``last_finite`` (the step was applied), and whether params and
    optimizer state are all finite.
    """

    def step(carry, s):
        params, opt_state = carry
        x, y = batch(s["t"])
        ls_state = jamp.get_loss_scale(opt_state)
        mult = jnp.where(s["kind"] == LOSS, s["poison"], jnp.float32(1.0))
        grads = jax.grad(lambda p: jamp.scale(ls_state, loss_fn(p, x, y) * mult))(params)
        grads = inject(grads, s["kind"] == GRAD, s["leaf"], s["elem"], s["poison"])

        return apply_unless_omitted(tx, params, opt_state, grads, s["omit"])

    @jax.jit
    def run(params, opt_state, sched):
        (params, opt_state), recs = lax.scan(step, (params, opt_state), sched)
        return params, opt_state, recs

    return run


def run_chunks(run, params, opt_state, sched: dict, chunk: int):
    """Feed ``sched`` to ``run`` ``chunk`` steps at a time; records concatenated."""
    n = len(sched["t"])
    assert n % chunk == 0
    recs = []
    for i in range(0, n, chunk):
        part = {k: v[i : i + chunk] for k, v in sched.items()}
        params, opt_state, r = run(params, opt_state, part)
        recs.append(jax.tree.map(np.asarray, r))
    return params, opt_state, jax.tree.map(lambda *a: np.concatenate(a), *recs)


# ------------------------------------------------------ data-parallel loop


def mesh(n):
    devices = jax.devices()[:n]
    assert len(devices) == n, f"need {n} devices, got {jax.devices()}"
    return Mesh(np.array(devices), ("data",))


def stack(tree, n):
    """Every replica's own copy of ``tree`` (pmap-style leading axis)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), tree)


def make_dp_runner(tx, n):
    """Data parallel over ``n`` devices with ``jax.shard_map``.

    Each replica holds its own copy of params and optimizer state (so a
    replica that decided differently would really diverge), computes
    gradients on its own rows, averages them with ``lax.pmean``, and calls
    ``tx.update``. Faults hit one replica: its loss or a local gradient leaf
    (before the mean, which spreads it), or its copy of the averaged
    gradients (after the mean: only ``axis_name`` agreement saves the others).
    Returns per-replica final states and per-replica, per-step records.
    """

    def step(carry, s):
        params, opt_state = carry
        me = lax.axis_index("data").astype(jnp.int32)
        mine = s["replica"] == me
        x, y = batch(s["t"], me)
        ls_state = jamp.get_loss_scale(opt_state)
        mult = jnp.where((s["kind"] == LOSS) & mine, s["poison"], jnp.float32(1.0))
        grads = jax.grad(lambda p: jamp.scale(ls_state, loss_fn(p, x, y) * mult))(params)
        grads = inject(grads, (s["kind"] == GRAD) & mine, s["leaf"], s["elem"], s["poison"])
        grads = lax.pmean(grads, "data")
        grads = inject(grads, (s["kind"] == REDUCED) & mine, s["leaf"], s["elem"], s["poison"])

        return apply_unless_omitted(tx, params, opt_state, grads, s["omit"])

    def per_replica(params, opt_state, sched):
        squeeze = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
        expand = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
        (params, opt_state), recs = lax.scan(step, (squeeze(params), squeeze(opt_state)), sched)
        return expand(params), expand(opt_state), expand(recs)

    return jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh(n),
            in_specs=(P("data"), P("data"), P()),
            out_specs=P("data"),
            # Replicas hold their own copies (varying), while loss_scaling's
            # agreed flag is invariant across "data"; the skip-or-take cond
            # around the step would need pcasts to reconcile the two.
            check_vma=False,
        )
    )


# ------------------------------------------------------------------ checks


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def tree_same_bits(a, b) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(same_bits(x, y) for x, y in zip(la, lb, strict=True))


def first_difference(a, b) -> str:
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True
    ):
        if not same_bits(x, y):
            x, y = np.asarray(x), np.asarray(y)
            rel = np.max(np.abs(x.astype(np.float64) - y) / np.maximum(np.abs(y), 1e-30))
            return f"{jax.tree_util.keystr(path)}: max relative difference {rel:.3g}"
    return "trees are bit-identical"


def is_power_of_two(x) -> np.ndarray:
    x = np.asarray(x, np.float32)
    m, _ = np.frexp(x)
    return (x > 0) & (m == 0.5)


def within_one_factor(a, b, factor) -> bool:
    return max(a, b) / min(a, b) <= factor * (1 + 1e-7)


def log2_span(lo, hi) -> int:
    return int(round(math.log2(hi / lo)))
