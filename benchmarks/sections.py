"""What the benchmarks that write one section of RESULTS.md share.

``autocast_memory`` and ``float8`` each write a markdown section between
their own markers in ``benchmarks/RESULTS.md``, and time GPT steps on a GPU
with ``--step-time``: the flags for both, and the writing, live here.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable


def parser(description: str, step_default: str, step_help: str) -> argparse.ArgumentParser:
    """The flags every section benchmark takes; the caller adds its own."""
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tiny", action="store_true", help="tiny models: a smoke test in seconds")
    ap.add_argument("--out", default="", help="also write the markdown section to this file")
    ap.add_argument(
        "--results", default="", help="splice the section into this file between its markers"
    )
    ap.add_argument(
        "--step-time", action="store_true", help="time GPT training steps instead (for a GPU)"
    )
    ap.add_argument("--step-config", choices=("small", "large"), default=step_default,
                    help=step_help)  # fmt: skip
    ap.add_argument("--step-rounds", type=int, default=10)
    ap.add_argument("--step-reps", type=int, default=10)
    return ap


def splice(path: str, text: str, start: str, end: str) -> None:
    """Puts ``text`` between the markers ``start`` and ``end`` in ``path``, or appends it."""
    old = ""
    if os.path.exists(path):
        with open(path) as fh:
            old = fh.read()
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if pattern.search(old):
        new = pattern.sub(lambda _: text, old)
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text + "\n"
    with open(path, "w") as fh:
        fh.write(new)


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


def run(
    args: argparse.Namespace,
    measure: Callable[[argparse.Namespace, Callable[[str], None]], str],
    step_time: Callable[[argparse.Namespace, Callable[[str], None]], str],
    markers: tuple[str, str],
    step_markers: tuple[str, str],
) -> str:
    """A section benchmark's ``main``: ``measure`` (or ``step_time`` with ``--step-time``),
    then :func:`emit`. The step-time table is a section of its own, so ``--results``
    never replaces the other."""
    if args.step_time:
        return emit(args, marked(step_time(args, log), *step_markers), *step_markers)
    return emit(args, measure(args, log), *markers)
