"""The frozen teacher of distillation: built, read, placed and
fingerprinted.

The teacher (the config's `teacher_model`) is any model name of
`models.create_model`; its weights come from `teacher_init_from` through
the readers `init_from` uses (`weights/factory.py`: any published format,
an export, a workdir or checkpoint of this project, local or gs://),
fitted without a new head.
The model is built with the conventions the file computes with (the
reader's `conventions`: padding, GELU, pooling, position embedding,
distillation token) and, for this project's own files, the shape keys it
was trained with (`num_layers`, `width`, ...); published files get the
model's standard depth. Everything else (image size, scanning, precision)
is the run's. Its arrays are created in place with the shardings of
`runtime/sharding.py` (FSDP-split like the student's) and held in the
run's compute dtype: no gradient or optimizer state ever needs more.

The teacher rides in the train state (`TrainState.teacher`) so that the
compiled step gets it as an argument, and is left out of every checkpoint:
a resume reads its file again, and refuses another teacher than the one
the checkpoint's config records (`check_same_teacher`), or none.

Its predictions on the eval split never change: `EvalPredictions` runs
it once over the eval batches, as the run starts, and gives its top-1
classes with the batches to every evaluation (and to the moving average's
pass) instead of running it again.
"""

import dataclasses
import hashlib
import itertools
import re
from typing import Any

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp

import input_pipeline
import models
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from runtime import config_error
from runtime import paths
from runtime import sharding
from training import distillation
from weights import factory
from weights import fitting
from weights import pretrained

# The key of the checkpoint's config that records the teacher's weights.
FINGERPRINT_KEY = compatibility.TEACHER_FILE_KEY


@dataclasses.dataclass
class Teacher:
  graphdef: Any  # nnx.GraphDef of the teacher model
  state: nnx.State  # every variable of it, in the compute dtype, placed
  sharding: Any  # the NamedShardings of `state`
  fingerprint: dict  # what identifies its weights: see `fingerprint`


def teacher_settings(model: str, run_options: dict, conventions: dict,
                     model_options: dict) -> dict:
  """The settings (`models.settings`) the teacher is built from: `model`
  at its standard depth, no dropout, the run's options `run_options`
  (`models.options`) otherwise, and the file's conventions and model
  options."""
  settings = {**run_options, 'model': model, 'num_layers': 0,
              'dropout_rate': 0.0, 'drop_path_rate': 0.0,
              'vit_distillation_token': False, 'feature_batch_norm': False}
  settings.update({key: value for key, value in conventions.items()
                   if key != 'model' and key in settings})
  settings.update({key: value for key, value in model_options.items()
                   if key in settings})
  return settings


def as_teacher_error(error: Exception) -> ValueError:
  """A reader's or fitting's message, about the teacher's keys (fitting
  with `fixed_depth` names no key but the model: the teacher's depth and
  width are its file's or its model's standard ones)."""
  message = re.sub(r'\binit_(from|format)', r'teacher_init_\1', str(error))
  message = re.sub(r'--config\.model\b', '--config.teacher_model', message)
  return ValueError(f'teacher: {message}')


def create_teacher(model: str, init_from: str, init_format: str,
                   run_options: dict, info, mesh, *, dtype, seed: int,
                   abstract: bool = False) -> Teacher | None:
  """The teacher `model` (None when it is '') with the weights of
  `init_from` (read as `init_format`), of the run's model options
  `run_options` (`models.options`) where its file sets none, placed on
  `mesh`, computing in `dtype`, its variables initialised from `seed`
  before the file's replace them. With `abstract`, no file is read:
  `model` at its standard depth, its arrays shapes and shardings alone
  (for compiling). Every mistake is one ValueError line naming the fix."""
  if not model:
    return None

  def build(settings: dict) -> nnx.Module:
    return models.create_model(settings['model'], info.num_classes,
                               info.image_shape[-1], dtype=dtype,
                               rngs=nnx.Rngs(seed),
                               **models.options(settings))
  if abstract:
    return _abstract_teacher(
        build, teacher_settings(model, run_options, {}, {}), mesh, dtype)
  try:
    probe = teacher_settings(model, run_options, {}, {})
    target = fitting.model_shapes(nnx.eval_shape(lambda: build(probe)))
    weights = factory.read(init_from, init_format, target)
  except ValueError as e:
    raise as_teacher_error(e) from None
  head = weights.arrays.get('head.bias')
  _check_classes(None if head is None else head.shape[0], info.num_classes,
                 init_from)
  built = teacher_settings(model, run_options, weights.conventions,
                           weights.model_options)
  try:  # every check before a real array is made
    arrays, notes = fitting.fit(weights, fitting.model_shapes(nnx.eval_shape(
        lambda: build(built))), built, new_head=False, fixed_depth=True)
  except ValueError as e:
    raise as_teacher_error(e) from None
  init, made_by_init = _initializer(build, built, dtype)
  state_sharding = sharding.state_shardings(jax.eval_shape(init), mesh)
  state = pretrained.place_arrays(
      jax.jit(init, out_shardings=state_sharding)(), arrays)
  logging.info('Teacher %s (%s) from %s: %d arrays, frozen, in %s%s.',
               built['model'], weights.source, init_from, len(arrays),
               jnp.dtype(dtype).name,
               ''.join(f'; {n}' for n in notes if n))
  return Teacher(made_by_init['graphdef'], state, state_sharding,
                 fingerprint(init_from))


