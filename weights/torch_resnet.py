"""torchvision's ResNets (timm's plain ResNets use the same names)."""

import re

from weights import records
from weights import torch_files


def read_torchvision(path: str, target: dict) -> records.Weights:
  """A torchvision (or timm) ResNet state dict: `.pth` (needs PyTorch) or
  `.safetensors`."""
  del target
  return from_state_dict(torch_files.read_state_dict(path),
                         'a torchvision ResNet')


def from_state_dict(state_dict: dict, source: str) -> records.Weights:
  """torchvision's ResNet names (timm's plain ResNets use the same)."""
  bn = {'weight': 'scale', 'bias': 'bias', 'running_mean': 'mean',
        'running_var': 'var'}
  arrays, unmatched = {}, []
  for key, value in state_dict.items():
    parts = key.split('.')
    if parts[-1] == 'num_batches_tracked':
      continue  # a counter of BatchNorm updates, not a weight
    m = re.fullmatch(r'layer(\d)\.(\d+)\.(.+)', key)
    prefix = f'stages.{int(m[1]) - 1}.blocks.{m[2]}.' if m else ''
    inner = m[3] if m else key
    if m and (c := re.fullmatch(r'conv(\d)\.weight', inner)):
      arrays[f'{prefix}conv{c[1]}.kernel'] = records.conv_kernel(value)
    elif m and (c := re.fullmatch(r'bn(\d)\.(\w+)', inner)) and c[2] in bn:
      arrays[f'{prefix}bn{c[1]}.{bn[c[2]]}'] = value
    elif m and inner == 'downsample.0.weight':
      arrays[f'{prefix}proj.kernel'] = records.conv_kernel(value)
    elif m and (c := re.fullmatch(r'downsample\.1\.(\w+)', inner)) and (
        c[1] in bn):
      arrays[f'{prefix}proj_bn.{bn[c[1]]}'] = value
    elif key == 'conv1.weight':
      arrays['stem.kernel'] = records.conv_kernel(value)
    elif parts[0] == 'bn1' and len(parts) == 2 and parts[1] in bn:
      arrays[f'stem_bn.{bn[parts[1]]}'] = value
    elif key == 'fc.weight':
      arrays['head.kernel'] = value.T
    elif key == 'fc.bias':
      arrays['head.bias'] = value
    else:
      unmatched.append(key)
  return records.Weights(arrays, source, 'resnet',
                         {'resnet_padding': 'symmetric'}, unmatched)
