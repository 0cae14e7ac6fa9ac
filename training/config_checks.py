"""Checks of what a user passes in (config file, overrides, config values,
workdir, data set), in one place.

Each mistake becomes one line that names the fix (and lists the valid
names), before anything is compiled or written. `validate_config` raises
ConfigError; the flag, workdir and factory checks raise ValueError, which
`as_config_error` turns into ConfigErrors; `main` prints them.
"""

import contextlib
import difflib
import importlib.util
import os
import re
import sys
import tempfile
import uuid

from absl import flags
import jax
import ml_collections

from evaluators import evaluator_types
import input_pipeline
from layers import stacked
import models
from runtime import paths
from runtime import sharding
from runtime import storage_faults
from runtime import mixed_precision
from training import distillation
from training import evaluator_checks
from training import optimizer

STEP_MODES = ('jit', 'pmap')


class ConfigError(ValueError):
  """A config value the trainer cannot run with; the message names the fix.
  `fixes`: the config values it names, when they are known as values
  ({key: value}), e.g. those that build the model a weights file fits."""

  def __init__(self, message: str, fixes: dict | None = None):
    super().__init__(message)
    self.fixes = fixes or {}


@contextlib.contextmanager
def as_config_error():
  """The checks' and factories' ValueErrors (unknown names, unusable
  workdirs, data sets), as ConfigErrors, with the fixes they name."""
  try:
    yield
  except ValueError as e:
    raise ConfigError(str(e), getattr(e, 'fixes', None)) from None


