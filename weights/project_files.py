"""This project's own weights: a workdir or checkpoint of the trainer, and
the `.safetensors` files of export.py.

Both are in this project's names already; the config the weights were
trained with gives the conventions they compute with.
"""

import contextlib
import json
import logging

import jax
import numpy as np
import orbax.checkpoint as ocp

from runtime import checkpoint_reads
from runtime import checkpointing
from runtime import network_keys
from runtime import paths
from weights import records
from weights import torch_files

@contextlib.contextmanager
def _no_item_metadata_warning():
  """Without orbax's warning that `state/_CHECKPOINT_METADATA` does not
  exist: read as a checkpoint of its own, the `state` item has none, since
  the checkpoint manager writes that file once per step, one level up. It
  means nothing here, and reads like a damaged checkpoint."""
  def shown(record: logging.LogRecord) -> bool:
    return not (isinstance(record.msg, str) and
                record.msg.startswith('Metadata file does not exist'))
  absl_logger = logging.getLogger('absl')
  absl_logger.addFilter(shown)
  try:
    yield
  finally:
    absl_logger.removeFilter(shown)


# Metadata key of export.py's files: the config the weights were trained with.
EXPORT_CONFIG_KEY = 'config'
EXPORT_STEP_KEY = 'step'
EXPORT_CLASSES_KEY = 'class_names'
# The keys of the model's shape that a model built for these weights (a
# teacher) takes from their config, and that a run starting from them may
# set otherwise (their arrays' shapes are checked; a linear probe adds the
# feature normalisation).
MODEL_OPTIONS = ('num_layers', 'width', 'layer_scale_init',
                 'feature_batch_norm')


def read_checkpoint(path: str, target: dict) -> records.Weights:
  """This project's workdir, its checkpoints directory, or one checkpoint."""
  del target  # stored in this project's names already
  return _read_checkpoint_weights(path, ema=False)


def read_checkpoint_ema(path: str, target: dict) -> records.Weights:
  """The moving average of the weights (`ema_decay`) in this project's
  workdir, checkpoints directory or checkpoint."""
  del target
  return _read_checkpoint_weights(path, ema=True)


def _read_checkpoint_weights(path: str, ema: bool) -> records.Weights:
  step_dir = checkpointing.checkpoint_dir(path)
  if step_dir is None:
    raise ValueError(f'init_from {path!r} holds no checkpoint of this '
                     f'project (no {checkpointing.CHECKPOINTS_DIR}/STEP with a '
                     'state); pass a workdir, its checkpoints directory or '
                     'one checkpoint')
  config = checkpointing.saved_config(step_dir)
  if config is None:
    raise ValueError(f'checkpoint {step_dir!r} has no saved config; pass a '
                     'checkpoint this trainer wrote')
  state_dir = paths.path(step_dir) / 'state'

  # Read as a restore reads: again after storage errors, until a stall;
  # damage ends the read in one line.
  tree = checkpointing.saved_state_metadata(step_dir)
  if ema and not tree.get('ema'):
    raise ValueError(f'checkpoint {step_dir!r} holds no moving average of '
                     'the weights (trained with ema_decay 0); drop the EMA '
                     'option')
  weights = tree['ema'] if ema else tree
  wanted = {key: weights[key] for key in ('params', 'model_state')}
  if ema:
    wanted = {'ema': wanted}

  def read_arrays():
    with ocp.PyTreeCheckpointer() as reader, _no_item_metadata_warning():
      return reader.restore(state_dir, args=ocp.args.PyTreeRestore(
          item=wanted, partial_restore=True,
          restore_args=jax.tree.map(
              lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)))
  restored = checkpoint_reads.read_retried(read_arrays,
                                           f'checkpoint {step_dir}')
  if ema:
    restored = restored['ema']
  arrays = {}
  for part in restored.values():
    for path_keys, value in jax.tree_util.tree_flatten_with_path(part)[0]:
      arrays[records.dotted(path_keys)] = value
  if config.get('vit_posemb') == 'sincos2d':
    arrays.pop(records.POSEMB, None)  # computed, not learned
  return _own_weights(arrays, config, f"this project's checkpoint {step_dir}")


def read_export(path: str, target: dict) -> records.Weights:
  """A `.safetensors` file written by export.py."""
  del target
  metadata, arrays = torch_files.read_safetensors(path)
  if EXPORT_CONFIG_KEY not in metadata:
    raise ValueError(f'init_from {path!r} has no config in its metadata, so '
                     'export.py did not write it; pass --config.init_format '
                     'for its source (timm, torchvision)')
  config = json.loads(metadata[EXPORT_CONFIG_KEY])
  return _own_weights(arrays, config, f"this project's export {path}")


def _own_weights(arrays: dict, config: dict, source: str) -> records.Weights:
  """Weights of this project, with the conventions of the config they
  were trained with."""
  family = records.family_of(arrays)
  # Every other key that defines the network but the image size (a run
  # resamples the position embedding to its own).
  conventions = {key: config[key]
                 for key in network_keys.network_keys(family)
                 if key not in (*MODEL_OPTIONS, 'image_size')
                 and key in config}
  shape_keys = ('model', 'num_layers', 'width')
  suggestion = {key: config[key] for key in shape_keys if key in config}
  model_options = {key: config[key] for key in MODEL_OPTIONS if key in config}
  return records.Weights(arrays, source, family, conventions,
                         suggestion=suggestion, model_options=model_options)
