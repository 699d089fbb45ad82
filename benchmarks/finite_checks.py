"""The finite check alone, beside other formulations and one-pass read floors (a spoke whose
table and targets join ``python -m benchmarks loss-scaling``'s report).

Every check maps a pytree to one bool (True = all finite); a "read" is no check but a plain
reduction reading every byte once, the floor a check is compared against. Each is timed
alone, interleaved, on gradient-like trees of several sizes and dtypes; ``sound`` says
whether it flags a NaN and an inf in a large leaf and passes a finite tree whose sum
overflows.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jamp
from benchmarks import timing
from benchmarks.report import target_row

# The trees' element counts and the interleaved rounds, by mode (``--finite-sizes``
# replaces the counts).
CONFIGS = {
    "tiny": ((20_000,), 1),
    "quick": ((1_000_000, 10_000_000), 5),
    "full": ((1_000_000, 10_000_000, 50_000_000), 8),
}
REPS = 3  # timed calls of each check per round
# A jamp check's time, ratio to the fastest plain read of the same tree.
FINITE_LIMIT = 1.2
# Trees below this many elements: a call's fixed cost dominates.
SMALL_TREE = 2_000_000

# Leaf fractions of the total element count: a few big matrices, smaller
# matrices, and bias-sized vectors (like a real gradient tree).
_FRACTIONS = (0.35, 0.25, 0.15, 0.1, 0.06, 0.04, 0.03, 0.015, 0.005)
_BIASES = (4096, 2048, 1024, 10)


def make_tree(n: int, dtype: Any, seed: int = 0) -> dict[str, jax.Array]:
    """About ``n`` elements of ``dtype`` in leaves of varied shapes (2-D and 1-D)."""
    rng = np.random.default_rng(seed)
    tree = {}
    for i, f in enumerate(_FRACTIONS):
        m = max(1, int(n * f))
        cols = 1024 if m >= 1024 * 8 else 8
        rows = max(1, m // cols)
        tree[f"w{i}"] = jnp.asarray(rng.standard_normal((rows, cols), np.float32), dtype)
    for i, b in enumerate(_BIASES):
        if b * 50 <= n:
            tree[f"b{i}"] = jnp.asarray(rng.standard_normal((b,), np.float32), dtype)
    return tree


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def _add(xs):
    return functools.reduce(jnp.add, xs)


def _native_sum(x):
    """A sum accumulated in x's own dtype (jnp.sum upcasts float16/bfloat16)."""
    return lax.reduce(x, np.array(0, x.dtype), lax.add, tuple(range(x.ndim)))


_EXP_MASK = {2: (np.uint16, 0x7C00, 0x7F80), 4: (np.uint32, 0x7F800000, None)}


def _exp_bits(x):
    """The exponent field of every element, as an unsigned integer array."""
    bits = x.dtype.itemsize
    uint, mask16, maskbf = _EXP_MASK[bits]
    mask = 0x7F800000 if bits == 4 else (maskbf if x.dtype == jnp.bfloat16 else mask16)
    return lax.bitcast_convert_type(x, uint) & np.array(mask, uint), np.array(mask, uint)


# --------------------------------------------------------------- the checks


def _each(f: Callable) -> Callable:
    """``tree -> sum over its leaves of f(leaf)``, in float32."""
    return lambda tree: _add([f(x).astype(jnp.float32) for x in _leaves(tree)])


def _isfinite(f: Callable) -> Callable:
    return lambda tree: jnp.isfinite(_each(f)(tree))


def peers_all_isfinite(tree):
    """jmp / optax.apply_if_finite: all(isfinite(x)) per leaf, stacked."""
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in _leaves(tree)]).all()


def jamp_scaled_check(tree):
    """jamp's check as the training step runs it, the flag of ``unscale_and_check``: under
    ``jit`` the unscaled values are checked from one read of the scaled tree (``1/scale <=
    1`` fast path, exact fallback of the unscaled values under ``lax.cond``)."""
    return jamp.unscale_and_check(jamp.dynamic_loss_scale(2.0**15), tree)[1]


def sum_native_fallback(tree):
    s = READS["read: sum native"](tree)
    return lax.cond(jnp.isfinite(s), lambda: jnp.asarray(True), lambda: peers_all_isfinite(tree))


def concat_sum_times_zero(tree):
    """One reduction over the concatenation of every leaf (costs a copy)."""
    flat = jnp.concatenate([x.ravel().astype(jnp.float32) for x in _leaves(tree)])
    return jnp.isfinite(jnp.sum(flat * 0.0))


def exp_bits_max(tree):
    """max of the exponent bits per leaf < all-ones exponent (integer max: no NaN trap)."""
    bad = []
    for x in _leaves(tree):
        e, mask = _exp_bits(x)
        bad.append(jnp.max(e) == mask)
    return jnp.logical_not(_add([b.astype(jnp.int32) for b in bad]) > 0)


