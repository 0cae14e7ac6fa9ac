"""The published ViT backbones (DINOv2, DINOv2 with registers, OpenAI's
CLIP, SigLIP, DeiT III): timm's own files of them, saved by timm from its
own models, load with `init_from` and compute timm's logits (or features,
for files without a head); position embeddings are resampled as timm
resamples them; parameter counts are timm's."""

import math
import os
import subprocess

import numpy as np
import pytest

from flax import nnx
import jax
import jax.numpy as jnp

from configs import default
from configs import finetune
from families import vit as vit_family
import input_pipeline
import models
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from training import optimizer
from training import run_state
from weights import factory
from weights import pretrained
from helpers import flat_params
from helpers import import_timm
from helpers import images
from helpers import read_scalars
from helpers import torch_logits
from image_data import image_pixels
from image_data import save_image
import processes

torch = pytest.importorskip('torch')

# (timm name, model, config overrides, image size, file format). The files
# alternate between timm's safetensors and its `.pth`.
CASES = {
    'vit_small_patch14_dinov2': (
        'ViT_S14', dict(vit_pool='cls', vit_layer_scale=True), 28,
        'safetensors'),
    'vit_base_patch14_dinov2': (
        'ViT_B14', dict(vit_pool='cls', vit_layer_scale=True), 28, 'pth'),
    'vit_base_patch14_reg4_dinov2': (
        'ViT_B14', dict(vit_pool='cls', vit_layer_scale=True,
                        vit_registers=4), 28, 'safetensors'),
    'vit_base_patch16_clip_224.openai': (
        'ViT_B16', dict(vit_pool='cls', vit_norm_pre=True, vit_norm_eps=1e-5),
        32, 'pth'),
    'vit_large_patch14_clip_224.openai': (
        'ViT_L14', dict(vit_pool='cls', vit_norm_pre=True, vit_norm_eps=1e-5),
        28, 'safetensors'),
    'vit_base_patch16_siglip_224': (
        'ViT_B16', dict(vit_pool='map'), 32, 'pth'),
    'deit3_small_patch16_224': (
        'ViT_S16', dict(vit_pool='cls', vit_layer_scale=True), 32,
        'safetensors'),
}
TIMM_OPTIONS = dict(vit_posemb='learn', vit_gelu='exact')
DEPTH = 2


def config_for(model, **overrides):
  config = default.get_config()
  config.update(model=model, num_layers=DEPTH, **TIMM_OPTIONS)
  config.update(overrides)
  return config


def timm_model(name, image_size, **kwargs):
  """timm's model of `name`, two blocks, for `image_size` pixels, every
  parameter random (timm starts layer scale, biases and tokens at
  constants, which would hide a mix-up)."""
  timm = import_timm()
  model = timm.create_model(name, pretrained=False, depth=DEPTH,
                            img_size=image_size, **kwargs).eval()
  generator = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for key, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=generator)
      is_norm_weight = ('norm' in key and key.endswith('weight')) or (
          key.endswith('gamma'))
      p.copy_(1 + 0.2 * noise if is_norm_weight else 0.1 * noise)
  return model


def save(model_or_state, path):
  """The state dict as timm saves it: `safetensors.torch.save_file` or
  `torch.save`."""
  state = (model_or_state.state_dict() if hasattr(model_or_state,
                                                  'state_dict')
           else model_or_state)
  state = {key: value.contiguous() for key, value in state.items()}
  if path.endswith('.safetensors'):
    import safetensors.torch  # pylint: disable=g-import-not-at-top
    safetensors.torch.save_file(state, path)
  else:
    torch.save(state, path)


def loaded_model(config, path, num_classes, image_size):
  """Model `config.model` with the weights of `path`. Every array the
  comparisons read comes from the file (a new head from zeros), so the
  model is built from shapes alone at zeros: a random initialisation of
  these widths takes far longer on a CPU."""
  options = dict(models.options(config), image_size=image_size)
  model = nnx.eval_shape(lambda: models.create_model(
      config.model, num_classes, 3, rngs=nnx.Rngs(0), **options))
  nnx.update(model, jax.tree.map(
      lambda s: jax.device_put(np.zeros(s.shape, s.dtype)),
      nnx.state(model)))
  pretrained.load_into_model(model, models.settings(config), path)
  return model


@nnx.jit(static_argnames='head')
def apply(model, x, head=True):
  """The logits, or without `head` the features the head reads."""
  return model(x, train=False) if head else model.features(x)


def assert_within_scale(actual, expected):
  """Within 1e-5 of the reference's largest magnitude (float32 on both
  sides differs by about 2e-6 of it here)."""
  scale = np.abs(expected).max()
  assert scale > 0.1
  np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize('name', list(CASES))
