"""Flax: checkpoints of [`jamp.LossScaleState`][], and flax's ``DynamicScale`` converted.

``flax.serialization.to_bytes`` / ``to_state_dict`` handle only types they
know (NamedTuples, dicts, flax dataclasses, registered types), so without this
a ``TrainState`` whose optimizer is ``jamp.loss_scaling(...)`` cannot be saved
with them. ``register`` runs when ``flax.serialization`` is imported (or at
``import jamp``, if it already is): jamp itself never imports flax.

The state dict holds the dynamic leaves (``scale``, ``growth_tracker``,
``overflow_streak``); the configuration is static and comes from the target
restored into, as for every other flax checkpoint. Restoring goes through
``loss_scale.restore``, the one validation of restored values. Subclasses of
the state (``jamp.GradScalerState``) are saved the same way: what they add
(the GradScaler's stage and the inf checks of an iteration in progress) comes
from the target, as PyTorch's scaler may be saved only between iterations.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

from jamp._src import loss_scale as ls
from jamp._src.types import PyTree
from jamp._src.validate import MIN_SCALE, check_config, checked_floor


def _to_state_dict(state: ls.LossScaleState) -> dict[str, PyTree]:
    from flax import serialization

    return {f: serialization.to_state_dict(getattr(state, f)) for f in ls.DATA_FIELDS}


def _from_state_dict(target: ls.LossScaleState, state_dict: dict[str, PyTree]) -> ls.LossScaleState:
    from flax import serialization

    missing = [f for f in ls.DATA_FIELDS if f not in state_dict]
    if missing:
        raise ValueError(
            f"Expected the state dict of a jamp.LossScaleState at "
            f"{serialization.current_path()} to have the keys {list(ls.DATA_FIELDS)}, missing "
            f"{missing}."
        )
    # Validated as every restored state is (loss_scale.restore): a NaN or
    # non-positive scale is an error, the scale is clamped into the target's
    # bounds, the tracker held below its interval, numbers become arrays.
    where = serialization.current_path().removeprefix("./").strip("/")
    return ls.restore(
        target,
        state_dict["scale"],
        state_dict["growth_tracker"],
        state_dict["overflow_streak"],
        where=f"{where}/" if where else "",
    )


def register(serialization: types.ModuleType) -> None:
    """Register [`jamp.LossScaleState`][] and its subclasses with ``flax.serialization``."""
    # flax looks serializers up by exact type: register every subclass defined by now.
    pending, types = [ls.LossScaleState], []
    while pending:
        types.append(pending.pop())
        pending.extend(types[-1].__subclasses__())
    for ty in types:
        serialization.register_serialization_state(
            ty, _to_state_dict, _from_state_dict, override=True
        )


class _OnImport(importlib.abc.MetaPathFinder):
    """Registers jamp's states once ``flax.serialization`` is imported: a one-shot hook on
    ``sys.meta_path`` that runs ``register`` right after that module has executed."""

    def find_spec(
        self,
        name: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            register(module)

        loader.exec_module = exec_module
        return spec


_MODULE = "flax.serialization"


def register_when_imported() -> None:
    """Register jamp's states with ``flax.serialization`` now if it is imported, else when
    it is. jamp never imports flax itself: ``import jamp`` stays as fast without it."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        register(module)
    elif not any(isinstance(f, _OnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport())


def from_flax_dynamic_scale(
    dynamic_scale: Any,
    *,
    growth_factor: float | None = None,
    backoff_factor: float | None = None,
    growth_interval: int | None = None,
    minimum_scale: float | None = None,
) -> ls.LossScaleState:
    """A [`jamp.LossScaleState`][] from a flax ``DynamicScale`` or its checkpoint.

    Accepts a ``flax.training.dynamic_scale.DynamicScale`` (its configuration
    is read from it) or the state dict of one, ``{"fin_steps": ..., "scale":
    ...}``, as ``flax.serialization.to_state_dict`` saved it inside a
    ``TrainState`` checkpoint (the configuration is not in the checkpoint:
    pass the one the run used, or flax's defaults apply: ``growth_factor=2.0``,
    ``backoff_factor=0.5``, ``growth_interval=2000``, ``minimum_scale`` float32's
    smallest normal number, ``2**-126``, which is also jamp's default
    ``min_scale``; flax's ``minimum_scale=None`` means no floor, jamp's
    default floor then applies).

    The values go through the same validation as every restored state: a NaN
    or non-positive scale is a ``ValueError``, a scale outside jamp's bounds is
    clamped into them, and flax's ``fin_steps``, which reaches
    ``growth_interval`` before flax grows (one step later than torch and
    jamp), is held at ``growth_interval - 1``: the scale grows on the next
    finite step, as flax's would.

    Args:
      dynamic_scale: a ``DynamicScale``, or a mapping with ``fin_steps`` and ``scale``.
      growth_factor: overrides the ``DynamicScale``'s (flax's default: 2.0).
      backoff_factor: overrides the ``DynamicScale``'s (flax's default: 0.5).
      growth_interval: overrides the ``DynamicScale``'s (flax's default: 2000).
      minimum_scale: overrides the ``DynamicScale``'s (flax's default:
        float32's ``tiny``, 2**-126); a smaller floor, or ``None``, becomes
        jamp's 2**-126.

    Returns:
      A dynamic [`jamp.LossScaleState`][] with torch's update rule.

    Examples:
      >>> import jamp
      >>> state = jamp.compat.from_flax_dynamic_scale({"fin_steps": 2000, "scale": 32768.0})
      >>> float(state.scale), int(state.growth_tracker)
      (32768.0, 1999)
    """
    if isinstance(dynamic_scale, Mapping):
        missing = [k for k in ("fin_steps", "scale") if k not in dynamic_scale]
        if missing:
            raise ValueError(
                "Expected the state dict of a flax DynamicScale, with the keys "
                f"['fin_steps', 'scale'], missing {missing}."
            )
        values, config = dynamic_scale, {}
    elif all(hasattr(dynamic_scale, k) for k in ("fin_steps", "scale", "growth_interval")):
        values = {"fin_steps": dynamic_scale.fin_steps, "scale": dynamic_scale.scale}
        config = {
            k: getattr(dynamic_scale, k)
            for k in ("growth_factor", "backoff_factor", "growth_interval", "minimum_scale")
        }
    else:
        raise TypeError(
            "Expected `dynamic_scale` to be a flax DynamicScale or its state dict "
            f"{{'fin_steps': ..., 'scale': ...}}, got {type(dynamic_scale).__name__} instead."
        )
    given = dict(
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        minimum_scale=minimum_scale,
    )
    config.update({k: v for k, v in given.items() if v is not None})
    if values["fin_steps"] is None:  # check_config reads None as "not given"
        raise TypeError(
            "Expected `fin_steps` of the flax DynamicScale to be an integer >= 0, got None instead."
        )
    floor = config.get("minimum_scale")
    checked = check_config(
        scale=values["scale"],
        scale_name="scale",
        growth_factor=config.get("growth_factor", 2.0),
        backoff_factor=config.get("backoff_factor", 0.5),
        growth_interval=config.get("growth_interval", 2000),
        min_scale=MIN_SCALE if floor is None else checked_floor("minimum_scale", floor),
        growth_tracker=values["fin_steps"],
        restore=True,
        names={"growth_tracker": "fin_steps"},
    )
    return ls.from_config(ls.DYNAMIC, checked)
