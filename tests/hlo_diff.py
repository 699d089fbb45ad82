"""Compare two dumps of the suite's GPU programs (``JAMP_DUMP_GPU_HLO``, tests/conftest.py).

``python -m tests.hlo_diff OLD NEW`` compares the two sets of distinct programs, each
without its metadata (source files and lines, op names: they move when code moves) and its
module's name line. Programs are matched by content, not by test name, so renamed tests and
a compile shared by several tests compare too. It prints the programs found on one side
only, with the tests that compiled them, and exits 1 if there is any.
"""

import hashlib
import pathlib
import re
import sys

_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")


def canonical(text: str) -> str:
    """The program without its metadata and its module's name line (which carries a hash)."""
    text = _METADATA.sub("", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("HloModule"))


def programs(folder: str) -> dict[str, list[str]]:
    """``{hash of the canonical program: [the dump files holding it]}``."""
    out: dict[str, list[str]] = {}
    for path in sorted(pathlib.Path(folder).glob("*.hlo")):
        key = hashlib.sha256(canonical(path.read_text()).encode()).hexdigest()
        out.setdefault(key, []).append(path.name)
    return out


def main(old: str, new: str) -> int:
    a, b = programs(old), programs(new)
    for side, only in (("old", a.keys() - b.keys()), ("new", b.keys() - a.keys())):
        for key in sorted(only):
            print(f"only in {side}: {', '.join((a if side == 'old' else b)[key])}")
    same = len(a.keys() & b.keys())
    print(f"{same} distinct programs in both; {len(a)} in old, {len(b)} in new")
    return 0 if a.keys() == b.keys() else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
