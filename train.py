"""The training loop: mesh, state, compiled steps, CLU logging, checkpoints.

The model lives as an NNX graph definition plus pure state (parameters,
BatchNorm statistics, optimizer state); `train_step` and `eval_step` are pure
functions of that state, compiled once each with explicit shardings.
"""

import contextlib
import dataclasses
import functools
import itertools
import time
from typing import Any, Callable

from absl import logging
import flax
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections
import optax

from training import accumulation
from runtime import checkpointing
from training import config_checks
from data import datasets
import input_pipeline
from training import intermediate_grads
from training import mixed_precision
import models
from runtime import paths
from runtime import preemption
from weights import pretrained
from runtime import sharding
from training import throughput


class ConfigError(ValueError):
  """A config value the trainer cannot run with; the message names the fix."""


class NonFiniteError(RuntimeError):
  """Training produced non-finite values; the message names the step and the
  last good checkpoint."""


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State
  model_state: nnx.State  # BatchNorm statistics and other non-parameters
  opt_state: Any
  # Non-finite steps in a row just before this one (see guard_nonfinite).
  nonfinite_streak: jax.Array
  loss_scale: Any = None  # Flax's DynamicScale for float16, else None


OPTIMIZERS = ('sgd', 'adamw')
STEP_MODES = ('jit', 'pmap')
# The pmap axis: every device, as the mesh's two axes are under jit.
PMAP_AXIS = 'devices'


def peak_learning_rate(config) -> float:
  """The learning rate after warmup: `learning_rate` x batch_size /
  learning_rate_base_batch_size (the linear scaling rule), or
  `learning_rate` itself when learning_rate_base_batch_size is 0."""
  if config.learning_rate_base_batch_size > 0:
    return (config.learning_rate * config.batch_size /
            config.learning_rate_base_batch_size)
  return config.learning_rate


def create_optimizer(config, learning_rate_fn) -> optax.GradientTransformation:
  """`config.optimizer` with weight decay on kernels and optional clipping.

  sgd: the Flax ImageNet example's update: L2 decay (weight_decay x kernel
  added to the gradient, the gradient of 0.5 x weight_decay x |kernel|^2 in
  the loss), then Nesterov momentum 0.9.
  adamw: big_vision's: weight decay decoupled from the learning rate,
  update = -(lr(t) x adam + lr(t) / peak x weight_decay x kernel), so the
  decay follows the schedule's shape but not `learning_rate` itself.
  """
  def decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, 'key', None) == 'kernel' for k in path),
        params)

  if config.optimizer == 'sgd':
    optimizer = optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
        optax.sgd(learning_rate_fn, momentum=0.9, nesterov=True))
  elif config.optimizer == 'adamw':
    optimizer = optax.chain(
        optax.scale_by_adam(),
        optax.add_decayed_weights(
            config.weight_decay / peak_learning_rate(config), mask=decay_mask),
        optax.scale_by_learning_rate(learning_rate_fn))
  else:
    raise ValueError(f'unknown optimizer {config.optimizer!r}; valid names: '
                     f'{", ".join(OPTIMIZERS)}')
  if config.grad_clip_norm > 0:
    optimizer = optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm), optimizer)
  return optimizer


def warmup_steps(config, steps_per_epoch: int) -> int:
  """`warmup_steps`, or `warmup_epochs` in steps when it is -1."""
  if config.warmup_steps >= 0:
    return config.warmup_steps
  return int(config.warmup_epochs * steps_per_epoch)


def learning_rate_schedule(config, num_steps: int, steps_per_epoch: int):
  """Linear warmup from 0 to the peak learning rate, then cosine decay to 0
  at `num_steps`."""
  peak = peak_learning_rate(config)
  warmup = min(warmup_steps(config, steps_per_epoch), num_steps)
  return optax.join_schedules([
      optax.linear_schedule(0.0, peak, warmup),
      optax.cosine_decay_schedule(peak, max(num_steps - warmup, 1)),
  ], boundaries=[warmup])


def num_train_steps(config, info: input_pipeline.DatasetInfo) -> int:
  if config.num_train_steps > 0:
    return config.num_train_steps
  return int(config.num_epochs * steps_per_epoch(config, info))


