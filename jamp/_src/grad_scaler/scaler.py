"""``jamp.GradScaler``: torch.amp.GradScaler's API, made of pure functions.

The scaler is an immutable, hashable configuration; the state is a
[`jamp.GradScalerState`][] that every method takes and returns. Like
torch's scaler, the state records where the iteration stands (unscaled,
stepped) and the inf checks made so far, so a PyTorch training loop ports
line by line, and its misuses fail as they do in PyTorch::

    torch                                   jamp
    scaler = GradScaler()          scaler = jamp.GradScaler(); state = scaler.init()
    scaler.scale(loss).backward()  grads = jax.grad(lambda p: scaler.scale(state, loss(p)))(params)
    scaler.unscale_(optimizer)     grads, state = scaler.unscale(state, grads)
    scaler.step(optimizer)         params, opt_state, state = scaler.step(
                                       state, tx, grads, opt_state, params)
    scaler.update()                state = scaler.update(state)

The stage is static pytree metadata and every misuse is refused while the
step is traced, so the bookkeeping compiles to nothing. This module is the
PyTorch API; the state, its stages and consumption, and the sentences a
misuse raises are ``state``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import overload

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from jamp._src import loss_scale as ls
from jamp._src.finite.check import check_unscaled, unscaled_and_finite
from jamp._src.grad_scaler.records import check_step, record
from jamp._src.grad_scaler.state import (
    CALLS,
    NO_INF_CHECKS,
    STEPPED,
    UNSCALED,
    UNSCALED_TWICE,
    GradScalerState,
    any_found,
    as_grad_scaler_state,
    check_not_consumed,
    check_scaler_state,
    checked_by_of,
    consume,
    found_infs_of,
    ready,
    refuse_found_inf,
    stage_of,
    takes_state,
    with_checks,
)
from jamp._src.leaves import is_real_number
from jamp._src.loss_scale import StateT
from jamp._src.loss_scaling import loss_scaling
from jamp._src.skip import optimizer_step
from jamp._src.types import AxisName, Filter, Grads, OptState, Params, PyTree, is_tracer
from jamp._src.validate import (
    Config,
    check_axis_name,
    check_config,
    check_flag,
    check_not_swapped,
    check_skip,
    check_step_arguments,
    hide_from_tracebacks,
    refuse_axis_name,
)

hide_from_tracebacks(__file__)  # a misuse it refuses shows the user's line

_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _python_scalar(value: object) -> object:
    """A 0-d NumPy/JAX array (a dict restored by Orbax or ``np.load``) as a Python number."""
    if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0:
        if is_tracer(value):
            return value
        arr = np.asarray(value)
        if arr.dtype.kind in "iu":
            return int(arr)
        if arr.dtype.kind == "f":
            return float(arr)
    return value


@dataclasses.dataclass(frozen=True)
class GradScaler:
    """PyTorch's ``torch.amp.GradScaler``, as pure functions over an immutable state.

    Same constructor arguments, defaults, method names and ``state_dict``
    keys as PyTorch. The differences come from JAX: the state is passed in
    and returned (``state = scaler.update(state)``), nothing syncs with the
    host (``get_scale`` returns a device array), ``scale`` accepts any pytree
    (dicts included), and the scale never leaves ``[2**-126, 2**126]``, so it
    cannot collapse to 0 as torch's does.

    The state (a [`jamp.GradScalerState`][]) records, as torch's scaler
    does per optimizer, whether the gradients were unscaled and which inf
    checks were made since the last ``update``. So ``step`` after ``unscale``
    does not unscale again, ``update`` takes no flag, and what PyTorch
    refuses is refused here too, with PyTorch's words, while the step is
    traced: unscaling twice, ``update`` without an inf check (or twice), and
    reusing a state that ``unscale``, ``step`` or ``update`` already replaced.

    Args:
      init_scale: initial scale.
      growth_factor: > 1.
      backoff_factor: in (0, 1).
      growth_interval: finite steps in a row before the scale grows; >= 1.
      enabled: ``False`` makes every method the identity / a plain step, as
        in PyTorch (and skips validation, as PyTorch does).
      skip: how [`step`][jamp.GradScaler.step] drops a non-finite step (not in PyTorch):
        ``"auto"`` (default: ``"select"`` on GPUs and TPUs, ``"cond"`` on
        CPUs), ``"cond"`` or ``"select"``; see [`jamp.loss_scaling`][].
      axis_name: a ``shard_map``/``pmap`` axis name (or tuple of them) over
        which [`unscale`][jamp.GradScaler.unscale] and [`step`][jamp.GradScaler.step] agree
        on ``found_inf``, so every replica skips together (not in PyTorch, whose
        DDP all-reduces the gradients first). It does not average the gradients:
        do that yourself (``lax.pmean``) before
        [`unscale`][jamp.GradScaler.unscale]/[`step`][jamp.GradScaler.step], as flax's
        ``DynamicScale(axis_name=...)`` did for you. Not needed under plain
        ``jit`` with sharded arrays.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jamp
      >>> scaler = jamp.GradScaler(init_scale=1024.0)
      >>> state = scaler.init()
      >>> tx = optax.sgd(0.5)
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> grads = jax.grad(lambda p: scaler.scale(state, jnp.sum(p["w"] ** 2)))(params)
      >>> params, opt_state, state = scaler.step(state, tx, grads, opt_state, params)
      >>> bool(scaler.found_inf(state))
      False
      >>> state = scaler.update(state)
      >>> params["w"], state.stage
      (Array([0., 0.], dtype=float32), 'ready')
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True
    skip: str = "auto"
    axis_name: AxisName | None = None

    def __post_init__(self) -> None:
        # GradScaler is configuration, not a pytree, so validating here is safe.
        check_flag("enabled", self.enabled)
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

    def _config(self) -> Config:
        return check_config(
            scale=self.init_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )

    def _loss_scale(self) -> ls.LossScaleState:
        if not self.enabled:
            return ls.no_loss_scale()
        return ls.from_config(ls.DYNAMIC, self._config())

    def init(self) -> GradScalerState:
        """The initial state, with fresh arrays: ready, no inf check recorded.

        When disabled, its scale is 1 (``no_loss_scale()``'s).
        """
        return as_grad_scaler_state(self._loss_scale())

    def is_enabled(self) -> bool:
        return self.enabled

    @takes_state("scaler.get_scale(state)")
    def get_scale(self, state: ls.LossScaleState) -> jax.Array:
        """The scale, a float32 device array (1.0 when disabled). No host sync."""
        return check_scaler_state(state, "get_scale").scale

    @takes_state("scaler.get_growth_tracker(state)")
    def get_growth_tracker(self, state: ls.LossScaleState) -> jax.Array:
        return check_scaler_state(state, "get_growth_tracker").growth_tracker

    @takes_state("scaler.get_growth_factor(state)")
    def get_growth_factor(self, state: ls.LossScaleState) -> float:
        return check_scaler_state(state, "get_growth_factor").growth_factor

    @takes_state("scaler.get_backoff_factor(state)")
    def get_backoff_factor(self, state: ls.LossScaleState) -> float:
        return check_scaler_state(state, "get_backoff_factor").backoff_factor

    @takes_state("scaler.get_growth_interval(state)")
    def get_growth_interval(self, state: ls.LossScaleState) -> int:
        return check_scaler_state(state, "get_growth_interval").growth_interval

    def _reconfigure(self, state: StateT, method: str, **changes: object) -> StateT:
        check_scaler_state(state, method)
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

    @takes_state("state = scaler.set_growth_factor(state, new_factor)")
    def set_growth_factor(self, state: StateT, new_factor: float) -> StateT:
        """A state with a new growth factor (static: changing it recompiles)."""
        return self._reconfigure(state, "set_growth_factor", growth_factor=new_factor)

    @takes_state("state = scaler.set_backoff_factor(state, new_factor)")
    def set_backoff_factor(self, state: StateT, new_factor: float) -> StateT:
        return self._reconfigure(state, "set_backoff_factor", backoff_factor=new_factor)

    @takes_state("state = scaler.set_growth_interval(state, new_interval)")
    def set_growth_interval(self, state: StateT, new_interval: int) -> StateT:
        """A state with a new growth interval (static: changing it recompiles).

        Unlike PyTorch, a growth tracker already at or past the new interval is
        held one short of it, so the scale grows on the next finite step;
        PyTorch's tracker would never equal the interval again, and its scale
        would stop growing until the next inf.
        """
        return self._reconfigure(state, "set_growth_interval", growth_interval=new_interval)

    # ------------------------------------------------------------ the loop

    @takes_state("scaler.scale(state, loss)")
    def scale(self, state: ls.LossScaleState, outputs: PyTree) -> PyTree:
        """``outputs`` times the scale: a loss, or any pytree (list, tuple, dict)."""
        return ls.scale_tree(check_scaler_state(state, "scale"), outputs)

    @overload
    def unscale(self, state: GradScalerState, grads: Grads) -> tuple[Grads, GradScalerState]: ...
    @overload
    def unscale(
        self, state: ls.LossScaleState, grads: Grads
    ) -> tuple[Grads, ls.LossScaleState]: ...
    @takes_state(CALLS["unscale"])
    def unscale(self, state: ls.LossScaleState, grads: Grads) -> tuple[Grads, ls.LossScaleState]:
        """``(unscaled_grads, state)``: torch's ``unscale_(optimizer)``; clip after this.

        The returned state records the inf check and that these gradients are
        unscaled, so [`step`][jamp.GradScaler.step] given it takes them as they are (it does not
        unscale again) and [`update`][jamp.GradScaler.update] sees the check. Unscale each
        optimizer's gradients at most once per iteration, and step them
        before unscaling the next optimizer's. When disabled, returns
        ``(grads, state)`` unchanged, as PyTorch does nothing.

        Raises:
          RuntimeError: ``state`` is unscaled already ("unscale_() has already
            been called on this optimizer since the last update()"), or was
            already passed to ``unscale``, ``step`` or ``update``.
        """
        state = check_scaler_state(state, "unscale")
        if not self.enabled:
            return grads, state
        check_not_consumed(state, "unscale")
        if stage_of(state) == UNSCALED:
            raise RuntimeError(
                f"{UNSCALED_TWICE} `scaler.unscale` returned gradients that are unscaled already, "
                "and the state says so: `scaler.step` takes them as they are. With several "
                "optimizers, step each one's gradients before unscaling the next one's: "
                f"`{CALLS['unscale']}`, then `{CALLS['step']}`, for each optimizer in turn."
            )
        unscaled, finite = unscaled_and_finite(state, grads, self.axis_name)
        consume(state, "unscale", grads)
        found_infs = (*found_infs_of(state), jnp.logical_not(finite))
        return unscaled, with_checks(state, found_infs, UNSCALED, (*checked_by_of(state), None))

    @overload
    def step(
        self,
        state: GradScalerState,
        tx: optax.GradientTransformation,
        grads: Grads,
        opt_state: OptState,
        params: Params,
        *,
        filter: Filter = None,
        **extra_args: object,
    ) -> tuple[Params, OptState, GradScalerState]: ...
    @overload
    def step(
        self,
        state: ls.LossScaleState,
        tx: optax.GradientTransformation,
        grads: Grads,
        opt_state: OptState,
        params: Params,
        *,
        filter: Filter = None,
        **extra_args: object,
    ) -> tuple[Params, OptState, ls.LossScaleState]: ...
    @takes_state(CALLS["step"])
    def step(
        self,
        state: ls.LossScaleState,
        tx: optax.GradientTransformation,
        grads: Grads,
        opt_state: OptState,
        params: Params,
        *,
        filter: Filter = None,
        **extra_args: object,
    ) -> tuple[Params, OptState, ls.LossScaleState]:
        """Apply ``tx`` unless a gradient is inf/NaN: torch's ``scaler.step(optimizer)``.

        Unless ``state`` comes from [`unscale`][jamp.GradScaler.unscale] (whose gradients are taken
        as they are), ``grads`` are unscaled and checked first. The update is
        applied or dropped as ``skip`` says (a select on GPUs, ``lax.cond`` on CPUs):
        on a skipped step the parameters and ``opt_state`` come back unchanged
        (Adam's count does not advance). Extra keyword arguments go to
        ``tx.update``. When disabled, the step is always applied, as in
        PyTorch.

        ``params`` may be an Equinox module, with ``filter`` (not in PyTorch):
        ``tx`` and the skip see only the leaves it selects
        (``eqx.filter(params, filter)``; pass the filter the optimizer state
        was initialised with, e.g. ``eqx.is_array``), the others come back
        untouched, and ``None`` gradients (``eqx.filter_grad``'s) leave their
        parameter as it is.

        Returns:
          ``(params, opt_state, state)``: ``state`` records this step's inf
          check; pass it to the next optimizer's ``step`` or to
          [`update`][jamp.GradScaler.update]. [`found_inf`][jamp.GradScaler.found_inf] tells
          whether the step was skipped.

        Raises:
          RuntimeError: ``state`` was already passed to ``unscale`` (its
            gradients would be unscaled twice), ``step`` or ``update``; or
            ``tx`` already stepped these parameters since the last
            ``update`` ("step() has already been called since the last
            update()": the loop left ``update`` out); or ``state`` holds a
            check that a step of parameters of this structure recorded in
            another trace (it left a jitted call without ``update``, and
            would grow and retrace every iteration).
          TypeError: ``tx`` is not an Optax transformation, ``params`` and
            ``opt_state`` are swapped, or ``found_inf=`` was passed.
        """
        state = check_scaler_state(state, "step")
        refuse_axis_name(extra_args, "`GradScaler.step`", "`tx`", "jamp.GradScaler")
        check_not_swapped(grads, opt_state, params)
        check_step_arguments(tx, grads, opt_state, params, filter=filter, fn="GradScaler.step")

        def step(pred: jax.Array | None, grads_fn: Callable[[], Grads]) -> tuple[Params, OptState]:
            return optimizer_step(
                pred,
                tx,
                grads_fn,
                opt_state,
                params,
                grads=grads,
                filter=filter,
                skip=self.skip,
                extra_args=extra_args,
                fn="GradScaler.step",
            )

        if not self.enabled:
            params, opt_state = step(None, lambda: grads)
            return params, opt_state, state
        check_not_consumed(state, "step")
        found_infs, checked_by = found_infs_of(state), checked_by_of(state)
        check_step(checked_by, tx, params)
        if stage_of(state) == UNSCALED:  # grads unscaled by scaler.unscale, its check recorded
            found_infs, found_inf = found_infs[:-1], found_infs[-1]
            checked_by = checked_by[:-1]
            finite = jnp.logical_not(found_inf)
            unscaled = lambda: grads  # noqa: E731
        else:
            finite = check_unscaled(
                state, grads, axis_name=self.axis_name, filter=filter, fn="GradScaler.step"
            )
            found_inf = None
            unscaled = lambda: ls.unscale_tree(state, grads, filter)  # noqa: E731

        # Unscaling inside the branch lets XLA fuse it into the optimizer's pass.
        new_params, new_opt_state = step(finite, unscaled)
        if found_inf is None:
            found_inf = jnp.logical_not(finite)
        consume(state, "step", grads)
        checked_by = (*checked_by, record(tx, params, new_params))
        new_state = with_checks(state, (*found_infs, found_inf), STEPPED, checked_by)
        return new_params, new_opt_state, new_state

    @takes_state(CALLS["update"])
    def update(self, state: StateT, new_scale: ArrayLike | None = None) -> StateT:
        """The state for the next iteration: ``scaler.update()``.

        Backs the scale off once if any inf check recorded since the last
        update (one per optimizer, by [`unscale`][jamp.GradScaler.unscale] or
        [`step`][jamp.GradScaler.step]) found an inf/NaN, else counts a finite step,
        and returns a state that is ready for the next iteration, with no check
        recorded.

        Args:
          state: the state [`step`][jamp.GradScaler.step] (or
            [`unscale`][jamp.GradScaler.unscale]) returned.
          new_scale: set the scale to this value instead (a float or a
            scalar array); like PyTorch, the growth tracker is left unchanged
            and no inf check is needed. A value that is not positive and
            finite raises ``ValueError``; under ``jit``, where it cannot be
            read, such a value leaves the scale as it was (PyTorch would take
            a NaN and skip every step after), and one outside
            ``[min_scale, max_scale]`` is clamped.

        Raises:
          RuntimeError: no inf check was recorded ("No inf checks were
            recorded prior to update."), or ``state`` was already passed to
            ``unscale``, ``step`` or ``update``.
          TypeError: a ``found_inf`` flag was passed (``step`` records it), or
            a ``new_scale`` that is no number (a list, a state).
        """
        check_scaler_state(state, "update")
        if not self.enabled:
            return state
        if isinstance(new_scale, ls.LossScaleState):  # the state step returned, as a flag
            raise TypeError(
                "Expected `new_scale` to be a Python float or a scalar array, got a "
                f"{type(new_scale).__name__} instead: `update` takes the state once, and "
                "`new_scale` only to set the scale (`scaler.update(state, new_scale=1024.0)`). "
                "The third value `scaler.step` returns is the state, not a found_inf flag: "
                f"{refuse_found_inf('update')}"
            )
        flags = new_scale if isinstance(new_scale, (list, tuple)) else [new_scale]
        if flags and all(
            isinstance(f, (bool, np.bool_)) or getattr(f, "dtype", None) == np.bool_ for f in flags
        ):
            raise refuse_found_inf("update")
        if isinstance(new_scale, (list, tuple, dict)):
            raise TypeError(
                "Expected `new_scale` to be a Python float or a scalar array, got "
                f"{type(new_scale).__name__} {new_scale!r:.40} instead; `update` reads the inf "
                "checks from the state, so it takes no list of found_inf flags either."
            )
        check_not_consumed(state, "update")
        if new_scale is not None:
            if is_tracer(new_scale):
                dtype = np.dtype(new_scale.dtype)
                if dtype not in (np.float32, np.float64) and not np.issubdtype(dtype, np.integer):
                    raise TypeError(
                        "Expected `new_scale` to be a float32 (or integer) scalar, got a traced "
                        f"array of dtype {dtype} instead: converting it would drop what a "
                        f"float32 scale cannot hold. Pass `new_scale.astype(jnp.float32)` if "
                        "that is what you mean."
                    )
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
            new = dataclasses.replace(state, scale=value)
        else:
            found_infs = found_infs_of(state)
            if not found_infs:
                raise RuntimeError(
                    f"{NO_INF_CHECKS} `scaler.update(state)` acts on the inf checks that "
                    "`scaler.step` (or `scaler.unscale`) recorded in the state it returned: write "
                    f"`{CALLS['step']}`, then `{CALLS['update']}`, once per iteration. To set "
                    "the scale without a step, pass `new_scale`."
                )
            new = ls.update_state(state, jnp.logical_not(any_found(found_infs)))
        if found_infs_of(state):  # a ready state (new_scale only) can be reused harmlessly
            consume(state, "update", found_infs_of(state))
        return ready(new)

    @takes_state("scaler.found_inf(state)")
    def found_inf(self, state: ls.LossScaleState) -> jax.Array:
        """Whether an inf/NaN was found since the last update (not in PyTorch): a skipped step.

        The OR of the checks recorded by [`unscale`][jamp.GradScaler.unscale] and
        [`step`][jamp.GradScaler.step] (one per optimizer; each is also in
        ``state.found_infs``), which is what [`update`][jamp.GradScaler.update] acts
        on. Read it before ``update``, which clears them; ``False`` when nothing
        is recorded. A device array: no sync.
        """
        found_infs = found_infs_of(check_scaler_state(state, "found_inf"))
        return any_found(found_infs) if found_infs else jnp.asarray(False)

    def as_optax(
        self, inner: optax.GradientTransformation
    ) -> optax.GradientTransformationExtraArgs:
        """The same scaler as an Optax transformation: [`jamp.loss_scaling`][].

        When disabled, the transformation scales by 1 but still skips
        non-finite steps (PyTorch would apply them).
        """
        return loss_scaling(inner, self._loss_scale(), skip=self.skip, axis_name=self.axis_name)

    # ------------------------------------------------------------ checkpoints

    @takes_state("scaler.state_dict(state)")
    def state_dict(self, state: ls.LossScaleState) -> dict[str, float | int]:
        """PyTorch's state dict: ``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker`` (``{}`` when disabled).

        Reads two scalars from the device (a sync): call it when checkpointing.
        """
        check_scaler_state(state, "state_dict")
        if not self.enabled:
            return {}
        return {
            "scale": float(np.asarray(state.scale)),
            "growth_factor": float(state.growth_factor),
            "backoff_factor": float(state.backoff_factor),
            "growth_interval": int(state.growth_interval),
            "_growth_tracker": int(np.asarray(state.growth_tracker)),
        }

    def load_state_dict(self, state_dict: Mapping[str, object]) -> GradScalerState:
        """A state from a dict saved by [`state_dict`][jamp.GradScaler.state_dict] or by PyTorch.

        The dict's growth/backoff configuration is carried in the returned
        state. When disabled, returns [`init`][jamp.GradScaler.init]'s state, as PyTorch ignores
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
        if state_dict["_growth_tracker"] is None:  # check_config reads None as "not given"
            raise TypeError(
                "Expected state_dict['_growth_tracker'] to be an integer >= 0, got None "
                "instead; a dict saved by PyTorch or by GradScaler.state_dict holds the count."
            )
        scale_value = state_dict["scale"]
        if is_real_number(scale_value) and not (
            isinstance(scale_value, int) or math.isfinite(scale_value) and float(scale_value) > 0
        ):
            raise ValueError(
                f"Expected state_dict['scale'] to be positive and finite, got {scale_value!r:.60} "
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
            names={
                "growth_tracker": "state_dict['_growth_tracker']",
                **{k: f"state_dict['{k}']" for k in _TORCH_KEYS[1:4]},
            },
        )
        return as_grad_scaler_state(ls.from_config(ls.DYNAMIC, config))
