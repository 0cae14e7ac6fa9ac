"""The training loop: mesh, state, compiled steps, CLU logging, checkpoints.

The model lives as an NNX graph definition plus pure state (parameters,
BatchNorm statistics, optimizer state); `train_step` and `eval_step` are pure
functions of that state, compiled once each with explicit shardings.
"""

import contextlib
import functools
import itertools
import time
from typing import Any

from absl import logging
import flax
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_collections
import optax

import checkpointing
import input_pipeline
import mixed_precision
import models
import throughput


class ConfigError(ValueError):
  """A config value the trainer cannot run with; the message names the fix."""


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State
  model_state: nnx.State  # BatchNorm statistics and other non-parameters
  opt_state: Any
  loss_scale: Any = None  # a DynamicLossScale for float16, else None


OPTIMIZERS = ('sgd', 'adamw')


def create_optimizer(config, learning_rate_fn) -> optax.GradientTransformation:
  """`config.optimizer` with weight decay on kernels and optional clipping."""
  def decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, 'key', None) == 'kernel' for k in path),
        params)

  if config.optimizer == 'sgd':
    optimizer = optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
        optax.sgd(learning_rate_fn, momentum=0.9, nesterov=True))
  elif config.optimizer == 'adamw':
    optimizer = optax.adamw(learning_rate_fn, weight_decay=config.weight_decay,
                            mask=decay_mask)
  else:
    raise ValueError(f'unknown optimizer {config.optimizer!r}; valid names: '
                     f'{", ".join(OPTIMIZERS)}')
  if config.grad_clip_norm > 0:
    optimizer = optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm), optimizer)
  return optimizer


def learning_rate_schedule(config, num_steps: int, steps_per_epoch: int):
  """Linear warmup from 0, then cosine decay to 0 at `num_steps`."""
  warmup_steps = min(int(config.warmup_epochs * steps_per_epoch), num_steps)
  return optax.join_schedules([
      optax.linear_schedule(0.0, config.learning_rate, warmup_steps),
      optax.cosine_decay_schedule(config.learning_rate,
                                  max(num_steps - warmup_steps, 1)),
  ], boundaries=[warmup_steps])


def num_train_steps(config, info: input_pipeline.DatasetInfo) -> int:
  if config.num_train_steps > 0:
    return config.num_train_steps
  return int(config.num_epochs * steps_per_epoch(config, info))


def steps_per_epoch(config, info: input_pipeline.DatasetInfo) -> int:
  return max(info.num_train_examples // config.batch_size, 1)


def validate_config(config) -> None:
  """Raises ConfigError, naming the fix, for values no run can use."""
  checks = [
      (config.batch_size > 0, 'batch_size must be positive'),
      (config.batch_size % jax.device_count() == 0,
       f'batch_size {config.batch_size} is not divisible by the '
       f'{jax.device_count()} devices; use a multiple of '
       f'{jax.device_count()}'),
      (config.num_train_steps > 0 or
       (config.num_train_steps == -1 and config.num_epochs > 0),
       'set num_train_steps > 0, or num_train_steps=-1 with num_epochs > 0'),
      (config.learning_rate > 0, 'learning_rate must be positive'),
      (config.log_every_steps > 0 and config.eval_every_steps > 0 and
       config.checkpoint_every_steps > 0,
       'log_every_steps, eval_every_steps and checkpoint_every_steps must be '
       'positive'),
      (config.keep_checkpoints > 0, 'keep_checkpoints must be positive'),
      (config.scan_unroll >= 1, 'scan_unroll must be >= 1 (layers per loop '
       'iteration)'),
  ]
  for ok, message in checks:
    if not ok:
      raise ConfigError(message)
  with _as_config_error():
    models.remat_policy_by_name(config.remat_policy)
    create_optimizer(config, 0.0)
    nnx.eval_shape(lambda: models.create_model(
        config, 10, 3, rngs=nnx.Rngs(0)))


@contextlib.contextmanager
def _as_config_error():
  """The factories' ValueErrors for unknown names, as ConfigErrors."""
  try:
    yield
  except ValueError as e:
    raise ConfigError(str(e)) from None


def create_train_state(config, info, learning_rate_fn):
  """The model's graph definition, the initial TrainState and optimizer."""
  model = models.create_model(config, info.num_classes, info.image_shape[-1],
                              rngs=nnx.Rngs(config.seed))
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  tx = create_optimizer(config, learning_rate_fn)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                     model_state=model_state, opt_state=tx.init(params),
                     loss_scale=mixed_precision.create_loss_scale(config))
  return graphdef, state, tx