def _check_classes(teacher_classes: int | None, num_classes: int,
                   path: str) -> None:
  """Raises ConfigError unless the teacher's head predicts the data set's
  classes."""
  if teacher_classes != num_classes:
    raise config_error.ConfigError(
        f'teacher_init_from {path!r} predicts '
        f'{teacher_classes or "no"} classes, the data set has '
        f'{num_classes}; pass a teacher trained on this data set\'s classes')


def _initializer(build, settings: dict, dtype):
  """`init() -> state`, every variable of the teacher `build(settings)`
  in `dtype`, and the dict where it leaves the graph definition."""
  made_by_init = {}

  def init():
    made_by_init['graphdef'], state = nnx.split(build(settings))
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else x, state)
  return init, made_by_init


def _abstract_teacher(build, settings: dict, mesh, dtype) -> Teacher:
  init, made_by_init = _initializer(build, settings, dtype)
  shapes = jax.eval_shape(init)
  state_sharding = sharding.state_shardings(shapes, mesh)
  state = jax.tree.map(lambda shape, placed: jax.ShapeDtypeStruct(
      shape.shape, shape.dtype, sharding=placed), shapes, state_sharding)
  return Teacher(made_by_init['graphdef'], state, state_sharding, {})


def top1_program(teacher: Teacher, mesh):
  """The teacher's top-1 classes of a batch of images, `(state, images) ->
  int32 classes` compiled by `jax.jit`, placed as the batch."""
  return jax.jit(lambda state, images: jnp.argmax(
      distillation.teacher_logits(teacher.graphdef, state, images),
      -1).astype(jnp.int32), out_shardings=sharding.batch_sharding(mesh))


class EvalPredictions:
  """A data set's eval batches, each with the teacher's top-1 class of its
  images as 'teacher_top1' (int32, placed as the labels), and the
  teacher's accuracy on them (`metrics`: `eval_teacher_accuracy`).

  The teacher runs over the first `steps` eval batches (-1: all) once,
  here, while its arrays are the run's: the train step donates the state
  that holds them. Its predictions stay on the devices (an int per
  example) for every evaluation of this batch size and dtype."""

  def __init__(self, dataset, teacher: Teacher, mesh, *, batch_size: int,
               dtype, steps: int = -1):
    self.info = dataset.info
    self._dataset = dataset
    self._batch_size, self._dtype = batch_size, dtype
    batch_sharding = sharding.batch_sharding(mesh)
    top1 = top1_program(teacher, mesh)
    batches = dataset.eval_batches(batch_size, batch_sharding, dtype)
    self._top1, correct, examples = [], 0, 0
    try:
      for batch in itertools.islice(batches, steps if steps > 0 else None):
        if self._top1:  # one batch's images on the devices at a time
          jax.block_until_ready(self._top1[-1])
        self._top1.append(top1(teacher.state, batch['image']))
        mask = batch['mask'].astype(jnp.float32)
        correct += jnp.sum((self._top1[-1] == batch['label']) * mask)
        examples += jnp.sum(mask)
    finally:
      input_pipeline.close(batches)
    self.metrics = {'eval_teacher_accuracy': float(
        correct / max(float(examples), 1.0))}

  def eval_batches(self, batch_size: int, batch_sharding, dtype):
    if (batch_size, jnp.dtype(dtype)) != (self._batch_size,
                                          jnp.dtype(self._dtype)):
      raise ValueError(f'the teacher predicted batches of {self._batch_size} '
                       f'in {self._dtype}, not {batch_size} in {dtype}')
    batches = self._dataset.eval_batches(batch_size, batch_sharding, dtype)
    try:
      for batch, top1 in zip(batches, self._top1):
        yield {**batch, 'teacher_top1': top1}
    finally:
      input_pipeline.close(batches)


def eval_data(dataset, teacher: Teacher | None, mesh, *, batch_size: int,
              dtype, steps: int = -1):
  """The data set an evaluation with `teacher` (None: none) reads:
  `dataset` itself, or its `EvalPredictions`."""
  if teacher is None:
    return dataset
  return EvalPredictions(dataset, teacher, mesh, batch_size=batch_size,
                         dtype=dtype, steps=steps)


