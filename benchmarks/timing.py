"""Interleaved timing (the hub): every variant runs a few calls per round, round after round."""

from __future__ import annotations

import random
import resource
import statistics
import time
from collections.abc import Callable

import jax


class Runner:
    """``fn()``, and per call its wall seconds, process CPU seconds (all threads) and the
    process's minor page faults."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.faults: list[int] = []

    def run(self, n: int) -> None:
        for _ in range(n):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(self.fn())
            t1, c1 = time.perf_counter(), time.process_time()
            self.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            self.times.append(t1 - t0)
            self.cpu.append(c1 - c0)


def orders(names: list[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """One order of ``names`` per round: a seeded shuffle, so no variant always
    follows the same one (a heavy predecessor slows the next few calls: with a
    rotation, ``finite_checks``' row after the 40 MB temporaries of
    ``read: integer max of bits`` ran at 1.8x its real cost)."""
    rng, out = random.Random(seed), []
    for _ in range(rounds):
        out.append(list(names))
        rng.shuffle(out[-1])
    return out


def interleave(runners: dict[str, Runner], rounds: int, per_round: int, seed: int = 0,
               settle: bool = False) -> None:  # fmt: skip
    """Each round runs ``per_round`` calls of every runner, in a fresh seeded order each
    round; with ``settle``, one untimed call first absorbs the predecessor's after-effects."""
    for order in orders(list(runners), rounds, seed):
        for name in order:
            if settle:
                jax.block_until_ready(runners[name].fn())
            runners[name].run(per_round)


def time_calls(fns: dict[str, Callable], args: tuple, rounds: int, reps: int = 3, seed: int = 0,
               settle: bool = False) -> dict[str, list[float]]:  # fmt: skip
    """Wall seconds of ``reps`` calls of each ``fns[k](*args)`` per round, interleaved."""
    runners = {k: Runner(lambda f=f: f(*args)) for k, f in fns.items()}
    interleave(runners, rounds, reps, seed, settle)
    return {k: r.times for k, r in runners.items()}


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio_stats(
    times: list[float], base: list[float], per_round: int
) -> tuple[float, float, float]:
    """Median ratio to ``base`` of per-round medians, with its quartiles over rounds."""
    n = min(len(times), len(base)) // per_round
    rs = []
    for r in range(n):
        a = statistics.median(times[r * per_round : (r + 1) * per_round])
        b = statistics.median(base[r * per_round : (r + 1) * per_round])
        rs.append(a / b)
    if not rs:
        return float("nan"), float("nan"), float("nan")
    rs.sort()

    def q(p):
        return rs[min(len(rs) - 1, int(p * len(rs)))]

    return statistics.median(rs), q(0.25), q(0.75)


def time_compiled(steps: dict[str, tuple[Callable, tuple]], rounds: int, reps: int) -> dict:
    """Median wall seconds of each ``fn(*args)`` of ``steps[name] = (fn, args)``, called once
    to warm up, then ``reps`` calls a round over ``rounds`` interleaved rounds."""
    for fn, args in steps.values():
        jax.block_until_ready(fn(*args))
    times = time_calls({k: lambda f=f, a=a: f(*a) for k, (f, a) in steps.items()}, (), rounds, reps)
    return {k: median(v) for k, v in times.items()}


def gpt_step_config(args) -> tuple[tuple[int, ...], str]:
    """``--step-time``'s GPT, ``(d, heads, layers, batch, time)``, and its table's title."""
    big = args.step_config == "large"
    d, heads, layers, b, t = (1024, 16, 8, 16, 512) if big else (256, 4, 4, 8, 128)
    if args.tiny:
        d, heads, layers, b, t = 32, 2, 1, 2, 16
    where = f"{jax.default_backend()}: {jax.devices()[0].device_kind}"
    title = f"### GPT step time: d={d}, {heads} heads, {layers} layers, batch {b}x{t} ({where})"
    return (d, heads, layers, b, t), title


def sgd(params, grads, lr: float = 1e-3):
    """``params - lr * grads``: the update a step-time run times after the gradients."""
    return jax.tree_util.tree_map(lambda a, b: a - lr * b, params, grads)
