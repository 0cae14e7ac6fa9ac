"""Pretrained weights that do not fit: missing, extra and misshapen
arrays, another architecture, size or convention, a bad init_from; each
refused in one line naming the fix."""

import os
import re

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from runtime import config_error
import models
from weights import factory
from weights import pretrained
import train
from weight_references import IMAGE_SIZE
from weight_references import config_for
from weight_references import resnet
from weight_references import run_config
from weight_references import timm_vit_state_dict
from weight_references import torch_resnet_state_dict


@pytest.fixture(scope='module')
def resnet18_file(tmp_path_factory):
  """A torchvision ResNet-18 (width 8) state dict as safetensors."""
  state = torch_resnet_state_dict([2, 2, 2, 2], bottleneck=False)
  path = str(tmp_path_factory.mktemp('torchvision') / 'resnet18.safetensors')
  safetensors.numpy.save_file(state, path)
  return path, state


def import_error(path, network, **config) -> str:
  with pytest.raises(ValueError) as error:
    pretrained.load_into_model(network, models.settings(config_for(**config)),
                               path)
  message = str(error.value)
  assert '\n' not in message
  return message


@pytest.mark.parametrize('change, message', [
    (lambda s: s.pop('layer3.0.downsample.1.running_var'),
     'missing in the file: stages.2.first.proj_bn.var;'),
    (lambda s: s.update({'layer1.0.se.fc1.weight': np.ones((2, 8, 1, 1),
                                                           np.float32)}),
     'not in the model: layer1.0.se.fc1.weight;'),
    (lambda s: s.update({'layer2.1.conv2.weight': np.ones((16, 16, 5, 5),
                                                          np.float32)}),
     r'other shapes than --config.model=ResNet18: '
     r'stages.1.rest.layers.conv2.kernel \(1, 5, 5, 16, 16\) \(model '
     r'\(1, 3, 3, 16, 16\)\)'),
])
def test_missing_extra_and_misshapen_arrays_are_one_error_naming_them(
    tmp_path, resnet18_file, change, message):
  state = dict(resnet18_file[1])
  change(state)
  path = str(tmp_path / 'changed.safetensors')
  safetensors.numpy.save_file(state, path)
  assert re.search(message, import_error(
      path, resnet([2, 2, 2, 2], False, 'symmetric'), model='ResNet18',
      resnet_padding='symmetric'))


def test_wrong_architecture_or_conventions_name_the_fix(tmp_path,
                                                        resnet18_file):
  path = resnet18_file[0]
  assert import_error(path, resnet([2, 2, 2, 2], False, 'same'),
                      model='ResNet18') == (
      "init_from is a torchvision ResNet with resnet_padding='symmetric'; "
      "set --config.resnet_padding=symmetric (the model has 'same')")
  assert ('stages.0.rest.layers.conv1.kernel (1, 3, 3, 8, 8) (model '
          '(2, 3, 3, 8, 8))') in import_error(
              path, resnet([3, 4, 6, 3], False, 'symmetric'),
              model='ResNet34', resnet_padding='symmetric')
  vit_path = str(tmp_path / 'vit.safetensors')
  safetensors.numpy.save_file(timm_vit_state_dict(grid=2), vit_path)
  assert import_error(vit_path, resnet([2, 2, 2, 2], False, 'symmetric'),
                      model='ResNet18').startswith(
      'init_from is a timm ViT, but --config.model=ResNet18 is a ResNet')


def test_a_published_model_of_another_size_is_named_in_the_error(tmp_path):
  """A ViT-Ti/16 file (width 192, 3 heads) for a ViT-S/16 model."""
  rng = np.random.default_rng(0)
  width, mlp = 192, 768
  state = {'patch_embed.proj.weight': (width, 3, 16, 16),
           'patch_embed.proj.bias': (width,), 'cls_token': (1, 1, width),
           'pos_embed': (1, 5, width), 'norm.weight': (width,),
           'norm.bias': (width,), 'head.weight': (1000, width),
           'head.bias': (1000,)}
  for i in range(2):
    state.update({f'blocks.{i}.norm1.weight': (width,),
                  f'blocks.{i}.norm1.bias': (width,),
                  f'blocks.{i}.attn.qkv.weight': (3 * width, width),
                  f'blocks.{i}.attn.qkv.bias': (3 * width,),
                  f'blocks.{i}.attn.proj.weight': (width, width),
                  f'blocks.{i}.attn.proj.bias': (width,),
                  f'blocks.{i}.norm2.weight': (width,),
                  f'blocks.{i}.norm2.bias': (width,),
                  f'blocks.{i}.mlp.fc1.weight': (mlp, width),
                  f'blocks.{i}.mlp.fc1.bias': (mlp,),
                  f'blocks.{i}.mlp.fc2.weight': (width, mlp),
                  f'blocks.{i}.mlp.fc2.bias': (width,)})
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file({k: rng.normal(size=s).astype(np.float32)
                               for k, s in state.items()}, path)
  config = dict(model='ViT_S16', num_layers=2, image_size=IMAGE_SIZE,
                vit_pool='cls', vit_posemb='learn', vit_gelu='exact')
  model = models.create_model(config['model'], 10, 3, rngs=nnx.Rngs(0),
                              **models.options(config_for(**config)))
  assert import_error(path, model, **config).endswith(
      'its model needs --config.model=ViT_Ti16 --config.num_layers=2')


def test_bad_init_from_is_refused_before_anything_is_written(
    tmp_path, resnet18_file):
  with pytest.raises(ValueError, match=(
      "unknown init_format 'caffe'; valid names: auto, "
      + re.escape(', '.join(factory.READERS)) + '$')):
    factory.read(resnet18_file[0], 'caffe', {})
  workdir = str(tmp_path / 'workdir')
  absent = str(tmp_path / 'absent.pth')
  for overrides, message in [
      # The whole of main.py's one line after 'Error: ' (its rendering of a
      # ConfigError: tests/test_train.py's command-line test).
      (dict(init_from=absent),
       f"^init_from '{re.escape(absent)}' does not exist; pass a workdir, "
       'checkpoint or weights file$'),
      (dict(init_from=resnet18_file[0], resnet_padding='symmetric'),
       r'does not fit --config.model=SmallResNet: not in the model: '
       r'stages.{1-3}.first.bn1.bias, .*stages.{1-3}.rest.layers.conv2.kernel;'
       ),
  ]:
    with pytest.raises(config_error.ConfigError, match=message):
      train.train_and_evaluate(run_config(**overrides), workdir)
    assert not os.path.exists(workdir)
