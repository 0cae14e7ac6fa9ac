"""What the tests of export.py's formats share: one small run of each
family, written as a checkpoint of random weights and statistics, and the
command run as users run it."""

import subprocess
import sys

import jax
import numpy as np

from configs import default
import helpers
import input_pipeline
from processes import REPO
from processes import cpu_environment
from runtime import checkpointing
from training import state as train_state

NUM_CLASSES = 5
CLASSES = tuple(f'class_{i}' for i in range(NUM_CLASSES))
# One small run per family, at a small image size each takes (a Swin's
# windows of 2 at 64 px: maps 16, 8, 4, 2); the ViTs with two blocks, one with
# the distillation token and timm's conventions, one with big_vision's.
RUNS = {
    'resnet': dict(model='ResNet18', image_size=32,
                   resnet_padding='symmetric'),
    'vit_distilled': dict(model='ViT_Ti16', num_layers=2, image_size=32,
                          vit_pool='cls', vit_posemb='learn',
                          vit_gelu='exact', vit_distillation_token=True),
    'vit_gap': dict(model='ViT_S16', num_layers=2, image_size=48,
                    vit_pool='gap', vit_posemb='sincos2d', vit_gelu='tanh'),
    'convnext': dict(model='ConvNeXt_T', image_size=32),
    'convnext_v2': dict(model='ConvNeXtV2_T', image_size=32),
    'swin': dict(model='Swin_T', image_size=64, swin_window=2),
    'regnet': dict(model='RegNetY_4GF', image_size=32),
}


def run_config(**overrides):
  """The default config on fake data, stacks rolled, with `overrides` (one
  of RUNS)."""
  config = default.get_config()
  config.update(dataset='fake', scan_unroll=1, **overrides)
  return config


def initial_state(config, noise=0.02):
  """The graph definition and train state of `config`'s model on 3-channel
  images of NUM_CLASSES classes, as a run builds it: its initial parameters
  plus `noise` x normal noise (a zero head predicts nothing), its BatchNorm
  statistics moved off their initial 0 and 1, and so its moving average,
  if any, with other noise."""
  info = input_pipeline.DatasetInfo(
      NUM_CLASSES, (config.image_size, config.image_size, 3), 8, 8, CLASSES)
  graphdef, state, _ = train_state.create_train_state(config, info,
                                                      lambda _: 0.0)
  # Drawn and added by NumPy: JAX, op by op, compiles a program per shape.
  rng = np.random.default_rng(1)
  noisy = lambda tree, draw: jax.tree.map(
      lambda x: jax.device_put(
          (np.asarray(x) + noise * draw(x.shape)).astype(x.dtype)), tree)

  def noisy_weights(weights):
    return {'params': noisy(weights['params'], rng.standard_normal),
            'model_state': noisy(weights['model_state'], rng.random)}
  state = state.replace(**noisy_weights(
      {'params': state.params, 'model_state': state.model_state}))
  if state.ema is not None:  # other noise: an average of other weights
    state = state.replace(ema=noisy_weights(state.ema))
  return graphdef, state


def write_run(workdir, config, noise=0.02):
  """A workdir holding one checkpoint, at step 1, of `initial_state`;
  returns its graph definition and the state written."""
  graphdef, state = initial_state(config, noise)
  manager = checkpointing.create_manager(str(workdir), 1)
  checkpointing.save(manager, 1, state, config, CLASSES)
  manager.wait_until_finished()
  manager.close()
  return graphdef, state


def export_command(workdir, output, *flags) -> subprocess.CompletedProcess:
  """export.py as a user runs it."""
  return subprocess.run(
      [sys.executable, 'export.py', f'--workdir={workdir}',
       f'--output={output}', *flags], cwd=REPO, capture_output=True,
      text=True, env=cpu_environment(1), timeout=600, check=False)


def images(config, count=2):
  """`count` images of `config`'s size."""
  return helpers.images(config.image_size, seed=2, count=count)


def assert_close_to_scale(logits, expected, tolerance):
  """The largest difference at most `tolerance` of the largest logit, of a
  network whose layers all count."""
  scale = np.abs(expected).max()
  assert scale > 0.01
  assert np.abs(logits - expected).max() <= tolerance * scale
