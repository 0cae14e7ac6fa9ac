"""Each preset of configs/finetune.py as a user fine-tunes and exports it:
started from timm's own model saved as the preset's published file, trained
for two steps on image folders by `main.py` on one device, as a user runs
it (the preset's recipe, its sizes shrunk, in float32: see TRAINING), then
exported to timm, ONNX and serving. Each export answers as the project
does: timm's model, built from the file's metadata alone, through timm's
own data config and transforms from image files; ONNX Runtime on the
project's evaluation images; the serving programs on the image files; and,
for CLIP's preset, `export.py --format=serving` and `predict.py --model=`,
each its own process, print the lines of `predict.py --workdir`."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime
import PIL.Image
import pytest

from configs import default
from data import datasets
import export
from exporting import onnx_files
from exporting import serving
from exporting import timm_files
import predict
import input_pipeline
from training import run_state
from weights import fitting
from weights import pretrained
from exported_runs import assert_close_to_scale
from exported_runs import export_command
from exported_runs import timm_model
from helpers import import_timm
from helpers import torch_logits
from image_data import SORTED_CLASSES
from image_data import image_pixels
from image_data import save_image
from image_data import write_folders
from processes import REPO
from processes import cpu_environment
from processes import main_command
from processes import one_device_environment
from processes import run as run_commands

torch = pytest.importorskip('torch')

# One worker trains and exports each preset once for every test of it.
pytestmark = pytest.mark.xdist_group('export_trained_presets')

# Per preset: the overrides that shrink it (the family's smallest member, or
# two blocks; an image size whose evaluation crop is a whole number of
# pixels, image_size / 0.875), its published file as timm's model name and
# the create_model arguments of the same shrinking, and the timm model its
# export names.
PRESETS = {
    'resnet50': (dict(model='ResNet18', image_size=28),
                 ('resnet18', {}), 'resnet18'),
    'vit_s16': (dict(num_layers=2, image_size=112),
                ('vit_small_patch16_224', dict(depth=2)),
                'vit_small_patch16_224'),
    # MAE's pretraining file has no head; AdamW's rate, not SGD's.
    'vit_b16_mae': (dict(num_layers=2, image_size=112, learning_rate=3e-3),
                    ('vit_base_patch16_224', dict(depth=2, num_classes=0)),
                    'vit_base_patch16_224'),
    'convnext_t': (dict(model='ConvNeXt_Atto', image_size=56),
                   ('convnext_atto', {}), 'convnext_atto'),
    'regnety_040': (dict(model='RegNetY_200MF', image_size=28),
                    ('regnety_002', {}), 'regnety_002'),
    # Unshrunk: a Swin's stage maps are whole at multiples of 32 px and its
    # crop at multiples of 7, so 224 px (maps 56, 28, 14, 7, windows of 7)
    # is the smallest; a Swin's stage depths are fixed.
    'swin_t': (dict(image_size=224), ('swin_tiny_patch4_window7_224', {}),
               'swin_tiny_patch4_window7_224'),
    # The published file at DINOv2's 518 px, resampled to the run's 56.
    'dinov2_b14': (dict(num_layers=2, image_size=56),
                   ('vit_base_patch14_dinov2', dict(depth=2, num_classes=0)),
                   'vit_base_patch14_dinov2'),
    # OpenAI's file: its head is CLIP's 512-wide projection.
    'clip_b16': (dict(num_layers=2, image_size=112),
                 ('vit_base_patch16_clip_224',
                  dict(depth=2, num_classes=512)),
                 'vit_base_patch16_clip_quickgelu_224'),
    'siglip_b16': (dict(num_layers=2, image_size=112),
                   ('vit_base_patch16_siglip_224',
                    dict(depth=2, num_classes=0)),
                   'vit_base_patch16_siglip_224'),
}
# Two steps of batch 8 from the file, a rate that moves the new head (it
# starts from zeros) far enough for the classes to differ. In float32, as
# timm computes: in the presets' bfloat16, predict.py (jax's XLA) and the
# SavedModel (TensorFlow's XLA) round differently, measured up to 3.3e-3
# apart in probability (DINOv2's preset) on the same PNG.
TRAINING = dict(half_precision=False, batch_size=8, num_train_steps=2,
                warmup_steps=0,
                learning_rate=0.3, learning_rate_base_batch_size=0,
                log_every_steps=1, steps_per_eval=1)
# Exported and predicted by the commands, each its own process.
BY_THE_COMMANDS = 'clip_b16'
# The suite trains the published backbones' presets; the others (their
# families' exports are checked at random weights elsewhere) with
# ALL_FINETUNE_PRESETS=1: each takes minutes of compiling on 2 CPU cores.
SUITE_PRESETS = ('dinov2_b14', 'clip_b16', 'siglip_b16')


@dataclasses.dataclass(frozen=True)
class Trained:
  """A preset's run and its exports."""
  preset: str
  config: object  # as trained (the checkpoint's)
  workdir: str
  timm_file: str
  onnx_file: str
  serving_export: str
  pngs: list  # PNG files of side image_size / 0.875
  jpeg: str  # a 45 x 60 JPEG


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  """folder:ROOT of 3 classes, 4 training and 2 validation images each."""
  root = tmp_path_factory.mktemp('folders')
  write_folders(root, per_class=(4, 2), extras=False)
  return f'folder:{root}'