def test_timm_files_compute_timms_network(tmp_path, name):
  model_name, overrides, size, file_format = CASES[name]
  reference = timm_model(name, size)
  path = str(tmp_path / f'model.{file_format}')
  save(reference, path)
  assert factory.detect_format(path) == 'timm'
  has_head = reference.num_classes > 0
  num_classes = reference.num_classes if has_head else 10
  config = config_for(model_name, image_size=size, **overrides)
  model = loaded_model(config, path, num_classes, size)
  x = images(size)
  ours = apply(model, jnp.asarray(x), head=has_head)
  assert_within_scale(np.asarray(ours), torch_logits(torch, reference, x))


def test_quick_gelu_computes_timms_quickgelu_clip(tmp_path):
  reference = timm_model('vit_base_patch16_clip_quickgelu_224.openai', 32)
  path = str(tmp_path / 'model.safetensors')
  save(reference, path)
  config = config_for('ViT_B16', image_size=32, vit_pool='cls',
                      vit_norm_pre=True, vit_norm_eps=1e-5, vit_gelu='quick')
  model = loaded_model(config, path, 512, 32)
  x = images(32)
  assert_within_scale(np.asarray(apply(model, jnp.asarray(x))),
                      torch_logits(torch, reference, x))


def test_clip_projection_becomes_the_features_under_a_new_head(tmp_path):
  """With `vit_projection`, timm's CLIP head (the image projection) is the
  layer before a new head: the features are CLIP's image embedding, the
  new head starts from zeros."""
  reference = timm_model('vit_base_patch16_clip_224.openai', 32)
  path = str(tmp_path / 'model.pth')
  save(reference, path)
  config = config_for('ViT_B16', image_size=32, vit_pool='cls',
                      vit_norm_pre=True, vit_norm_eps=1e-5,
                      vit_projection=512)
  model = loaded_model(config, path, 10, 32)
  x = images(32)
  assert_within_scale(np.asarray(apply(model, jnp.asarray(x), head=False)),
                      torch_logits(torch, reference, x))
  assert model.head.kernel.shape == (512, 10)
  assert not np.any(apply(model, jnp.asarray(x)))


@pytest.mark.parametrize('name, file_size, run_size', [
    # DINOv2's files are for 518 px (a 37 x 37 grid), run at 224 (16 x 16),
    # here both shrunk: 7 x 7 -> 4 x 4, and upwards.
    ('vit_small_patch14_dinov2', 98, 56),
    ('vit_base_patch14_reg4_dinov2', 42, 70),
    ('deit3_small_patch16_224', 64, 48),
])
def test_position_embedding_is_resampled_as_timm_resamples_it(
    tmp_path, name, file_size, run_size):
  """A file for one image size run at another computes timm's model built
  at the run's size from the same file (timm's `checkpoint_filter_fn`
  resamples with `resample_abs_pos_embed`)."""
  model_name, overrides, _, _ = CASES[name]
  saved = timm_model(name, file_size)
  path = str(tmp_path / 'model.safetensors')
  save(saved, path)
  timm = import_timm()
  reference = timm.create_model(name, pretrained=False, depth=DEPTH,
                                img_size=run_size).eval()
  reference.load_state_dict(timm.models.vision_transformer.
                            checkpoint_filter_fn(saved.state_dict(),
                                                 reference))
  config = config_for(model_name, image_size=run_size, **overrides)
  num_classes = max(reference.num_classes, 10)
  model = loaded_model(config, path, num_classes, run_size)
  x = images(run_size)
  ours = apply(model, jnp.asarray(x), head=reference.num_classes > 0)
  assert_within_scale(np.asarray(ours), torch_logits(torch, reference, x))


@pytest.mark.parametrize('preset, name, size', [
    ('dinov2_b14', 'vit_base_patch14_dinov2', 28),
    # OpenAI's weights, as trained: with quick GELU.
    ('clip_b16', 'vit_base_patch16_clip_quickgelu_224.openai', 32),
    ('siglip_b16', 'vit_base_patch16_siglip_224', 32),
])
def test_finetune_presets_load_their_timm_files(tmp_path, preset, name,
                                                size):
  """`configs/finetune.py`'s preset, shrunk to two blocks and a small
  image, takes its weights' timm file as it is: the features its new head
  reads are timm's (CLIP's: before the projection, which the new head
  replaces)."""
  saved = timm_model(name, size)
  path = str(tmp_path / 'model.safetensors')
  save(saved, path)
  config = finetune.get_config(preset)
  config.update(num_layers=DEPTH, image_size=size)
  model = loaded_model(config, path, 102, size)
  timm = import_timm()
  reference = timm.create_model(name, pretrained=False, depth=DEPTH,
                                img_size=size, num_classes=0).eval()
  reference.load_state_dict({key: value for key, value
                             in saved.state_dict().items()
                             if not key.startswith('head.')})
  x = images(size)
  assert_within_scale(np.asarray(apply(model, jnp.asarray(x), head=False)),
                      torch_logits(torch, reference, x))


