"""Compare two dumps of the suite's GPU programs (``JAMP_DUMP_GPU_HLO``, tests/conftest.py).

``python -m tests.hlo_diff OLD NEW`` prints, for every program, whether it is identical
once the metadata (source files and lines, op names, which move when code moves) is left
out, and exits 1 if any differs or is missing from one side.
"""

import pathlib
import re
import sys

_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")


def canonical(text: str) -> str:
    """The program without its metadata and its module's name line (which carries a hash)."""
    text = _METADATA.sub("", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("HloModule"))


def main(old: str, new: str) -> int:
    a = {p.name: p for p in pathlib.Path(old).glob("*.hlo")}
    b = {p.name: p for p in pathlib.Path(new).glob("*.hlo")}
    bad = 0
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            print(f"only in {'old' if name in a else 'new'}: {name}")
            bad += 1
        elif canonical(a[name].read_text()) != canonical(b[name].read_text()):
            print(f"differs: {name}")
            bad += 1
    total = len(a.keys() | b.keys())
    print(f"{total - bad} of {total} programs identical (metadata aside)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