def steps_per_epoch(config, info: input_pipeline.DatasetInfo) -> int:
  """Whole global batches in the training split (the rest is dropped)."""
  try:
    return input_pipeline.steps_per_epoch(info.num_train_examples,
                                          config.batch_size)
  except ValueError as e:
    raise ConfigError(f'{config.dataset}: {e}') from None


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
      (config.learning_rate_base_batch_size >= 0,
       'learning_rate_base_batch_size must be >= 0 (0: learning_rate is not '
       'scaled by the batch size)'),
      (config.warmup_epochs >= 0, 'warmup_epochs must be >= 0'),
      (config.warmup_steps >= -1, 'warmup_steps must be >= 0, or -1 to take '
       'the warmup from warmup_epochs'),
      (config.weight_decay >= 0, 'weight_decay must be >= 0 (0: off)'),
      (config.grad_clip_norm >= 0, 'grad_clip_norm must be >= 0 (0: off)'),
      (0 <= config.label_smoothing < 1,
       f'label_smoothing {config.label_smoothing} must be in [0, 1)'),
      (0 <= config.dropout_rate < 1,
       f'dropout_rate {config.dropout_rate} must be in [0, 1)'),
      (config.mixup_alpha >= 0, 'mixup_alpha must be >= 0 (0: off)'),
      (config.randaug_num_layers >= 0,
       'randaug_num_layers must be >= 0 (0: off)'),
      (config.randaug_magnitude >= 0, 'randaug_magnitude must be >= 0'),
      (config.log_every_steps > 0 and config.eval_every_steps > 0 and
       config.checkpoint_every_steps > 0,
       'log_every_steps, eval_every_steps and checkpoint_every_steps must be '
       'positive'),
      (config.keep_checkpoints > 0, 'keep_checkpoints must be positive'),
      (config.scan_unroll >= 1, 'scan_unroll must be >= 1 (layers per loop '
       'iteration)'),
      (config.skip_nonfinite_steps >= 0, 'skip_nonfinite_steps must be >= 0 '
       '(non-finite steps to skip in a row; 0 = stop at the first)'),
      (config.intermediate_grads_every_steps >= 0,
       'intermediate_grads_every_steps must be >= 0 (0 = off)'),
      (config.profile_delay_steps >= 1 and config.profile_num_steps >= 1,
       'profile_delay_steps and profile_num_steps must be >= 1'),
  ]
  for ok, message in checks:
    if not ok:
      raise ConfigError(message)
  check_grad_accum_steps(config.grad_accum_steps, config.batch_size)
  if config.step_mode not in STEP_MODES:
    raise ConfigError(f'unknown step_mode {config.step_mode!r}; valid names: '
                      f'{", ".join(STEP_MODES)}')
  with _as_config_error():
    mesh_shape = sharding.mesh_shape(config.mesh, jax.device_count(),
                                     sharding.num_slices())
  if config.step_mode == 'pmap' and mesh_shape[1] != 1:
    raise ConfigError("step_mode 'pmap' replicates the parameters; set "
                      "--config.mesh.fsdp=1 or use step_mode 'jit' for FSDP")
  with _as_config_error():
    models.remat_policy_by_name(config.remat_policy)
    input_pipeline.check_preprocessing(config)
    mixed_precision.compute_dtype(config)
    create_optimizer(config, 0.0)


def check_grad_accum_steps(k: int, batch_size: int) -> None:
  """Raises ConfigError unless k micro-batches split every process's rows
  of the global batch evenly and give every device the same whole number
  of examples of each micro-batch."""
  devices = jax.device_count()
  per_device = batch_size // devices
  fix = (f'use a divisor of {per_device} (batch_size {batch_size} / '
         f'{devices} devices), e.g. --config.grad_accum_steps=1 (off)')
  if k < 1:
    raise ConfigError(f'grad_accum_steps {k} must be >= 1; {fix}')
  process_batch = batch_size // jax.process_count()
  if process_batch % k:
    raise ConfigError(
        f'grad_accum_steps {k} does not divide the {process_batch} examples '
        f'each process loads per step; {fix}')
  if per_device % k:
    raise ConfigError(
        f'grad_accum_steps {k} makes micro-batches of {batch_size / k:g} '
        f'examples, which do not split evenly over the {devices} devices; '
        f'{fix}')


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
                              dtype=mixed_precision.compute_dtype(config),
                              rngs=nnx.Rngs(config.seed))
  graphdef, params, model_state = nnx.split(model, nnx.Param, ...)
  tx = create_optimizer(config, learning_rate_fn)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                     model_state=model_state, opt_state=tx.init(params),
                     nonfinite_streak=jnp.zeros((), jnp.int32),
                     loss_scale=mixed_precision.create_loss_scale(config))
  return graphdef, state, tx


