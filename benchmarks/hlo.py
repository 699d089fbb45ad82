"""Compiled-HLO statistics: fusions, conditionals, copies, bytes accessed, temp memory."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any


def _temp_bytes(compiled: Any) -> float:
    """XLA's temporary allocation: allocated on every call, every branch's included."""
    try:
        return float(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # a backend without memory analysis
        return float("nan")


def stats(compiled: Any) -> dict[str, float]:
    text = compiled.as_text()
    entry = text[text.find("ENTRY") :]
    entry = entry[: entry.find("\n}\n") + 1] if "\n}\n" in entry else entry
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {
        "fusions_total": len(re.findall(r"= [^\n]*? fusion\(", text)),
        "fusions_entry": len(re.findall(r"= [^\n]*? fusion\(", entry)),
        "conditionals": len(re.findall(r" conditional\(", text)),
        "copies": len(re.findall(r" copy\(", text)),
        "bytes_accessed": float(ca.get("bytes accessed", float("nan"))),
        "temp_bytes": _temp_bytes(compiled),
        "flops": float(ca.get("flops", float("nan"))),
    }


def compile_times(lower: dict[str, Callable[[int], Any]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds of ``compile()`` for each ``lower[name](round)``, interleaved over rounds.

    Prints each one's fusions and temp memory, from the first round.
    """
    times: dict[str, list[float]] = {name: [] for name in lower}
    for rnd in range(rounds):
        for name, make in lower.items():
            lowered = make(rnd)
            t = time.process_time()
            compiled = lowered.compile()
            times[name].append(time.process_time() - t)
            if rnd == 0:
                st = stats(compiled)
                temp = st["temp_bytes"] / 1e6
                print(f"{name:42s} fusions {st['fusions_total']:4.0f}, temp {temp:.2f} MB")
    return times