# jamp.all_finite is now the float32 sum per leaf with an exact all(isfinite)
# fallback under lax.cond (the former "isfinite(sum f32) + exact fallback" row).
CHECKS: dict[str, Callable] = {
    "jamp.all_finite": jamp.all_finite,
    "jamp.unscale_and_check flag (scale 2^15)": jamp_scaled_check,
    "peers: all(isfinite) per leaf": peers_all_isfinite,
    # sum(x * 0) per leaf in x's dtype: NaN iff a non-finite element
    "sum(x*0) native dtype": _isfinite(lambda x: _native_sum(x * jnp.zeros((), x.dtype))),
    "sum(x*0) float32": _isfinite(lambda x: jnp.sum(x.astype(jnp.float32) * 0.0)),
    "sum(x-x) native dtype": _isfinite(lambda x: _native_sum(x - x)),
    "isfinite(sum native) + exact fallback": sum_native_fallback,
    "concat + sum(x*0) f32": concat_sum_times_zero,
    "max(exponent bits) integer": exp_bits_max,
    # WRONG on XLA:CPU (max drops NaN on >= 4096 elements): for speed only
    "isfinite(max|x|) [unsound on CPU]": _isfinite(lambda x: jnp.max(jnp.abs(x))),
}
JAMP_CHECKS = ("jamp.all_finite", "jamp.unscale_and_check flag (scale 2^15)")
# One-pass reductions: each reads every byte once and computes nothing a check needs.
READS: dict[str, Callable] = {
    "read: sum native": _each(_native_sum),
    "read: sum f32": _each(lambda x: jnp.sum(x, dtype=jnp.float32)),
    "read: max": _each(jnp.max),
    "read: integer max of bits": _each(lambda x: jnp.max(_exp_bits(x)[0])),
}


@functools.cache
def _verify_trees(dtype_name: str) -> tuple:
    """A finite tree, a finite tree whose sums overflow, and three with one NaN/inf (built once)."""
    dtype = jnp.dtype(dtype_name)
    t = make_tree(20000, dtype)
    big = jnp.finfo(dtype).max
    huge = {k: jnp.full_like(v, big) for k, v in t.items()}
    bad = []
    for x in (jnp.nan, jnp.inf, -jnp.inf):
        t2 = dict(t)
        t2["w0"] = t["w0"].at[3, 5].set(x)
        bad.append(t2)
    return t, huge, tuple(bad)


def verify(fn: Callable, dtype: Any) -> bool:
    """Does ``fn`` flag a NaN and an inf in a large leaf, and pass a finite tree of huge values?"""
    t, huge, bad = _verify_trees(jnp.dtype(dtype).name)
    ok = bool(fn(t))
    ok &= bool(fn(huge))  # finite but a sum overflows
    for t2 in bad:
        ok &= not bool(fn(t2))
    return ok


# --------------------------------------------------------------- measuring


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--no-finite", action="store_true", help="skip the finite-check section")
    ap.add_argument("--finite-dtypes", default="float32,float16,bfloat16",
                    help="the dtypes of the finite-check trees")  # fmt: skip
    ap.add_argument("--finite-sizes", default="",
                    help="element counts of the finite-check trees, e.g. 1e6,5e7")  # fmt: skip


def measure(sizes, dtypes, rounds: int, log) -> list[dict]:
    """One row per tree (size, dtype): each function's median time and ratio to the floor."""
    fns = {**CHECKS, **READS}
    jitted = {k: jax.jit(f) for k, f in fns.items()}  # one executable per tree shape, reused
    sound = {jnp.dtype(dt).name: {k: verify(jitted[k], dt) for k in CHECKS} for dt in dtypes}
    results = []
    for n in sizes:
        for dt in dtypes:
            tree = make_tree(n, dt)
            nel = sum(x.size for x in jax.tree_util.tree_leaves(tree))
            for f in jitted.values():
                jax.block_until_ready(f(tree))
            times = timing.time_calls(jitted, (tree,), rounds, reps=REPS, seed=len(results),
                                      settle=True)  # fmt: skip
            med = {k: timing.median(v) for k, v in times.items()}
            floor = min(READS, key=lambda k: med[k])
            # Per-round ratio to the floor read, median over rounds.
            ratio = {k: timing.ratio_stats(v, times[floor], REPS)[0] for k, v in times.items()}
            name = jnp.dtype(dt).name
            results.append(dict(n=nel, dtype=name, med=med, ratio=ratio, ok=sound[name],
                                floor=floor, reps=REPS))  # fmt: skip
            del tree
            log(f"  finite: {nel / 1e6:.1f}M {name} floor {floor} {med[floor] * 1e3:.2f} ms")
    return results


