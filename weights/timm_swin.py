"""Swin Transformer state dicts: timm's (`swin_*`, timm 0.9 and later) and
the original releases (microsoft/Swin-Transformer's `{'model': ...}` files,
also timm's before 0.9), which end each stage with the next one's patch
merging and name the classifier `head`: their names are first renamed to
timm's."""

import re

from weights import records
from weights import torch_files

# A key only a Swin state dict has, in either naming.
SWIN_KEY = 'layers.0.blocks.0.attn.relative_position_bias_table'
# Arrays the models compute from the window alone: not parameters.
_BUFFERS = ('relative_position_index', 'attn_mask')
# timm's layer names -> this project's, within a block and outside.
_BLOCK_LAYERS = {'norm1': 'norm1', 'attn.qkv': 'attn.qkv',
                 'attn.proj': 'attn.proj', 'norm2': 'norm2',
                 'mlp.fc1': 'fc1', 'mlp.fc2': 'fc2'}
_LAYERS = {'patch_embed.proj': 'patch_embed',
           'patch_embed.norm': 'patch_embed_norm', 'norm': 'head_norm',
           'head.fc': 'head'}
_DOWNSAMPLE = {'norm': 'downsample_norm', 'reduction': 'downsample'}
_BIAS_TABLE = 'attn.relative_position_bias_table'


def is_swin(keys) -> bool:
  """Whether a state dict's `keys` are a Swin Transformer's."""
  return SWIN_KEY in keys


def read_timm_swin(path: str, target: dict) -> records.Weights:
  """A Swin state dict, `.safetensors` or `.pth` (needs PyTorch; `{'model':
  state dict}` as the original releases hold it)."""
  del target
  return from_state_dict(torch_files.read_state_dict(path))


def from_state_dict(state_dict: dict) -> records.Weights:
  """The arrays of a Swin state dict in this project's names, one entry
  per block (`stages.S.blocks.M.*`, paired and stacked by `fitting`)."""
  state_dict = timm_names(state_dict)
  arrays, unmatched = {}, []
  for key, value in state_dict.items():
    if key.rpartition('.')[2] in _BUFFERS:
      continue
    name = _project_name(key)
    if name is None:
      unmatched.append(key)
    else:
      arrays[name] = _project_array(key, value)
  return records.Weights(arrays, 'a Swin Transformer', 'swin', {},
                         unmatched)


def timm_names(state_dict: dict) -> dict:
  """The state dict in timm's current names: an original-layout file's
  `layers.N.downsample` (the end of stage N) is stage N + 1's start, its
  `head` timm's `head.fc`."""
  if not any(key.startswith('layers.0.downsample.') for key in state_dict):
    return state_dict
  renamed = {}
  for key, value in state_dict.items():
    key = re.sub(r'^layers\.(\d+)\.downsample\.',
                 lambda m: f'layers.{int(m[1]) + 1}.downsample.', key)
    renamed[re.sub(r'^head\.(weight|bias)$', r'head.fc.\1', key)] = value
  return renamed


def _project_name(key: str) -> str | None:
  """This project's name of timm's `key`; None when no rule maps it."""
  m = re.fullmatch(r'layers\.(\d+)\.blocks\.(\d+)\.(.+)\.(weight|bias)', key)
  if m and m[3] in _BLOCK_LAYERS:
    return records.torch_param(
        f'stages.{m[1]}.blocks.{m[2]}.{_BLOCK_LAYERS[m[3]]}', m[4])
  m = re.fullmatch(r'layers\.(\d+)\.blocks\.(\d+)\.attn\.'
                   r'relative_position_bias_table', key)
  if m:
    return f'stages.{m[1]}.blocks.{m[2]}.attn.relative_position_bias_table'
  m = re.fullmatch(r'layers\.(\d+)\.downsample\.(norm|reduction)\.'
                   r'(weight|bias)', key)
  if m:
    return records.torch_param(f'stages.{m[1]}.{_DOWNSAMPLE[m[2]]}', m[3])
  layer, _, kind = key.rpartition('.')
  if layer in _LAYERS and kind in ('weight', 'bias'):
    return records.torch_param(_LAYERS[layer], kind)
  return None


def to_state_dict(arrays: dict) -> dict:
  """timm's state dict of a Swin's arrays in this project's names, one
  entry per block (`fitting.unstacked_layout`): the inverse of
  `from_state_dict`."""
  block_layers, layers = (records.inverse(_BLOCK_LAYERS),
                          records.inverse(_LAYERS))
  downsample = records.inverse(_DOWNSAMPLE)
  state_dict = {}
  for name, value in arrays.items():
    layer, _, kind = name.rpartition('.')
    m = re.fullmatch(r'stages\.(\d+)\.blocks\.(\d+)\.(.+)', layer)
    d = re.fullmatch(r'stages\.(\d+)\.(downsample(_norm)?)', layer)
    if m and f'{m[3]}.{kind}' == _BIAS_TABLE:
      state_dict[f'layers.{m[1]}.blocks.{m[2]}.{_BIAS_TABLE}'] = value
      continue
    if m:
      key = f'layers.{m[1]}.blocks.{m[2]}.{block_layers[m[3]]}'
    elif d:
      key = f'layers.{d[1]}.downsample.{downsample[d[2]]}'
    else:
      key = layers[layer]
    state_dict[f'{key}.{records.torch_kind(kind)}'] = (
        records.torch_weight(value) if kind == 'kernel' else value)
  return state_dict


def _project_array(key: str, value):
  """timm's array as the project holds it: the patch embedding's
  convolution (out, in, h, w) -> (h, w, in, out), linear layers transposed,
  the bias tables ((2 window - 1)^2, heads) as they are."""
  if value.ndim == 4:
    return records.conv_kernel(value)
  if value.ndim == 2 and not key.endswith('relative_position_bias_table'):
    return value.T
  return value