def create_sharded_train_state(config, info, learning_rate_fn, mesh):
  """`create_train_state` compiled, so that every array is created in
  place with its sharding: no device ever holds a whole FSDP model.

  Returns the graph definition, the state, its shardings and the optimizer.
  """
  static = {}

  def init():
    static['graphdef'], state, static['tx'] = create_train_state(
        config, info, learning_rate_fn)
    return state

  state_sharding = sharding.state_shardings(jax.eval_shape(init), mesh)
  state = jax.jit(init, out_shardings=state_sharding)()
  return static['graphdef'], state, state_sharding, static['tx']


def mixup_ratio(key, alpha: float):
  """big_vision's mixup ratio r ~ Beta(alpha, alpha), taken >= 1/2 so that
  each example's own label dominates; None (no mixup) when alpha is 0."""
  if alpha <= 0:
    return None
  ratio = jax.random.beta(key, alpha, alpha)
  return jnp.maximum(ratio, 1.0 - ratio)


def mix(x, ratio):
  """Each example of the batch x mixed with the one before it (the first
  with the last): ratio x x + (1 - ratio) x rolled x; x itself if no ratio."""
  if ratio is None:
    return x
  mixed = (ratio * x.astype(jnp.float32) +
           (1.0 - ratio) * jnp.roll(x, 1, axis=0).astype(jnp.float32))
  return mixed.astype(x.dtype)


def cross_entropy(logits, labels, label_smoothing=0.0, mix_ratio=None):
  """Softmax cross-entropy against the (smoothed, mixed) one-hot labels."""
  targets = optax.smooth_labels(
      jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  return optax.softmax_cross_entropy(logits, mix(targets, mix_ratio))


def _sync_batch_norm(model: nnx.Module, axis_name: str) -> None:
  """Makes every BatchNorm of `model` average its batch statistics over
  the devices of `axis_name`, as one BatchNorm over the global batch does."""
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.BatchNorm):
      module.axis_name = axis_name


def training_inputs(batch, step_key, *, label_smoothing: float,
                    mixup_alpha: float):
  """What a train step feeds the model, and its loss of the model's output:
  the images and the mean cross-entropy against the smoothed labels, both
  mixed (see `mix`) with a ratio drawn from `step_key` when mixup_alpha > 0.
  """
  ratio = mixup_ratio(jax.random.fold_in(step_key, 1), mixup_alpha)

  def loss_of_output(logits):
    return jnp.mean(cross_entropy(logits, batch['label'], label_smoothing,
                                  ratio))
  return mix(batch['image'], ratio), loss_of_output