def fingerprint(name: str) -> dict:
  """What identifies the teacher's weights in `name`, read without their
  arrays. A workdir or checkpoint of this project: {'path', 'checkpoint'
  (the step directory it resolves to, its newest), 'identity'
  (`checkpointing.checkpoint_identity`)}. A file, or a directory of files:
  {'path', 'size', 'version'} (`paths.size_and_version`: the total size, the
  newest version), to which `check_same_teacher` adds its 'sha256'."""
  root = paths.path(name)
  step_dir = checkpointing.checkpoint_dir(name) if root.is_dir() else None
  if step_dir:
    return {'path': str(name), 'checkpoint': step_dir,
            'identity': checkpointing.checkpoint_identity(step_dir)}
  stamps = [paths.size_and_version(file) for file in _files(root)]
  return {'path': str(name), 'size': sum(size for size, _ in stamps),
          'version': max(version for _, version in stamps)}


def _files(root) -> list:
  return sorted(paths.files_under(root), key=str) if root.is_dir() else [root]


def _sha256(name: str) -> str:
  """The digest of every byte of the file `name`, or of every file under
  the directory `name`, each with its name relative to it."""
  root = paths.path(name)
  digest = hashlib.sha256()
  for file in _files(root):
    if file != root:
      digest.update(str(file.relative_to(root)).encode() + b'\0')
    with file.open('rb') as stream:
      for chunk in iter(lambda: stream.read(1 << 22), b''):
        digest.update(chunk)
  return digest.hexdigest()


def check_same_teacher(saved_config: dict | None, current: dict | None,
                       step: int) -> None:
  """Refuses to resume the checkpoint at `step` (its config
  `saved_config`; None when the run starts from scratch) with another
  teacher than the one it was distilled from: `current`, the fingerprint
  of this run's teacher (None without one).

  A file's `current` gets its 'sha256' here, for the run's checkpoints to
  record: read from the file at the run's first start, and at a resume
  only when its size or version differs from the recorded ones. The rule:
  a file of the recorded size and modification time (generation in a
  bucket) is the recorded file.
  """
  saved = (saved_config or {}).get(FINGERPRINT_KEY)
  if saved_config is not None and bool(
      saved_config.get('teacher_model')) != (current is not None):
    raise config_error.ConfigError(
        _teacher_added_or_removed(saved_config, current, step))
  if current is None:
    return
  if 'identity' not in current:
    # On every process, not process 0 alone: each reads the whole file
    # anyway to build the teacher, and each must refuse alike.
    recorded = saved and all(saved.get(key) == current[key]
                             for key in ('size', 'version'))
    current['sha256'] = saved['sha256'] if recorded else _sha256(
        current['path'])
  if not saved or _same_weights(saved, current):
    return
  if 'identity' in current and not {'identity', 'version'} & saved.keys():
    logging.warning('The checkpoint at step %d recorded its teacher as a '
                    'digest of all its files; not compared with %s.', step,
                    current['checkpoint'])
    return
  raise config_error.ConfigError(_teacher_changed(saved, current, step))


def _same_weights(saved: dict, current: dict) -> bool:
  if 'identity' in current:
    return saved.get('identity') == current['identity']
  return (saved.get('size'), saved.get('sha256')) == (current['size'],
                                                      current['sha256'])


def _teacher_added_or_removed(saved_config: dict, current: dict | None,
                              step: int) -> str:
  if current is not None:
    return (f'the checkpoint at step {step} was trained without a teacher '
            f'and this run distils from {current["path"]!r}; resume with '
            "--config.teacher_model='' --config.distillation_type=none, or "
            'use a new --workdir (with --config.init_from to start from it)')
  flags = ' '.join(
      f'--config.{key}={saved_config.get(key)}'
      for key in ('teacher_model', 'teacher_init_from', 'teacher_init_format',
                  'distillation_type')
      if key != 'teacher_init_format' or saved_config.get(key) != 'auto')
  return (f'the checkpoint at step {step} was distilled from teacher_model '
          f'{saved_config["teacher_model"]!r} and this run has no teacher; '
          f'resume with {flags}, or use a new --workdir')


def _teacher_changed(saved: dict, current: dict, step: int) -> str:
  if 'checkpoint' in saved and 'checkpoint' in current:
    # A teacher workdir that trained on: its recorded step is still there.
    pinned = paths.path(current['checkpoint']).parent / paths.path(
        saved['checkpoint']).name
    if pinned.is_dir() and checkpointing.checkpoint_identity(
        pinned) == saved['identity']:
      return (f'teacher_init_from {current["path"]!r} now holds a newer '
              f'checkpoint ({current["checkpoint"]}) than the one the '
              f'checkpoint at step {step} was distilled from; pin that one: '
              f'--config.teacher_init_from={pinned}, or use a new --workdir')
  return (f'teacher_init_from {current["path"]!r} has changed since the '
          f'checkpoint at step {step} (now {_describe(current)}; it recorded '
          f'{_describe(saved)} of {saved["path"]!r}); pass the teacher it '
          'was trained with, or a new --workdir')


def _describe(weights: dict) -> str:
  if 'identity' in weights:
    return (f'the checkpoint {weights["checkpoint"]}, metadata '
            f'{weights["identity"][:12]}...')
  return f'{weights["size"]} bytes, sha256 {weights["sha256"][:12]}...'
