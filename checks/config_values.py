"""Checks of a config's values before a run starts: each mistake becomes
one ConfigError of one line that names the fix (and lists the valid
names), before anything is compiled or written; `main` prints it."""

import jax

from evaluators import evaluator_checks
import input_pipeline
from layers import stacked
import models
from runtime import config_error
from runtime import sharding
from training import distillation
from training import optimizer

STEP_MODES = ('jit', 'pmap')


def validate_config(config, devices=None) -> None:
  """Raises ConfigError, naming the fix, for values no run on `devices`
  (default: this run's) can use."""
  devices = devices or jax.devices()
  checks = [*length_checks(config, len(devices)),
            *learning_rate_checks(config),
            *regularisation_checks(config),
            *augmentation_checks(config),
            *cadence_checks(config)]
  for ok, message in checks:
    if not ok:
      raise config_error.ConfigError(message)
  check_grad_accum_steps(config.grad_accum_steps, config.batch_size, devices)
  check_distillation(config)
  check_image_size(config)
  check_compilation(config, devices)
  with config_error.as_config_error():
    stacked.remat_policy_by_name(config.remat_policy)
    check_preprocessing(config)
    models.compute_dtype(config)
    optimizer.update_rule(config, 0.0)
    evaluator_checks.check_evaluators(config.evals)


def length_checks(config, num_devices: int) -> list[tuple[bool, str]]:
  """(ok, message) of the batch over the devices and the run's length."""
  return [
      (config.batch_size > 0, 'batch_size must be positive'),
      (config.batch_size % num_devices == 0,
       f'batch_size {config.batch_size} is not divisible by the '
       f'{num_devices} devices; use a multiple of {num_devices}'),
      (config.num_train_steps > 0 or
       (config.num_train_steps == -1 and config.num_epochs > 0),
       'set num_train_steps > 0, or num_train_steps=-1 with num_epochs > 0'),
  ]


def regularisation_checks(config) -> list[tuple[bool, str]]:
  """(ok, message) of the warmup, weight decay, clipping, label smoothing,
  dropout, stochastic depth, the weights' moving average and layer
  decay."""
  return [
      (config.warmup_epochs >= 0, 'warmup_epochs must be >= 0'),
      (config.warmup_steps >= -1, 'warmup_steps must be >= 0, or -1 to take '
       'the warmup from warmup_epochs'),
      (config.weight_decay >= 0, 'weight_decay must be >= 0 (0: off)'),
      (config.grad_clip_norm >= 0, 'grad_clip_norm must be >= 0 (0: off)'),
      (0 <= config.label_smoothing < 1,
       f'label_smoothing {config.label_smoothing} must be in [0, 1)'),
      (0 <= config.dropout_rate < 1,
       f'dropout_rate {config.dropout_rate} must be in [0, 1)'),
      (0 <= config.ema_decay < 1,
       f'ema_decay {config.ema_decay} must be in [0, 1) (0: off)'),
      (0 < config.layer_decay <= 1,
       f'layer_decay {config.layer_decay} must be in (0, 1] (1: off)'),
      (0 <= config.drop_path_rate < 1,
       f'drop_path_rate {config.drop_path_rate} must be in [0, 1) (0: off)'),
  ]


def augmentation_checks(config) -> list[tuple[bool, str]]:
  """(ok, message) of mixup, CutMix, repeated augmentation and
  RandAugment."""
  return [
      (config.mixup_alpha >= 0, 'mixup_alpha must be >= 0 (0: off)'),
      (config.cutmix_alpha >= 0, 'cutmix_alpha must be >= 0 (0: off)'),
      (0 <= config.mixup_switch_prob <= 1,
       f'mixup_switch_prob {config.mixup_switch_prob} must be in [0, 1]'),
      (isinstance(config.repeated_augments, int) and
       1 <= config.repeated_augments <= config.batch_size,
       f'repeated_augments {config.repeated_augments} must be a whole number '
       f'in [1, batch_size {config.batch_size}] (copies of each example; 1: '
       'off)'),
      (config.randaug_num_layers >= 0,
       'randaug_num_layers must be >= 0 (0: off)'),
      (config.randaug_magnitude >= 0, 'randaug_magnitude must be >= 0'),
  ]