def train_step(state: TrainState, batch, *, graphdef, tx, learning_rate_fn,
               label_smoothing: float, dropout_seed: int,
               mixup_alpha: float = 0.0, axis_name: str | None = None,
               skip_nonfinite_steps: int = 0, grad_accum_steps: int = 1,
               accum_unroll: int = 1):
  """One optimizer update; returns the new state and scalar metrics.

  Under `jax.jit` the batch is the global batch. Under `jax.pmap` it is one
  device's share and `axis_name` names the device axis: gradients, metrics
  and BatchNorm statistics are averaged over it, so both give one result.
  With `mixup_alpha` > 0 the images and labels are mixed (`mix`); accuracy
  counts the dominant label. A non-finite update is not applied (see
  `guard_nonfinite`).

  With `grad_accum_steps` = k > 1 the gradient is the mean of the gradients
  of k micro-batches (`accumulation.micro_batches`), computed one after the
  other by a scan whose body is one micro-batch's forward and backward
  pass, so that a rolled scan holds one micro-batch's activations;
  `accum_unroll` micro-batches per loop iteration.
  Each micro-batch has its own mixup ratio and dropout masks; BatchNorm
  normalises with each micro-batch's statistics and updates its running
  averages once per micro-batch. The update, the step counter, the
  learning rate, the non-finite guard and the loss scale act once per step.
  """
  step_key = jax.random.fold_in(jax.random.key(dropout_seed), state.step)
  mean_over_devices = (functools.partial(jax.lax.pmean, axis_name=axis_name)
                       if axis_name is not None else lambda x: x)

  def micro_step(carry, micro):
    """The gradient of one micro-batch, added to the running sums."""
    model_state, sums, finite, loss_scale = carry
    micro_batch, micro_key = micro
    # The same mixup ratio on every device: made from the micro-batch's key.
    images, loss_of_output = training_inputs(
        micro_batch, micro_key, label_smoothing=label_smoothing,
        mixup_alpha=mixup_alpha)
    dropout_key = micro_key
    if axis_name is not None:  # a distinct dropout mask on every device
      dropout_key = jax.random.fold_in(dropout_key,
                                       jax.lax.axis_index(axis_name))

    def loss_fn(params):
      model = nnx.merge(graphdef, params, model_state, copy=True)
      if axis_name is not None:
        _sync_batch_norm(model, axis_name)
      logits = model(images, train=True, dropout_key=dropout_key)
      loss = loss_of_output(logits)
      return loss, (logits, nnx.state(model, nnx.Not(nnx.Param)))

    # Every micro-batch is scaled by the step's loss scale; the scale's next
    # value is the one of the first micro-batch with non-finite gradients,
    # or, if there is none, of any (they agree).
    next_scale, micro_finite, (loss, (logits, model_state)), grads = (
        mixed_precision.value_and_grad(loss_fn, state.loss_scale, axis_name)(
            state.params))
    if state.loss_scale is not None:
      loss_scale = jax.tree.map(lambda kept, new: jnp.where(finite, new, kept),
                                loss_scale, next_scale)
      finite = finite & micro_finite
    accuracy = jnp.mean(jnp.argmax(logits, -1) == micro_batch['label'])
    sums = jax.tree.map(jnp.add, sums, {'grads': grads, 'loss': loss,
                                        'accuracy': accuracy})
    return (model_state, sums, finite, loss_scale), None

  zeros = jax.tree.map(jnp.zeros_like, {
      'grads': state.params, 'loss': jnp.zeros((), jnp.float32),
      'accuracy': jnp.zeros((), jnp.float32)})
  (model_state, sums, grads_finite, loss_scale), _ = accumulation.scan(
      micro_step, (state.model_state, zeros, jnp.array(True),
                   state.loss_scale),
      batch, step_key, grad_accum_steps, accum_unroll)
  grads, loss, accuracy = jax.tree.map(
      lambda total: total / grad_accum_steps,
      (sums['grads'], sums['loss'], sums['accuracy']))
  if state.loss_scale is None:
    grads_finite = None
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {
      'loss': mean_over_devices(loss),
      'accuracy': mean_over_devices(accuracy),
      'learning_rate': learning_rate_fn(state.step),
      'grad_norm': optax.global_norm(grads),
  }
  if state.loss_scale is not None:
    metrics['loss_scale'] = state.loss_scale.scale
  new_state = state.replace(step=state.step + 1, params=params,
                            model_state=model_state, opt_state=opt_state,
                            loss_scale=loss_scale)
  # float16: overflowing gradients are the loss scale's business (skip the
  # update, halve the scale); only a non-finite loss counts as divergence.
  new_state = mixed_precision.skip_nonfinite(grads_finite, new_state, state)
  checked = (loss, grads) if state.loss_scale is None else loss
  new_state, skipped = guard_nonfinite(state, new_state, checked,
                                       skip_nonfinite_steps)
  if skip_nonfinite_steps > 0:
    metrics['skipped_steps'] = skipped.astype(jnp.float32)
  return new_state, metrics


def all_finite(tree) -> jax.Array:
  """True when every floating-point value in `tree` is finite."""
  return jnp.all(jnp.stack([
      jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
      if jnp.issubdtype(x.dtype, jnp.inexact)]))


def guard_nonfinite(state: TrainState, new_state: TrainState, loss_and_grads,
                    max_skips: int) -> tuple[TrainState, jax.Array]:
  """`new_state`, unless the step produced non-finite values; and whether
  this step was skipped.

  A non-finite step keeps the old parameters, statistics and optimizer state
  (so no checkpoint ever holds NaNs) and extends `nonfinite_streak`. Once
  the streak exceeds `max_skips` the state freezes: later steps change
  nothing, not even the step counter, until the host stops the run at its
  next synchronisation (`stop_if_nonfinite`). So the hot loop needs no
  host round trip per step, and the frozen state is exactly the one the
  offending step started from.
  """
  finite = all_finite((loss_and_grads, new_state.params,
                       new_state.model_state))
  frozen = state.nonfinite_streak > max_skips
  apply = finite & ~frozen
  keep_old = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(apply, n, o), new, old)
  guarded = new_state.replace(
      params=keep_old(new_state.params, state.params),
      model_state=keep_old(new_state.model_state, state.model_state),
      opt_state=keep_old(new_state.opt_state, state.opt_state),
      step=jnp.where(frozen, state.step, new_state.step),
      nonfinite_streak=jnp.where(
          frozen, state.nonfinite_streak,
          jnp.where(finite, 0, state.nonfinite_streak + 1)))
  return guarded, ~finite & ~frozen


