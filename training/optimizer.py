"""The optimizer, the learning-rate schedule and the run's length in steps."""

from absl import logging
import jax
import jax.numpy as jnp
import optax

import input_pipeline
from layers import stacked
from runtime import config_error
from training import layer_decay
from training import trainable

OPTIMIZERS = ('sgd', 'adamw', 'lars')
# MAE's and MoCo v3's LARS: a kernel's update is at most about this share of
# the kernel's norm times the learning rate.
LARS_TRUST_COEFFICIENT = 0.001
# How adamw scales its decoupled weight decay: by lr(t) / peak (big_vision:
# the decay follows the schedule's shape, not `learning_rate` itself) or by
# lr(t) (PyTorch's AdamW, as DeiT and timm write weight_decay).
WEIGHT_DECAY_FORMS = ('big_vision', 'pytorch')
# A warmup at least as long as the run becomes this share of the run (the
# common warmup ratio of short fine-tuning runs), so a shrunk recipe decays.
SHORT_RUN_WARMUP_SHARE = 0.1


def peak_learning_rate(config) -> float:
  """The learning rate after warmup: `learning_rate` x batch_size /
  learning_rate_base_batch_size (the linear scaling rule), or
  `learning_rate` itself when learning_rate_base_batch_size is 0."""
  if config.learning_rate_base_batch_size > 0:
    return (config.learning_rate * config.batch_size /
            config.learning_rate_base_batch_size)
  return config.learning_rate


def min_learning_rate(config) -> float:
  """The cosine's floor: `min_learning_rate` as it is (timm's and DeiT's
  `min_lr`), or scaled by the batch as the peak is (min_learning_rate x
  batch_size / learning_rate_base_batch_size): with
  `scale_min_learning_rate` (Swin's MIN_LR), and wherever the value as it
  is would not be below the peak (`floor_follows_batch`)."""
  if ((config.scale_min_learning_rate and
       config.learning_rate_base_batch_size) or floor_follows_batch(config)):
    return (config.min_learning_rate * config.batch_size /
            config.learning_rate_base_batch_size)
  return config.min_learning_rate


def floor_follows_batch(config) -> bool:
  """Whether an absolute `min_learning_rate` is scaled by the batch because
  this batch puts the peak at or below it (a recipe shrunk far below its
  own batch): scaled as the peak is, as Swin scales MIN_LR, the floor keeps
  its ratio to `learning_rate` and stays under the peak. A floor at or
  above `learning_rate` would stay above the peak at such a batch however
  scaled; it is not, and the config checks refuse it."""
  return (not config.scale_min_learning_rate and
          config.learning_rate_base_batch_size > 0 and
          peak_learning_rate(config) <= config.min_learning_rate <
          config.learning_rate)


def _is_kernel(path) -> bool:
  return any(getattr(k, 'key', None) == 'kernel' for k in path)


def _decay_mask(params):
  """True on kernels: the parameters weight decay (and LARS) acts on."""
  return jax.tree_util.tree_map_with_path(lambda path, _: _is_kernel(path),
                                          params)


def scale_by_trust_ratio(trust_coefficient: float
                         ) -> optax.GradientTransformation:
  """LARS's trust ratio on kernels: each update times trust_coefficient x
  |kernel| / |update| (1 where either norm is 0), the norms of each layer
  of a scanned stack taken apart, as an unstacked network's would be."""
  def scaled(path, update, param):
    if not _is_kernel(path):
      return update
    axes = tuple(range(1 if stacked.is_stacked(trainable.param_name(path))
                       else 0, update.ndim))
    norm = lambda x: jnp.sqrt(jnp.sum(jnp.square(x), axes, keepdims=True))
    param_norm, update_norm = norm(param), norm(update)
    ratio = jnp.where((param_norm == 0) | (update_norm == 0), 1.0,
                      trust_coefficient * param_norm / update_norm)
    return update * ratio.astype(update.dtype)

  return optax.stateless(lambda updates, params: (
      jax.tree_util.tree_map_with_path(scaled, updates, params)))


def update_rule(config, learning_rate_fn) -> optax.GradientTransformation:
  """`config.optimizer` with weight decay on kernels.

  sgd: the Flax ImageNet example's update: L2 decay (weight_decay x kernel
  added to the gradient, the gradient of 0.5 x weight_decay x |kernel|^2 in
  the loss), then Nesterov momentum 0.9.
  adamw: weight decay decoupled from the gradient; in big_vision's form
  update = -(lr(t) x adam + lr(t) / peak x weight_decay x kernel), so the
  decay follows the schedule's shape but not `learning_rate` itself; in
  PyTorch's AdamW form (`weight_decay_form='pytorch'`) update = -lr(t) x
  (adam + weight_decay x kernel).
  lars: MAE's and MoCo v3's LARS for linear probes: L2 decay added to the
  gradient, each kernel's update scaled by its trust ratio (trust
  coefficient 0.001), then momentum 0.9 and the learning rate.
  """
  if config.optimizer == 'sgd':
    return optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask=_decay_mask),
        optax.sgd(learning_rate_fn, momentum=0.9, nesterov=True))
  if config.optimizer == 'adamw':
    if config.weight_decay_form not in WEIGHT_DECAY_FORMS:
      raise ValueError(f'unknown weight_decay_form {config.weight_decay_form!r}'
                       f'; valid names: {", ".join(WEIGHT_DECAY_FORMS)}')
    decay = config.weight_decay
    if config.weight_decay_form == 'big_vision':
      decay /= peak_learning_rate(config)
    return optax.chain(
        optax.scale_by_adam(),
        optax.add_decayed_weights(decay, mask=_decay_mask),
        optax.scale_by_learning_rate(learning_rate_fn))
  if config.optimizer == 'lars':
    return optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask=_decay_mask),
        scale_by_trust_ratio(LARS_TRUST_COEFFICIENT),
        optax.trace(decay=0.9),
        optax.scale_by_learning_rate(learning_rate_fn))
  raise ValueError(f'unknown optimizer {config.optimizer!r}; valid names: '
                   f'{", ".join(OPTIMIZERS)}')