def parameter_count(model_or_shapes) -> int:
  return sum(int(np.prod(v.shape)) for v in jax.tree.leaves(
      nnx.state(model_or_shapes, nnx.Param)))


@pytest.mark.parametrize('name', list(CASES))
def test_parameter_counts_are_timms(name):
  """At full depth and timm's image size (shapes only, on both sides); the
  class token's own position entry, which this model adds to the token,
  counted once."""
  model_name, overrides, _, _ = CASES[name]
  timm = import_timm()
  with torch.device('meta'):
    reference = timm.create_model(name, pretrained=False)
  size = reference.pretrained_cfg['input_size'][-1]
  expected = sum(p.numel() for p in reference.parameters())
  if reference.pos_embed.shape[1] != (size // reference.patch_embed
                                      .patch_size[0]) ** 2:
    expected -= reference.embed_dim  # the class token's position entry
  config = config_for(model_name, num_layers=0, image_size=size, **overrides)
  num_classes = reference.num_classes or 1
  shapes = nnx.eval_shape(lambda: models.create_model(
      model_name, num_classes, 3, rngs=nnx.Rngs(0),
      **models.options(config)))
  count = parameter_count(shapes)
  if not reference.num_classes:  # a file without a head
    count -= reference.embed_dim + 1
  assert count == expected


@pytest.mark.parametrize('options, message', [
    (dict(vit_pool='avg'), "unknown vit_pool 'avg'; valid: gap, cls, map"),
    (dict(vit_gelu='quick_gelu'), 'valid names: tanh, exact, quick'),
    (dict(vit_registers=-1), 'vit_registers -1 must be a whole number >= 0'),
    (dict(vit_projection=-5), 'vit_projection -5 must be a whole number'),
    (dict(vit_projection=512, vit_pre_logits=True),
     'set --config.vit_pre_logits=False or --config.vit_projection=0'),
    (dict(vit_norm_eps=0.0), 'vit_norm_eps 0.0 must be > 0'),
    (dict(vit_layer_scale=True, layer_scale_init=0.0),
     'layer_scale_init 0.0 must be > 0 with --config.vit_layer_scale=True'),
])
def test_bad_vit_options_are_refused_naming_the_fix(options, message):
  config = config_for('ViT_S14', image_size=28, **options)
  with pytest.raises(ValueError, match=message) as error:
    nnx.eval_shape(lambda: models.create_model(
        'ViT_S14', 10, 3, rngs=nnx.Rngs(0), **models.options(config)))
  assert '\n' not in str(error.value)


def test_patch_14_models_name_the_sizes_they_take():
  with pytest.raises(ValueError, match='ViT_B14 cannot take image_size 256: '
                     'it is cut into patches of 14; use a multiple of 14'):
    models.check_image_size('ViT_B14', 256)
  models.check_image_size('ViT_B14', 518)
  models.check_image_size('ViT_B14', 224)
  assert vit_family.image_size_problem(224, 16) is None


# ---------------------------------------- the DINOv2 preset run end to end

# `configs/finetune.py:dinov2_b14` as a user runs it, only its sizes
# shrunk: ViT-S/14 (the preset's ViT-B/14 at DINOv2's small width, still
# patch 14 with layer scale), two blocks, 28 px images (a 2 x 2 grid) from
# a file for 42 px (3 x 3, resampled as the preset resamples 518 px to
# 224), batch 8, three steps, then an evaluation and a checkpoint.
RUN_SIZE, FILE_SIZE, STEPS = 28, 42, 3
RUN_CLASSES = ('tulip', 'daisy', 'rose')  # sorted: daisy, rose, tulip
SHRUNK = dict(model='ViT_S14', num_layers=DEPTH, image_size=RUN_SIZE,
              batch_size=8, num_train_steps=STEPS, log_every_steps=1,
              eval_every_steps=STEPS, checkpoint_every_steps=STEPS)


@pytest.fixture(scope='module')
def flower_folders(tmp_path_factory):
  """ROOT/{train,val}/<class>/ of 6 and 2 JPEG and PNG images of 28-56 px,
  and a timm `vit_small_patch14_dinov2` file (random weights) for 42 px."""
  root = tmp_path_factory.mktemp('flowers')
  rng = np.random.default_rng(0)
  for split, count in (('train', 6), ('val', 2)):
    for name in RUN_CLASSES:
      os.makedirs(root / 'images' / split / name)
      for i in range(count):
        size = (28 + 7 * i, 56 - 5 * i)
        save_image(str(root / 'images' / split / name /
                       f'{i}.{("JPEG", "png")[i % 2]}'),
                   image_pixels(rng, *size))
  path = str(root / 'vit_small_patch14_dinov2.safetensors')
  save(timm_model('vit_small_patch14_dinov2', FILE_SIZE), path)
  return str(root / 'images'), path


