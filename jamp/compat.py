"""jmp's and flax's helpers, for a program migrating to jamp.

``get_policy``, ``half_dtype`` and ``select_tree`` are jmp's functions of the
same names (``jamp.Policy`` is jmp's ``Policy``); ``parse_dtype`` reads a
dtype the way ``get_policy`` does; ``from_flax_dynamic_scale`` turns a flax
``DynamicScale`` (or its checkpoint) into a ``jamp.LossScaleState``. See
``docs/migrating-from-jmp-flax.md``.
"""

from jamp._src.flax_support import from_flax_dynamic_scale
from jamp._src.policy import get_policy, half_dtype, parse_dtype
from jamp._src.skip import select_tree

__all__ = [
    "from_flax_dynamic_scale",
    "get_policy",
    "half_dtype",
    "parse_dtype",
    "select_tree",
]
