"""Reading compiled HLO text (the hub): XLA:CPU's statistics of a step, and the GEMMs of a
compiled program (``benchmarks/xla_gpu.py`` reads a GPU program in full)."""

from __future__ import annotations

import re
from typing import Any


def _temp_bytes(compiled: Any) -> float:
    """XLA's temporary allocation: allocated on every call, every branch's included."""
    try:
        return float(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # a backend without memory analysis
        return float("nan")


def stats(compiled: Any) -> dict[str, float]:
    """Fusions, conditionals, bytes accessed and temp memory of a compiled step."""
    text = compiled.as_text()
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {
        "fusions_total": len(re.findall(r"= [^\n]*? fusion\(", text)),
        "conditionals": len(re.findall(r" conditional\(", text)),
        "bytes_accessed": float(ca.get("bytes accessed", float("nan"))),
        "temp_bytes": _temp_bytes(compiled),
    }


GEMM_TARGETS = ("__cublas$lt$matmul$f8", "__cublas$lt$matmul", "__cublas$gemm")


def gemm_calls(hlo: str) -> dict[str, int]:
    """GEMM custom calls by target; GEMM fusions (Triton, cuDNN); and computations holding a
    ``dot`` of float8 values (a GEMM fusion fed float8, or a CPU that did not upcast)."""
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    out = {t: sum(1 for x in targets if x == t) for t in GEMM_TARGETS}
    out["triton"] = len(re.findall(r'"kind":"__triton_gemm"', hlo))
    out["cudnn"] = len(re.findall(r'"kind":"__cudnn\$fusion"', hlo))
    computations = re.split(r"\n(?=\S)", hlo)  # each starts at column 0
    out["f8 dots"] = sum(
        1 for c in computations if re.search(r" dot\(", c) and re.search(r"f8e(4m3fn|5m2)\[", c)
    )
    return out