def cross_entropy(logits, labels, label_smoothing=0.0):
  targets = optax.smooth_labels(
      jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  return optax.softmax_cross_entropy(logits, targets)


def train_step(state: TrainState, batch, *, graphdef, tx, learning_rate_fn,
               label_smoothing: float, dropout_seed: int):
  """One optimizer update; returns the new state and scalar metrics."""
  dropout_key = jax.random.fold_in(jax.random.key(dropout_seed), state.step)

  def loss_fn(params):
    model = nnx.merge(graphdef, params, state.model_state, copy=True)
    logits = model(batch['image'], train=True, dropout_key=dropout_key)
    loss = jnp.mean(cross_entropy(logits, batch['label'], label_smoothing))
    return (mixed_precision.scale_loss(state.loss_scale, loss),
            (logits, nnx.state(model, nnx.Not(nnx.Param))))

  (loss, (logits, model_state)), grads = jax.value_and_grad(
      loss_fn, has_aux=True)(state.params)
  loss, grads, grads_finite = mixed_precision.unscale(state.loss_scale, loss,
                                                      grads)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {
      'loss': loss,
      'accuracy': jnp.mean(jnp.argmax(logits, -1) == batch['label']),
      'learning_rate': learning_rate_fn(state.step),
      'grad_norm': optax.global_norm(grads),
  }
  if state.loss_scale is not None:
    metrics['loss_scale'] = state.loss_scale.scale
  new_state = state.replace(step=state.step + 1, params=params,
                            model_state=model_state, opt_state=opt_state)
  new_state = mixed_precision.skip_nonfinite(grads_finite, new_state, state)
  return new_state, metrics


def eval_step(state: TrainState, batch, *, graphdef):
  """Sums of loss and correct predictions over the unmasked examples."""
  model = nnx.merge(graphdef, state.params, state.model_state)
  logits = model(batch['image'], train=False)
  mask = batch['mask'].astype(jnp.float32)
  return {
      'loss': jnp.sum(cross_entropy(logits, batch['label']) * mask),
      'correct': jnp.sum((jnp.argmax(logits, -1) == batch['label']) * mask),
      'examples': jnp.sum(mask),
  }


def create_mesh(config) -> jax.sharding.Mesh:
  """A 1-D mesh over every device of every process: the data axis."""
  del config
  return jax.make_mesh((jax.device_count(),), ('data',))


def compile_step(step_fn, state_sharding, batch_sharding, state, batch,
                 donate_state: bool):
  """AOT-compiles `step_fn(state, batch)`; returns it and compile seconds."""
  start = time.perf_counter()
  compiled = jax.jit(
      step_fn, in_shardings=(state_sharding, batch_sharding),
      out_shardings=(state_sharding if donate_state else None),
      donate_argnums=(0,) if donate_state else ()).lower(state, batch).compile()
  return compiled, time.perf_counter() - start


def true_step_flops(config, info, step_kwargs, state, batch) -> float:
  """FLOPs of one train step, every layer counted.

  XLA's cost analysis counts a rolled scan's body once, so the step is
  lowered again with the stacks as a Python loop (same parameter layout)
  and without remat, whose recomputation is not model work.
  """
  unrolled = ml_collections.ConfigDict(config.to_dict())
  unrolled.scan_layers = False
  unrolled.remat_policy = 'none'
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: models.create_model(
      unrolled, info.num_classes, info.image_shape[-1], rngs=nnx.Rngs(0))))
  step = functools.partial(train_step, **{**step_kwargs, 'graphdef': graphdef})
  return float(jax.jit(step).lower(state, batch).cost_analysis()['flops'])


def _flat_hparams(config) -> dict:
  flat = {}
  for key, value in config.items():
    flat[key] = value if isinstance(value, (int, float, str, bool)) else str(
        value)
  return flat