def cadence_checks(config) -> list[tuple[bool, str]]:
  """(ok, message) of what the loop does every so many steps (logs,
  evaluations, checkpoints, summaries, profiles), how many checkpoints it
  keeps, how long a restore retries and the non-finite steps it skips."""
  return [
      (config.log_every_steps > 0 and config.eval_every_steps > 0 and
       config.checkpoint_every_steps > 0,
       'log_every_steps, eval_every_steps and checkpoint_every_steps must be '
       'positive'),
      (config.keep_checkpoints > 0, 'keep_checkpoints must be positive'),
      (config.restore_retry_seconds >= 0, 'restore_retry_seconds must be >= '
       '0 (seconds a restore retries storage errors; 0: no retry)'),
      (config.skip_nonfinite_steps >= 0, 'skip_nonfinite_steps must be >= 0 '
       '(non-finite steps to skip in a row; 0 = stop at the first)'),
      (config.intermediate_grads_every_steps >= 0,
       'intermediate_grads_every_steps must be >= 0 (0 = off)'),
      (config.profile_delay_steps >= 1 and config.profile_num_steps >= 1,
       'profile_delay_steps and profile_num_steps must be >= 1'),
  ]


def check_compilation(config, devices) -> None:
  """Raises ConfigError for what the step cannot be compiled with: an
  unknown step_mode, fewer than one layer per loop iteration, a mesh the
  devices cannot form, FSDP under pmap."""
  if config.step_mode not in STEP_MODES:
    raise config_error.ConfigError(
        f'unknown step_mode {config.step_mode!r}; valid names: '
        f'{", ".join(STEP_MODES)}')
  if config.scan_unroll < 1:
    raise config_error.ConfigError(
        'scan_unroll must be >= 1 (layers per loop iteration)')
  with config_error.as_config_error():
    mesh_shape = sharding.mesh_shape(config.mesh, len(devices),
                                     sharding.num_slices(devices))
  if config.step_mode == 'pmap' and mesh_shape[1] != 1:
    raise config_error.ConfigError(
        "step_mode 'pmap' replicates the parameters; set "
        "--config.mesh.fsdp=1 or use step_mode 'jit' for FSDP")


def learning_rate_checks(config) -> list[tuple[bool, str]]:
  """(ok, message) of the peak learning rate, its batch scaling and its
  floor."""
  peak = optimizer.peak_learning_rate(config)
  # The floor's bound in the terms the config writes it in: below
  # learning_rate, a floor is scaled by the batch where the batch puts the
  # peak at or below it (optimizer.floor_follows_batch).
  if config.scale_min_learning_rate:
    min_bound = (f'learning_rate {config.learning_rate:g}) '
                 '(scale_min_learning_rate scales both by the batch)')
  elif config.learning_rate_base_batch_size > 0:
    min_bound = (f'{max(peak, config.learning_rate):g}) at batch '
                 f'{config.batch_size}: below the peak learning rate '
                 f'{peak:g}, or below learning_rate {config.learning_rate:g}'
                 ' to be scaled with the batch as the peak is')
  else:
    min_bound = f'the peak learning rate {peak:g})'
  return [
      (config.learning_rate > 0, 'learning_rate must be positive'),
      (config.learning_rate_base_batch_size >= 0,
       'learning_rate_base_batch_size must be >= 0 (0: learning_rate is not '
       'scaled by the batch size)'),
      (not config.scale_min_learning_rate or
       config.learning_rate_base_batch_size > 0,
       'scale_min_learning_rate scales min_learning_rate by batch_size / '
       'learning_rate_base_batch_size, which is 0; set '
       'learning_rate_base_batch_size > 0 or scale_min_learning_rate=False'),
      (0 <= optimizer.min_learning_rate(config) < peak,
       f'min_learning_rate {config.min_learning_rate:g} must be in [0, '
       f'{min_bound}'),
  ]