def save_published_file(path, name, args):
  """timm's own `name` (random weights, each array moved off its initial
  value: no zero bias or unit scale hides a misread array), saved as timm
  saves its published files."""
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  model = import_timm().create_model(name, pretrained=False, **args)
  with torch.no_grad():
    for value in model.state_dict().values():
      if value.is_floating_point():
        value.add_(0.02 * torch.rand_like(value))
  safetensors.torch.save_file(model.state_dict(), str(path))


# Each preset's Trained, made once for every test of it.
_TRAINED = {}


@pytest.fixture(scope='module', params=list(
    PRESETS if os.environ.get('ALL_FINETUNE_PRESETS') else SUITE_PRESETS))
def trained(request, folders, tmp_path_factory):
  """Each preset trained from its published file and exported to every
  format (`export.export`; CLIP's serving export by the command)."""
  return trained_once(request.param, folders, tmp_path_factory)


@pytest.fixture(scope='module')
def trained_by_the_commands(folders, tmp_path_factory):
  return trained_once(BY_THE_COMMANDS, folders, tmp_path_factory)


def trained_once(preset, folders, tmp_path_factory) -> 'Trained':
  if preset not in _TRAINED:
    _TRAINED[preset] = train_and_export(preset, folders,
                                        tmp_path_factory.mktemp(preset))
  return _TRAINED[preset]


def train_and_export(preset, folders, directory) -> Trained:
  overrides, (name, args), _ = PRESETS[preset]
  published = directory / 'published.safetensors'
  save_published_file(published, name, args)
  workdir = str(directory / 'run')
  run_commands([main_command(workdir, dict(
      dataset=folders, init_from=published, **{**TRAINING, **overrides}),
                             config=f'configs/finetune.py:{preset}')],
               [one_device_environment()])
  exports = {file_format: str(directory / name) for file_format, name in (
      ('timm', 'timm.safetensors'), ('onnx', 'model.onnx'),
      ('serving', 'serving'))}
  for file_format, output in exports.items():
    if file_format == 'serving' and preset == BY_THE_COMMANDS:
      result = export_command(workdir, output, '--format=serving')
      assert result.returncode == 0, result.stderr[-3000:]
    else:
      export.export(workdir, output, file_format=file_format)
  config = run_state.load_trained(workdir, default.get_config())[0]
  side = serving.input_size(config.image_size)
  rng = np.random.default_rng(0)
  pngs = [str(directory / f'{i}.png') for i in range(2)]
  for path in pngs:
    save_image(path, image_pixels(rng, side, side))
  jpeg = str(directory / 'photo.JPEG')
  save_image(jpeg, image_pixels(rng, 45, 60))
  return Trained(preset, config, workdir, *exports.values(), pngs, jpeg)


def float32_logits(trained, paths):
  """(the project's evaluation images of `paths`, its logits on them)
  computed in float32, as the timm and ONNX exports compute."""
  config, run = run_state.load_trained(trained.workdir, default.get_config())
  model = run.model()
  channels = fitting.image_channels(fitting.model_shapes(model))
  source = input_pipeline.DataSource.from_config(config)
  x = np.stack([datasets.eval_image_file(source, path, channels, jnp.float32)
                for path in paths])
  forward, variables = onnx_files.eval_forward(config, model, unrolled=False)
  return x, np.asarray(jax.jit(forward)(variables, x))


