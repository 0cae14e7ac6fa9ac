"""DeiT's distillation token: timm's distilled ViT files loaded exactly,
against a PyTorch version of timm's `VisionTransformerDistilled`."""

import math

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch

import models
from weights import pretrained
from helpers import VIT
from helpers import tiny_config
from weight_references import timm_vit_state_dict

pytestmark = pytest.mark.xdist_group('distillation')


def torch_deit_distilled(state, images, heads, train):
  """timm's VisionTransformerDistilled forward in PyTorch: [cls; dist;
  patches] + pos_embed, pre-norm blocks (fused qkv, exact GELU, LayerNorm
  eps 1e-6), then head(cls) and head_dist(dist): both in training, their
  mean in evaluation."""
  w = {k: torch.from_numpy(v).double() for k, v in state.items()}
  x = torch.from_numpy(np.asarray(images)).double().permute(0, 3, 1, 2)
  x = torch.nn.functional.conv2d(x, w['patch_embed.proj.weight'],
                                 w['patch_embed.proj.bias'], stride=16)
  x = x.flatten(2).transpose(1, 2)
  n, _, width = x.shape
  x = torch.cat([w['cls_token'].expand(n, -1, -1),
                 w['dist_token'].expand(n, -1, -1), x], 1) + w['pos_embed']
  norm = lambda x, p: torch.nn.functional.layer_norm(
      x, (width,), w[f'{p}.weight'], w[f'{p}.bias'], eps=1e-6)
  linear = lambda x, p: x @ w[f'{p}.weight'].T + w[f'{p}.bias']
  i = 0
  while f'blocks.{i}.norm1.weight' in w:
    p = f'blocks.{i}'
    qkv = linear(norm(x, f'{p}.norm1'), f'{p}.attn.qkv').reshape(
        n, -1, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
    attention = torch.softmax(
        qkv[0] @ qkv[1].transpose(-2, -1) / math.sqrt(width // heads), -1)
    x = x + linear((attention @ qkv[2]).transpose(1, 2).reshape(n, -1, width),
                   f'{p}.attn.proj')
    x = x + linear(torch.nn.functional.gelu(
        linear(norm(x, f'{p}.norm2'), f'{p}.mlp.fc1')), f'{p}.mlp.fc2')
    i += 1
  x = norm(x, 'norm')
  logits, distilled = linear(x[:, 0], 'head'), linear(x[:, 1], 'head_dist')
  if train:
    return logits.numpy(), distilled.numpy()
  return ((logits + distilled) / 2).numpy()


def test_timm_deit_distilled_files_load_exactly(tmp_path):
  width, depth, heads, mlp = 192, 2, 3, 768  # ViT_Ti16's widths
  state = timm_vit_state_dict(2, width=width, mlp=mlp, depth=depth, classes=7,
                              dist_token=True)
  path = str(tmp_path / 'deit_tiny_distilled_patch16_224.safetensors')
  safetensors.numpy.save_file(state, path)
  config = tiny_config(**VIT, vit_pool='cls', vit_posemb='learn',
                       vit_gelu='exact', vit_distillation_token=True)
  model = models.create_model('ViT_Ti16', 7, 3, rngs=nnx.Rngs(0),
                              **models.options(config))
  pretrained.load_into_model(model, models.settings(config), path)
  images = np.random.default_rng(1).normal(size=(3, 32, 32, 3)).astype(
      np.float32)
  evaluated = np.asarray(model(jnp.asarray(images), train=False))
  assert np.max(np.abs(evaluated - torch_deit_distilled(
      state, images, heads, train=False))) < 1e-5
  trained = model(jnp.asarray(images), train=True)
  for ours, reference in zip(trained, torch_deit_distilled(
      state, images, heads, train=True)):
    assert np.max(np.abs(np.asarray(ours) - reference)) < 1e-5
  # The file's token is a convention: a model without one is told.
  config.vit_distillation_token = False
  with pytest.raises(ValueError,
                     match='set --config.vit_distillation_token=True'):
    pretrained.load_into_model(models.create_model(
        'ViT_Ti16', 7, 3, rngs=nnx.Rngs(0), **models.options(config)),
        models.settings(config), path)