def check_grad_accum_steps(k: int, batch_size: int, devices=None) -> None:
  """Raises ConfigError unless k micro-batches split every process's rows
  of the global batch evenly and give every device (of `devices`,
  default: this run's) the same whole number of examples of each
  micro-batch."""
  devices = devices or jax.devices()
  process_count = len({device.process_index for device in devices})
  devices = len(devices)
  per_device = batch_size // devices
  fix = (f'use a divisor of {per_device} (batch_size {batch_size} / '
         f'{devices} devices), e.g. --config.grad_accum_steps=1 (off)')
  if k < 1:
    raise config_error.ConfigError(f'grad_accum_steps {k} must be >= 1; {fix}')
  process_batch = batch_size // process_count
  if process_batch % k:
    raise config_error.ConfigError(
        f'grad_accum_steps {k} does not divide the {process_batch} examples '
        f'each process loads per step; {fix}')
  if per_device % k:
    raise config_error.ConfigError(
        f'grad_accum_steps {k} makes micro-batches of {batch_size / k:g} '
        f'examples, which do not split evenly over the {devices} devices; '
        f'{fix}')


def check_distillation(config) -> None:
  """Raises ConfigError, naming the fix, for a teacher and distillation
  settings that do not go together."""
  kind, teacher = config.distillation_type, config.teacher_model
  if kind not in distillation.DISTILLATION_TYPES:
    raise config_error.ConfigError(
        f'unknown distillation_type {kind!r}; valid names: '
        f'{", ".join(distillation.DISTILLATION_TYPES)}')
  checks = [
      (not teacher or teacher in models.MODEL_NAMES,
       f'unknown teacher_model {teacher!r}; valid names: '
       f'{", ".join(models.MODEL_NAMES)}'),
      (kind == 'none' or teacher,
       f"distillation_type {kind!r} needs a teacher: set "
       "--config.teacher_model and --config.teacher_init_from, or "
       "--config.distillation_type=none"),
      (not teacher or kind != 'none',
       f"teacher_model {teacher!r} is set but distillation_type is 'none'; "
       "set --config.distillation_type to soft, hard or kl, or "
       "--config.teacher_model=''"),
      (not teacher or config.teacher_init_from,
       f'teacher_model {teacher!r} needs its weights: set '
       '--config.teacher_init_from to a weights file or workdir'),
      (0 <= config.distillation_alpha <= 1,
       f'distillation_alpha {config.distillation_alpha} must be in [0, 1] '
       '(the distillation loss\'s weight)'),
      (config.distillation_tau > 0,
       f'distillation_tau {config.distillation_tau} must be > 0 (the '
       'temperature; 1 = none)'),
      (not config.vit_distillation_token or
       models.family(config.model) == 'vit',
       f'vit_distillation_token needs a ViT, not --config.model='
       f'{config.model}; use a ViT model (e.g. ViT_S16) or set '
       '--config.vit_distillation_token=False'),
      (not config.vit_distillation_token or config.vit_pool == 'cls',
       'vit_distillation_token needs the class token: set '
       '--config.vit_pool=cls'),
  ]
  for ok, message in checks:
    if not ok:
      raise config_error.ConfigError(message)


def check_image_size(config) -> None:
  """Raises ConfigError unless the model and the teacher can take images
  of `image_size`: one line naming the sizes they can."""
  with config_error.as_config_error():
    models.check_image_size(config.model, config.image_size,
                            config.swin_window)
  if config.teacher_model:
    try:
      models.check_image_size(config.teacher_model, config.image_size,
                              config.swin_window)
    except ValueError as e:
      raise config_error.ConfigError(f'teacher_model {e}') from None


def check_preprocessing(config) -> None:
  """Raises ValueError, naming the fix, for preprocessing values no data set
  can use."""
  input_pipeline.Preprocessing.from_config(config)