def validate_config(config, devices=None) -> None:
  """Raises ConfigError, naming the fix, for values no run on `devices`
  (default: this run's) can use."""
  devices = devices or jax.devices()
  num_devices = len(devices)
  checks = [
      (config.batch_size > 0, 'batch_size must be positive'),
      (config.batch_size % num_devices == 0,
       f'batch_size {config.batch_size} is not divisible by the '
       f'{num_devices} devices; use a multiple of {num_devices}'),
      (config.num_train_steps > 0 or
       (config.num_train_steps == -1 and config.num_epochs > 0),
       'set num_train_steps > 0, or num_train_steps=-1 with num_epochs > 0'),
      *learning_rate_checks(config),
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
      (config.log_every_steps > 0 and config.eval_every_steps > 0 and
       config.checkpoint_every_steps > 0,
       'log_every_steps, eval_every_steps and checkpoint_every_steps must be '
       'positive'),
      (config.keep_checkpoints > 0, 'keep_checkpoints must be positive'),
      (config.restore_retry_seconds >= 0, 'restore_retry_seconds must be >= '
       '0 (seconds a restore retries storage errors; 0: no retry)'),
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
  check_grad_accum_steps(config.grad_accum_steps, config.batch_size, devices)
  check_distillation(config)
  check_image_size(config)
  if config.step_mode not in STEP_MODES:
    raise ConfigError(f'unknown step_mode {config.step_mode!r}; valid names: '
                      f'{", ".join(STEP_MODES)}')
  with as_config_error():
    mesh_shape = sharding.mesh_shape(config.mesh, num_devices,
                                     sharding.num_slices(devices))
  if config.step_mode == 'pmap' and mesh_shape[1] != 1:
    raise ConfigError("step_mode 'pmap' replicates the parameters; set "
                      "--config.mesh.fsdp=1 or use step_mode 'jit' for FSDP")
  with as_config_error():
    stacked.remat_policy_by_name(config.remat_policy)
    check_preprocessing(config)
    mixed_precision.compute_dtype(config)
    optimizer.update_rule(config, 0.0)
    evaluator_checks.check_evaluators(config.evals)


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
    raise ConfigError(f'grad_accum_steps {k} must be >= 1; {fix}')
  process_batch = batch_size // process_count
  if process_batch % k:
    raise ConfigError(
        f'grad_accum_steps {k} does not divide the {process_batch} examples '
        f'each process loads per step; {fix}')
  if per_device % k:
    raise ConfigError(
        f'grad_accum_steps {k} makes micro-batches of {batch_size / k:g} '
        f'examples, which do not split evenly over the {devices} devices; '
        f'{fix}')


def check_distillation(config) -> None:
  """Raises ConfigError, naming the fix, for a teacher and distillation
  settings that do not go together."""
  kind, teacher = config.distillation_type, config.teacher_model
  if kind not in distillation.DISTILLATION_TYPES:
    raise ConfigError(f'unknown distillation_type {kind!r}; valid names: '
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
      raise ConfigError(message)


def check_image_size(config) -> None:
  """Raises ConfigError unless the model and the teacher can take images
  of `image_size`: one line naming the sizes they can."""
  with as_config_error():
    models.check_image_size(config.model, config.image_size,
                            config.swin_window)
  if config.teacher_model:
    try:
      models.check_image_size(config.teacher_model, config.image_size,
                              config.swin_window)
    except ValueError as e:
      raise ConfigError(f'teacher_model {e}') from None


def check_teacher_classes(teacher_classes: int | None, num_classes: int,
                          path: str) -> None:
  """Raises ConfigError unless the teacher's head predicts the data set's
  classes."""
  if teacher_classes != num_classes:
    raise ConfigError(
        f'teacher_init_from {path!r} predicts '
        f'{teacher_classes or "no"} classes, the data set has '
        f'{num_classes}; pass a teacher trained on this data set\'s classes')


def check_preprocessing(config) -> None:
  """Raises ValueError, naming the fix, for preprocessing values no data set
  can use."""
  input_pipeline.Preprocessing.from_config(config)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (for `app.run(flags_parser=...)`), with config-file
  and override mistakes reported as one line and exit code 1."""
  try:
    remaining = flags.FLAGS(argv)
    _ = flags.FLAGS.config.keys()  # config_flags defers a missing file's error
  except Exception as e:  # pylint: disable=broad-except
    # config_flags raises IOError, AttributeError, KeyError, TypeError or
    # flags.Error; find the cause ourselves and name the fix.
    sys.exit(f'Error: {describe_flag_error(argv, e)}')
  return remaining


def describe_flag_error(argv: list[str], error: Exception) -> str:
  """The one-line cause and fix of a flag-parsing failure."""
  path = _flag_value(argv, 'config')
  if path is not None:
    path, _, option = path.partition(':')
    try:
      config = load_config_file(path, option)
    except ValueError as e:
      return str(e)
    for key in _override_keys(argv):
      try:
        _get_nested(config, key)
      except (KeyError, AttributeError):
        if key.startswith('evals.'):
          return unknown_evaluator_message(key, path, option)
        return unknown_key_message(key, config, path)
  return str(error).strip().splitlines()[0]


def load_config_file(path: str,
                     option: str = '') -> ml_collections.ConfigDict:
  """`get_config()` of the file at `path` (`get_config(option)` with an
  option, as `--config=PATH:OPTION` passes it), or a ValueError naming the
  fix."""
  if not os.path.isfile(path):
    raise ValueError(f'config file {path!r} not found; pass an existing '
                     'file, e.g. --config=configs/default.py')
  spec = importlib.util.spec_from_file_location('user_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not callable(getattr(module, 'get_config', None)):
    raise ValueError(f'config file {path!r} has no get_config(); define '
                     '`def get_config():` returning an ml_collections.'
                     'ConfigDict')
  config = module.get_config(option) if option else module.get_config()
  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(f'get_config() of {path!r} returned '
                     f'{type(config).__name__}, not an ml_collections.'
                     'ConfigDict; return the config')
  return config


def unknown_key_message(key: str, config, path: str) -> str:
  keys = sorted(_flat_keys(config))
  close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
  hint = (f'close keys: {", ".join(close)}' if close
          else 'see the key table in README.md')
  return f'--config.{key}: {path} has no key {key!r}; {hint}'


def unknown_evaluator_message(key: str, path: str, option: str) -> str:
  """The fix of an override of an evaluator the config does not have: the
  config option that adds one of the type, where the config takes it."""
  name = key.split('.')[1]
  kind = name if name in evaluator_types.SETTINGS else 'knn'
  with_evaluator = f'{option},{kind}' if option else kind
  try:
    added = load_config_file(path, with_evaluator).evals
  except ValueError:
    added = {}
  if kind not in added:
    return (f'--config.{key}: {path} has no evaluator {name!r} and no option '
            'adding one; define config.evals in a config file of your own '
            '(README.md, "Evaluators and distillation")')
  config = f'{path}:{option}' if option else path
  return (f'--config.{key}: {config} has no evaluator {name!r}; add one '
          f'with --config={path}:{with_evaluator} (an option per type: '
          f'{", ".join(evaluator_types.SETTINGS)}), then set its settings '
          f'by key, e.g. --config.evals.{kind}.every_steps=100')


def _flat_keys(config, prefix: str = ''):
  for key, value in config.items():
    yield prefix + key
    if isinstance(value, ml_collections.ConfigDict):
      yield from _flat_keys(value, f'{prefix}{key}.')


def _get_nested(config, dotted: str):
  for part in dotted.split('.'):
    config = config[part]
  return config


def _flag_value(argv: list[str], name: str) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      return arg.split('=', 1)[1]
    if arg == f'--{name}' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _override_keys(argv: list[str]) -> list[str]:
  """KEY of each --config.KEY[=VALUE] (and --noconfig.KEY) in `argv`."""
  return [m.group(1) for arg in argv
          if (m := re.match(r'--(?:no)?config\.([^=]+)', arg))]


def check_workdir(workdir: str) -> None:
  """Raises ValueError unless `workdir` is, or can become, a writable
  directory: a local one, or one in a gs:// bucket."""
  if paths.is_remote(workdir):
    _check_remote_workdir(workdir)
    return
  path = os.path.abspath(workdir)
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f'workdir {workdir!r}: {existing} is a file, not a '
                     'directory; pass a directory path as --workdir')
  try:  # a real probe: permission bits do not bind root, read-only mounts do
    tempfile.TemporaryFile(dir=existing).close()
  except OSError as e:
    raise ValueError(f'workdir {workdir!r} is not writable ({e.strerror} in '
                     f'{existing}); choose another --workdir or fix its '
                     'permissions') from None


def _check_remote_workdir(workdir: str) -> None:
  """A supported scheme, not an object, and a bucket that takes a write."""
  scheme = paths.scheme(workdir)
  if scheme not in paths.REMOTE_SCHEMES:
    raise ValueError(f'workdir {workdir!r}: {scheme}:// is not supported; '
                     'use a local directory or a gs://BUCKET/DIR path')
  path = paths.path(workdir)
  if path.is_file():
    raise ValueError(f'workdir {workdir!r} is an object, not a directory; '
                     'pass a directory path as --workdir')
  probe = path / f'.write-probe-{uuid.uuid4().hex}'
  try:  # what a save needs: the bucket exists and takes a write
    probe.write_bytes(b'')
    probe.unlink()
  except Exception as e:  # pylint: disable=broad-except
    # gcsfs and google-auth report a missing bucket, a refused write and
    # missing credentials with their own exception types.
    bucket = workdir.split('://', 1)[1].split('/', 1)[0]
    if storage_faults.unavailable(e):
      raise ValueError(
          f'bucket {bucket!r} did not answer a write to workdir {workdir!r} '
          f'({storage_faults.first_line(e)}); nothing was changed; run the '
          'same command again once it answers') from None
    raise ValueError(
        f'workdir {workdir!r} is not writable ({type(e).__name__}: '
        f'{str(e).splitlines()[0][:200]}); check that bucket {bucket!r} '
        'exists and that these credentials may write to it (`gcloud storage '
        f'buckets describe gs://{bucket}`), or choose another --workdir'
    ) from None
