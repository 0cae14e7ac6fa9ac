"""timm's files: its VisionTransformer with 16 x 16 patches (DeiT's
distilled ones too: `dist_token`, `head_dist`), its plain ResNets
(torchvision's names), its ConvNeXts, its Swins and its RegNets."""

import re

import numpy as np

from weights import records
from weights import state_dict_formats
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
  detected = state_dict_formats.state_dict_format(state_dict)
  if detected == 'timm_swin':
    return timm_swin.from_state_dict(state_dict)
  if detected == 'timm':
    return _timm_vit(state_dict, target)
  if detected == 'timm_convnext':
    return timm_convnext.from_state_dict(state_dict)
  if detected == 'timm_regnet':
    return timm_regnet.from_state_dict(state_dict)
  return torch_resnet.from_state_dict(state_dict, 'a timm ResNet')


def _timm_vit(state_dict: dict, target: dict) -> records.Weights:
  """timm's VisionTransformer names; q, k and v split into heads."""
  # (layers, width, heads, head_dim); one head when the model is no ViT,
  # which `fit` refuses with its own message.
  heads = target.get('encoder.layers.attention.query.kernel', (1,) * 4)[-2]
  arrays, unmatched = {}, []
  linear = {'norm1': 'ln1', 'norm2': 'ln2', 'mlp.fc1': 'mlp_in',
            'mlp.fc2': 'mlp_out'}
  norm = {'weight': 'scale', 'bias': 'bias'}
  for key, value in state_dict.items():
    if key == 'mask_token' or key.startswith('decoder_'):
      continue  # MAE's pretraining decoder: fine-tuning drops it
    m = re.fullmatch(r'blocks\.(\d+)\.(.+)\.(weight|bias)', key)
    if m:
      block, layer, kind = f'encoder.blocks.{m[1]}.', m[2], m[3]
      if layer in ('norm1', 'norm2'):
        arrays[f'{block}{linear[layer]}.{norm[kind]}'] = value
      elif layer in linear:
        arrays[f'{block}{linear[layer]}.{records.param_name(kind)}'] = (
            value.T if kind == 'weight' else value)
      elif layer == 'attn.qkv':
        for name, part in zip(('query', 'key', 'value'),
                              _split_qkv(value, heads)):
          arrays[f'{block}attention.{name}.{records.param_name(kind)}'] = part
      elif layer == 'attn.proj':
        arrays[f'{block}attention.out.{records.param_name(kind)}'] = (
            value.T.reshape(heads, -1, value.shape[0]) if kind == 'weight'
            else value)
      else:
        unmatched.append(key)
    elif key == 'patch_embed.proj.weight':
      arrays['patch_embed.kernel'] = records.conv_kernel(value)
    elif key == 'patch_embed.proj.bias':
      arrays['patch_embed.bias'] = value
    elif key == 'cls_token':
      arrays['cls'] = value
    elif key == 'dist_token':  # DeiT's distillation token
      arrays['dist'] = value
    elif key == 'pos_embed':
      arrays[records.POSEMB] = value
    elif key in ('norm.weight', 'norm.bias'):
      arrays[f'encoder_norm.{norm[key.split(".")[1]]}'] = value
    elif re.fullmatch(r'head(_dist)?\.(weight|bias)', key):
      layer, kind = key.split('.')
      arrays[f'{layer}.{records.param_name(kind)}'] = (
          value.T if kind == 'weight' else value)
    else:
      unmatched.append(key)
  records.separate_class_token_position(arrays)
  return records.Weights(arrays, 'a timm ViT', 'vit', {
      'vit_gelu': 'exact', 'vit_pool': 'cls' if 'cls' in arrays else 'gap',
      'vit_posemb': 'learn', 'vit_pre_logits': False,
      'vit_distillation_token': 'dist' in arrays}, unmatched)


def _split_qkv(value: np.ndarray, heads: int) -> list:
  """timm's fused q, k, v (3 * width outputs, head-major within each) as
  nnx.MultiHeadAttention kernels (width, heads, head_dim) or biases."""
  if value.ndim == 2:  # (3 * width, width): outputs x inputs
    return list(value.reshape(3, heads, -1, value.shape[1]).transpose(
        0, 3, 1, 2))
  return list(value.reshape(3, heads, -1))
