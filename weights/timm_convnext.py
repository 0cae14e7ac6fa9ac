"""ConvNeXt and ConvNeXt V2 state dicts: timm's (`convnext_*`,
`convnextv2_*`) and facebookresearch's original releases, which name the
same arrays otherwise: their names are first renamed to timm's. timm's
smallest ConvNeXts (`convnext_atto`, `convnextv2_atto`) hold each block's
MLP as two 1x1 convolutions (`conv_mlp`): the same arrays, (out, in, 1, 1)
instead of (out, in)."""

import re

from weights import records
from weights import torch_files

# One key of each naming that only a ConvNeXt state dict has.
TIMM_KEY = 'stages.0.blocks.0.conv_dw.weight'
ORIGINAL_KEY = 'stages.0.0.dwconv.weight'

# The original release's names, as timm renames them on loading
# (`checkpoint_filter_fn` of timm's convnext.py): (pattern, replacement).
_ORIGINAL_TO_TIMM = (
    (r'downsample_layers\.0\.(\d)\.', r'stem.\1.'),
    (r'downsample_layers\.(\d)\.(\d)\.', r'stages.\1.downsample.\2.'),
    (r'stages\.(\d)\.(\d+)\.', r'stages.\1.blocks.\2.'),
    (r'\.dwconv\.', '.conv_dw.'),
    (r'\.pwconv1\.', '.mlp.fc1.'),
    (r'\.pwconv2\.', '.mlp.fc2.'),
    (r'\.grn\.gamma$', '.mlp.grn.weight'),
    (r'\.grn\.beta$', '.mlp.grn.bias'),
    (r'^norm\.', 'head.norm.'),
    (r'^head\.(weight|bias)$', r'head.fc.\1'),
)
# timm's layer names -> this project's, within a block and outside.
_BLOCK_LAYERS = {'conv_dw': 'conv_dw', 'norm': 'norm', 'mlp.fc1': 'fc1',
                 'mlp.fc2': 'fc2'}
_LAYERS = {'stem.0': 'stem', 'stem.1': 'stem_norm', 'head.norm': 'head_norm',
           'head.fc': 'head'}
_DOWNSAMPLE = {'0': 'downsample_norm', '1': 'downsample'}
_GRN = {'weight': 'gamma', 'bias': 'beta'}


def is_convnext(keys) -> bool:
  """Whether a state dict's `keys` are a ConvNeXt's, in either naming."""
  return TIMM_KEY in keys or ORIGINAL_KEY in keys


def read_timm_convnext(path: str, target: dict) -> records.Weights:
  """A ConvNeXt (V1 or V2) state dict, `.safetensors` or `.pth` (needs
  PyTorch; `{'model': state dict}` as the original releases hold it)."""
  del target
  return from_state_dict(torch_files.read_state_dict(path))


def from_state_dict(state_dict: dict) -> records.Weights:
  """The arrays of a ConvNeXt state dict in this project's names, one entry
  per block (`stages.S.blocks.M.*`, stacked by `fitting`)."""
  if ORIGINAL_KEY in state_dict:
    state_dict = {timm_name(key): value for key, value in state_dict.items()}
  arrays, unmatched = {}, []
  for key, value in state_dict.items():
    name = _project_name(key)
    if name is None:
      unmatched.append(key)
    else:
      arrays[name] = _project_array(key, value)
  v2 = any(key.endswith('.mlp.grn.weight') for key in state_dict)
  return records.Weights(arrays, 'a ConvNeXt V2' if v2 else 'a ConvNeXt',
                         'convnext', {}, unmatched)


def timm_name(original: str) -> str:
  """timm's name of an array in facebookresearch's naming."""
  for pattern, replacement in _ORIGINAL_TO_TIMM:
    original = re.sub(pattern, replacement, original)
  return original


def _project_name(key: str) -> str | None:
  """This project's name of timm's `key`; None when no rule maps it."""
  m = re.fullmatch(r'(stages\.\d+\.blocks\.\d+)\.(.+)\.(weight|bias)', key)
  if m and m[2] in _BLOCK_LAYERS:
    return records.torch_param(f'{m[1]}.{_BLOCK_LAYERS[m[2]]}', m[3])
  if m and m[2] == 'mlp.grn':
    return f'{m[1]}.grn.{_GRN[m[3]]}'
  m = re.fullmatch(r'(stages\.\d+\.blocks\.\d+)\.gamma', key)
  if m:
    return f'{m[1]}.layer_scale'
  m = re.fullmatch(r'(stages\.\d+)\.downsample\.([01])\.(weight|bias)', key)
  if m:
    return records.torch_param(f'{m[1]}.{_DOWNSAMPLE[m[2]]}', m[3])
  layer, _, kind = key.rpartition('.')
  if layer in _LAYERS and kind in ('weight', 'bias'):
    return records.torch_param(_LAYERS[layer], kind)
  return None


def to_state_dict(arrays: dict, conv_mlp: bool = False) -> dict:
  """timm's state dict of a ConvNeXt's arrays in this project's names, one
  entry per block (`fitting.unstacked_layout`): the inverse of
  `from_state_dict`; each block's MLP as 1x1 convolutions if `conv_mlp`."""
  block_layers, layers = (records.inverse(_BLOCK_LAYERS),
                          records.inverse(_LAYERS))
  downsample, grn = records.inverse(_DOWNSAMPLE), records.inverse(_GRN)
  state_dict = {}
  for name, value in arrays.items():
    layer, _, kind = name.rpartition('.')
    m = re.fullmatch(r'(stages\.\d+\.blocks\.\d+)\.(.+)', layer)
    d = re.fullmatch(r'(stages\.\d+)\.(downsample(_norm)?)', layer)
    if kind == 'layer_scale':
      key = f'{layer}.gamma'
    elif m and m[2] == 'grn':
      key = f'{m[1]}.mlp.grn.{grn[kind]}'
    elif m:
      key = f'{m[1]}.{block_layers[m[2]]}.{records.torch_kind(kind)}'
      if conv_mlp and m[2] in ('fc1', 'fc2') and kind == 'kernel':
        value = value[None, None]  # (1, 1, in, out): a 1x1 convolution's
    elif d:
      key = f'{d[1]}.downsample.{downsample[d[2]]}.{records.torch_kind(kind)}'
    else:
      key = f'{layers[layer]}.{records.torch_kind(kind)}'
    state_dict[key] = (records.torch_weight(value) if kind == 'kernel'
                       else value)
  return state_dict


def _project_array(key: str, value):
  """timm's array as the project holds it: convolutions (out, in, h, w) ->
  (h, w, in, out), linear layers and the MLPs' 1x1 convolutions
  (`conv_mlp`) -> (in, out), GRN's (1, 1, 1, C) flattened."""
  if value.ndim == 4 and key.endswith(('fc1.weight', 'fc2.weight')):
    return value[:, :, 0, 0].T
  if value.ndim == 4 and not key.endswith(('grn.weight', 'grn.bias')):
    return records.conv_kernel(value)
  if value.ndim == 2:
    return value.T
  return value.reshape(-1)
