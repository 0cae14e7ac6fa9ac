"""`export.py --format=timm`, checked against timm itself: each family's
exported file loads strictly into `timm.create_model` and computes the
project's logits; it reads back bit for bit; and the readers of timm's
files compute timm's own models."""

import json
import subprocess
import sys

from flax import nnx
import jax
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from configs import default
import export
from exporting import timm_files
import input_pipeline
import models
from processes import REPO
from processes import cpu_environment
from runtime import checkpointing
from training import run_state
from training import state as train_state
from weights import fitting
from weights import pretrained
from helpers import import_timm

# One worker builds each family's exported run once for every test of it.
pytestmark = pytest.mark.xdist_group('export_timm')

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


def run_config(run: str):
  config = default.get_config()
  config.update(dataset='fake', scan_unroll=1, **RUNS[run])
  return config


def write_run(workdir, config, noise=0.02):
  """A workdir holding one checkpoint of `config`'s model: its initial
  parameters plus `noise` x normal noise (a zero head predicts nothing), its
  BatchNorm statistics moved off their initial 0 and 1."""
  info = input_pipeline.DatasetInfo(
      NUM_CLASSES, (config.image_size, config.image_size, 3), 8, 8, CLASSES)
  _, state, _ = train_state.create_train_state(config, info, lambda _: 0.0)
  # Drawn and added by NumPy: JAX, op by op, compiles a program per shape.
  rng = np.random.default_rng(1)
  noisy = lambda tree, draw: jax.tree.map(
      lambda x: jax.device_put(
          (np.asarray(x) + noise * draw(x.shape)).astype(x.dtype)), tree)
  state = state.replace(params=noisy(state.params, rng.standard_normal),
                        model_state=noisy(state.model_state, rng.random))
  manager = checkpointing.create_manager(str(workdir), 1)
  checkpointing.save(manager, 1, state, config, CLASSES)
  manager.wait_until_finished()
  manager.close()


def export_command(workdir, output, *flags) -> subprocess.CompletedProcess:
  """export.py as a user runs it."""
  return subprocess.run(
      [sys.executable, 'export.py', f'--workdir={workdir}',
       f'--output={output}', *flags], cwd=REPO, capture_output=True,
      text=True, env=cpu_environment(1), timeout=600, check=False)


@pytest.fixture(scope='module', params=list(RUNS))
def exported(request, tmp_path_factory):
  """(config, workdir, timm file) of each family's run, exported by
  export.py."""
  config = run_config(request.param)
  directory = tmp_path_factory.mktemp(request.param)
  workdir, output = directory / 'run', str(directory / 'timm.safetensors')
  write_run(workdir, config)
  result = export_command(workdir, output, '--format=timm')
  assert result.returncode == 0, result.stderr[-3000:]
  return config, str(workdir), output


def images(config, count=2):
  return np.asarray(jax.random.normal(
      jax.random.key(2), (count, config.image_size, config.image_size, 3)))


def timm_model(timm, path):
  """timm's model named in the file's metadata, its weights loaded
  strictly."""
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  with safetensors.safe_open(path, framework='numpy') as f:
    metadata = f.metadata()
  model = timm.create_model(metadata[timm_files.MODEL_KEY],
                            num_classes=NUM_CLASSES,
                            **json.loads(metadata[timm_files.ARGS_KEY]))
  model.load_state_dict(safetensors.torch.load_file(path), strict=True)
  return model.eval()


def timm_logits(model, x):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()


def assert_close_to_scale(logits, expected, tolerance):
  scale = np.abs(expected).max()
  assert scale > 0.01  # a network whose layers all count
  assert np.abs(logits - expected).max() <= tolerance * scale


def test_timm_loads_the_export_strictly_and_computes_the_projects_logits(
    exported):
  config, workdir, path = exported
  timm = import_timm()
  model = run_state.load_trained(workdir, default.get_config())[1].model()
  x = images(config)
  expected = np.asarray(model(x, train=False))
  assert_close_to_scale(timm_logits(timm_model(timm, path), x), expected,
                        1e-5)


def test_the_timm_export_reads_back_bit_for_bit(exported):
  config, workdir, path = exported
  if models.family(config.model) == 'vit' and (
      config.vit_posemb == 'sincos2d'):
    # timm's table is learned: read back with --config.vit_posemb=learn
    # and timm's conventions, the fixed table becomes a parameter.
    pytest.skip('a fixed position embedding reads back as a learned one')
  model = run_state.load_trained(workdir, default.get_config())[1].model()
  original = pretrained.trained_arrays(model)
  graphdef, *states = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
  del graphdef
  config.init_from = path
  loaded = pretrained.load(path, 'auto', config, states, new_head=False)
  read = {name: np.asarray(variable.get_value())
          for state in loaded
          for name, variable in fitting.named_variables(state).items()
          if name in original}
  assert read.keys() == original.keys()
  for name, value in original.items():
    np.testing.assert_array_equal(read[name], value, err_msg=name)


def test_a_model_timm_lacks_is_refused_in_one_line_naming_the_formats(
    tmp_path):
  config = default.get_config()
  config.update(dataset='fake', image_size=8, num_layers=1, width=8)
  write_run(tmp_path / 'run', config)
  output = tmp_path / 'timm.safetensors'
  result = export_command(tmp_path / 'run', output, '--format=timm')
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1] == (
      'Error: --format=timm: no timm model is written for SmallResNet '
      f'(written: {", ".join(timm_files.TIMM_MODELS)}); export it with '
      '--format=project')
  assert not output.exists()
  with pytest.raises(ValueError, match=r"unknown --format='tf'; valid names: "
                     'project, timm'):
    export.export(str(tmp_path / 'run'), str(output), file_format='tf')


def test_a_vit_with_a_backbones_options_is_refused_naming_them():
  config = default.get_config()
  config.update(model='ViT_S16', vit_layer_scale=True, vit_pool='map')
  assert timm_files.problem(config) == (
      "the ViT is written as timm's plain VisionTransformer, without "
      "vit_layer_scale=True, vit_pool='map'")
  config.update(model='ViT_B14', vit_layer_scale=False, vit_pool='cls')
  assert timm_files.problem(config).startswith(
      'no timm model is written for ViT_B14 (written: ResNet18,')


# Each family's model as timm builds it, read by this project's readers;
# a ViT with big_vision's conventions is no timm model.
@pytest.mark.parametrize('run', [run for run in RUNS if run != 'vit_gap'])
def test_the_readers_of_timm_files_compute_timms_own_models(run, tmp_path):
  import torch  # pylint: disable=g-import-not-at-top
  timm = import_timm()
  config = run_config(run)
  name, args = timm_files.timm_model(config, 3)
  torch.manual_seed(0)
  reference = timm.create_model(name, num_classes=NUM_CLASSES, **args)
  with torch.no_grad():  # every array counts: no zero head, no unit stats
    for key, value in reference.state_dict().items():
      if value.is_floating_point():
        value.add_(0.02 * torch.rand_like(value))
  path = str(tmp_path / 'timm.safetensors')
  safetensors.numpy.save_file(
      {key: value.numpy() for key, value in reference.state_dict().items()},
      path)
  model = models.create_model(config.model, NUM_CLASSES, 3,
                              rngs=nnx.Rngs(0), **models.options(config))
  pretrained.load_into_model(model, config, path)
  x = images(config)
  # 1e-4: with timm's initial weights, ConvNeXt V2-T's logits differ by
  # 3.6e-5 of their scale (measured; the other families by under 1e-5).
  assert_close_to_scale(np.asarray(model(x, train=False)),
                        timm_logits(reference.eval(), x), 1e-4)
