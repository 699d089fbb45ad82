"""``python benchmarks/run.py [options]``: the same as ``python -m benchmarks`` (see ``cli``)."""

import os
import sys

if __package__ in (None, ""):  # `python benchmarks/run.py`: put the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
