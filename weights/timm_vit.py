"""timm's files: its VisionTransformer with 16 x 16 patches (DeiT's
distilled ones too: `dist_token`, `head_dist`), its plain ResNets
(torchvision's names), its ConvNeXts, its Swins and its RegNets."""

import re

import numpy as np

from weights import records
from weights import timm_convnext
from weights import timm_regnet
from weights import timm_swin
from weights import torch_files
from weights import torch_resnet


def read_timm(path: str, target: dict) -> records.Weights:
  """timm's `model.safetensors` (or `.pth`) of a ResNet or a ViT with
  16 x 16 patches; also MAE's `.pth` files (timm's names, without the
  pretraining decoder), ConvNeXts (`timm_convnext`), Swins (`timm_swin`)
  and RegNets (`timm_regnet`)."""
  state_dict = torch_files.read_state_dict(path)
  # Before the ViT's check: a Swin has a `patch_embed.proj` too.
  if timm_swin.is_swin(state_dict):
    return timm_swin.from_state_dict(state_dict)
  if 'patch_embed.proj.weight' in state_dict:
    return _timm_vit(state_dict, target)
  if timm_convnext.is_convnext(state_dict):
    return timm_convnext.from_state_dict(state_dict)
  if timm_regnet.is_regnet(state_dict):
    return timm_regnet.from_state_dict(state_dict)
  return torch_resnet.from_state_dict(state_dict, 'a timm ResNet')


# timm's layers -> this project's, within a block and outside; `qkv` is
# split into the query, key and value, `proj` is `attention.out`.
_BLOCK_LAYERS = {'norm1': 'ln1', 'norm2': 'ln2', 'mlp.fc1': 'mlp_in',
                 'mlp.fc2': 'mlp_out', 'attn.proj': 'attention.out'}
_LAYERS = {'patch_embed.proj': 'patch_embed', 'norm': 'encoder_norm',
           'head': 'head', 'head_dist': 'head_dist'}
_TOKENS = {'cls_token': 'cls', 'dist_token': 'dist',
           'pos_embed': records.POSEMB}
_QKV = ('query', 'key', 'value')


def _timm_vit(state_dict: dict, target: dict) -> records.Weights:
  """timm's VisionTransformer names; q, k and v split into heads."""
  # (layers, width, heads, head_dim); one head when the model is no ViT,
  # which `fit` refuses with its own message.
  heads = target.get('encoder.layers.attention.query.kernel', (1,) * 4)[-2]
  arrays, unmatched = {}, []
  for key, value in state_dict.items():
    if key == 'mask_token' or key.startswith('decoder_'):
      continue  # MAE's pretraining decoder: fine-tuning drops it
    layer, _, kind = key.rpartition('.')
    m = re.fullmatch(r'blocks\.(\d+)\.(.+)', layer)
    if key in _TOKENS:
      arrays[_TOKENS[key]] = value
    elif m and m[2] == 'attn.qkv' and kind in ('weight', 'bias'):
      for name, part in zip(_QKV, _split_qkv(value, heads)):
        arrays[f'encoder.blocks.{m[1]}.attention.{name}.'
               f'{records.param_name(kind)}'] = part
    elif m and m[2] in _BLOCK_LAYERS and kind in ('weight', 'bias'):
      name = records.torch_param(
          f'encoder.blocks.{m[1]}.{_BLOCK_LAYERS[m[2]]}', kind)
      if name.endswith('attention.out.kernel'):
        value = value.T.reshape(heads, -1, value.shape[0])
      arrays[name] = value.T if name.endswith('.kernel') and (
          value.ndim == 2) else value
    elif not m and layer in _LAYERS and kind in ('weight', 'bias'):
      name = records.torch_param(_LAYERS[layer], kind)
      arrays[name] = (records.conv_kernel(value) if value.ndim == 4 else
                      value.T if value.ndim == 2 else value)
    else:
      unmatched.append(key)
  records.separate_class_token_position(arrays)
  return records.Weights(arrays, 'a timm ViT', 'vit', {
      'vit_gelu': 'exact', 'vit_pool': 'cls' if 'cls' in arrays else 'gap',
      'vit_posemb': 'learn', 'vit_pre_logits': False,
      'vit_distillation_token': 'dist' in arrays}, unmatched)


def to_state_dict(arrays: dict) -> dict:
  """timm's state dict of a ViT's arrays in this project's names, one entry
  per block (`fitting.unstacked_layout`): the inverse of `_timm_vit`, the
  tokens' own positions split back out of the position embedding."""
  arrays = dict(arrays)
  records.join_class_token_position(arrays)
  tokens, layers = records.inverse(_TOKENS), records.inverse(_LAYERS)
  block_layers = records.inverse(_BLOCK_LAYERS)
  state_dict, qkv = {}, {}
  for name, value in arrays.items():
    layer, _, kind = name.rpartition('.')
    m = re.fullmatch(r'encoder\.blocks\.(\d+)\.(.+)', layer)
    if name in tokens:
      state_dict[tokens[name]] = value
    elif m and m[2] in [f'attention.{part}' for part in _QKV]:
      qkv.setdefault(f'blocks.{m[1]}.attn.qkv.{records.torch_kind(kind)}',
                     {})[m[2].split('.')[1]] = value
    else:
      key = (f'blocks.{m[1]}.{block_layers[m[2]]}' if m else layers[layer])
      if name.endswith('attention.out.kernel'):  # (heads, head_dim, width)
        value = value.reshape(-1, value.shape[-1])
      state_dict[f'{key}.{records.torch_kind(kind)}'] = (
          records.torch_weight(value) if kind == 'kernel' else value)
  for key, parts in qkv.items():
    state_dict[key] = _fused_qkv([parts[part] for part in _QKV])
  return state_dict


def _fused_qkv(parts: list) -> np.ndarray:
  """The inverse of `_split_qkv`: query, key and value kernels (width,
  heads, head_dim) or biases (heads, head_dim) as timm's fused array."""
  stacked = np.stack(parts)
  if stacked.ndim == 4:  # (3, width, heads, head_dim)
    return stacked.transpose(0, 2, 3, 1).reshape(-1, stacked.shape[1])
  return stacked.reshape(-1)


def _split_qkv(value: np.ndarray, heads: int) -> list:
  """timm's fused q, k, v (3 * width outputs, head-major within each) as
  nnx.MultiHeadAttention kernels (width, heads, head_dim) or biases."""
  if value.ndim == 2:  # (3 * width, width): outputs x inputs
    return list(value.reshape(3, heads, -1, value.shape[1]).transpose(
        0, 3, 1, 2))
  return list(value.reshape(3, heads, -1))
