"""The train state (parameters, statistics, optimizer state) and its
creation, in place on the mesh."""

from typing import Any

import flax
from flax import nnx
import jax
import jax.numpy as jnp
import optax

import models
from runtime import sharding
from runtime import mixed_precision
from training import layer_decay
from training import optimizer
from training import trainable


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


def create_train_state(config, info, learning_rate_fn, *, dtype):
  """The model's graph definition, the initial TrainState and optimizer;
  the model computes in `dtype`.

  The state comes from one compiled program: run op by op, every
  initializer of every shape would compile a program of its own (dozens,
  seconds on a CPU). A `config.trainable` that matches no parameter is a
  ValueError."""
  # What tracing `init` makes besides arrays: the graph, the optimizer.
  made_by_init = {}

  def init():
    model = models.create_model(config.model, info.num_classes,
                                info.image_shape[-1],
                                dtype=dtype, rngs=nnx.Rngs(config.seed),
                                **models.options(config))
    made_by_init['graphdef'], params, model_state = nnx.split(
        model, nnx.Param, ...)
    trainable.check(params, config.trainable)
    made_by_init['tx'] = optimizer.create_optimizer(
        config, learning_rate_fn, layer_decay.layer_depths(model))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      model_state=model_state,
                      opt_state=made_by_init['tx'].init(params),
                      nonfinite_streak=jnp.zeros((), jnp.int32),
                      loss_scale=mixed_precision.create_loss_scale(dtype),
                      ema=({'params': params, 'model_state': model_state}
                           if config.ema_decay > 0 else None))

  state = jax.jit(init)()
  return made_by_init['graphdef'], state, made_by_init['tx']


def create_sharded_train_state(config, info, learning_rate_fn, mesh, *,
                               dtype, abstract: bool = False):
  """`create_train_state` compiled, so that every array is created in
  place with its sharding: no device ever holds a whole FSDP model. With
  `abstract`, no array is made: the state holds each one's shape, dtype and
  sharding (jax.ShapeDtypeStruct), for a checkpoint to fill.

  Returns the graph definition, the state, its shardings and the optimizer.
  """
  made_by_init = {}

  def init():
    made_by_init['graphdef'], state, made_by_init['tx'] = create_train_state(
        config, info, learning_rate_fn, dtype=dtype)
    return state

  shapes = jax.eval_shape(init)
  state_sharding = sharding.state_shardings(shapes, mesh)
  if abstract:
    state = jax.tree.map(
        lambda shape, placed: jax.ShapeDtypeStruct(
            shape.shape, shape.dtype, sharding=placed), shapes, state_sharding)
  else:
    state = jax.jit(init, out_shardings=state_sharding)()
  return made_by_init['graphdef'], state, state_sharding, made_by_init['tx']
