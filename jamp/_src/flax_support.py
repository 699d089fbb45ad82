"""Flax checkpoints: ``flax.serialization`` learns :class:`jamp.LossScaleState`.

``flax.serialization.to_bytes`` / ``to_state_dict`` handle only types they
know (NamedTuples, dicts, flax dataclasses, registered types), so without this
a ``TrainState`` whose optimizer is ``jamp.loss_scaling(...)`` cannot be saved
with them. :func:`register` runs when jamp is imported, and only if flax is
installed; jamp itself never needs flax.

The state dict holds the dynamic leaves (``scale``, ``growth_tracker``,
``overflow_streak``); the configuration is static and comes from the target
restored into, as for every other flax checkpoint. Subclasses of the state
(``jamp.GradScalerState``) are saved the same way: what they add (the
GradScaler's stage and the inf checks of an iteration in progress) comes
from the target, as PyTorch's scaler may be saved only between iterations.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from jamp._src import loss_scale as ls

_FIELDS = ("scale", "growth_tracker", "overflow_streak")


def _to_state_dict(state: ls.LossScaleState) -> dict[str, Any]:
    from flax import serialization

    return {f: serialization.to_state_dict(getattr(state, f)) for f in _FIELDS}


def _from_state_dict(target: ls.LossScaleState, state_dict: dict[str, Any]) -> ls.LossScaleState:
    from flax import serialization

    missing = [f for f in _FIELDS if f not in state_dict]
    if missing:
        raise ValueError(
            f"Expected the state dict of a jamp.LossScaleState at "
            f"{serialization.current_path()} to have the keys {list(_FIELDS)}, missing "
            f"{missing}."
        )
    return dataclasses.replace(
        target,
        **{f: serialization.from_state_dict(getattr(target, f), state_dict[f], f) for f in _FIELDS},
    )


def register() -> None:
    """Register :class:`jamp.LossScaleState` and its subclasses with ``flax.serialization``.

    Does nothing without flax. Called by ``jamp/__init__.py`` once every
    module, ``grad_scaler`` included, is imported.
    """
    if importlib.util.find_spec("flax") is None:
        return
    try:
        from flax import serialization
    except Exception:  # a broken flax install must not break `import jamp`
        return
    # flax looks serializers up by exact type: register every subclass defined by now.
    pending, types = [ls.LossScaleState], []
    while pending:
        types.append(pending.pop())
        pending.extend(types[-1].__subclasses__())
    for ty in types:
        serialization.register_serialization_state(
            ty, _to_state_dict, _from_state_dict, override=True
        )