def create_intermediate_grad_summaries(config, graphdef, state, batch,
                                       state_sharding, batch_sharding, writer):
  """The summary step compiled beside the train step, with its writer."""
  compiled, _ = compile_step(
      functools.partial(
          intermediate_grads.summary_step, graphdef=graphdef,
          inputs_fn=functools.partial(
              training_inputs, label_smoothing=config.label_smoothing,
              mixup_alpha=config.mixup_alpha),
          dropout_seed=config.seed + 1,
          grad_accum_steps=config.grad_accum_steps,
          accum_unroll=config.scan_unroll),
      state_sharding, batch_sharding, state, batch,
      out_shardings=sharding.replicated(batch_sharding.mesh),
      donate_state=False)
  return intermediate_grads.Summaries(
      compiled, writer, config.intermediate_grads_every_steps)


def eval_step(state: TrainState, batch, *, graphdef):
  """Sums of loss, top-1 and top-5 correct predictions over the unmasked
  examples."""
  model = nnx.merge(graphdef, state.params, state.model_state)
  logits = model(batch['image'], train=False)
  mask = batch['mask'].astype(jnp.float32)
  labels = batch['label']
  _, top5 = jax.lax.top_k(logits, min(5, logits.shape[-1]))
  return {
      'loss': jnp.sum(cross_entropy(logits, labels) * mask),
      'correct': jnp.sum((top5[:, 0] == labels) * mask),
      'correct_top5': jnp.sum(jnp.any(top5 == labels[:, None], axis=-1) *
                              mask),
      'examples': jnp.sum(mask),
  }


def create_mesh(config) -> jax.sharding.Mesh:
  """The (data, fsdp) mesh of `config.mesh` over every device."""
  return sharding.create_mesh(config.mesh, config.step_mode)


def compile_step(step_fn, state_sharding, batch_sharding, state, batch, *,
                 out_shardings, donate_state: bool):
  """AOT-compiles `step_fn(state, batch)`; returns it and compile seconds."""
  start = time.perf_counter()
  compiled = jax.jit(
      step_fn, in_shardings=(state_sharding, batch_sharding),
      out_shardings=out_shardings,
      donate_argnums=(0,) if donate_state else ()).lower(state, batch).compile()
  return compiled, time.perf_counter() - start


def pmap_step(step_fn, mesh, state, batch):
  """`step_fn` through `jax.pmap` over every device, compiled once.

  It takes and returns the global arrays of the jit step (replicated state,
  global batch), split per device by a reshape that moves no data. pmap
  itself converts process-local arrays to such global ones and calls the
  same executable; calling it directly spares that round trip on several
  processes. Returns the step, its executable (for memory analysis) and the
  compile seconds.
  """
  num_devices = mesh.devices.size
  split_batch = jax.jit(
      lambda b: jax.tree.map(
          lambda x: x.reshape(num_devices, -1, *x.shape[1:]), b),
      out_shardings=sharding.batch_sharding(mesh))
  pmapped = jax.pmap(functools.partial(step_fn, axis_name=PMAP_AXIS),
                     axis_name=PMAP_AXIS, in_axes=(None, 0), out_axes=None,
                     donate_argnums=(0,))
  start = time.perf_counter()
  compiled = pmapped.lower(state, split_batch(batch)).compile()
  seconds = time.perf_counter() - start
  return (lambda state, batch: compiled(state, split_batch(batch)),
          compiled, seconds)


def compile_train_step(step_mode: str, mesh, step_fn, state_sharding, state,
                       batch):
  """The train step of `step_mode`, its compiled executable and the compile
  seconds."""
  if step_mode == 'pmap':
    return pmap_step(step_fn, mesh, state, batch)
  compiled, seconds = compile_step(
      step_fn, state_sharding, sharding.batch_sharding(mesh), state, batch,
      out_shardings=(state_sharding, sharding.replicated(mesh)),
      donate_state=True)
  return compiled, compiled, seconds


def true_step_flops(graphdef, step_kwargs, state, batch) -> float:
  """FLOPs of one train step, every layer counted.

  XLA's cost analysis counts a rolled scan's body once, so the step is
  lowered again with the stacks as a Python loop over the same parameters
  and without remat, whose recomputation is not model work, and with its
  loop over micro-batches unrolled.
  """
  model = nnx.merge(graphdef, state.params, state.model_state)
  for _, module in nnx.iter_modules(model):
    if isinstance(module, models.StackedBlocks):
      module.scan_layers, module.remat_policy = False, 'none'
  step = functools.partial(train_step, **{
      **step_kwargs, 'graphdef': nnx.graphdef(model),
      'accum_unroll': step_kwargs['grad_accum_steps']})
  return float(jax.jit(step).lower(state, batch).cost_analysis()['flops'])


def _flat_hparams(config) -> dict:
  flat = {}
  for key, value in config.items():
    flat[key] = value if isinstance(value, (int, float, str, bool)) else str(
        value)
  return flat