def create_optimizer(config, learning_rate_fn,
                     layer_depths: dict | None = None
                     ) -> optax.GradientTransformation:
  """The run's optimizer: `update_rule` after optional clipping, its update
  scaled per layer by `config.layer_decay` (`layer_depths`, the model's
  `layer_decay.layer_depths`, needed when it is not 1).

  With `config.trainable` set, all of it (clipping included) acts on the
  trained parameters alone; the frozen ones get a zero update and hold no
  optimizer state.
  """
  optimizer = update_rule(config, learning_rate_fn)
  if config.grad_clip_norm > 0:
    optimizer = optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm), optimizer)
  if config.layer_decay != 1:
    optimizer = optax.chain(optimizer, layer_decay.scale_by_layer(
        layer_decay.layer_scales(layer_depths, config.layer_decay)))
  if config.trainable:
    optimizer = optax.multi_transform(
        {True: optimizer, False: optax.set_to_zero()},
        lambda params: trainable.trained_mask(params, config.trainable))
  return optimizer


def configured_warmup_steps(config, steps_per_epoch: int) -> int:
  """`warmup_steps`, or `warmup_epochs` in steps when it is -1."""
  if config.warmup_steps >= 0:
    return config.warmup_steps
  return int(config.warmup_epochs * steps_per_epoch)


def warmup_steps(config, num_steps: int, steps_per_epoch: int) -> int:
  """The configured warmup, or, when it is not shorter than the run (a
  recipe shrunk to a few steps), SHORT_RUN_WARMUP_SHARE of the run rounded
  down, so that the run still decays."""
  warmup = configured_warmup_steps(config, steps_per_epoch)
  if warmup >= num_steps:
    return int(SHORT_RUN_WARMUP_SHARE * num_steps)
  return warmup


def schedule_adjustments(config, num_steps: int,
                         steps_per_epoch: int) -> list[str]:
  """One line for each value of the schedule that the run's batch or
  length made inconsistent, and what it became."""
  lines = []
  if floor_follows_batch(config):
    lines.append(
        f'min_learning_rate {config.min_learning_rate:g} is not below the '
        f'peak {peak_learning_rate(config):.2g} at batch {config.batch_size}'
        ': scaled with the batch as learning_rate is (x '
        f'{config.batch_size}/{config.learning_rate_base_batch_size}) to '
        f'{min_learning_rate(config):.2g}')
  configured = configured_warmup_steps(config, steps_per_epoch)
  if configured >= num_steps:
    source = (f'{configured:,} steps' if config.warmup_steps >= 0 else
              f'{config.warmup_epochs:g} epochs ({configured:,} steps)')
    lines.append(
        f"warmup of {source} is not shorter than the run's {num_steps:,} "
        f'steps: warmup shortened to '
        f'{warmup_steps(config, num_steps, steps_per_epoch):,} steps '
        f'({SHORT_RUN_WARMUP_SHARE:.0%} of the run)')
  return lines


def learning_rate_schedule(config, num_steps: int, steps_per_epoch: int):
  """Linear warmup from 0 to the peak learning rate over
  `warmup_steps(...)`, then cosine decay to the floor
  `min_learning_rate(config)` at `num_steps`: min + (peak - min) x
  (1 + cos(pi t)) / 2."""
  peak = peak_learning_rate(config)
  warmup = warmup_steps(config, num_steps, steps_per_epoch)
  return optax.join_schedules([
      optax.linear_schedule(0.0, peak, warmup),
      optax.cosine_decay_schedule(peak, max(num_steps - warmup, 1),
                                  alpha=min_learning_rate(config) / peak),
  ], boundaries=[warmup])


def num_train_steps(config, info: input_pipeline.DatasetInfo) -> int:
  """`num_train_steps`, or `num_epochs` in steps when it is -1."""
  if config.num_train_steps > 0:
    return config.num_train_steps
  return int(config.num_epochs * steps_per_epoch(config, info))


def steps_per_epoch(config, info: input_pipeline.DatasetInfo) -> int:
  """Whole global batches in the training split (the rest is dropped);
  a ValueError naming the fix when the batch exceeds the split."""
  try:
    return input_pipeline.steps_per_epoch(info.num_train_examples,
                                          config.batch_size)
  except ValueError as e:
    raise ValueError(f'{config.dataset}: {e}') from None


def logged_schedule(config, info: input_pipeline.DatasetInfo):
  """The run's number of steps and its learning-rate schedule, logged with
  every adjustment the run's length made to the config's."""
  with config_error.as_config_error():  # e.g. a batch over the split
    num_steps = num_train_steps(config, info)
    epoch_steps = steps_per_epoch(config, info)
  for line in schedule_adjustments(config, num_steps, epoch_steps):
    logging.info('%s.', line)
  logging.info('Peak learning rate %g (learning_rate %g, batch_size %d, '
               'learning_rate_base_batch_size %d); %d warmup steps of %d.',
               peak_learning_rate(config), config.learning_rate,
               config.batch_size, config.learning_rate_base_batch_size,
               warmup_steps(config, num_steps, epoch_steps), num_steps)
  return num_steps, learning_rate_schedule(config, num_steps, epoch_steps)
