"""Pretrained weights of every published format imported: each file is
written by the test in its project's published layout (real key names, a
small variant's shapes). After import, the model's forward pass must equal
the source network computed from the file's arrays by an independent
reference in plain jax.numpy (tests/weight_references.py), within 1e-5.
"""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from configs import default
import models
from weights import factory
from weights import fitting
from weights import pretrained
from weights import torch_files
from helpers import images
from weight_references import IMAGE_SIZE
from weight_references import NUM_CLASSES
from weight_references import VIT
from weight_references import big_vision_params
from weight_references import big_vision_reference
from weight_references import config_for
from weight_references import flax_resnet_reference
from weight_references import flax_resnet_variables
from weight_references import logits
from weight_references import resnet
from weight_references import timm_vit_reference
from weight_references import timm_vit_state_dict
from weight_references import torch_resnet_reference
from weight_references import torch_resnet_state_dict
from weight_references import vit

TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.xdist_group('torchvision_resnet18')  # one worker compiles
@pytest.mark.parametrize('scan', ['scanned', 'unrolled'])
def test_torchvision_resnet18_safetensors_computes_the_torch_network(
    tmp_path, scan):
  stage_sizes = (2, 2, 2, 2)
  state = torch_resnet_state_dict(stage_sizes, bottleneck=False)
  path = str(tmp_path / 'resnet18.safetensors')
  safetensors.numpy.save_file(state, path)
  assert factory.detect_format(path) == 'torchvision'
  model = resnet(stage_sizes, False, 'symmetric', scan)
  pretrained.load_into_model(
      model, models.settings(config_for(model='ResNet18',
                                        resnet_padding='symmetric')), path)
  x = images(IMAGE_SIZE)
  expected = torch_resnet_reference(state, x, stage_sizes, bottleneck=False)
  np.testing.assert_allclose(logits(model, x), expected, **TOLERANCE)
  # timm publishes its plain ResNets under the same names.
  timm_model = resnet(stage_sizes, False, 'symmetric', scan)
  pretrained.load_into_model(
      timm_model, models.settings(config_for(model='ResNet18',
                                             resnet_padding='symmetric')),
      path, 'timm')
  np.testing.assert_allclose(logits(timm_model, x), expected, **TOLERANCE)


def test_torchvision_bottleneck_resnet_pth_computes_the_torch_network(
    tmp_path):
  torch = pytest.importorskip('torch')
  stage_sizes = (2, 3)
  state = torch_resnet_state_dict(stage_sizes, bottleneck=True)
  path = str(tmp_path / 'resnet.pth')
  torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
  model = resnet(stage_sizes, True, 'symmetric')
  pretrained.load_into_model(
      model, models.settings(config_for(model='ResNet50',
                                        resnet_padding='symmetric')), path)
  x = images(IMAGE_SIZE)
  expected = torch_resnet_reference(state, x, stage_sizes, bottleneck=True)
  np.testing.assert_allclose(logits(model, x), expected, **TOLERANCE)
  # The reference itself against PyTorch's own operators.
  torch_logits = torch_functional_resnet(torch, state, np.asarray(x),
                                         stage_sizes)
  np.testing.assert_allclose(expected, torch_logits, **TOLERANCE)


def torch_functional_resnet(torch, state, x_nhwc, stage_sizes):
  """A bottleneck ResNet in eval mode with torch.nn.functional."""
  functional = torch.nn.functional
  t = {k: torch.from_numpy(v) for k, v in state.items()}
  bn = lambda x, p: functional.batch_norm(
      x, t[f'{p}.running_mean'], t[f'{p}.running_var'], t[f'{p}.weight'],
      t[f'{p}.bias'], training=False, eps=1e-5)
  x = torch.from_numpy(np.array(x_nhwc)).permute(0, 3, 1, 2)
  x = functional.relu(bn(functional.conv2d(x, t['conv1.weight'], stride=2,
                                           padding=3), 'bn1'))
  x = functional.max_pool2d(x, 3, 2, 1)
  for s, num_blocks in enumerate(stage_sizes):
    for j in range(num_blocks):
      p = f'layer{s + 1}.{j}.'
      stride = 2 if s > 0 and j == 0 else 1
      y = functional.relu(bn(functional.conv2d(x, t[p + 'conv1.weight']),
                             p + 'bn1'))
      y = functional.relu(bn(functional.conv2d(
          y, t[p + 'conv2.weight'], stride=stride, padding=1), p + 'bn2'))
      y = bn(functional.conv2d(y, t[p + 'conv3.weight']), p + 'bn3')
      if p + 'downsample.0.weight' in t:
        x = bn(functional.conv2d(x, t[p + 'downsample.0.weight'],
                                 stride=stride), p + 'downsample.1')
      x = functional.relu(x + y)
  x = x.mean((2, 3))
  return (x @ t['fc.weight'].T + t['fc.bias']).numpy()