def evaluate(eval_step_fn, state, batches, steps_per_eval: int = -1) -> dict:
  """Loss, top-1 and top-5 accuracy over the eval `batches` (the first
  `steps_per_eval` of them when > 0)."""
  if steps_per_eval > 0:
    batches = itertools.islice(batches, steps_per_eval)
  totals = None
  for batch in input_pipeline.prefetch(batches):
    # One eval step at a time. The steps do not depend on each other, so
    # XLA may run several at once; each all-reduces its sums across
    # processes with the same instruction of the same program, and
    # two-process CPU runs were seen to hang here with both processes
    # waiting on such a step. Waiting for the previous sums orders them.
    if totals is not None:
      jax.block_until_ready(totals)
    sums = eval_step_fn(state, batch)
    totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
  totals = jax.device_get(totals)
  examples = max(float(totals['examples']), 1.0)
  return {'eval_loss': totals['loss'] / examples,
          'eval_accuracy': totals['correct'] / examples,
          'eval_top5_accuracy': totals['correct_top5'] / examples,
          'eval_examples': totals['examples']}


def stop_if_nonfinite(state: TrainState, skip_nonfinite_steps: int, manager,
                      writer, before_stopping=None) -> None:
  """Raises NonFiniteError if the train step froze the state (see
  `guard_nonfinite`), after finishing pending saves and writes.

  Called only on steps that synchronise with the host anyway. The frozen
  `state` is the one the offending step started from, except that its
  `step` already counts the offending step: its batch is the training batch
  at index `state.step - 1` (0-based) of the data order.
  `before_stopping(state)` runs first (the intermediate-gradient summaries
  of that batch).
  """
  streak = int(state.nonfinite_streak)
  if streak <= skip_nonfinite_steps:
    return
  if before_stopping is not None:
    before_stopping(state)
  manager.wait_until_finished()
  writer.flush()
  good = manager.latest_step()
  where = (f'step {good} in {manager.directory} (untouched)' if good is not None
           else 'none was saved')
  raise NonFiniteError(
      f'non-finite loss or gradients at step {int(state.step)} ({streak} such '
      f'steps in a row, skip_nonfinite_steps={skip_nonfinite_steps}); '
      f'last good checkpoint: {where}. Lower learning_rate, set '
      'grad_clip_norm, or raise skip_nonfinite_steps to skip such steps.')


def profile_hooks(config, logdir: str, start_step: int,
                  num_steps: int) -> list:
  """CLU's Profile set for one trace of `profile_num_steps` steps that
  starts `profile_delay_steps` steps after this (re)start, written under
  `logdir/plugins/profile/`; none when fewer steps are left (the trace
  would never be stopped and written)."""
  from clu import periodic_actions  # pylint: disable=g-import-not-at-top
  first = start_step + config.profile_delay_steps
  if first + config.profile_num_steps > num_steps:
    logging.warning('Not profiling: %d steps left, fewer than the %d of '
                    'profile_delay_steps + profile_num_steps.',
                    num_steps - start_step,
                    config.profile_delay_steps + config.profile_num_steps)
    return []
  return [periodic_actions.Profile(
      logdir=logdir, num_profile_steps=config.profile_num_steps,
      profile_duration_ms=None, first_profile=first, every_secs=None)]


def prepare_data(config, workdir: str, events_dir: str):
  """Checks the config and the run's directories, and opens the data set:
  every mistake is a ConfigError naming the fix, before anything is
  written."""
  validate_config(config)
  with _as_config_error():
    if any(map(paths.is_remote, (workdir, events_dir))):
      paths.use_gcsfs_for_buckets()
    for directory in dict.fromkeys((workdir, events_dir)):
      config_checks.check_workdir(directory)
    return datasets.create_dataset(config)


def train_step_kwargs(config, graphdef, tx, learning_rate_fn) -> dict:
  """The keyword arguments of `train_step` under `config`."""
  return dict(graphdef=graphdef, tx=tx, learning_rate_fn=learning_rate_fn,
              label_smoothing=config.label_smoothing,
              dropout_seed=config.seed + 1, mixup_alpha=config.mixup_alpha,
              skip_nonfinite_steps=config.skip_nonfinite_steps,
              grad_accum_steps=config.grad_accum_steps,
              # XLA:CPU is slow in loops, as for the layers (`scan_unroll`).
              accum_unroll=config.scan_unroll)


@dataclasses.dataclass
class CompiledSteps:
  """A run's compiled functions and what they cost."""
  train: Callable  # (state, global batch) -> (state, metrics)
  eval: Callable  # (state, global batch) -> sums (see eval_step)
  summaries: intermediate_grads.Summaries | None
  # compile_seconds, memory_*_bytes, step_flops: logged once per start.
  startup_scalars: dict


