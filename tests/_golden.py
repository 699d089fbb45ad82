"""Readers for the torch.amp.GradScaler golden data in tests/data (schema: SCHEMA.md)."""

from __future__ import annotations

import functools
import json
import math
import pathlib

import ml_dtypes
import numpy as np

DATA = pathlib.Path(__file__).parent / "data"

_BITS = {
    "float32": (np.uint32, np.float32),
    "float16": (np.uint16, np.float16),
    "bfloat16": (np.uint16, ml_dtypes.bfloat16),
    "float64": (np.uint64, np.float64),
}


@functools.cache
def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def scenario_names() -> list[str]:
    return sorted(p.stem.removeprefix("scenario_") for p in DATA.glob("scenario_*.json"))


def scenario(name: str) -> dict:
    return load(f"scenario_{name}.json")


def array(rec: dict) -> np.ndarray:
    """A tensor record as a numpy array with the exact stored bits."""
    dtype = rec["dtype"]
    if dtype in _BITS:
        utype, ftype = _BITS[dtype]
        raw = np.array([int(b, 16) for b in rec["bits"]], dtype=utype)
        return raw.view(ftype).reshape(rec["shape"])
    return np.array(rec["values"], dtype=dtype).reshape(rec["shape"])


def scalar(x) -> float:
    if isinstance(x, str):
        return float(x)
    if isinstance(x, dict):
        return float(array(x).reshape(()))
    return float(x)


def bits_equal(a, b) -> bool:
    """Bitwise equality of two float arrays, any NaN equal to any NaN."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    ua = a.view(np.uint16 if a.itemsize == 2 else np.uint32 if a.itemsize == 4 else np.uint64)
    ub = b.view(ua.dtype)
    return bool(np.all((ua == ub) | nan))


def is_f32_subnormal(x) -> np.ndarray:
    x = np.abs(np.asarray(x, dtype=np.float32))
    return (x != 0) & (x < np.finfo(np.float32).tiny)


def isclose_f32(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