def run_preset(options, folders, workdir):
  """`main.py --config=configs/finetune.py:OPTIONS` on the folders, only
  SHRUNK's sizes and the file set on the command line; returns the config
  it ran (the preset with those overrides)."""
  root, path = folders
  overrides = dict(SHRUNK, dataset=f'folder:{root}', init_from=path)
  command = processes.main_command(
      workdir, overrides, config=f'configs/finetune.py:{options}')
  result = subprocess.run(command, cwd=processes.REPO, capture_output=True,
                          text=True, timeout=300,
                          env=processes.cpu_environment(1), check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  config = finetune.get_config(options)
  config.update(overrides)
  return config, result.stderr


def trained_and_loaded(config, workdir, path):
  """({name: array} of the checkpoint's parameters, of the file's as the
  trainer reads it into the preset's model), and that model."""
  info = input_pipeline.DatasetInfo(len(RUN_CLASSES),
                                    (RUN_SIZE, RUN_SIZE, 3), 18, 6)
  _, state, _ = run_state.create_train_state(
      config, info, lambda step: 0.0,
      dtype=models.compute_dtype(config))
  manager = checkpointing.create_manager(workdir, 1)
  restored = checkpointing.restore_latest(manager, state,
                                          compatibility.as_json(config))
  manager.close()
  assert int(restored.state.step) == STEPS
  model = loaded_model(config, path, len(RUN_CLASSES), RUN_SIZE)
  loaded = flat_params(nnx.state(model))
  nnx.update(model, restored.state.params)
  return flat_params(nnx.state(model)), loaded, model


def is_head(name: str) -> bool:
  return name.startswith(('head/', 'feature_norm/'))


def assert_trained_and_evaluated(workdir):
  scalars = read_scalars(workdir)
  losses = [scalars['train_loss'][step] for step in range(1, STEPS + 1)]
  assert all(np.isfinite(losses)) and len(set(losses)) > 1, losses
  # The new head starts from zeros: every class equally likely.
  assert losses[0] == pytest.approx(math.log(len(RUN_CLASSES)), abs=2e-3)
  assert scalars['eval_examples'] == {STEPS: 6.0}
  assert np.isfinite(scalars['eval_loss'][STEPS])


@pytest.mark.slow
def test_dinov2_preset_fine_tunes_from_its_timm_file_on_folders(
    tmp_path, flower_folders):
  """Every parameter trains from the file: after three steps the backbone
  has moved, but by no more than SGD's clipped steps can move it (momentum
  0.9 and gradients of norm <= 1: at most 10 x the rate a step), where a
  backbone not read from the file would lie far off."""
  workdir = str(tmp_path / 'run')
  config, log = run_preset('dinov2_b14', flower_folders, workdir)
  assert 'head re-initialised to zeros' in log
  assert_trained_and_evaluated(workdir)
  trained, loaded, _ = trained_and_loaded(config, workdir, flower_folders[1])
  backbone = [name for name in loaded if not is_head(name)]
  moved = math.sqrt(sum(np.sum((trained[name] - loaded[name]).astype(
      np.float64)**2) for name in backbone))
  assert 0 < moved <= 10 * STEPS * optimizer.peak_learning_rate(config)


@pytest.mark.slow
def test_dinov2_linear_probe_trains_the_head_alone_on_timms_features(
    tmp_path, flower_folders):
  """The backbone after three steps is the file's, bit for bit, and
  computes timm's features of the file (resampled to 28 px as timm
  resamples it); the head has moved from zeros."""
  workdir = str(tmp_path / 'run')
  config, _ = run_preset('dinov2_b14,linear_probe', flower_folders, workdir)
  assert_trained_and_evaluated(workdir)
  trained, loaded, model = trained_and_loaded(config, workdir,
                                              flower_folders[1])
  assert trained.keys() == loaded.keys()
  for name in loaded:
    if not is_head(name):
      np.testing.assert_array_equal(trained[name], loaded[name], name)
  assert np.any(trained['head/kernel'])
  timm = import_timm()
  saved = timm.create_model('vit_small_patch14_dinov2', pretrained=False,
                            depth=DEPTH, img_size=FILE_SIZE)
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  saved.load_state_dict(safetensors.torch.load_file(flower_folders[1]))
  reference = timm.create_model('vit_small_patch14_dinov2', pretrained=False,
                                depth=DEPTH, img_size=RUN_SIZE).eval()
  reference.load_state_dict(timm.models.vision_transformer.
                            checkpoint_filter_fn(saved.state_dict(),
                                                 reference))
  x = images(RUN_SIZE)
  assert_within_scale(np.asarray(apply(model, jnp.asarray(x), head=False)),
                      torch_logits(torch, reference, x))