def compile_steps(config, mesh, graphdef, tx, learning_rate_fn, state,
                  state_sharding, train_batch, eval_batch,
                  writer) -> CompiledSteps:
  """The train step (of `config.step_mode`), the eval step and, when asked
  for, the intermediate-gradient summary step, compiled for these arrays."""
  batch_sharding = sharding.batch_sharding(mesh)
  step_kwargs = train_step_kwargs(config, graphdef, tx, learning_rate_fn)
  run_train_step, executable, compile_seconds = compile_train_step(
      config.step_mode, mesh, functools.partial(train_step, **step_kwargs),
      state_sharding, state, train_batch)
  compiled_eval_step, _ = compile_step(
      functools.partial(eval_step, graphdef=graphdef), state_sharding,
      batch_sharding, state, eval_batch,
      out_shardings=sharding.replicated(mesh), donate_state=False)
  summaries = (create_intermediate_grad_summaries(
      config, graphdef, state, train_batch, state_sharding, batch_sharding,
      writer) if config.intermediate_grads_every_steps else None)
  memory = executable.memory_analysis()
  return CompiledSteps(run_train_step, compiled_eval_step, summaries, {
      'compile_seconds': compile_seconds,
      'memory_temp_bytes': memory.temp_size_in_bytes,
      'memory_argument_bytes': memory.argument_size_in_bytes,
      'memory_output_bytes': memory.output_size_in_bytes,
      'step_flops': true_step_flops(graphdef, step_kwargs, state,
                                    train_batch),
  })


def train_summary(train_metrics: list, steps: int, seconds: float,
                  batch_size: int, step_flops: float) -> dict:
  """The logged means of `train_metrics` (one dict per step; a count of
  skipped steps), with steps/s, examples/s, FLOP/s and MFU."""
  # nanmean: a step skipped as non-finite has a NaN loss.
  summary = jax.tree.map(lambda *x: jnp.nanmean(jnp.stack(x)),
                         *train_metrics)
  if 'skipped_steps' in summary:  # a count, not a mean
    summary['skipped_steps'] = sum(m['skipped_steps'] for m in train_metrics)
  summary = {f'train_{k}': v for k, v in jax.device_get(summary).items()}
  summary['steps_per_second'] = steps / seconds
  summary.update(throughput.throughput_metrics(
      summary['steps_per_second'], batch_size, step_flops, jax.devices()))
  return summary


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       stop_request: preemption.StopRequest | None = None,
                       events_dir: str | None = None) -> TrainState:
  """Trains `config` in `workdir`, resuming from its latest checkpoint.

  Stops early, with a checkpoint, when `stop_request` (entered: SIGTERM and
  SIGINT; see main.py) or a multi-host preemption notice asks it to.
  TensorBoard event files (and profiles) go to `events_dir`, by default the
  workdir itself.
  """
  # CLU (and TensorFlow under it) only here: models and the compiled steps
  # import without them, e.g. on a machine that runs benchmarks only.
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  events_dir = events_dir or workdir
  dataset = prepare_data(config, workdir, events_dir)
  num_steps = num_train_steps(config, dataset.info)
  epoch_steps = steps_per_epoch(config, dataset.info)
  learning_rate_fn = learning_rate_schedule(config, num_steps, epoch_steps)
  logging.info('Peak learning rate %g (learning_rate %g, batch_size %d, '
               'learning_rate_base_batch_size %d); %d warmup steps of %d.',
               peak_learning_rate(config), config.learning_rate,
               config.batch_size, config.learning_rate_base_batch_size,
               min(warmup_steps(config, epoch_steps), num_steps), num_steps)

  mesh = create_mesh(config)
  batch_sharding = sharding.batch_sharding(mesh)
  dtype = mixed_precision.compute_dtype(config)
  logging.info('Mesh %s; process %d loads rows %s of every global batch.',
               dict(mesh.shape), jax.process_index(),
               input_pipeline.describe_rows(input_pipeline.process_rows(
                   config.batch_size, batch_sharding)))
  with _as_config_error():  # the model's own checks, as it is built
    graphdef, state, state_sharding, tx = create_sharded_train_state(
        config, dataset.info, learning_rate_fn, mesh)
    state = pretrained.initialize(state, config, workdir)
  manager = checkpointing.create_manager(workdir, config.keep_checkpoints)
  with _as_config_error():
    state = checkpointing.restore_latest(manager, state, config,
                                         dataset.info.class_names)
  start_step = int(state.step)
  if start_step >= num_steps:
    logging.info('The run is complete: the checkpoint in %s is at step %d '
                 'of %d. Evaluate it with --mode=eval.', manager.directory,
                 start_step, num_steps)
    return state
  preemption.drop_events_after(events_dir, start_step)

  writer = metric_writers.create_default_writer(
      events_dir, just_logging=jax.process_index() > 0)
  if start_step == 0:
    writer.write_hparams(_flat_hparams(config))
  train_iter = input_pipeline.prefetch(dataset.train_batches(
      config.batch_size, config.seed, start_step, batch_sharding, dtype))
  first_batch = next(train_iter)
  steps = compile_steps(
      config, mesh, graphdef, tx, learning_rate_fn, state, state_sharding,
      first_batch, next(dataset.eval_batches(config.batch_size,
                                             batch_sharding, dtype)), writer)
  writer.write_scalars(start_step, steps.startup_scalars)
  logging.info('Starting at step %d of %d; TensorBoard logs in %s, '
               'checkpoints in %s.', start_step, num_steps, events_dir,
               manager.directory)
  state = train_loop(config, state, itertools.chain([first_batch], train_iter),
                     steps, dataset, mesh, manager, writer, start_step,
                     num_steps, stop_request or preemption.StopRequest(),
                     events_dir)
  manager.wait_until_finished()
  writer.flush()
  return state


