"""torchvision's ResNets (timm's plain ResNets use the same names), read
and written: one table of layer names, read both ways."""

import re

from weights import records
from weights import torch_files

# torchvision's layers -> this project's, outside the blocks and within.
_LAYERS = {'conv1': 'stem', 'bn1': 'stem_bn', 'fc': 'head'}
_BLOCK_LAYERS = {'conv1': 'conv1', 'conv2': 'conv2', 'conv3': 'conv3',
                 'bn1': 'bn1', 'bn2': 'bn2', 'bn3': 'bn3',
                 'downsample.0': 'proj', 'downsample.1': 'proj_bn'}


def read_torchvision(path: str, target: dict) -> records.Weights:
  """A torchvision (or timm) ResNet state dict: `.pth` (needs PyTorch) or
  `.safetensors`."""
  del target
  return from_state_dict(torch_files.read_state_dict(path),
                         'a torchvision ResNet')


def from_state_dict(state_dict: dict, source: str) -> records.Weights:
  """torchvision's ResNet names (timm's plain ResNets use the same)."""
  arrays, unmatched = {}, []
  for key, value in state_dict.items():
    if key.endswith('.num_batches_tracked'):
      continue  # a counter of BatchNorm updates, not a weight
    name = _project_name(key)
    if name is None:
      unmatched.append(key)
    elif name.endswith('.kernel'):
      arrays[name] = records.conv_kernel(value) if value.ndim == 4 else value.T
    else:
      arrays[name] = value
  return records.Weights(arrays, source, 'resnet',
                         {'resnet_padding': 'symmetric'}, unmatched)


def _project_name(key: str) -> str | None:
  """This project's name of torchvision's `key`; None when no rule maps
  it."""
  layer, _, kind = key.rpartition('.')
  m = re.fullmatch(r'layer(\d)\.(\d+)\.(.+)', layer)
  if m and m[3] in _BLOCK_LAYERS:
    name = f'stages.{int(m[1]) - 1}.blocks.{m[2]}.{_BLOCK_LAYERS[m[3]]}'
  elif not m and layer in _LAYERS:
    name = _LAYERS[layer]
  else:
    return None
  if re.search(r'bn\d?$', name):  # stem_bn, bn1, proj_bn
    return (f'{name}.{records.BATCH_NORM[kind]}'
            if kind in records.BATCH_NORM else None)
  if kind == 'weight':
    return f'{name}.kernel'
  return f'{name}.bias' if kind == 'bias' and name == 'head' else None


def to_state_dict(arrays: dict) -> dict:
  """torchvision's state dict of a ResNet's arrays in this project's names,
  one entry per block (`fitting.unstacked_layout`): the inverse of
  `from_state_dict`."""
  layers, block_layers = (records.inverse(_LAYERS),
                          records.inverse(_BLOCK_LAYERS))
  state_dict = {}
  for name, value in arrays.items():
    layer, kind = name.rsplit('.', 1)
    m = re.fullmatch(r'stages\.(\d+)\.blocks\.(\d+)\.(.+)', layer)
    key = (f'layer{int(m[1]) + 1}.{m[2]}.{block_layers[m[3]]}' if m
           else layers[layer])
    state_dict[f'{key}.{records.torch_kind(kind)}'] = (
        records.torch_weight(value) if kind == 'kernel' else value)
  return state_dict
