"""``jamp.GradScaler``: torch.amp.GradScaler's API, made of pure functions.

The scaler is an immutable, hashable configuration; the state lives in a
:class:`jamp.LossScaleState` that every method takes and returns, so a
PyTorch training loop ports line by line::

    torch                                   jamp
    scaler = GradScaler()          scaler = jamp.GradScaler(); state = scaler.init()
    scaler.scale(loss).backward()  grads = jax.grad(lambda p: scaler.scale(state, loss(p)))(params)
    scaler.step(optimizer)         params, opt_state, found_inf = scaler.step(
                                       state, tx, grads, opt_state, params)
    scaler.update()                state = scaler.update(state, found_inf)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jamp._src import loss_scale as ls
from jamp._src.config import check_config
from jamp._src.finite import agree, check_axis_name, check_unscaled, refuse_axis_name
from jamp._src.finite import unscale_and_check as _unscale_and_check
from jamp._src.leaves import check_bool_scalar, is_real_number
from jamp._src.lookup import holds_loss_scale
from jamp._src.loss_scaling import loss_scaling
from jamp._src.skip import check_skip, optimizer_step

_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _check_state(state: Any, method: str) -> ls.LossScaleState:
    """``state`` if it is a loss-scale state, else a TypeError that says where one comes from."""
    if isinstance(state, ls.LossScaleState):
        return state
    hint = ""
    if holds_loss_scale(state):
        hint = (
            "; this looks like a jamp.loss_scaling optimizer state: its loss-scale state is "
            "jamp.get_loss_scale(opt_state)"
        )
    raise TypeError(
        f"`GradScaler.{method}` expected `state` to be the scaler's LossScaleState (from "
        f"scaler.init() or scaler.load_state_dict), got {type(state).__name__} instead{hint}."
    )


def _python_scalar(value: Any) -> Any:
    """A 0-d NumPy/JAX array (a dict restored by Orbax or ``np.load``) as a Python number."""
    if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0:
        if isinstance(value, jax.core.Tracer):
            return value
        arr = np.asarray(value)
        if arr.dtype.kind in "iu":
            return int(arr)
        if arr.dtype.kind == "f":
            return float(arr)
    return value


def _found_inf_flag(found_inf: Any) -> jax.Array:
    """One boolean scalar from a flag or a list of flags (one per optimizer)."""
    if isinstance(found_inf, (list, tuple)):
        if not found_inf:
            raise ValueError("Expected at least one `found_inf` flag, got an empty sequence.")
        flags = [_found_inf_flag(f) for f in found_inf]
        out = flags[0]
        for f in flags[1:]:
            out = out | f
        return out
    return check_bool_scalar(found_inf, "found_inf", "from scaler.step or scaler.unscale")


@dataclasses.dataclass(frozen=True)
class GradScaler:
    """PyTorch's ``torch.amp.GradScaler``, as pure functions over an immutable state.

    Same constructor arguments, defaults, method names and ``state_dict``
    keys as PyTorch. The differences come from JAX: the state is passed in
    and returned (``state = scaler.update(state, found_inf)``), nothing syncs
    with the host (``get_scale`` returns a device array), ``scale`` accepts
    any pytree (dicts included), and the scale never leaves
    ``[2**-126, 2**126]``, so it cannot collapse to 0 as torch's does.

    Args:
      init_scale: initial scale.
      growth_factor: > 1.
      backoff_factor: in (0, 1).
      growth_interval: finite steps in a row before the scale grows; >= 1.
      enabled: ``False`` makes every method the identity / a plain step, as
        in PyTorch (and skips validation, as PyTorch does).
      skip: how :meth:`step` drops a non-finite step (not in PyTorch):
        ``"cond"`` (default) or ``"select"``; see :func:`jamp.loss_scaling`.
      axis_name: a ``shard_map``/``pmap`` axis name (or tuple of them) over
        which :meth:`unscale` and :meth:`step` agree on ``found_inf``, so every
        replica skips together (not in PyTorch, whose DDP all-reduces the
        gradients first). Not needed under plain ``jit`` with sharded arrays.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> scaler = jamp.GradScaler(init_scale=1024.0)
      >>> state = scaler.init()
      >>> tx = optax.sgd(0.5)
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> grads = jax.grad(lambda p: scaler.scale(state, jnp.sum(p["w"] ** 2)))(params)
      >>> params, opt_state, found_inf = scaler.step(state, tx, grads, opt_state, params)
      >>> state = scaler.update(state, found_inf)
      >>> params["w"], bool(found_inf)
      (Array([0., 0.], dtype=float32), False)
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True
    skip: str = "cond"
    axis_name: Any = None

    def __post_init__(self) -> None:
        # GradScaler is configuration, not a pytree, so validating here is safe.
        if not isinstance(self.enabled, bool):
            raise TypeError(f"Expected `enabled` to be a bool, got {self.enabled!r} instead.")
        if isinstance(self.init_scale, str):
            raise TypeError(
                f"Expected `init_scale` to be a real number, got {self.init_scale!r} instead; "
                "torch.amp.GradScaler's first argument is the device, jamp.GradScaler has none "
                "(JAX places arrays itself): drop it, or pass init_scale=... by name."
            )
        check_skip(self.skip)
        check_axis_name(self.axis_name)
        if self.enabled:
            self._config()

    # ------------------------------------------------------------ state

    def _config(self) -> Any:
        return check_config(
            scale=self.init_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )

    def init(self) -> ls.LossScaleState:
        """The initial state (``no_loss_scale()`` when disabled), with fresh arrays."""
        if not self.enabled:
            return ls.no_loss_scale()
        return ls.from_config(ls.DYNAMIC, self._config())

    def is_enabled(self) -> bool:
        return self.enabled

    def get_scale(self, state: ls.LossScaleState) -> jax.Array:
        """The scale, a float32 device array (1.0 when disabled). No host sync."""
        return _check_state(state, "get_scale").scale

    def get_growth_tracker(self, state: ls.LossScaleState) -> jax.Array:
        return _check_state(state, "get_growth_tracker").growth_tracker

    def get_growth_factor(self, state: ls.LossScaleState) -> float:
        return _check_state(state, "get_growth_factor").growth_factor

    def get_backoff_factor(self, state: ls.LossScaleState) -> float:
        return _check_state(state, "get_backoff_factor").backoff_factor

    def get_growth_interval(self, state: ls.LossScaleState) -> int:
        return _check_state(state, "get_growth_interval").growth_interval

    def _reconfigure(
        self, state: ls.LossScaleState, method: str, **changes: Any
    ) -> ls.LossScaleState:
        _check_state(state, method)
        if not state.is_dynamic:
            return state
        checked = check_config(**{**ls.config_of(state), **changes})
        # A tracker already at or past a lowered interval would never equal it
        # again (torch's rule grows on equality): the scale would stop growing
        # for good, as torch's does. Held one short, it grows on the next
        # finite step instead.
        tracker = jnp.minimum(state.growth_tracker, jnp.int32(checked.growth_interval - 1))
        return dataclasses.replace(
            state,
            growth_tracker=tracker,
            growth_factor=checked.growth_factor,
            backoff_factor=checked.backoff_factor,
            growth_interval=checked.growth_interval,
        )

    def set_growth_factor(self, state: ls.LossScaleState, new_factor: float) -> ls.LossScaleState:
        """A state with a new growth factor (static: changing it recompiles)."""
        return self._reconfigure(state, "set_growth_factor", growth_factor=new_factor)

    def set_backoff_factor(self, state: ls.LossScaleState, new_factor: float) -> ls.LossScaleState:
        return self._reconfigure(state, "set_backoff_factor", backoff_factor=new_factor)

    def set_growth_interval(self, state: ls.LossScaleState, new_interval: int) -> ls.LossScaleState:
        """A state with a new growth interval (static: changing it recompiles).

        Unlike PyTorch, a growth tracker already at or past the new interval is
        held one short of it, so the scale grows on the next finite step;
        PyTorch's tracker would never equal the interval again, and its scale
        would stop growing until the next inf.
        """
        return self._reconfigure(state, "set_growth_interval", growth_interval=new_interval)

    # ------------------------------------------------------------ the loop

    def scale(self, state: ls.LossScaleState, outputs: Any) -> Any:
        """``outputs`` times the scale: a loss, or any pytree (list, tuple, dict)."""
        return ls.scale(_check_state(state, "scale"), outputs)

    def unscale(self, state: ls.LossScaleState, grads: Any) -> tuple[Any, jax.Array]:
        """``(unscaled_grads, found_inf)``, torch's ``unscale_``: clip after this.

        Pass ``found_inf`` on to :meth:`step` so it does not unscale twice.
        """
        grads, finite = _unscale_and_check(
            _check_state(state, "unscale"), grads, axis_name=self.axis_name
        )
        return grads, jnp.logical_not(finite)

    def step(
        self,
        state: ls.LossScaleState,
        tx: optax.GradientTransformation,
        grads: Any,
        opt_state: Any,
        params: Any,
        *,
        found_inf: Any = None,
        filter: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, Any, jax.Array]:
        """Unscale, and apply ``tx`` unless a gradient is inf/NaN: ``scaler.step(opt)``.

        The update is applied inside a ``lax.cond`` (or selected, with
        ``skip="select"``): on a skipped step the parameters and
        ``opt_state`` come back unchanged (Adam's count does not advance).
        With ``found_inf`` (from :meth:`unscale`), ``grads`` are taken as
        already unscaled. When disabled, the step is always applied,
        as in PyTorch.

        ``params`` may be an Equinox module, with ``filter`` (not in PyTorch):
        ``tx`` and the skip see only the leaves it selects
        (``eqx.filter(params, filter)``; pass the filter the optimizer state
        was initialised with, e.g. ``eqx.is_array``), the others come back
        untouched, and ``None`` gradients (``eqx.filter_grad``'s) leave their
        parameter as it is.

        Returns:
          ``(params, opt_state, found_inf)``; pass ``found_inf`` to :meth:`update`.
        """
        _check_state(state, "step")
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            hint = " (call it: optax.sgd(0.1), not optax.sgd)" if callable(tx) else ""
            raise TypeError(
                "Expected `tx` to be an optax.GradientTransformation, got "
                f"{getattr(tx, '__name__', type(tx).__name__)} instead{hint}."
            )
        refuse_axis_name(extra_args, "`GradScaler.step`", "`tx`", "jamp.GradScaler")

        def step(pred: Any, grads_fn: Any) -> tuple[Any, Any]:
            return optimizer_step(
                pred,
                tx,
                grads_fn,
                opt_state,
                params,
                filter=filter,
                skip=self.skip,
                extra_args=extra_args,
                fn="GradScaler.step",
            )

        if not self.enabled:
            params, opt_state = step(None, lambda: grads)
            return params, opt_state, jnp.asarray(False)
        if found_inf is None:
            finite = check_unscaled(state, grads, axis_name=self.axis_name, filter=filter)
            unscaled = lambda: ls.unscale(state, grads, filter=filter)  # noqa: E731
        else:  # grads already unscaled by scaler.unscale
            finite = agree(jnp.logical_not(_found_inf_flag(found_inf)), self.axis_name)
            unscaled = lambda: grads  # noqa: E731

        # Unscaling inside the branch lets XLA fuse it into the optimizer's pass.
        new_params, new_opt_state = step(finite, unscaled)
        return new_params, new_opt_state, jnp.logical_not(finite)

    def update(
        self, state: ls.LossScaleState, found_inf: Any = None, new_scale: Any = None
    ) -> ls.LossScaleState:
        """The state for the next iteration: ``scaler.update()``.

        Args:
          state: the current state.
          found_inf: the flag from :meth:`step` / :meth:`unscale`, or a list
            of them (several optimizers): the scale backs off once if any is
            set.
          new_scale: set the scale to this value instead (a float or a
            scalar array); like PyTorch, the growth tracker is left unchanged.
            A value that is not positive and finite raises ``ValueError``;
            under ``jit``, where it cannot be read, such a value leaves the
            scale as it was (PyTorch would take a NaN and skip every step
            after), and one outside ``[min_scale, max_scale]`` is clamped.
        """
        _check_state(state, "update")
        if not self.enabled:
            return state
        if new_scale is not None:
            if isinstance(new_scale, jax.core.Tracer):
                if jnp.shape(new_scale) != ():
                    raise ValueError(
                        "Expected `new_scale` to be a scalar, got an array of shape "
                        f"{jnp.shape(new_scale)} instead."
                    )
                v = jnp.asarray(new_scale, jnp.float32)
                lo, hi = jnp.float32(state.min_scale), jnp.float32(state.max_scale)
                usable = jnp.isfinite(v) & (v > 0)
                value = jnp.where(usable, jnp.clip(v, lo, hi), state.scale)
            else:
                checked = check_config(**ls.config_of(state, new_scale), scale_name="new_scale")
                value = jnp.asarray(checked.scale, jnp.float32)
            return dataclasses.replace(state, scale=value)
        if found_inf is None:
            raise ValueError(
                "Expected `found_inf` (from scaler.step or scaler.unscale) or `new_scale`, got "
                "neither: no inf checks were recorded prior to update."
            )
        return ls.update(state, jnp.logical_not(_found_inf_flag(found_inf)))

    def as_optax(
        self, inner: optax.GradientTransformation
    ) -> optax.GradientTransformationExtraArgs:
        """The same scaler as an Optax transformation: :func:`jamp.loss_scaling`.

        When disabled, the transformation scales by 1 but still skips
        non-finite steps (PyTorch would apply them).
        """
        return loss_scaling(inner, self.init(), skip=self.skip, axis_name=self.axis_name)

    # ------------------------------------------------------------ checkpoints

    def state_dict(self, state: ls.LossScaleState) -> dict[str, Any]:
        """PyTorch's state dict: ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker`` (``{}`` when disabled).

        Reads two scalars from the device (a sync): call it when checkpointing.
        """
        _check_state(state, "state_dict")
        if not self.enabled:
            return {}
        return {
            "scale": float(np.asarray(state.scale)),
            "growth_factor": float(state.growth_factor),
            "backoff_factor": float(state.backoff_factor),
            "growth_interval": int(state.growth_interval),
            "_growth_tracker": int(np.asarray(state.growth_tracker)),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> ls.LossScaleState:
        """A state from a dict saved by :meth:`state_dict` or by PyTorch.

        The dict's growth/backoff configuration is carried in the returned
        state. When disabled, returns :meth:`init`'s state, as PyTorch ignores
        the dict.
        """
        if not self.enabled:
            return self.init()
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"Expected `state_dict` to be a mapping, got {type(state_dict).__name__} instead."
            )
        if not state_dict:
            raise ValueError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler."
            )
        missing = [k for k in _TORCH_KEYS if k not in state_dict]
        if missing:
            raise ValueError(
                f"Expected `state_dict` to have the keys {list(_TORCH_KEYS)}, missing {missing}."
            )
        # Orbax and np.load hand back 0-d arrays where torch saved numbers.
        state_dict = {k: _python_scalar(state_dict[k]) for k in _TORCH_KEYS}
        scale_value = state_dict["scale"]
        if is_real_number(scale_value) and not (
            math.isfinite(float(scale_value)) and float(scale_value) > 0
        ):
            raise ValueError(
                f"Expected state_dict['scale'] to be positive and finite, got {scale_value!r} "
                "instead; a PyTorch scaler whose scale collapsed to 0 cannot be resumed."
            )
        # A restore: a scale torch let grow past max_scale (up to 2**127) is
        # clamped to it, and a tracker at or past the interval held one short.
        config = check_config(
            scale=scale_value,
            scale_name="state_dict['scale']",
            growth_factor=state_dict["growth_factor"],
            backoff_factor=state_dict["backoff_factor"],
            growth_interval=state_dict["growth_interval"],
            growth_tracker=state_dict["_growth_tracker"],
            restore=True,
            names={"growth_tracker": "state_dict['_growth_tracker']"},
        )
        return ls.from_config(ls.DYNAMIC, config)