def train_loop(config, state, train_iter, steps: CompiledSteps, dataset,
               mesh, manager, writer, start_step: int, num_steps: int,
               stop_request: preemption.StopRequest, events_dir: str):
  """Steps `start_step + 1` to `num_steps`, with logging, evaluation,
  summaries and checkpoints on their cadences; returns the last state."""
  from clu import periodic_actions  # pylint: disable=g-import-not-at-top
  batch_sharding = sharding.batch_sharding(mesh)
  dtype = mixed_precision.compute_dtype(config)
  hooks = []
  if jax.process_index() == 0:  # one progress log and profile per run
    hooks.append(periodic_actions.ReportProgress(
        num_train_steps=num_steps, every_steps=config.log_every_steps))
    if config.profile:
      hooks.extend(profile_hooks(config, events_dir, start_step, num_steps))

  def summarize_offender(frozen_state):
    """Summaries of the batch that made the run non-finite, if enabled."""
    if steps.summaries is not None:
      offending_step = int(frozen_state.step)
      steps.summaries.write(offending_step, frozen_state, next(
          dataset.train_batches(config.batch_size, config.seed,
                                offending_step - 1, batch_sharding, dtype)))

  train_metrics = []
  last_log = (start_step, time.perf_counter())
  excluded_seconds = 0.0  # evaluation, saving, summaries: not in steps/s
  for step in range(start_step + 1, num_steps + 1):
    batch = next(train_iter)
    with jax.profiler.StepTraceAnnotation('train', step_num=step):
      state, metrics = steps.train(state, batch)
    train_metrics.append(metrics)
    last_step = step == num_steps
    host_sync = last_step or any(step % every == 0 for every in (
        config.log_every_steps, config.eval_every_steps,
        config.checkpoint_every_steps))
    stopping = stop_request.should_stop(step, host_sync)
    if host_sync or stopping:
      stop_if_nonfinite(state, config.skip_nonfinite_steps, manager, writer,
                        summarize_offender)
    if step % config.log_every_steps == 0 or last_step:
      now = time.perf_counter()
      writer.write_scalars(step, train_summary(
          train_metrics, step - last_log[0],
          now - last_log[1] - excluded_seconds, config.batch_size,
          steps.startup_scalars['step_flops']) | dataset.skipped())
      train_metrics, last_log, excluded_seconds = [], (step, now), 0.0
    for hook in hooks:  # after the logging sync: progress times done steps
      hook(step)
    pause_start = time.perf_counter()
    if steps.summaries is not None:  # the updated state, this step's batch
      steps.summaries.write_if_due(step, state, batch)
    if step % config.eval_every_steps == 0 or last_step:
      writer.write_scalars(step, evaluate(
          steps.eval, state, dataset.eval_batches(config.batch_size,
                                                  batch_sharding, dtype),
          config.steps_per_eval))
    if step % config.checkpoint_every_steps == 0 or last_step or stopping:
      writer.flush()  # every event up to `step` is on disk before its checkpoint
      checkpointing.save(manager, step, state, config,
                         dataset.info.class_names)
    excluded_seconds += time.perf_counter() - pause_start
    if stopping:
      logging.warning('Stopped by %s after step %d of %d; checkpoint saved in '
                      '%s. Run the same command to resume.',
                      stop_request.signal_name, step, num_steps,
                      manager.directory)
      break
  return state
