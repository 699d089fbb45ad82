"""Renames with a deprecation period: the old spelling keeps working, and warns.

A public name or keyword argument that is renamed keeps its old spelling
for at least one minor release. Using it emits a ``DeprecationWarning`` that
names the version it was deprecated in, the version that removes it, and
what to write instead; ``CHANGELOG.md`` lists it under "Deprecated".

- A module attribute (a class, a function): ``module_getattr`` makes a
  module ``__getattr__`` that serves the old name, so ``jamp.OldName`` and
  ``from jamp import OldName`` still work::

      __getattr__ = module_getattr("jamp", {"OldName": Rename("NewName", NewName, "0.2.0")})

- A keyword argument: the function accepts the old keyword itself, passes it
  on as the new one, and warns with ``message``'s text (no keyword is renamed
  at present).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple


class Rename(NamedTuple):
    """An old public name and what replaced it.

    Attributes:
      new: the name to write instead.
      obj: the object both names refer to.
      since: the jamp version that deprecated the old name.
      removed_in: the version that removes it; by default the minor release
        after ``since``.
      how: what happened to it, for the message: ``"was renamed"`` (the
        default) or ``"moved to"`` (a namespace such as ``jamp.float8``).
      same_object: whether ``new`` names ``obj`` itself (``False``: a call
        to write instead, such as ``autocast(fun, enabled=False)``).
    """

    new: str
    obj: object
    since: str
    removed_in: str | None = None
    how: str = "was renamed"
    same_object: bool = True


def _next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}.0"


def message(
    old: str,
    new: str,
    since: str,
    removed_in: str | None,
    what: str = "",
    how: str = "was renamed",
) -> str:
    """The warning's text: what is deprecated, since when, until when, and what to write."""
    removed_in = removed_in or _next_minor(since)
    return (
        f"{old} is deprecated since jamp {since} and will be removed in jamp {removed_in}: "
        f"it {how} {new}{what}. Write {new} instead."
    )


def module_getattr(module: str, renames: Mapping[str, Rename]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves each old name of ``renames``, with a warning.

    Args:
      module: the module's public name, e.g. ``"jamp"``.
      renames: ``{old name: Rename(new name, object, since)}``.

    Returns:
      A function to assign to the module's ``__getattr__``; a name that is
      neither the module's nor an old one raises Python's ``AttributeError``.
    """

    def __getattr__(name: str) -> Any:
        rename = renames.get(name)
        if rename is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        text = message(
            f"{module}.{name}",
            f"{module}.{rename.new}",
            rename.since,
            rename.removed_in,
            " (the same object)" if rename.same_object else "",
            rename.how,
        )
        warnings.warn(text, DeprecationWarning, stacklevel=2)
        return rename.obj

    return __getattr__