@pytest.mark.parametrize('backend', ['orbax', 'msgpack'])
def test_flax_imagenet_checkpoint_computes_the_linen_network(tmp_path,
                                                             backend):
  import flax
  from flax.training import checkpoints
  stage_sizes = (1, 2)
  params, stats = flax_resnet_variables(stage_sizes, bottleneck=True)
  workdir = str(tmp_path / 'flax_workdir')
  # The example's TrainState, saved by the example's own call.
  state = {'step': 40, 'params': params, 'batch_stats': stats,
           'opt_state': {'momentum': jax.tree.map(np.zeros_like, params)}}
  use_orbax = flax.config.flax_use_orbax_checkpointing
  flax.config.update('flax_use_orbax_checkpointing', backend == 'orbax')
  try:
    checkpoints.save_checkpoint(workdir, state, step=40)
  finally:
    flax.config.update('flax_use_orbax_checkpointing', use_orbax)
  x = images(IMAGE_SIZE)
  expected = flax_resnet_reference(params, stats, x, stage_sizes, True)
  for path in (workdir, os.path.join(workdir, 'checkpoint_40')):
    assert factory.detect_format(path) == 'flax_imagenet'
    model = resnet(stage_sizes, True, 'same')
    pretrained.load_into_model(
        model, models.settings(config_for(model='ResNet50')), path)
    np.testing.assert_allclose(logits(model, x), expected, **TOLERANCE)


