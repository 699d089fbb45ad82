"""Compiled-HLO statistics: fusions, conditionals, copies, and XLA's bytes-accessed estimate."""

from __future__ import annotations

import re
from typing import Any


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
        "flops": float(ca.get("flops", float("nan"))),
    }
