"""Writing a section of ``RESULTS.md``, and the formats every section shares (the hub).

Each experiment but ``loss-scaling`` writes one markdown section between its own
markers: printed, written whole to ``--out`` and spliced into ``--results`` between
the markers (:func:`emit`); progress goes to stderr (:func:`log`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import re
import sys


def _read(path: str) -> str:
    return pathlib.Path(path).read_text() if os.path.exists(path) else ""


def splice(path: str, text: str, start: str, end: str) -> None:
    """Puts ``text`` between the markers ``start`` and ``end`` in ``path``, or appends it."""
    old = _read(path)
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    new = pattern.sub(lambda _: text, old) if pattern.search(old) else None
    pathlib.Path(path).write_text(new or old.rstrip("\n") + ("\n\n" if old else "") + text + "\n")


def replace_head(path: str, text: str) -> None:
    """Writes ``text`` as the part of ``path`` before its first section marker, keeping the
    sections (the loss-scaling report is that part; every other experiment a section)."""
    old = _read(path)
    first = re.search(r"^<!-- [a-z0-9-]+:start -->$", old, re.M)
    rest = "" if first is None else "\n\n" + old[first.start() :]
    pathlib.Path(path).write_text(text.rstrip("\n") + rest if rest else text)


def marked(text: str, start: str, end: str) -> str:
    """``text`` between the markers ``start`` and ``end``."""
    return f"{start}\n{text.strip()}\n\n{end}"


def emit(args: argparse.Namespace, text: str, start: str, end: str) -> str:
    """Prints the section, and writes it to ``--out`` and into ``--results``."""
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if args.results:
        splice(args.results, text, start, end)
    return text


def log(msg: str) -> None:
    """Progress, on stderr (stdout is the section)."""
    print(msg, file=sys.stderr, flush=True)


def version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except ImportError:
        return "not installed"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def fmt(x: float, nd: int = 3) -> str:
    return "n/a" if x != x else f"{x:.{nd}f}"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}" if n < 10 * 2**20 else f"{n / 2**20:.1f}"


def by_dtype(res: dict[str, int]) -> str:
    """Bytes by dtype, in MiB: ``float32 1.50, bfloat16 0.75``."""
    order = ("float32", "bfloat16", "float16", "bool", "int32")
    keys = sorted(res, key=lambda k: (order.index(k) if k in order else 99, k))
    return ", ".join(f"{k} {mib(res[k])}" for k in keys if res[k])


def target_row(target: str, measured: str, met: bool, miss: str = "", why: str = "") -> str:
    """A row of a targets table: ``| target | measured | met | miss by | why |``, the last two
    empty when the target is met."""
    return (f"| {target} | {measured} | {'yes' if met else '**no**'} | {'' if met else miss} | "
            f"{'' if met else why} |")  # fmt: skip