def test_the_run_trained_from_the_published_file(trained):
  """What the exports start from: the preset's run of two steps."""
  assert pretrained.class_names(
      trained.workdir, trained.config.dataset, trained.config.data_dir) == list(
      SORTED_CLASSES)
  step = run_state.load_trained(trained.workdir, default.get_config())[1].step
  assert step == TRAINING['num_train_steps']


def test_timm_builds_the_export_and_computes_the_projects_logits(trained):
  model = timm_model(trained.timm_file, len(SORTED_CLASSES))
  assert model.pretrained_cfg['architecture'] == PRESETS[trained.preset][2]
  x, expected = float32_logits(trained, [*trained.pngs, trained.jpeg])
  # Of the largest logit: float32 rounding of another order of operations
  # (measured: up to 2e-5, SigLIP's MAP head on the JPEG, logits of 41).
  assert_close_to_scale(torch_logits(torch, model, x), expected, 1e-4)


def test_timms_transforms_classify_image_files_as_the_project(trained):
  """timm's data config, resolved from the model the metadata builds, is
  the run's evaluation preprocessing; on files of side image_size / 0.875
  (both crop the same pixels and resize none) timm's transforms and model
  give the project's probabilities, most probable first."""
  model = timm_model(trained.timm_file, len(SORTED_CLASSES))
  timm = import_timm()
  data_config = timm.data.resolve_data_config(model=model)
  assert data_config == timm_files.pretrained_cfg(trained.config, 3)
  transform = timm.data.create_transform(**data_config)
  x = torch.stack([transform(PIL.Image.open(path).convert('RGB'))
                   for path in trained.pngs])
  with torch.no_grad():
    probabilities = torch.softmax(model(x), dim=-1).numpy()
  _, logits = float32_logits(trained, trained.pngs)
  expected = np.asarray(jax.nn.softmax(logits))
  assert (np.argsort(-probabilities, kind='stable') ==
          np.argsort(-expected, kind='stable')).all()
  np.testing.assert_allclose(probabilities, expected, rtol=0, atol=1e-5)


def test_onnx_runtime_computes_the_projects_logits(trained):
  options = onnxruntime.SessionOptions()
  options.log_severity_level = 3  # errors only
  runtime = onnxruntime.InferenceSession(
      trained.onnx_file, options, providers=['CPUExecutionProvider'])
  x, expected = float32_logits(trained, [*trained.pngs, trained.jpeg])
  logits, = runtime.run(None, {onnx_files.INPUT_NAME: x})
  # Of the largest logit: float32 rounding of another order of operations.
  assert_close_to_scale(logits, expected, 1e-4)


def test_serving_programs_answer_as_predict(trained):
  """The SavedModel on the PNGs and the JPEG, model.jax_exported on the
  PNGs' pixels: predict.py's classes in order, its probabilities."""
  paths = [*trained.pngs, trained.jpeg]
  _, expected = predict.classify_with_run(trained.workdir, paths,
                                          batch_size=3)
  classify, names = serving.load(trained.serving_export)
  assert names == list(SORTED_CLASSES)
  with open(f'{trained.serving_export}/{serving.JAX_EXPORTED}', 'rb') as f:
    program = jax.export.deserialize(f.read())
  pixels = np.stack([np.asarray(PIL.Image.open(path).convert('RGB'))
                     for path in trained.pngs])
  for served in (list(zip(*classify(paths))),
                 list(zip(*map(np.asarray, program.call(pixels))))):
    for (indices, probabilities), (want_indices, want) in zip(served,
                                                             expected):
      assert indices.tolist() == want_indices.tolist()
      np.testing.assert_allclose(probabilities, want, rtol=0, atol=1e-5)


def test_predict_with_the_serving_export_prints_the_lines_of_the_workdir(
    trained_by_the_commands):
  trained = trained_by_the_commands
  paths = [*trained.pngs, trained.jpeg]
  result = subprocess.run(
      [sys.executable, 'predict.py', f'--model={trained.serving_export}',
       *paths], cwd=REPO, capture_output=True, text=True,
      env=cpu_environment(1), timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == predict.predict(trained.workdir,
                                                       paths)
