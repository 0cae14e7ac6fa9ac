"""A run's state, built in one place: the model, its train state (optimizer
state, moving average), the frozen teacher, their shardings on the mesh,
and the checkpoint or `init_from` weights it holds.

Training (`train.py`), `--mode=eval` (`eval_checkpoint.py`),
predict.py and export.py all build it with `create`, then restore a
checkpoint onto it: training its workdir's newest readable one
(`restore_latest`, which sets damaged ones aside), the others one
checkpoint as it is (`restore_checkpoint`, which moves nothing). The
commands that read a finished run take its config from the checkpoint
(`trained_config`); `--mode=eval` lets the command line change only what
is evaluated (`evaluated_config`).
"""

import dataclasses
import json
from typing import Any

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
import ml_collections
import numpy as np
import optax

import input_pipeline
import models
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from runtime import config_error
from runtime import mixed_precision
from runtime import network_keys
from runtime import paths
from runtime import sharding
from training import config_compatibility
from training import layer_decay
from training import optimizer
from training import state as train_state
from training import teacher as teacher_lib
from training import trainable as trainable_lib
from weights import fitting
from weights import pretrained

# The keys a `--mode=eval` command line may change: what is evaluated and
# how, on this machine. Every other key is the checkpoint's.
EVALUATION_KEYS = ('dataset', 'data_dir', 'train_split', 'eval_split',
                   'evals', 'batch_size', 'mesh', 'step_mode',
                   'restore_retry_seconds', 'teacher_init_from',
                   'scan_unroll', 'remat_policy')


@dataclasses.dataclass
class RunState:
  """A run's model and state, placed on its mesh."""
  graphdef: Any  # nnx.GraphDef of the model
  state: train_state.TrainState  # with the teacher's variables, if any
  sharding: Any  # the NamedShardings of `state`
  tx: optax.GradientTransformation
  teacher: teacher_lib.Teacher | None
  dtype: Any  # the compute dtype of the model and the teacher
  step: int | None = None  # the restored checkpoint's step; None: fresh
  saved_config: dict | None = None  # that checkpoint's config
  from_init_from: bool = False  # whether its weights are config.init_from's

  @property
  def teacher_graphdef(self):
    return self.teacher and self.teacher.graphdef

  @property
  def teacher_fingerprint(self) -> dict | None:
    return self.teacher and self.teacher.fingerprint

  def model(self) -> nnx.Module:
    """The student model with the state's weights."""
    return nnx.merge(self.graphdef, self.state.params, self.state.model_state)


