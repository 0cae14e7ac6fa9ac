"""timm's RegNet state dicts (`regnety_040`, `regnety_160`, also DeiT's
`regnety_160` teacher, `{'model': state dict}`): stages `s1`..`s4` of
blocks `b1`.., each convolution with its BatchNorm as `convN.conv` and
`convN.bn`, SE as `se.fc1`/`se.fc2`, the shortcut as `downsample`."""

import re

from weights import records
from weights import torch_files

# A key that only a RegNet's state dict has.
TIMM_KEY = 's1.b1.conv1.conv.weight'

# timm's layers within a block -> this project's (convolution, BatchNorm).
_BLOCK_LAYERS = {'conv1': ('conv1', 'bn1'), 'conv2': ('conv2', 'bn2'),
                 'conv3': ('conv3', 'bn3'), 'downsample': ('proj', 'proj_bn')}
_SE_LAYERS = {'fc1': 'reduce', 'fc2': 'expand'}
_BATCH_NORM = records.BATCH_NORM
_STEM = ('stem', 'stem_bn')


def is_regnet(keys) -> bool:
  """Whether a state dict's `keys` are a RegNet's."""
  return TIMM_KEY in keys


def read_timm_regnet(path: str, target: dict) -> records.Weights:
  """A timm RegNet state dict: `.safetensors` or `.pth` (needs PyTorch)."""
  del target
  return from_state_dict(torch_files.read_state_dict(path))


def from_state_dict(state_dict: dict) -> records.Weights:
  """The arrays of a RegNet state dict in this project's names, one entry
  per block (`stages.S.blocks.M.*`, stacked by `fitting`)."""
  arrays, unmatched = {}, []
  for key, value in state_dict.items():
    if key.endswith('.num_batches_tracked'):
      continue  # a counter of BatchNorm updates, not a weight
    name = _project_name(key)
    if name is None:
      unmatched.append(key)
    elif name.endswith('.kernel'):
      arrays[name] = _kernel(name, value)
    else:
      arrays[name] = value
  return records.Weights(arrays, 'a timm RegNet', 'regnet', {}, unmatched)


def _project_name(key: str) -> str | None:
  """This project's name of timm's `key`; None when no rule maps it."""
  m = re.fullmatch(r's(\d+)\.b(\d+)\.(\w+)\.(conv|bn|fc\d)\.(\w+)', key)
  if m:
    block = f'stages.{int(m[1]) - 1}.blocks.{int(m[2]) - 1}'
    layer, part, kind = m[3], m[4], m[5]
    if layer == 'se' and part in _SE_LAYERS and kind in ('weight', 'bias'):
      return f'{block}.se.{_SE_LAYERS[part]}.{records.param_name(kind)}'
    if layer in _BLOCK_LAYERS:
      return _conv_or_norm(block + '.', _BLOCK_LAYERS[layer], part, kind)
    return None
  m = re.fullmatch(r'stem\.(conv|bn)\.(\w+)', key)
  if m:
    return _conv_or_norm('', _STEM, m[1], m[2])
  if key in ('head.fc.weight', 'head.fc.bias'):
    return f'head.{records.param_name(key.rpartition(".")[2])}'
  return None


def _conv_or_norm(prefix: str, layers: tuple, part: str, kind: str):
  """The name of a ConvNormAct's `conv.weight` or `bn.<kind>`."""
  conv, norm = layers
  if part == 'conv' and kind == 'weight':
    return f'{prefix}{conv}.kernel'
  if part == 'bn' and kind in _BATCH_NORM:
    return f'{prefix}{norm}.{_BATCH_NORM[kind]}'
  return None


def to_state_dict(arrays: dict) -> dict:
  """timm's state dict of a RegNet's arrays in this project's names, one
  entry per block (`fitting.unstacked_layout`): the inverse of
  `from_state_dict`."""
  # This project's convolution or BatchNorm -> (timm's layer, its part).
  parts = {layer: (timm_layer, part)
           for timm_layer, pair in {**_BLOCK_LAYERS, 'stem': _STEM}.items()
           for layer, part in zip(pair, ('conv', 'bn'))}
  se_layers = records.inverse(_SE_LAYERS)
  state_dict = {}
  for name, value in arrays.items():
    layer, _, kind = name.rpartition('.')
    m = re.fullmatch(r'stages\.(\d+)\.blocks\.(\d+)\.(.+)', layer)
    prefix = f's{int(m[1]) + 1}.b{int(m[2]) + 1}.' if m else ''
    layer = m[3] if m else layer
    if layer.startswith('se.'):
      key = f'{prefix}se.{se_layers[layer[3:]]}'
      value = value.T[:, :, None, None] if kind == 'kernel' else value
    elif layer == 'head':
      key, value = 'head.fc', value.T if kind == 'kernel' else value
    else:
      timm_layer, part = parts[layer]
      key = f'{prefix}{timm_layer}.{part}'
      value = records.torch_weight(value) if kind == 'kernel' else value
    state_dict[f'{key}.{records.torch_kind(kind)}'] = value
  return state_dict


def _kernel(name: str, value):
  """timm's weight as this project's kernel: a convolution's (out, in, h,
  w) as (h, w, in, out); SE's 1x1 convolutions, dense layers here, and the
  head as (in, out)."""
  if '.se.' in name:
    return value[:, :, 0, 0].T
  return records.conv_kernel(value) if value.ndim == 4 else value.T
