"""Compare two dumps of the suite's GPU programs (``JAMP_DUMP_GPU_HLO``, tests/conftest.py).

``python -m tests.hlo_diff OLD NEW`` compares the two sets of distinct programs, each
without its metadata (source files and lines, op names, stack frames: they move when code
moves). Programs are matched by content, not by test name, so renamed tests and
a compile shared by several tests compare too. It prints the programs found on one side
only, with the tests that compiled them, and exits 1 if there is any.
"""

import hashlib
import pathlib
import re
import sys

_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")


_FINGERPRINT = re.compile(r'fingerprint_before_lhs="[0-9a-f]*",?')
# The tables of source files, functions, locations and stack frames that open the text.
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def canonical(text: str) -> str:
    """The program without its source tables, its instructions' metadata and its module
    fingerprint (which hashes them)."""
    out, in_table = [], False
    for line in _FINGERPRINT.sub("", _METADATA.sub("", text)).splitlines():
        if line in _TABLES:
            in_table = True
        elif line.startswith(("%", "ENTRY")):
            in_table = False
        if not in_table:
            out.append(line)
    return "\n".join(out)


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
