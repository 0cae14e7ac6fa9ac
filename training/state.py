"""The train state (parameters, statistics, optimizer state, moving
average) and its update; `training/run_state.py` creates it."""

from typing import Any

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import optax



@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State
  model_state: nnx.State  # BatchNorm statistics and other non-parameters
  opt_state: Any
  # Non-finite steps in a row just before this one (see
  # nonfinite.guard_nonfinite).
  nonfinite_streak: jax.Array
  loss_scale: Any = None  # Flax's DynamicScale for float16, else None
  # {'params': ..., 'model_state': ...}: the weights' moving average, when
  # config.ema_decay > 0 (see `update_ema`), else None.
  ema: Any = None
  # The frozen teacher's variables (`training/teacher.py`) when the run
  # distils, else None: an input of the step that no update touches, never
  # saved in checkpoints.
  teacher: Any = None


def update_ema(ema: dict, params, model_state, decay: float) -> dict:
  """timm's ModelEma step: decay x ema + (1 - decay) x the new weights,
  floating-point arrays only (any other is taken as it is)."""
  def average(old, new):
    if not jnp.issubdtype(new.dtype, jnp.floating):
      return new
    return decay * old + (1.0 - decay) * new
  return jax.tree.map(average, ema,
                      {'params': params, 'model_state': model_state})


def apply_update(state, grads, model_state, loss_scale, tx,
                 ema_decay: float):
  """The state after the optimizer's update with `grads`, one step on, its
  moving average (if any) updated from the new weights."""
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  ema = state.ema
  if ema is not None:
    ema = update_ema(ema, params, model_state, ema_decay)
  return state.replace(step=state.step + 1, params=params,
                       model_state=model_state, opt_state=opt_state,
                       loss_scale=loss_scale, ema=ema)


def restart_ema(state: TrainState) -> TrainState:
  """`state` with its moving average (if any) set to its weights, in new
  buffers placed as the weights (after other weights were loaded)."""
  if state.ema is None:
    return state
  return state.replace(ema=jax.tree.map(
      lambda x: jax.device_put(x, x.sharding, may_alias=False),
      {'params': state.params, 'model_state': state.model_state}))
