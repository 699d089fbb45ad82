"""Writing a section of ``RESULTS.md``, and the formats every section shares (the hub).

Each experiment but ``loss-scaling`` writes one markdown section between its own
markers: printed, written whole to ``--out`` and spliced into ``--results`` between
the markers (:func:`emit`); progress goes to stderr (:func:`log`). Every section, and
the loss-scaling report's head, starts with :func:`header`'s lines: the command, the
date, ``git describe`` and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import re
import subprocess
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


def describe() -> str:
    """``git describe --always --dirty`` of the checkout the benchmarks run from (what
    code a section measured), or why there is none (an unpacked sdist)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    return out.stdout.strip()


def machine() -> str:
    """The CPUs, their model, the JAX backend and the load: what a section ran on."""
    import jax

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh
                        if line.startswith("model name")), cpu)  # fmt: skip
    except OSError:
        pass
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return (f"{os.cpu_count()} CPUs (`nproc`), {cpu}; JAX backend `{jax.default_backend()}`; "
            f"load average at the end {load} (other processes share the cores)")  # fmt: skip


def header(command: str, elapsed: float, packages: tuple[str, ...] = ("jax",)) -> list[str]:
    """The lines every RESULTS.md section starts with, from its one writer: the command, the
    date and the run's wall time, ``git describe``, the machine, and python and
    ``packages``' versions."""
    versions = ", ".join(f"{m} {version(m)}" for m in packages)
    return [
        f"- command: `{command}`; date {now()}; {elapsed:.0f} s",
        f"- commit: `{describe()}`",
        f"- machine: {machine()}",
        f"- python {platform.python_version()}; {versions}",
    ]


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