def table(results: list[dict], rounds: int) -> list[str]:
    """The report's section: every check's time on every tree."""
    head = " | ".join(f"{r['n'] / 1e6:.1f}M {r['dtype']}" for r in results)
    L = [
        "## Finite check alone\n",
        "Each check maps a gradient-like tree (leaves of varied 2-D/1-D shapes) to one bool. "
        f"{rounds} rounds, each in a shuffled order; per function one untimed call, then "
        f"{results[0]['reps']} timed. Entries: median time in ms, and in parentheses the ratio "
        "to the floor, the fastest of the plain one-pass reductions (`read:` rows: each reads "
        "every byte once and computes nothing a check needs; XLA cannot read all bytes faster "
        "than its fastest full reduction). `sound` = flags NaN/inf in a large leaf and passes a "
        "finite tree whose sum overflows, for every dtype. `jamp.all_finite` is jamp's current "
        "check (on a CPU: large float32 leaves reduced to row sums by a matrix-vector product "
        "with `2**-40` weights, those rows and the small leaves checked element by element as "
        "one vector, float16 leaves by their non-finite flags, and an exact fallback under "
        "`lax.cond` only for a scale below 1 or a non-finite sum of other leaves); the "
        "`unscale_and_check flag` row is the check jamp's training steps run (`check_unscaled`: "
        "the unscaled values checked from one read of the scaled tree).\n",
        f"| check | sound | {head} |",
        "| --- | --- | " + " | ".join("---:" for _ in results) + " |",
    ]
    for k in [*CHECKS, *READS]:
        sound = ""
        if k in CHECKS:
            sound = "yes" if all(r["ok"][k] for r in results) else "**no**"
        cells = " | ".join(f"{r['med'][k] * 1e3:.2f} ({r['ratio'][k]:.2f})" for r in results)
        L.append(f"| {k} | {sound} | {cells} |")
    floors = " | ".join(r["floor"].replace("read: ", "") for r in results)
    L += [f"| *floor is* |  | {floors} |", ""]
    return L


def run(args: argparse.Namespace, log) -> tuple[list[str], list[str]]:
    """(the report's section, the targets table's rows) for the loss-scaling report."""
    sizes, rounds = CONFIGS[args.mode]
    if args.finite_sizes:
        sizes = tuple(int(float(x)) for x in args.finite_sizes.split(","))
    results = measure(sizes, args.finite_dtypes.split(","), rounds, log)
    return table(results, rounds), targets(results, jax.default_backend())


# --------------------------------------------------------------- targets


def _m(n: int) -> str:
    """An element count in millions."""
    return f"{n / 1e6:.1f}M"


def _why(k: str, misses: list[dict], cpu: bool) -> str:
    """Why the jamp check ``k`` is over ``FINITE_LIMIT`` on the trees in ``misses``."""
    if not cpu:
        return "no explanation recorded for this backend (`benchmarks/FINDINGS.md` is XLA:CPU's)"
    why = []

    def to_sum(r):  # the check's time over the float32-sum read's, on the same tree
        return r["med"][k] / r["med"]["read: sum f32"]

    f16 = [r for r in misses if r["dtype"] == "float16"]
    if f16:
        w = max(f16, key=lambda r: r["ratio"][k])
        why.append(
            "no native float16 arithmetic on this CPU: jamp checks float16 leaves with a uint8 "
            f"max of their non-finite flags (no conversion; {to_sum(w):.2f}x the time of the "
            "float32-sum read); the floor is a float16 `max`, which is no sound check (drops NaN)"
        )
    small = [r for r in misses if r["n"] < SMALL_TREE and r["dtype"] != "float16"]
    if small:
        cells = ", ".join(f"{_m(r['n'])} {r['dtype']} {r['med'][k] * 1e3:.2f} ms" for r in small)
        why.append(
            f"small trees ({cells} a call): dispatch and the per-leaf reductions' fixed cost "
            "dominate"
        )
    large = [r for r in misses if r["n"] >= SMALL_TREE]
    f32 = [r for r in large if r["dtype"] == "float32"]
    if f32:
        w = max(f32, key=to_sum)
        why.append(
            "float32: on a CPU jamp reduces large float32 leaves to row sums by a matrix-vector "
            f"product, which ran at up to {to_sum(w):.2f}x a plain float32 sum in this table "
            "(the other checks' temporaries evict the tree between calls), and faster than the "
            "tiled sums XLA:CPU compiles inside a training step"
        )
    bf16 = [r for r in large if r["dtype"] == "bfloat16"]
    if bf16:
        w = max(bf16, key=to_sum)
        why.append(
            "bfloat16: jamp sums bfloat16 leaves in float32, the same reduction as "
            f"`read: sum f32`, and ran at up to {to_sum(w):.2f}x of it here"
        )
    return "; ".join(why)


def targets(results: list[dict], backend: str = "cpu") -> list[str]:
    """The targets table's rows for the finite check, judged from this run's rows."""
    out = []
    for k in JAMP_CHECKS if results else ():
        worst = max(results, key=lambda r: r["ratio"][k])
        misses = [r for r in results if r["ratio"][k] > FINITE_LIMIT]
        cells = ", ".join(f"{_m(r['n'])} {r['dtype']} {r['ratio'][k]:.2f}x" for r in misses)
        target = (
            f"finite check `{k}` within {FINITE_LIMIT}x of the read floor, every size and dtype"
        )
        measured = f"worst {worst['ratio'][k]:.2f}x ({_m(worst['n'])} {worst['dtype']})"
        why = _why(k, misses, backend == "cpu") if misses else ""
        out.append(target_row(target, measured, not misses, f"over {FINITE_LIMIT}x: {cells}", why))
    return out
