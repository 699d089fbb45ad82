"""Interleaved timing: every variant runs a few steps per round, round after round."""

from __future__ import annotations

import random
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


class Runner:
    """A jitted step and its (donated) state; ``run(n)`` times ``n`` steps."""

    def __init__(self, step: Callable, state: Any, batch: Any):
        self.step, self.state, self.batch = step, state, batch
        self.times: list[float] = []  # wall-clock seconds per step
        self.cpu: list[float] = []  # process CPU seconds per step (all threads)
        self.faults: list[int] = []  # minor page faults of the process per step

    def warm(self, n: int = 2) -> None:
        for _ in range(n):
            self.state = self.step(self.state, self.batch)
        jax.block_until_ready(self.state)

    def run(self, n: int, record: bool = True) -> None:
        for _ in range(n):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.process_time(), time.perf_counter()
            self.state = self.step(self.state, self.batch)
            jax.block_until_ready(self.state)
            t1, c1 = time.perf_counter(), time.process_time()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if record:
                self.times.append(t1 - t0)
                self.cpu.append(c1 - c0)
                self.faults.append(f1 - f0)


def orders(names: list[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """One order of ``names`` per round: a seeded shuffle, so no variant always
    follows the same one (a heavy predecessor slows the next few calls: with a
    rotation, ``finite_checks``' row after the 40 MB temporaries of
    ``read: integer max of bits`` ran at 1.8x its real cost)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        out.append(order)
    return out


def interleave(runners: dict[str, Runner], rounds: int, per_round: int) -> None:
    """Round-robin: each round runs ``per_round`` steps of every variant in turn,
    in a fresh shuffled order each round."""
    for order in orders(list(runners), rounds):
        for name in order:
            runners[name].run(per_round)


def time_calls(
    fns: dict[str, Callable],
    args: tuple,
    rounds: int,
    reps: int = 3,
    seed: int = 0,
    settle: bool = False,
) -> dict[str, list[float]]:
    """Wall seconds of ``reps`` calls of each ``fns[k](*args)`` per round, interleaved.

    Each round runs the functions in a fresh seeded shuffle (``orders``); with
    ``settle``, one untimed call first absorbs the predecessor's after-effects.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for order in orders(list(fns), rounds, seed=seed):
        for k in order:
            if settle:
                jax.block_until_ready(fns[k](*args))
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fns[k](*args))
                times[k].append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio_stats(
    times: list[float], base: list[float], per_round: int
) -> tuple[float, float, float]:
    """Median ratio to ``base`` of per-round medians, with its min/max over rounds..."""
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