def evaluate(eval_step_fn, state, dataset, config, batch_sharding, dtype):
  """Loss and accuracy over the held-out split (or `steps_per_eval` batches)."""
  batches = dataset.eval_batches(config.batch_size, batch_sharding, dtype)
  if config.steps_per_eval > 0:
    batches = itertools.islice(batches, config.steps_per_eval)
  totals = None
  for batch in input_pipeline.prefetch(batches):
    sums = eval_step_fn(state, batch)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  totals = jax.device_get(totals)
  examples = max(float(totals['examples']), 1.0)
  return {'eval_loss': totals['loss'] / examples,
          'eval_accuracy': totals['correct'] / examples,
          'eval_examples': totals['examples']}


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str) -> TrainState:
  """Trains `config` in `workdir`, resuming from its latest checkpoint."""
  # CLU (and TensorFlow under it) only here: models and the compiled steps
  # import without them, e.g. on a machine that runs benchmarks only.
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  from clu import periodic_actions  # pylint: disable=g-import-not-at-top
  validate_config(config)
  with _as_config_error():
    dataset = input_pipeline.create_dataset(config)
  info = dataset.info
  num_steps = num_train_steps(config, info)
  learning_rate_fn = learning_rate_schedule(
      config, num_steps, steps_per_epoch(config, info))

  mesh = create_mesh(config)
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P('data'))
  dtype = mixed_precision.compute_dtype(config)

  graphdef, state, tx = create_train_state(config, info, learning_rate_fn)
  state = jax.device_put(state, replicated)
  manager = checkpointing.create_manager(workdir, config.keep_checkpoints)
  state = checkpointing.restore_latest(manager, state)
  start_step = int(state.step)

  writer = metric_writers.create_default_writer(
      workdir, just_logging=jax.process_index() > 0)
  if start_step == 0:
    writer.write_hparams(_flat_hparams(config))
  logging.info('Starting at step %d of %d.', start_step, num_steps)

  train_iter = input_pipeline.prefetch(dataset.train_batches(
      config.batch_size, config.seed, start_step, batch_sharding, dtype))
  first_batch = next(train_iter)
  train_iter = itertools.chain([first_batch], train_iter)
  step_kwargs = dict(graphdef=graphdef, tx=tx,
                     learning_rate_fn=learning_rate_fn,
                     label_smoothing=config.label_smoothing,
                     dropout_seed=config.seed + 1)
  compiled_train_step, compile_seconds = compile_step(
      functools.partial(train_step, **step_kwargs), replicated,
      batch_sharding, state, first_batch, donate_state=True)
  eval_batch = next(dataset.eval_batches(config.batch_size, batch_sharding,
                                         dtype))
  compiled_eval_step, _ = compile_step(
      functools.partial(eval_step, graphdef=graphdef), replicated,
      batch_sharding, state, eval_batch, donate_state=False)
  memory = compiled_train_step.memory_analysis()
  step_flops = true_step_flops(config, info, step_kwargs, state, first_batch)
  writer.write_scalars(start_step, {
      'compile_seconds': compile_seconds,
      'memory_temp_bytes': memory.temp_size_in_bytes,
      'memory_argument_bytes': memory.argument_size_in_bytes,
      'memory_output_bytes': memory.output_size_in_bytes,
      'step_flops': step_flops,
  })

  hooks = [periodic_actions.ReportProgress(num_train_steps=num_steps)]
  if config.profile and jax.process_index() == 0:
    hooks.append(periodic_actions.Profile(logdir=workdir, num_profile_steps=5))
  train_metrics = []
  last_log = (start_step, time.perf_counter())
  excluded_seconds = 0.0  # evaluation and saving, kept out of steps/s
  for step in range(start_step + 1, num_steps + 1):
    with jax.profiler.StepTraceAnnotation('train', step_num=step):
      state, metrics = compiled_train_step(state, next(train_iter))
    train_metrics.append(metrics)
    for hook in hooks:
      hook(step)
    last_step = step == num_steps
    if step % config.log_every_steps == 0 or last_step:
      summary = jax.tree.map(lambda *x: jnp.mean(jnp.stack(x)), *train_metrics)
      summary = {f'train_{k}': v for k, v in jax.device_get(summary).items()}
      now = time.perf_counter()
      summary['steps_per_second'] = (step - last_log[0]) / (
          now - last_log[1] - excluded_seconds)
      summary.update(throughput.throughput_metrics(
          summary['steps_per_second'], config.batch_size, step_flops,
          jax.devices()))
      writer.write_scalars(step, summary)
      train_metrics, last_log, excluded_seconds = [], (step, now), 0.0
    pause_start = time.perf_counter()
    if step % config.eval_every_steps == 0 or last_step:
      writer.write_scalars(step, evaluate(
          compiled_eval_step, state, dataset, config, batch_sharding, dtype))
    if step % config.checkpoint_every_steps == 0 or last_step:
      checkpointing.save(manager, step, state)
    excluded_seconds += time.perf_counter() - pause_start
  manager.wait_until_finished()
  writer.flush()
  return state
