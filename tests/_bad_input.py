"""The one check every invalid call goes through (not a test module).

Each module's test file holds one table ``BAD_INPUT = {id: (call, exception, match)}``
and one parametrized test that runs every entry through :func:`assert_clear_error`:
the call must raise exactly ``exception`` (not a subclass from deep inside JAX), with
a message matching ``match`` (a regex, or a tuple of regexes that must all match),
raised by jamp's own validation (the innermost frame is a file under ``jamp/``) and
not from inside JAX's tracing machinery.
"""

from __future__ import annotations

import pathlib
import re
import traceback
from collections.abc import Callable

import pytest

import jamp

# The package under test: the source tree, or an installed wheel (.ci/floors).
JAMP = pathlib.Path(jamp.__file__).resolve().parent

# Frames of JAX's tracing machinery: an error raised under them came from a trace.
_TRACING = ("jax/_src/interpreters/", "jax/_src/pjit.py", "jax/_src/api.py", "jax/_src/core.py")


def assert_clear_error(
    fn: Callable[[], object], exc: type[BaseException], match: str | tuple[str, ...]
) -> None:
    """``fn()`` raises exactly ``exc`` matching ``match``, from jamp, before any tracing."""
    patterns = (match,) if isinstance(match, str) else tuple(match)
    with pytest.raises(exc, match=patterns[0]) as info:
        fn()
    for pattern in patterns[1:]:
        assert re.search(pattern, str(info.value)), (pattern, str(info.value))
    assert type(info.value) is exc  # not a subclass from somewhere deep inside jax
    frames = traceback.extract_tb(info.value.__traceback__)
    raiser = pathlib.Path(frames[-1].filename).resolve()
    assert JAMP in raiser.parents, f"raised by {raiser}, not by jamp's own validation"
    tracing = [
        f.filename for f in frames if any(t in f.filename.replace("\\", "/") for t in _TRACING)
    ]
    assert not tracing, f"raised while tracing: {tracing}"