@pytest.mark.parametrize('scan', ['scanned', 'unrolled', 'segmented'])
def test_timm_vit_safetensors_computes_the_timm_network(tmp_path, scan):
  state = timm_vit_state_dict(grid=IMAGE_SIZE // 16)
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(state, path)
  assert factory.detect_format(path) == 'timm'
  model = vit('cls', 'learn', 'exact', scan)
  pretrained.load_into_model(model, models.settings(config_for(
      model='ViT_Ti16', vit_pool='cls', vit_posemb='learn',
      vit_gelu='exact')), path)
  x = images(IMAGE_SIZE)
  np.testing.assert_allclose(logits(model, x),
                             timm_vit_reference(state, x, VIT['heads']),
                             **TOLERANCE)


def test_mae_pth_loads_its_encoder_without_the_decoder_or_a_head(tmp_path):
  """MAE's released files: {'model': state dict} in timm's names, with the
  pretraining decoder and no head. Found as timm's by their keys, the
  encoder computes timm's network, the decoder is dropped and the head
  starts from zeros (here given the file's other head to compare)."""
  torch = pytest.importorskip('torch')
  state = timm_vit_state_dict(grid=IMAGE_SIZE // 16)
  head = {key: state.pop(key) for key in ('head.weight', 'head.bias')}
  rng = np.random.default_rng(3)
  decoder = {'mask_token': rng.normal(size=(1, 1, 16)),
             'decoder_embed.weight': rng.normal(size=(16, VIT['width'])),
             'decoder_blocks.0.norm1.weight': rng.normal(size=16),
             'decoder_pred.weight': rng.normal(size=(768, 16))}
  path = str(tmp_path / 'mae_pretrain_vit_tiny.pth')
  torch.save({'model': {k: torch.from_numpy(np.asarray(v, np.float32))
                        for k, v in {**state, **decoder}.items()}}, path)
  assert factory.detect_format(path) == 'timm'
  model = vit('cls', 'learn', 'exact')
  pretrained.load_into_model(model, models.settings(config_for(
      model='ViT_Ti16', vit_pool='cls', vit_posemb='learn',
      vit_gelu='exact')), path)
  assert not np.any(model.head.kernel[...]) and not np.any(
      model.head.bias[...])
  model.head.kernel[...] = jnp.asarray(head['head.weight'].T)
  model.head.bias[...] = jnp.asarray(head['head.bias'])
  x = images(IMAGE_SIZE)
  np.testing.assert_allclose(
      logits(model, x),
      timm_vit_reference({**state, **head}, x, VIT['heads']), **TOLERANCE)


@pytest.mark.parametrize('keys, detected', [
    # A Swin has a patch embedding too: still a Swin.
    (['patch_embed.proj.weight',
      'layers.0.blocks.0.attn.relative_position_bias_table'], 'timm_swin'),
    (['patch_embed.proj.weight', 'cls_token'], 'timm'),
    (['stem.0.weight', 'stages.0.blocks.0.conv_dw.weight'], 'timm_convnext'),
    (['downsample_layers.0.0.weight', 'stages.0.0.dwconv.weight'],
     'timm_convnext'),
    (['stem.conv.weight', 's1.b1.conv1.conv.weight'], 'timm_regnet'),
    (['conv1.weight', 'fc.weight'], 'torchvision'),
    (['encoder.weight'], None),
])
def test_pickle_and_safetensors_of_the_same_keys_are_told_alike(
    tmp_path, keys, detected):
  torch = pytest.importorskip('torch')
  state = {key: np.zeros(2, np.float32) for key in keys}
  pickle = str(tmp_path / 'weights.pth')
  torch.save({key: torch.from_numpy(value) for key, value in state.items()},
             pickle)
  tensors = str(tmp_path / 'weights.safetensors')
  safetensors.numpy.save_file(state, tensors)
  for path in (pickle, tensors):
    if detected:
      assert factory.detect_format(path) == detected
    else:
      with pytest.raises(ValueError, match=(
          f"^cannot tell the format of init_from '{re.escape(path)}'; set "
          '--config.init_format to one of '
          + re.escape(', '.join(factory.READERS)) + '$')):
        factory.detect_format(path)


def save_npz_as_big_vision(path, flat):
  """np.savez of the flat '/'-joined names, as big_vision saves them."""
  with open(path, 'wb') as f:
    np.savez(f, **flat)


@pytest.mark.parametrize('layout', ['flat_gap_sincos', 'scanned_tok_learn',
                                    'vit_jax_names'])
def test_big_vision_npz_computes_the_big_vision_network(tmp_path, layout):
  grid = IMAGE_SIZE // 16
  cls, learned = layout != 'flat_gap_sincos', layout != 'flat_gap_sincos'
  flat = big_vision_params(grid, cls, learned)
  saved, posemb_first = dict(flat), True
  if layout == 'scanned_tok_learn':
    # A scanned model's checkpoint with optimizer state, bfloat16 weights.
    blocks = [{k.split('/', 2)[2]: v for k, v in flat.items()
               if k.startswith(f'Transformer/encoderblock_{i}/')}
              for i in range(VIT['depth'])]
    saved = {f'params/{k}': v.astype(jnp.bfloat16) for k, v in flat.items()
             if '/encoderblock_' not in k}
    saved.update({f'params/Transformer/encoderblock/{k}': np.stack(
        [b[k] for b in blocks]).astype(jnp.bfloat16) for k in blocks[0]})
    saved['opt/state/count'] = np.array(3)
    flat = {k: np.asarray(v.astype(jnp.bfloat16), np.float32)
            for k, v in flat.items()}
  elif layout == 'vit_jax_names':
    # The ViT paper's code: modules numbered together in a scope, and the
    # position embedding (class token's entry first) added after [cls; ...].
    renames = {'MultiHeadDotProductAttention_0':
               'MultiHeadDotProductAttention_1',
               'LayerNorm_1': 'LayerNorm_2', 'MlpBlock_0': 'MlpBlock_3'}
    saved = {}
    for key, value in flat.items():
      parts = key.split('/')
      saved['/'.join(renames.get(p, p) if '/encoderblock_' in key else p
                     for p in parts)] = value
    del saved['pos_embedding']
    flat['pos_embedding'] = np.random.default_rng(5).normal(
        0, 0.5, (1, grid * grid + 1, VIT['width'])).astype(np.float32)
    saved['Transformer/posembed_input/pos_embedding'] = flat['pos_embedding']
    posemb_first = False
  path = str(tmp_path / 'vit.npz')
  save_npz_as_big_vision(path, saved)
  assert factory.detect_format(path) == 'big_vision'
  pool, posemb = ('cls', 'learn') if cls else ('gap', 'sincos2d')
  model = vit(pool, posemb, 'tanh')
  pretrained.load_into_model(model, models.settings(config_for(
      model='ViT_Ti16', vit_pool=pool, vit_posemb=posemb)), path)
  x = images(IMAGE_SIZE)
  np.testing.assert_allclose(logits(model, x),
                             big_vision_reference(flat, x, posemb_first),
                             **TOLERANCE)


def test_position_embedding_is_resampled_to_another_image_size(tmp_path):
  state = timm_vit_state_dict(grid=2)
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(state, path)
  model = vit('cls', 'learn', 'exact', image_size=48)  # a 3 x 3 grid
  pretrained.load_into_model(model, models.settings(config_for(
      model='ViT_Ti16', vit_pool='cls', vit_posemb='learn',
      vit_gelu='exact')), path)
  # The reference with the class token's entry and the resampled grid.
  resampled = dict(state)
  resampled['pos_embed'] = np.concatenate([
      state['pos_embed'][:, :1],
      fitting.resample_posemb(state['pos_embed'][:, 1:], 3)], axis=1)
  x = images(48)
  np.testing.assert_allclose(logits(model, x),
                             timm_vit_reference(resampled, x, VIT['heads']),
                             **TOLERANCE)
  # Bicubic resampling keeps a linear ramp linear away from the border
  # (output centres 1.25 and 1.75 of a 4-wide grid, upsampled twofold).
  ramp = np.broadcast_to(np.arange(4.0)[None, :, None], (4, 4, 1))
  upsampled = fitting.resample_posemb(ramp.reshape(1, 16, 1), 8)
  np.testing.assert_allclose(upsampled.reshape(8, 8)[:, 3:5],
                             np.broadcast_to([1.25, 1.75], (8, 2)), atol=1e-6)


def test_big_vision_pre_logits_layer_is_loaded_with_its_tanh(tmp_path):
  if 'vit_pre_logits' not in default.get_config():
    pytest.skip('this ViT has no pre-logits layer (config.vit_pre_logits)')
  ti16 = dict(width=192, heads=3, mlp=768)  # ViT_Ti16, two layers
  flat = big_vision_params(IMAGE_SIZE // 16, cls=False, learned_posemb=False,
                           **ti16)
  rng = np.random.default_rng(3)
  flat['pre_logits/kernel'] = rng.normal(
      0, 1 / math.sqrt(192), (192, 192)).astype(np.float32)
  flat['pre_logits/bias'] = rng.normal(0, 0.1, 192).astype(np.float32)
  path = str(tmp_path / 'vit.npz')
  save_npz_as_big_vision(path, flat)
  for pre_logits in (True, False):
    config = config_for(model='ViT_Ti16', num_layers=2,
                        image_size=IMAGE_SIZE, vit_pre_logits=pre_logits)
    model = models.create_model(config.model, NUM_CLASSES, 3,
                                rngs=nnx.Rngs(0), **models.options(config))
    if not pre_logits:
      with pytest.raises(ValueError, match='set --config.vit_pre_logits=True'):
        pretrained.load_into_model(model, models.settings(config), path)
      continue
    pretrained.load_into_model(model, models.settings(config), path)
    x = images(IMAGE_SIZE)
    np.testing.assert_allclose(logits(model, x),
                               big_vision_reference(flat, x), **TOLERANCE)


def test_safetensors_arrays_read_as_float32_numpy_and_compile_nothing(
    tmp_path, caplog):
  """bfloat16 and float32 arrays of many shapes read exactly, as NumPy:
  no JAX program is compiled per array shape while a file is read."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  arrays = {f'layer{i}.weight': rng.normal(size=(i + 1, 3)).astype(
      ml_dtypes.bfloat16 if i % 2 else np.float32) for i in range(6)}
  path = str(tmp_path / 'weights.safetensors')
  safetensors.numpy.save_file(arrays, path)
  with jax.log_compiles(True):
    read = torch_files.read_state_dict(path)
  assert not [r for r in caplog.records if 'Compiling' in r.getMessage()]
  assert read.keys() == arrays.keys()
  for key, value in arrays.items():
    assert isinstance(read[key], np.ndarray) and read[key].dtype == np.float32
    np.testing.assert_array_equal(read[key], value.astype(np.float32))