def eval_logits(graphdef, state, images):
  """The logits of the model `nnx.split` made (`graphdef`, `state`) on
  `images`, in evaluation mode: the one forward pass of a trained model
  that predict.py and every export format run (a function of arrays, which
  `jax.jit`, `jax.export` and jax2tf trace alike)."""
  return nnx.merge(graphdef, state)(images, train=False)


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
    trainable_lib.check(params, config.trainable)
    made_by_init['tx'] = optimizer.create_optimizer(
        config, learning_rate_fn, layer_decay.layer_depths(model))
    return train_state.TrainState(
        step=jnp.zeros((), jnp.int32), params=params,
        model_state=model_state, opt_state=made_by_init['tx'].init(params),
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


def create(config, info: input_pipeline.DatasetInfo, mesh: Mesh,
           workdir: str, learning_rate_fn=optax.constant_schedule(0.0), *,
           dtype, new_head: bool = True, with_teacher: bool = True,
           abstract: bool = False, abstract_teacher: bool = False
           ) -> RunState:
  """The state a run of `config` in `workdir` starts from on `mesh`,
  computing in `dtype`, created in place: with the weights of
  `config.init_from` when `workdir` holds no checkpoint
  (`pretrained.initialize`; with `new_head`, a head of other classes
  starts from zeros), and the frozen teacher of `config.teacher_model`
  (`with_teacher`). With `abstract`, the student's
  arrays are shapes and shardings alone, for `restore_checkpoint` to fill;
  with `abstract_teacher` the teacher's too, no file read (for compiling).
  Every mistake is a ConfigError naming the fix."""
  with config_error.as_config_error():  # the model's own checks, as built
    graphdef, fresh, state_sharding, tx = (
        create_sharded_train_state(config, info, learning_rate_fn, mesh,
                                   dtype=dtype, abstract=abstract))
    state = (fresh if abstract else pretrained.initialize(
        fresh, workdir, config.restore_retry_seconds, new_head=new_head,
        **init_weights(config)))
    from_init_from = state is not fresh
    if from_init_from:
      # The moving average starts from the weights the run starts from.
      state = train_state.restart_ema(state)
    teacher = (teacher_lib.create_teacher(
        config.teacher_model, config.teacher_init_from,
        config.teacher_init_format, models.options(config), info, mesh,
        dtype=dtype, seed=config.seed, abstract=abstract_teacher)
               if with_teacher else None)
  if config.trainable and not abstract:  # what training will change
    logging.info(trainable_lib.describe(state.params, config.trainable))
  if config.layer_decay != 1 and not abstract:
    logging.info(layer_decay.describe(
        layer_decay.layer_depths(nnx.merge(graphdef, state.params,
                                           state.model_state)),
        config.layer_decay))
  if teacher is not None:
    state = state.replace(teacher=teacher.state)
    state_sharding = state_sharding.replace(teacher=teacher.sharding)
  return RunState(graphdef, state, state_sharding, tx, teacher, dtype,
                  from_init_from=from_init_from)


def restore_latest(run: RunState, manager, config, class_names,
                   **storage_retries) -> RunState:
  """`run` resumed from the newest readable checkpoint of `manager`
  (`checkpointing.restore_latest`), if any, after refusing one of another
  model, other classes or another teacher. When none could be restored
  (every one set aside as damaged), a run of `config.init_from` starts
  from those weights, as it did before its first checkpoint."""
  with config_error.as_config_error():
    restored = checkpointing.restore_latest(
        manager, run.state, compatibility.as_json(config), class_names,
        check_config=config_check(config), **storage_retries)
  run = _restored(run, restored)
  if run.step is None and config.init_from and not run.from_init_from:
    with config_error.as_config_error():
      state = pretrained.with_init_from(run.state, **init_weights(config))
    run = dataclasses.replace(run, state=train_state.restart_ema(state),
                              from_init_from=True)
  return run


def config_check(config):
  """The check a restore makes of a checkpoint's saved config against
  `config`'s (`config_compatibility.check_compatible`)."""
  new = compatibility.as_json(config)
  return lambda saved, step: config_compatibility.check_compatible(
      saved, new, step)


def init_weights(config) -> dict:
  """The weights a run of `config` starts from, as `pretrained.initialize`
  takes them: `init_from`, `init_format` and the model's `settings`."""
  return {'init_from': config.init_from, 'init_format': config.init_format,
          'settings': models.settings(config)}


def restore_checkpoint(run: RunState, step_dir: str, config,
                       class_names=None, *, ema: bool = False) -> RunState:
  """`run` with the weights of the checkpoint in `step_dir` alone, or with
  `ema` that checkpoint's moving average as its weights (`weights_alone`);
  only those are read, and nothing is written or moved."""
  if ema and run.state.ema is None:
    raise config_error.ConfigError(
        f'checkpoint {step_dir!r} holds no moving average of the weights '
        '(trained with ema_decay 0); drop the EMA option')
  with config_error.as_config_error():
    restored = checkpointing.restore_checkpoint(
        step_dir, run.state, compatibility.as_json(config), class_names,
        check_config=config_check(config),
        unread=(('params', 'model_state') if ema else ('ema',)) +
        _NOT_WEIGHTS)
  return weights_alone(_restored(run, restored), ema)


# The parts of a train state that only training reads.
_NOT_WEIGHTS = ('opt_state',)


def weights_alone(run: RunState, ema: bool = False) -> RunState:
  """`run` with its weights, or with `ema` their moving average, as its
  only weights: no moving average beside them, no optimizer state."""
  state = run.state.replace(**run.state.ema) if ema else run.state
  dropped = dict.fromkeys(('ema', *_NOT_WEIGHTS))
  return dataclasses.replace(run, state=state.replace(**dropped),
                             sharding=run.sharding.replace(**dropped))


def _restored(run: RunState, restored: checkpointing.Restored) -> RunState:
  teacher_lib.check_same_teacher(restored.saved_config,
                                 run.teacher_fingerprint,
                                 int(restored.state.step))
  return dataclasses.replace(run, state=restored.state, step=restored.step,
                             saved_config=restored.saved_config)


def trained_config(step_dir: str, defaults: ml_collections.ConfigDict
                   ) -> ml_collections.ConfigDict:
  """The config saved with the checkpoint in `step_dir`; keys it predates
  take their values in `defaults`."""
  saved = checkpointing.saved_config(step_dir)
  if saved is None:
    raise config_error.ConfigError(
        f'checkpoint {step_dir!r} has no saved config; pass a checkpoint '
        'this trainer wrote')
  saved.pop(compatibility.TEACHER_FILE_KEY, None)
  return ml_collections.ConfigDict({**defaults.to_dict(), **saved})


def evaluated_config(config, overridden: set, step_dir: str
                     ) -> ml_collections.ConfigDict:
  """The config `--mode=eval` evaluates the checkpoint in `step_dir` with:
  the one it was trained with, and of the command line's `config` the
  EVALUATION_KEYS in `overridden` (the keys the command sets) and its
  evaluators, if it has any (a config file's, e.g. `:real_v2,fewshot`).
  Another model's key is refused; any other key is the checkpoint's
  (logged)."""
  evaluated = trained_config(step_dir, config)
  step = int(paths.path(step_dir).name)
  for key in sorted(set(overridden) | ({'evals'} if config.evals else set())):
    if key in EVALUATION_KEYS:
      evaluated[key] = config[key]
    elif _same(config[key], evaluated[key]):
      continue
    elif key in _evaluated_model_keys(evaluated) and not (
        network_keys.same_network(key, config[key], evaluated[key])):
      raise config_error.ConfigError(
          f'--config.{key}={config[key]}: the checkpoint at step {step} was '
          f'trained with {key}={evaluated[key]!r}, and --mode=eval '
          'evaluates the model as trained; drop the override (or evaluate '
          'another --workdir)')
    else:
      logging.warning('--config.%s is not used by --mode=eval: the '
                      'checkpoint at step %d was trained with %s=%r.', key,
                      step, key, evaluated[key])
  return evaluated


def _evaluated_model_keys(evaluated) -> tuple[str, ...]:
  """The keys whose value on an eval command line names another model
  than the one trained: those that define its network, which weights
  (`ema_decay`) and which teacher."""
  return (*network_keys.network_keys(models.family(evaluated.model)),
          'teacher_model', 'ema_decay')


def _same(a, b) -> bool:
  """Whether two config values are equal as saved (tuples as lists)."""
  as_json = lambda value: json.loads(
      ml_collections.ConfigDict({'value': value}).to_json())
  return as_json(a) == as_json(b)


def load_trained(workdir: str, defaults: ml_collections.ConfigDict,
                 ema: bool = False) -> tuple[ml_collections.ConfigDict,
                                             RunState]:
  """The config and the state (on this process's first device, no teacher)
  of the newest checkpoint in `workdir`, as it was trained, with its
  weights or (`ema`) their moving average; keys the checkpoint's config
  predates take their values in `defaults`. No data set is opened."""
  step_dir = checkpointing.checkpoint_dir(workdir)
  if step_dir is None:
    raise config_error.ConfigError(
        f'no checkpoint in {workdir!r}; pass the --workdir of a run that '
        'saved one')
  config = trained_config(step_dir, defaults)
  shapes = checkpointing.saved_param_shapes(step_dir)
  info = input_pipeline.DatasetInfo(
      num_classes=shapes['head.bias'][0],
      image_shape=(config.image_size, config.image_size,
                   fitting.image_channels(shapes)),
      num_train_examples=0, num_eval_examples=0)
  mesh = Mesh(np.array(jax.local_devices()[:1]).reshape(1, 1),
              sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 2)
  # The finished run's config is read here: its compute dtype too.
  run = create(config, info, mesh, workdir,
               dtype=models.compute_dtype(config),
               with_teacher=False, abstract=True)
  return config, restore_checkpoint(run, step_dir, config, ema=ema)
