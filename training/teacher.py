"""The frozen teacher of distillation: built, read, placed and
fingerprinted.

`teacher_model` is any model name of `models.create_model`; its weights
come from `teacher_init_from` through the readers `init_from` uses
(`weights/factory.py`: any published format, an export, a workdir or
checkpoint of this project, local or gs://), fitted without a new head.
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
a resume reads its file again, and refuses one whose size or digest
differs from the one the checkpoint's config records.
"""

import dataclasses
import hashlib
import re
from typing import Any

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import ml_collections

import models
from runtime import checkpointing
from runtime import mixed_precision
from runtime import paths
from runtime import sharding
from training import config_checks
from weights import factory
from weights import fitting
from weights import pretrained

# The key of the checkpoint's config that records the teacher's file.
FINGERPRINT_KEY = checkpointing.TEACHER_FILE_KEY


@dataclasses.dataclass
class Teacher:
  graphdef: Any  # nnx.GraphDef of the teacher model
  state: nnx.State  # every variable of it, in the compute dtype, placed
  sharding: Any  # the NamedShardings of `state`
  fingerprint: dict  # {'path', 'size', 'sha256'} of its weights


def teacher_config(config, conventions: dict,
                   model_options: dict) -> ml_collections.ConfigDict:
  """The config the teacher is built from: the run's, with model
  `teacher_model` at its standard depth, no dropout, and the file's
  conventions and model options."""
  built = ml_collections.ConfigDict(config.to_dict())
  built.update(model=config.teacher_model, num_layers=0, dropout_rate=0.0,
               drop_path_rate=0.0, vit_distillation_token=False,
               feature_batch_norm=False)
  built.update({key: value for key, value in conventions.items()
                if key != 'model' and key in built})
  built.update({key: value for key, value in model_options.items()
                if key in built})
  return built


def _build(config, num_classes: int, in_channels: int):
  return models.create_model(config.model, num_classes, in_channels,
                             dtype=mixed_precision.compute_dtype(config),
                             rngs=nnx.Rngs(config.seed),
                             **models.options(config))


def as_teacher_error(error: Exception) -> ValueError:
  """A reader's or fitting's message, about the teacher's keys."""
  message = re.sub(r'\binit_(from|format)', r'teacher_init_\1', str(error))
  message = message.replace('--config.model=', '--config.teacher_model=')
  return ValueError(f'teacher: {message}')


def create_teacher(config, info, mesh) -> Teacher | None:
  """The run's teacher with the weights of `config.teacher_init_from`,
  placed on `mesh`; None without `config.teacher_model`. Every mistake is
  one ValueError line naming the fix."""
  if not config.teacher_model:
    return None
  num_classes, in_channels = info.num_classes, info.image_shape[-1]
  path = config.teacher_init_from
  try:
    first = teacher_config(config, {}, {})
    target = fitting.model_shapes(nnx.eval_shape(
        lambda: _build(first, num_classes, in_channels)))
    weights = factory.read(path, config.teacher_init_format, target)
  except ValueError as e:
    raise as_teacher_error(e) from None
  head = weights.arrays.get('head.bias')
  config_checks.check_teacher_classes(
      None if head is None else head.shape[0], num_classes, path)
  built = teacher_config(config, weights.conventions, weights.model_options)
  try:  # every check before a real array is made
    arrays, notes = fitting.fit(weights, fitting.model_shapes(nnx.eval_shape(
        lambda: _build(built, num_classes, in_channels))), built,
                                new_head=False)
  except ValueError as e:
    raise as_teacher_error(e) from None
  dtype = mixed_precision.compute_dtype(config)
  static = {}

  def init():
    static['graphdef'], state = nnx.split(
        _build(built, num_classes, in_channels))
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else x, state)

  state_sharding = sharding.state_shardings(jax.eval_shape(init), mesh)
  state = pretrained.place_arrays(
      jax.jit(init, out_shardings=state_sharding)(), arrays)
  logging.info('Teacher %s (%s) from %s: %d arrays, frozen, in %s%s.',
               built.model, weights.source, path, len(arrays),
               jnp.dtype(dtype).name, ''.join(f'; {n}' for n in notes if n))
  return Teacher(static['graphdef'], state, state_sharding,
                 fingerprint(path))


def fingerprint(name: str) -> dict:
  """{'path', 'size', 'sha256'} of the teacher's weights: a file's bytes;
  of a directory (a workdir: its newest checkpoint), every file under it,
  each with its name relative to it."""
  root = paths.path(name)
  files = [root]
  if root.is_dir():
    root = paths.path(checkpointing.checkpoint_dir(name) or name)
    files = sorted(paths.files_under(root), key=str)
  digest, size = hashlib.sha256(), 0
  for file in files:
    if file != root:
      digest.update(str(file.relative_to(root)).encode() + b'\0')
    with file.open('rb') as stream:
      for chunk in iter(lambda: stream.read(1 << 22), b''):
        digest.update(chunk)
        size += len(chunk)
  return {'path': str(name), 'size': size, 'sha256': digest.hexdigest()}


def check_same_teacher(saved_config: dict | None, current: dict,
                       step: int) -> None:
  """Refuses to resume a checkpoint distilled from another teacher file
  than the one `teacher_init_from` now holds."""
  saved = (saved_config or {}).get(FINGERPRINT_KEY)
  if not saved or (saved['size'], saved['sha256']) == (current['size'],
                                                       current['sha256']):
    return
  raise config_checks.ConfigError(
      f'teacher_init_from {current["path"]!r} has changed since the '
      f'checkpoint at step {step} ({current["size"]} bytes, sha256 '
      f'{current["sha256"][:12]}..., it recorded {saved["size"]} bytes, '
      f'{saved["sha256"][:12]}... at {saved["path"]!r}); pass the teacher '
      'it was trained with, or a new --workdir')
