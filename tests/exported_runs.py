"""What the tests of export.py's formats share: one small run of each
family, written as a checkpoint of random weights and statistics, and the
command run as users run it."""

import json
import subprocess
import sys

from flax import nnx
import jax
import numpy as np
import safetensors

from configs import default
from exporting import timm_files
import helpers
import input_pipeline
import models
from processes import REPO
from processes import cpu_environment
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from training import run_state
from weights import fitting
from weights import pretrained
from weights import timm_vit

NUM_CLASSES = 5
CLASSES = tuple(f'class_{i}' for i in range(NUM_CLASSES))
# One small run per family, its smallest member at a small image size each
# takes (a Swin's windows of 2 at 64 px: maps 16, 8, 4, 2); the ViTs with two
# blocks, one with the distillation token and timm's conventions, one with
# big_vision's, and one with the published backbones' options at once
# (patch 14 at 42 px, DINOv2's layer scale and registers, SigLIP's MAP
# head, which here attends to the registers too). (The ConvNeXts' exports
# hold timm's 1x1-convolution MLPs, `conv_mlp`; the larger ConvNeXts'
# linear MLPs: test_export_timm.py.)
RUNS = {
    'resnet': dict(model='ResNet18', image_size=32,
                   resnet_padding='symmetric'),
    'vit_distilled': dict(model='ViT_Ti16', num_layers=2, image_size=32,
                          vit_pool='cls', vit_posemb='learn',
                          vit_gelu='exact', vit_distillation_token=True),
    'vit_gap': dict(model='ViT_S16', num_layers=2, image_size=48,
                    vit_pool='gap', vit_posemb='sincos2d', vit_gelu='tanh'),
    'vit_backbone': dict(model='ViT_S14', num_layers=2, image_size=42,
                         vit_pool='map', vit_posemb='learn', vit_gelu='exact',
                         vit_layer_scale=True, layer_scale_init=1e-5,
                         vit_registers=4),
    'convnext': dict(model='ConvNeXt_Atto', image_size=32),
    'convnext_v2': dict(model='ConvNeXtV2_Atto', image_size=32),
    'swin': dict(model='Swin_T', image_size=64, swin_window=2),
    'regnet': dict(model='RegNetY_200MF', image_size=32),
}


def run_config(**overrides):
  """The default config on fake data, stacks rolled, with `overrides` (one
  of RUNS)."""
  config = default.get_config()
  config.update(dataset='fake', scan_unroll=1, **overrides)
  return config


def initial_state(config):
  """The graph definition and a train state of `config`'s model on 3-channel
  images of NUM_CLASSES classes, its arrays drawn in NumPy
  (`helpers.random_arrays`: kernels at He initialisation's scale, the rest
  within 0.02 of 0 or 1; none at its initial value: a zero head or unit
  statistics would hide a misread array); its moving average, if any,
  other draws. Built abstractly: each full-size family's initialisers
  would compile for seconds."""
  info = input_pipeline.DatasetInfo(
      NUM_CLASSES, (config.image_size, config.image_size, 3), 8, 8, CLASSES)
  made_by_init = {}

  def init():
    made_by_init['graphdef'], state, _ = run_state.create_train_state(
        config, info, lambda _: 0.0,
        dtype=models.compute_dtype(config))
    return state
  shapes = jax.eval_shape(init)
  rng = np.random.default_rng(1)

  def spread(name, shape):  # kernels at He initialisation's scale
    return np.sqrt(2 / np.prod(shape[:-1])) if name == 'kernel' else 0.02

  def weights():
    return {'params': helpers.random_arrays(shapes.params, rng, spread),
            'model_state': helpers.random_arrays(shapes.model_state, rng,
                                                 spread)}
  zeros = lambda tree: jax.tree.map(
      lambda shape: jax.device_put(np.zeros(shape.shape, shape.dtype)), tree)
  state = shapes.replace(
      step=zeros(shapes.step), opt_state=zeros(shapes.opt_state),
      nonfinite_streak=zeros(shapes.nonfinite_streak),
      loss_scale=zeros(shapes.loss_scale),
      ema=None if shapes.ema is None else weights(), **weights())
  return made_by_init['graphdef'], state


def write_run(workdir, config):
  """A workdir holding one checkpoint, at step 1, of `initial_state`;
  returns its graph definition and the state written."""
  graphdef, state = initial_state(config)
  manager = checkpointing.create_manager(str(workdir), 1)
  checkpointing.save(manager, 1, state, compatibility.as_json(config), CLASSES)
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


def timm_model(path, num_classes=NUM_CLASSES):
  """timm's model of an export, built as the file's metadata says (its
  name, arguments and evaluation preprocessing), its weights loaded
  strictly."""
  # PyTorch only in the processes that run timm.
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  with safetensors.safe_open(path, framework='numpy') as f:
    metadata = f.metadata()
  model = helpers.import_timm().create_model(
      metadata[timm_vit.MODEL_KEY], num_classes=num_classes,
      pretrained_cfg_overlay=json.loads(
          metadata[timm_files.PRETRAINED_CFG_KEY]),
      **json.loads(metadata[timm_vit.ARGS_KEY]))
  model.load_state_dict(safetensors.torch.load_file(path), strict=True)
  return model.eval()


def assert_close_to_scale(logits, expected, tolerance):
  """The largest difference at most `tolerance` of the largest logit, of a
  network whose layers all count."""
  scale = np.abs(expected).max()
  assert scale > 0.01
  assert np.abs(logits - expected).max() <= tolerance * scale


def assert_reads_back_bit_for_bit(workdir, config, path):
  """The export `path` of the run in `workdir`, read by `init_from` with
  `config`, gives every trained array of the run exactly."""
  model = run_state.load_trained(workdir, default.get_config())[1].model()
  original = pretrained.trained_arrays(model)
  _, *states = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
  config.init_from = path
  loaded = pretrained.load(path, 'auto', models.settings(config), states,
                           new_head=False)
  read = {name: np.asarray(variable.get_value())
          for state in loaded
          for name, variable in fitting.named_variables(state).items()
          if name in original}
  assert read.keys() == original.keys()
  for name, value in original.items():
    np.testing.assert_array_equal(read[name], value, err_msg=name)
