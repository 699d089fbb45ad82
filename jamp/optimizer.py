"""The optimizer-memory transformations' states, and the master they keep.

``jamp.master_weights`` keeps a ``MasterWeightsState``; ``master_params`` reads the
float32 master out of any optimizer state holding one (to export at the end of
training). ``jamp.low_precision_state`` keeps a ``LowPrecisionState``, whose
block-quantised fields are ``BlockQuantized``. See ``docs/optimizer-memory.md``.
"""

from jamp._src.optimizer.master import MasterWeightsState, master_params
from jamp._src.optimizer.quantize import BlockQuantized
from jamp._src.optimizer.state import LowPrecisionState

__all__ = ["BlockQuantized", "LowPrecisionState", "MasterWeightsState", "master_params"]
