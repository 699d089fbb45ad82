"""Where a test's function wrote an operation: ``file:line``, as jamp.debug names it."""

import inspect
import os


def line_of(fun, text):
    """``file:line`` of the first line of ``fun``'s source holding ``text`` (the file's
    name, not its path)."""
    lines, start = inspect.getsourcelines(fun)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{os.path.basename(inspect.getsourcefile(inspect.unwrap(fun)))}:{start + offset}"
