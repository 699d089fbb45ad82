"""The states of the optimizer-memory transformations, for type annotations and
``isinstance``: ``jamp.master_weights`` keeps a ``MasterWeightsState``,
``jamp.low_precision_state`` a ``LowPrecisionState`` whose block-quantised fields are
``BlockQuantized``. See ``docs/optimizer-memory.md``.
"""

from jamp._src.optimizer.master import MasterWeightsState
from jamp._src.optimizer.quantize import BlockQuantized
from jamp._src.optimizer.state import LowPrecisionState

__all__ = ["BlockQuantized", "LowPrecisionState", "MasterWeightsState"]
