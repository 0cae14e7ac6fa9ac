"""Pretrained weights: every published format, this project's own
checkpoints and exports, eval-only mode, predict and fine-tuning.

Each fixture is written by the test in its project's published layout (real
key names, a small variant's shapes). After import, the model's forward pass
must equal the source network computed from the fixture's arrays by an
independent reference written here in plain jax.numpy, within 1e-5.
"""

import glob
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys

import jax
from jax import lax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from flax import nnx

from training import config_checks
from configs import default
from configs import finetune
from configs import imagenet
from evaluators import classification
import export
from families import resnet as resnet_family
from families import vit as vit_family
from data import datasets
import models
from training import optimizer
import predict
from weights import factory
from weights import fitting
from weights import pretrained
from training import run_state
from training import state as train_state
import train
from helpers import assert_refuses_a_file_that_is_not_an_image
from helpers import REPO
from helpers import images
from helpers import prepare_tiny_images
from helpers import read_scalars

WIDTH = 8  # ResNet fixtures: stage widths 8, 16, 32, 64
VIT = dict(width=32, depth=2, heads=4, mlp_dim=64)
IMAGE_SIZE = 32
NUM_CLASSES = 7
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def config_for(**overrides) -> ml_collections.ConfigDict:
  config = default.get_config()
  config.update(overrides)
  return config


def stack_options(scan: str) -> dict:
  """The three ways a stack runs the same stacked parameters."""
  return {'scanned': dict(scan_layers=True),
          'unrolled': dict(scan_layers=False),
          'segmented': dict(scan_layers=True, scan_segments=2)}[scan]


# -------------------------------------------------------------- fixtures


def batch_norm_arrays(rng, channels) -> dict:
  return {'weight': rng.uniform(0.3, 0.7, channels),
          'bias': rng.normal(0, 0.1, channels),
          'running_mean': rng.normal(0, 0.1, channels),
          'running_var': rng.uniform(0.5, 1.5, channels)}


def torch_resnet_state_dict(stage_sizes, bottleneck, seed=0) -> dict:
  """torchvision's ResNet names and (out, in, kh, kw) shapes, width WIDTH."""
  rng = np.random.default_rng(seed)
  state = {}

  def conv(name, out, inp, k):
    state[name] = rng.normal(0, 1 / math.sqrt(inp * k * k), (out, inp, k, k))

  def bn(prefix, channels):
    for key, value in batch_norm_arrays(rng, channels).items():
      state[f'{prefix}.{key}'] = value
    state[f'{prefix}.num_batches_tracked'] = np.array(100, np.int64)

  conv('conv1.weight', WIDTH, 3, 7)
  bn('bn1', WIDTH)
  expansion = 4 if bottleneck else 1
  inp = WIDTH
  for s, num_blocks in enumerate(stage_sizes):
    planes = WIDTH * 2**s
    for j in range(num_blocks):
      p = f'layer{s + 1}.{j}.'
      stride = 2 if s > 0 and j == 0 else 1
      if bottleneck:
        conv(p + 'conv1.weight', planes, inp, 1)
        bn(p + 'bn1', planes)
        conv(p + 'conv2.weight', planes, planes, 3)
        bn(p + 'bn2', planes)
        conv(p + 'conv3.weight', planes * 4, planes, 1)
        bn(p + 'bn3', planes * 4)
      else:
        conv(p + 'conv1.weight', planes, inp, 3)
        bn(p + 'bn1', planes)
        conv(p + 'conv2.weight', planes, planes, 3)
        bn(p + 'bn2', planes)
      if stride != 1 or inp != planes * expansion:
        conv(p + 'downsample.0.weight', planes * expansion, inp, 1)
        bn(p + 'downsample.1', planes * expansion)
      inp = planes * expansion
  state['fc.weight'] = rng.normal(0, 1 / math.sqrt(inp), (NUM_CLASSES, inp))
  state['fc.bias'] = rng.normal(0, 0.1, NUM_CLASSES)
  return {k: v.astype(np.float32) if v.dtype == np.float64 else v
          for k, v in state.items()}


def flax_resnet_variables(stage_sizes, bottleneck, seed=0):
  """The Flax ImageNet example's Linen names: (params, batch_stats)."""
  rng = np.random.default_rng(seed)
  params, stats = {}, {}

  def conv(scope, name, inp, out, k):
    scope[name] = {'kernel': rng.normal(0, 1 / math.sqrt(inp * k * k),
                                        (k, k, inp, out)).astype(np.float32)}

  def bn(param_scope, stat_scope, name, channels):
    arrays = {k: v.astype(np.float32)
              for k, v in batch_norm_arrays(rng, channels).items()}
    param_scope[name] = {'scale': arrays['weight'], 'bias': arrays['bias']}
    stat_scope[name] = {'mean': arrays['running_mean'],
                        'var': arrays['running_var']}

  conv(params, 'conv_init', 3, WIDTH, 7)
  bn(params, stats, 'bn_init', WIDTH)
  block_name = 'BottleneckResNetBlock' if bottleneck else 'ResNetBlock'
  expansion = 4 if bottleneck else 1
  inp, n = WIDTH, 0
  for s, num_blocks in enumerate(stage_sizes):
    filters = WIDTH * 2**s
    for j in range(num_blocks):
      block, block_stats = {}, {}
      kernels = ([(inp, filters, 1), (filters, filters, 3),
                  (filters, filters * 4, 1)] if bottleneck else
                 [(inp, filters, 3), (filters, filters, 3)])
      for k, (i, o, size) in enumerate(kernels):
        conv(block, f'Conv_{k}', i, o, size)
        bn(block, block_stats, f'BatchNorm_{k}', o)
      if (s > 0 and j == 0) or inp != filters * expansion:
        conv(block, 'conv_proj', inp, filters * expansion, 1)
        bn(block, block_stats, 'norm_proj', filters * expansion)
      params[f'{block_name}_{n}'] = block
      stats[f'{block_name}_{n}'] = block_stats
      inp, n = filters * expansion, n + 1
  params['Dense_0'] = {
      'kernel': rng.normal(0, 1 / math.sqrt(inp),
                           (inp, NUM_CLASSES)).astype(np.float32),
      'bias': rng.normal(0, 0.1, NUM_CLASSES).astype(np.float32)}
  return params, stats


def timm_vit_state_dict(grid, cls=True, seed=0) -> dict:
  """timm's VisionTransformer names: fused qkv, (out, in) linears, a
  position embedding with the class token's entry first."""
  rng = np.random.default_rng(seed)
  width, mlp = VIT['width'], VIT['mlp_dim']

  def linear(prefix, out, inp):
    state[f'{prefix}.weight'] = rng.normal(0, 1 / math.sqrt(inp), (out, inp))
    state[f'{prefix}.bias'] = rng.normal(0, 0.1, out)

  def norm(prefix):
    state[f'{prefix}.weight'] = rng.uniform(0.5, 1.5, width)
    state[f'{prefix}.bias'] = rng.normal(0, 0.1, width)

  state = {'patch_embed.proj.weight': rng.normal(
      0, 1 / math.sqrt(3 * 16 * 16), (width, 3, 16, 16)),
           'patch_embed.proj.bias': rng.normal(0, 0.1, width),
           'pos_embed': rng.normal(0, 0.5, (1, grid * grid + cls, width))}
  if cls:
    state['cls_token'] = rng.normal(0, 0.5, (1, 1, width))
  for i in range(VIT['depth']):
    norm(f'blocks.{i}.norm1')
    linear(f'blocks.{i}.attn.qkv', 3 * width, width)
    linear(f'blocks.{i}.attn.proj', width, width)
    norm(f'blocks.{i}.norm2')
    linear(f'blocks.{i}.mlp.fc1', mlp, width)
    linear(f'blocks.{i}.mlp.fc2', width, mlp)
  norm('norm')
  linear('head', NUM_CLASSES, width)
  return {k: v.astype(np.float32) for k, v in state.items()}


def big_vision_params(grid, cls, learned_posemb, seed=0, width=VIT['width'],
                      heads=VIT['heads'], mlp=VIT['mlp_dim']) -> dict:
  """big_vision's ViT names ('/'-joined Linen paths, flat blocks)."""
  rng = np.random.default_rng(seed)
  head_dim = width // heads
  flat = {'embedding/kernel': rng.normal(0, 1 / math.sqrt(3 * 16 * 16),
                                         (16, 16, 3, width)),
          'embedding/bias': rng.normal(0, 0.1, width)}
  if learned_posemb:
    flat['pos_embedding'] = rng.normal(0, 0.5, (1, grid * grid, width))
  if cls:
    flat['cls'] = rng.normal(0, 0.5, (1, 1, width))

  def norm(prefix):
    flat[f'{prefix}/scale'] = rng.uniform(0.5, 1.5, width)
    flat[f'{prefix}/bias'] = rng.normal(0, 0.1, width)

  for i in range(VIT['depth']):
    block = f'Transformer/encoderblock_{i}'
    norm(f'{block}/LayerNorm_0')
    attention = f'{block}/MultiHeadDotProductAttention_0'
    for name in ('query', 'key', 'value'):
      flat[f'{attention}/{name}/kernel'] = rng.normal(
          0, 1 / math.sqrt(width), (width, heads, head_dim))
      flat[f'{attention}/{name}/bias'] = rng.normal(0, 0.1, (heads, head_dim))
    flat[f'{attention}/out/kernel'] = rng.normal(
        0, 1 / math.sqrt(width), (heads, head_dim, width))
    flat[f'{attention}/out/bias'] = rng.normal(0, 0.1, width)
    norm(f'{block}/LayerNorm_1')
    flat[f'{block}/MlpBlock_0/Dense_0/kernel'] = rng.normal(
        0, 1 / math.sqrt(width), (width, mlp))
    flat[f'{block}/MlpBlock_0/Dense_0/bias'] = rng.normal(0, 0.1, mlp)
    flat[f'{block}/MlpBlock_0/Dense_1/kernel'] = rng.normal(
        0, 1 / math.sqrt(mlp), (mlp, width))
    flat[f'{block}/MlpBlock_0/Dense_1/bias'] = rng.normal(0, 0.1, width)
  norm('Transformer/encoder_norm')
  flat['head/kernel'] = rng.normal(0, 1 / math.sqrt(width),
                                   (width, NUM_CLASSES))
  flat['head/bias'] = rng.normal(0, 0.1, NUM_CLASSES)
  return {k: v.astype(np.float32) for k, v in flat.items()}


# ------------------------------------------- independent references (jnp)


def relu(x):
  return jnp.maximum(x, 0)


def conv_nchw(x, kernel, stride, padding):
  return lax.conv_general_dilated(
      x, kernel, (stride, stride), [(padding, padding)] * 2,
      dimension_numbers=('NCHW', 'OIHW', 'NCHW'),
      precision=lax.Precision.HIGHEST)


def batch_norm(x, scale, bias, mean, var, axis):
  shape = [1] * x.ndim
  shape[axis] = -1
  r = lambda a: jnp.reshape(a, shape)
  return (x - r(mean)) / jnp.sqrt(r(var) + 1e-5) * r(scale) + r(bias)


def torch_resnet_reference(state, x_nhwc, stage_sizes, bottleneck):
  """torchvision's ResNet forward in eval mode: NCHW, padding kernel // 2
  on every side, max pool 3/2 padded by 1."""
  bn = lambda x, p: batch_norm(x, state[f'{p}.weight'], state[f'{p}.bias'],
                               state[f'{p}.running_mean'],
                               state[f'{p}.running_var'], axis=1)
  x = jnp.transpose(x_nhwc, (0, 3, 1, 2))
  x = relu(bn(conv_nchw(x, state['conv1.weight'], 2, 3), 'bn1'))
  x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 3, 3), (1, 1, 2, 2),
                        ((0, 0), (0, 0), (1, 1), (1, 1)))
  for s, num_blocks in enumerate(stage_sizes):
    for j in range(num_blocks):
      p = f'layer{s + 1}.{j}.'
      stride = 2 if s > 0 and j == 0 else 1
      if bottleneck:
        y = relu(bn(conv_nchw(x, state[p + 'conv1.weight'], 1, 0), p + 'bn1'))
        y = relu(bn(conv_nchw(y, state[p + 'conv2.weight'], stride, 1),
                    p + 'bn2'))
        y = bn(conv_nchw(y, state[p + 'conv3.weight'], 1, 0), p + 'bn3')
      else:
        y = relu(bn(conv_nchw(x, state[p + 'conv1.weight'], stride, 1),
                    p + 'bn1'))
        y = bn(conv_nchw(y, state[p + 'conv2.weight'], 1, 1), p + 'bn2')
      if p + 'downsample.0.weight' in state:
        x = bn(conv_nchw(x, state[p + 'downsample.0.weight'], stride, 0),
               p + 'downsample.1')
      x = relu(x + y)
  return jnp.mean(x, axis=(2, 3)) @ state['fc.weight'].T + state['fc.bias']


def flax_resnet_reference(params, stats, x, stage_sizes, bottleneck):
  """The Flax ImageNet example's ResNet forward in eval mode: NHWC, XLA
  SAME padding (stride 2 pads after), max pool 3/2 SAME."""
  def conv(x, kernel, stride, padding='SAME'):
    return lax.conv_general_dilated(
        x, kernel, (stride, stride), padding,
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
        precision=lax.Precision.HIGHEST)

  def bn(x, scope_params, scope_stats, name):
    return batch_norm(x, scope_params[name]['scale'],
                      scope_params[name]['bias'], scope_stats[name]['mean'],
                      scope_stats[name]['var'], axis=3)

  x = conv(x, params['conv_init']['kernel'], 2, [(3, 3), (3, 3)])
  x = relu(bn(x, params, stats, 'bn_init'))
  x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                        'SAME')
  block_name = 'BottleneckResNetBlock' if bottleneck else 'ResNetBlock'
  n = 0
  for s, num_blocks in enumerate(stage_sizes):
    for j in range(num_blocks):
      p, st = params[f'{block_name}_{n}'], stats[f'{block_name}_{n}']
      stride = 2 if s > 0 and j == 0 else 1
      strides = [1, stride, 1] if bottleneck else [stride, 1]
      y = x
      for k, k_stride in enumerate(strides):
        y = bn(conv(y, p[f'Conv_{k}']['kernel'], k_stride), p, st,
               f'BatchNorm_{k}')
        y = relu(y) if k < len(strides) - 1 else y
      if 'conv_proj' in p:
        x = bn(conv(x, p['conv_proj']['kernel'], stride), p, st, 'norm_proj')
      x = relu(x + y)
      n += 1
  x = jnp.mean(x, axis=(1, 2))
  return x @ params['Dense_0']['kernel'] + params['Dense_0']['bias']


def layer_norm(x, scale, bias):
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-6) * scale + bias


def gelu_exact(x):
  return 0.5 * x * (1 + jax.scipy.special.erf(x / math.sqrt(2)))


def gelu_tanh(x):
  return 0.5 * x * (1 + jnp.tanh(math.sqrt(2 / math.pi) *
                                 (x + 0.044715 * x ** 3)))


def patchify(x_nhwc, kernel_hwio, bias):
  y = lax.conv_general_dilated(x_nhwc, kernel_hwio, (16, 16), 'VALID',
                               dimension_numbers=('NHWC', 'HWIO', 'NHWC'),
                               precision=lax.Precision.HIGHEST) + bias
  return y.reshape(y.shape[0], -1, y.shape[-1])


def attention(q, k, v):
  """(n, tokens, heads, head_dim) each -> (n, tokens, heads, head_dim)."""
  logits = jnp.einsum('nqhd,nkhd->nhqk', q, k) / math.sqrt(q.shape[-1])
  return jnp.einsum('nhqk,nkhd->nqhd', jax.nn.softmax(logits, -1), v)


def timm_vit_reference(state, x, heads, pool='token'):
  """timm's VisionTransformer forward: [cls; patches] + pos_embed, fused
  qkv split as (3, heads, head_dim), exact GELU, LayerNorm eps 1e-6."""
  w = lambda name: state[name]
  x = patchify(x, jnp.transpose(w('patch_embed.proj.weight'), (2, 3, 1, 0)),
               w('patch_embed.proj.bias'))
  n, _, width = x.shape
  if 'cls_token' in state:
    x = jnp.concatenate([jnp.broadcast_to(w('cls_token'), (n, 1, width)), x],
                        axis=1)
  x = x + w('pos_embed')
  i = 0
  while f'blocks.{i}.norm1.weight' in state:
    p = f'blocks.{i}.'
    h = layer_norm(x, w(p + 'norm1.weight'), w(p + 'norm1.bias'))
    qkv = h @ w(p + 'attn.qkv.weight').T + w(p + 'attn.qkv.bias')
    qkv = qkv.reshape(n, x.shape[1], 3, heads, width // heads)
    o = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    x = x + o.reshape(n, -1, width) @ w(p + 'attn.proj.weight').T + w(
        p + 'attn.proj.bias')
    h = layer_norm(x, w(p + 'norm2.weight'), w(p + 'norm2.bias'))
    h = gelu_exact(h @ w(p + 'mlp.fc1.weight').T + w(p + 'mlp.fc1.bias'))
    x = x + h @ w(p + 'mlp.fc2.weight').T + w(p + 'mlp.fc2.bias')
    i += 1
  x = layer_norm(x, w('norm.weight'), w('norm.bias'))
  x = x[:, 0] if pool == 'token' else jnp.mean(x, axis=1)
  return x @ w('head.weight').T + w('head.bias')


def sincos_posemb(grid, width):
  """MoCo v3's fixed 2-D embedding: sin/cos of x, then of y, on width / 4
  frequencies from 1 to 1/10000."""
  omega = 1.0 / 10_000 ** (np.arange(width // 4) / (width // 4 - 1))
  ys, xs = np.meshgrid(np.arange(grid), np.arange(grid), indexing='ij')
  x_angles = xs.reshape(-1, 1) * omega
  y_angles = ys.reshape(-1, 1) * omega
  return np.concatenate([np.sin(x_angles), np.cos(x_angles),
                         np.sin(y_angles), np.cos(y_angles)], 1)[None]


def big_vision_reference(flat, x, posemb_first=True):
  """big_vision's ViT forward: patches + posemb, then [cls; ...] (or, for
  the old vit_jax layout, [cls; patches] + posemb); tanh GELU; gap or
  token pooling; tanh pre-logits when present."""
  w = lambda name: flat[name]
  x = patchify(x, w('embedding/kernel'), w('embedding/bias'))
  n, tokens, width = x.shape
  posemb = flat.get('pos_embedding', sincos_posemb(math.isqrt(tokens), width))
  if posemb_first:
    x = x + posemb
  if 'cls' in flat:
    x = jnp.concatenate([jnp.broadcast_to(w('cls'), (n, 1, width)), x], 1)
  if not posemb_first:
    x = x + posemb
  i = 0
  while f'Transformer/encoderblock_{i}/LayerNorm_0/scale' in flat:
    p = f'Transformer/encoderblock_{i}/'
    a = p + 'MultiHeadDotProductAttention_0/'
    h = layer_norm(x, w(p + 'LayerNorm_0/scale'), w(p + 'LayerNorm_0/bias'))
    q, k, v = (jnp.einsum('ntd,dhk->nthk', h, w(f'{a}{name}/kernel')) +
               w(f'{a}{name}/bias') for name in ('query', 'key', 'value'))
    x = x + jnp.einsum('nthk,hkd->ntd', attention(q, k, v),
                       w(a + 'out/kernel')) + w(a + 'out/bias')
    h = layer_norm(x, w(p + 'LayerNorm_1/scale'), w(p + 'LayerNorm_1/bias'))
    h = gelu_tanh(h @ w(p + 'MlpBlock_0/Dense_0/kernel') +
                  w(p + 'MlpBlock_0/Dense_0/bias'))
    x = x + h @ w(p + 'MlpBlock_0/Dense_1/kernel') + w(
        p + 'MlpBlock_0/Dense_1/bias')
    i += 1
  x = layer_norm(x, w('Transformer/encoder_norm/scale'),
                 w('Transformer/encoder_norm/bias'))
  x = x[:, 0] if 'cls' in flat else jnp.mean(x, axis=1)
  if 'pre_logits/kernel' in flat:
    x = jnp.tanh(x @ w('pre_logits/kernel') + w('pre_logits/bias'))
  return x @ w('head/kernel') + w('head/bias')


# ---------------------------------------------------------------- models


# Models are built and applied by compiled programs: op by op, every
# initializer and layer of every shape would compile a program of its own.


def resnet(stage_sizes, bottleneck, padding, scan='scanned', classes=None):
  return nnx.jit(lambda: resnet_family.ResNet(
      stage_sizes,
      resnet_family.BottleneckBlock if bottleneck else resnet_family.BasicBlock,
      classes or NUM_CLASSES, width=WIDTH, padding=padding,
      stack_options=stack_options(scan), rngs=nnx.Rngs(0)))()


def vit(pool, posemb, gelu, scan='scanned', image_size=IMAGE_SIZE,
        classes=None):
  return nnx.jit(lambda: vit_family.ViT(
      classes or NUM_CLASSES, patch_size=16, width=VIT['width'],
      depth=VIT['depth'], num_heads=VIT['heads'], mlp_dim=VIT['mlp_dim'],
      image_size=image_size, pool=pool, posemb=posemb, gelu=gelu,
      stack_options=stack_options(scan), rngs=nnx.Rngs(0)))()


@nnx.jit
def _apply(model, x):
  return model(x, train=False)


def logits(model, x):
  return np.asarray(_apply(model, x))


# ----------------------------------------------------- import equivalence


@pytest.mark.xdist_group('torchvision_resnet18')  # one worker compiles
@pytest.mark.parametrize('scan', ['scanned', 'unrolled'])
def test_torchvision_resnet18_safetensors_computes_the_torch_network(
    tmp_path, scan):
  stage_sizes = [2, 2, 2, 2]
  state = torch_resnet_state_dict(stage_sizes, bottleneck=False)
  path = str(tmp_path / 'resnet18.safetensors')
  safetensors.numpy.save_file(state, path)
  assert factory.detect_format(path) == 'torchvision'
  model = resnet(stage_sizes, False, 'symmetric', scan)
  pretrained.load_into_model(
      model, config_for(model='ResNet18', resnet_padding='symmetric'), path)
  x = images(IMAGE_SIZE)
  expected = torch_resnet_reference(state, x, stage_sizes, bottleneck=False)
  np.testing.assert_allclose(logits(model, x), expected, **TOLERANCE)
  # timm publishes its plain ResNets under the same names.
  timm_model = resnet(stage_sizes, False, 'symmetric', scan)
  pretrained.load_into_model(
      timm_model, config_for(model='ResNet18', resnet_padding='symmetric'),
      path, 'timm')
  np.testing.assert_allclose(logits(timm_model, x), expected, **TOLERANCE)


def test_torchvision_bottleneck_resnet_pth_computes_the_torch_network(
    tmp_path):
  torch = pytest.importorskip('torch')
  stage_sizes = [2, 3]
  state = torch_resnet_state_dict(stage_sizes, bottleneck=True)
  path = str(tmp_path / 'resnet.pth')
  torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
  model = resnet(stage_sizes, True, 'symmetric')
  pretrained.load_into_model(
      model, config_for(model='ResNet50', resnet_padding='symmetric'), path)
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
  stage_sizes = [1, 2]
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
    pretrained.load_into_model(model, config_for(model='ResNet50'), path)
    np.testing.assert_allclose(logits(model, x), expected, **TOLERANCE)


@pytest.mark.parametrize('scan', ['scanned', 'unrolled', 'segmented'])
def test_timm_vit_safetensors_computes_the_timm_network(tmp_path, scan):
  state = timm_vit_state_dict(grid=IMAGE_SIZE // 16)
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(state, path)
  assert factory.detect_format(path) == 'timm'
  model = vit('cls', 'learn', 'exact', scan)
  pretrained.load_into_model(model, config_for(
      model='ViT_Ti16', vit_pool='cls', vit_posemb='learn',
      vit_gelu='exact'), path)
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
  pretrained.load_into_model(model, config_for(
      model='ViT_Ti16', vit_pool='cls', vit_posemb='learn',
      vit_gelu='exact'), path)
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
  pretrained.load_into_model(model, config_for(
      model='ViT_Ti16', vit_pool=pool, vit_posemb=posemb), path)
  x = images(IMAGE_SIZE)
  np.testing.assert_allclose(logits(model, x),
                             big_vision_reference(flat, x, posemb_first),
                             **TOLERANCE)


def test_position_embedding_is_resampled_to_another_image_size(tmp_path):
  state = timm_vit_state_dict(grid=2)
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(state, path)
  model = vit('cls', 'learn', 'exact', image_size=48)  # a 3 x 3 grid
  pretrained.load_into_model(model, config_for(
      model='ViT_Ti16', vit_pool='cls', vit_posemb='learn',
      vit_gelu='exact'), path)
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
        pretrained.load_into_model(model, config, path)
      continue
    pretrained.load_into_model(model, config, path)
    x = images(IMAGE_SIZE)
    np.testing.assert_allclose(logits(model, x),
                               big_vision_reference(flat, x), **TOLERANCE)


# ----------------------------------------------------------- error paths


@pytest.fixture(scope='module')
def resnet18_file(tmp_path_factory):
  """A torchvision ResNet-18 (width 8) state dict as safetensors."""
  state = torch_resnet_state_dict([2, 2, 2, 2], bottleneck=False)
  path = str(tmp_path_factory.mktemp('torchvision') / 'resnet18.safetensors')
  safetensors.numpy.save_file(state, path)
  return path, state


def import_error(path, network, **config) -> str:
  with pytest.raises(ValueError) as error:
    pretrained.load_into_model(network, config_for(**config), path)
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


# ------------------------------------------- the trainer and its workdirs


def run_config(**overrides):
  """The default config, tiny: SmallResNet (2 stacked blocks, width 8) on
  digits, 4 steps."""
  config = config_for(num_layers=2, width=8, batch_size=16, num_train_steps=4,
                      log_every_steps=2, eval_every_steps=4,
                      checkpoint_every_steps=4)
  config.update(overrides)
  return config


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """(workdir, config, final state) of a finished tiny run."""
  workdir = str(tmp_path_factory.mktemp('trained'))
  config = run_config()
  return workdir, config, train.train_and_evaluate(config, workdir)


def fresh_state(config):
  info = datasets.create_dataset(config).info
  return train_state.create_train_state(
      config, info, optimizer.learning_rate_schedule(config, 4, 1))[1]


def assert_same_arrays(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_export_reads_back_bit_for_bit_and_so_does_the_workdir(trained,
                                                               tmp_path):
  workdir, config, final = trained
  output = str(tmp_path / 'model.safetensors')
  export.export(workdir, output)
  with safetensors.safe_open(output, framework='numpy') as f:
    metadata = f.metadata()
    assert f.get_tensor('stages.0.rest.layers.conv1.kernel').shape == (
        2, 3, 3, 8, 8)
  assert json.loads(metadata['config'])['width'] == 8
  assert metadata['step'] == '4'
  assert factory.detect_format(output) == 'export'
  for source in (output, workdir):
    state = pretrained.initialize(fresh_state(run_config(init_from=source)),
                                  run_config(init_from=source),
                                  str(tmp_path / 'new_run'))
    assert int(state.step) == 0
    assert_same_arrays((state.params, state.model_state),
                       (final.params, final.model_state))
  # The same weights under every stack layout.
  for layout in (dict(scan_layers=False), dict(scan_segments=2)):
    config = run_config(init_from=output, **layout)
    state = pretrained.initialize(fresh_state(config), config,
                                  str(tmp_path / 'new_run'))
    assert_same_arrays(state.params, final.params)


def test_a_finished_run_is_read_as_its_weights_alone(trained):
  """predict.py, export.py and --mode=eval read a checkpoint's weights and
  BatchNorm statistics, not the optimizer's moments: the state they hold
  has none, and its weights are the run's last."""
  workdir, _, final = trained
  run = run_state.load_trained(workdir, default.get_config())[1]
  assert run.state.opt_state is None and run.sharding.opt_state is None
  assert run.state.ema is None and int(run.state.step) == 4
  assert_same_arrays((run.state.params, run.state.model_state),
                     (final.params, final.model_state))


def test_export_refuses_a_bad_output_and_writes_nothing(trained, tmp_path):
  with pytest.raises(ValueError, match=r"name the file FILE.safetensors"):
    export.export(trained[0], str(tmp_path / 'model.npz'))
  with pytest.raises(ValueError, match='no checkpoint in'):
    export.export(str(tmp_path), str(tmp_path / 'model.safetensors'))
  assert os.listdir(tmp_path) == []


def test_new_head_for_other_classes_starts_from_zeros_and_is_logged(
    trained, tmp_path, caplog):
  caplog.set_level(logging.INFO)
  workdir, _, final = trained
  config = run_config(dataset='digits_0to4', init_from=workdir)
  before = fresh_state(config)
  state = pretrained.initialize(before, config, str(tmp_path / 'finetune'))
  assert ('head re-initialised to zeros: the file has 10 classes, the '
          'model 5') in caplog.text
  assert_same_arrays(state.params['head'], jax.tree.map(
      jnp.zeros_like, before.params['head']))
  assert_same_arrays(state.params['stages'], final.params['stages'])
  assert_same_arrays(state.model_state, final.model_state)


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
    with pytest.raises(config_checks.ConfigError, match=message):
      train.train_and_evaluate(run_config(**overrides), workdir)
    assert not os.path.exists(workdir)


def checkpoint_files(workdir) -> dict:
  """{path: (size, mtime)} of every file under the checkpoints."""
  found = {}
  for root, _, files in os.walk(os.path.join(workdir, 'checkpoints')):
    for name in files:
      status = os.stat(os.path.join(root, name))
      found[os.path.join(root, name)] = (status.st_size, status.st_mtime_ns)
  return found


def eval_command(workdir, *overrides):
  return subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py',
       f'--workdir={workdir}', '--mode=eval', *overrides],
      cwd=REPO, capture_output=True, text=True, timeout=300)


def test_eval_mode_evaluates_the_checkpoint_as_trained_and_changes_none(
    trained, tmp_path):
  """No training override repeated: the checkpoint's own config; an eval
  batch size of the command line's."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(trained[0], workdir)
  before = checkpoint_files(workdir)
  events_before = set(glob.glob(os.path.join(workdir, 'events.out.*')))
  result = eval_command(workdir, '--config.batch_size=24')
  assert result.returncode == 0, result.stderr[-3000:]
  assert checkpoint_files(workdir) == before
  trained_eval = read_scalars(trained[0])
  new_files = set(glob.glob(os.path.join(workdir, 'events.out.*'))) - (
      events_before)
  assert len(new_files) == 1
  evaluated = read_scalars_of(new_files.pop())
  # The same state, data and compiled step as the run's own last eval.
  assert evaluated['eval_examples'] == {4: 360.0}
  assert evaluated['eval_accuracy'][4] == pytest.approx(
      trained_eval['eval_accuracy'][4], abs=1e-6)
  assert evaluated['eval_loss'][4] == pytest.approx(
      trained_eval['eval_loss'][4], rel=1e-5)
  assert re.search(r'step 4\): eval_accuracy=[\d.]+, eval_examples=360, '
                   r'eval_loss=', result.stdout)
  # Another model than the one trained is one line naming the fix.
  refused = eval_command(workdir, '--config.width=16')
  assert refused.returncode == 1
  assert refused.stderr.strip().splitlines()[-1] == (
      'Error: --config.width=16: the checkpoint at step 4 was trained with '
      'width=8, and --mode=eval evaluates the model as trained; drop the '
      'override (or evaluate another --workdir)')
  assert checkpoint_files(workdir) == before


def test_eval_config_is_the_checkpoints_changed_only_in_what_is_evaluated(
    trained, caplog):
  caplog.set_level(logging.WARNING)
  step_dir = os.path.join(trained[0], 'checkpoints', '4')
  command = default.get_config()  # none of the run's overrides
  command.update(batch_size=24, learning_rate=5.0, eval_split='test')
  command.evals.copy = ml_collections.ConfigDict(
      dict(type='classification', dataset='digits'))
  evaluated = run_state.evaluated_config(
      command, {'batch_size', 'learning_rate'}, step_dir)
  assert (evaluated.num_layers, evaluated.width) == (2, 8)
  assert evaluated.batch_size == 24  # what is evaluated, given
  assert evaluated.eval_split == ''  # what is evaluated, not given
  assert evaluated.learning_rate == run_config().learning_rate
  assert '--config.learning_rate is not used by --mode=eval' in caplog.text
  assert evaluated.evals.copy.dataset == 'digits'  # its config file's
  command.update(width=16)
  with pytest.raises(config_checks.ConfigError, match=(
      r'^--config.width=16: the checkpoint at step 4 was trained with '
      r'width=8, and --mode=eval evaluates the model as trained')):
    run_state.evaluated_config(command, {'width'}, step_dir)


def read_scalars_of(path) -> dict:
  """{tag: {step: float}} of one event file."""
  directory = os.path.join(os.path.dirname(path), 'one_file')
  os.makedirs(directory, exist_ok=True)
  shutil.copy(path, directory)
  return read_scalars(directory)


def test_eval_mode_evaluates_init_from_in_a_fresh_workdir(trained, tmp_path):
  workdir, config, _ = trained
  output = str(tmp_path / 'model.safetensors')
  export.export(workdir, output)
  metrics = classification.evaluate_checkpoint(run_config(init_from=output),
                                           str(tmp_path / 'eval'))
  assert metrics['eval_accuracy'] == pytest.approx(
      read_scalars(workdir)['eval_accuracy'][4], abs=1e-6)
  assert not os.path.exists(tmp_path / 'eval' / 'checkpoints')
  with pytest.raises(config_checks.ConfigError, match=(
      r'does not fit the data set: the file has 10 classes, the model 5')):
    classification.evaluate_checkpoint(
        run_config(init_from=output, dataset='digits_0to4'),
        str(tmp_path / 'eval5'))
  with pytest.raises(config_checks.ConfigError, match='nothing to evaluate'):
    classification.evaluate_checkpoint(run_config(), str(tmp_path / 'empty'))


def test_finished_run_started_again_exits_before_compiling_its_steps(
    trained, caplog):
  caplog.set_level(logging.INFO)
  workdir, config, final = trained
  events = {path: os.path.getsize(path)
            for path in glob.glob(os.path.join(workdir, 'events.out.*'))}
  again = train.train_and_evaluate(config, workdir)
  assert int(again.step) == 4
  assert 'The run is complete' in caplog.text
  # No writer was opened and nothing was logged to TensorBoard.
  assert {path: os.path.getsize(path) for path in
          glob.glob(os.path.join(workdir, 'events.out.*'))} == events


# --------------------------------------------------------------- predict


@pytest.fixture(scope='module')
def tfds_run(tmp_path_factory):
  """(workdir, config, png directory) of a two-step run on a TFDS data set
  of PNG files of many sizes (labels 0-18, each image its own class). Its
  tests share one xdist group, so that one worker trains it."""
  data_dir, source = prepare_tiny_images(tmp_path_factory)
  config = imagenet.get_config()
  config.update(dataset='tiny_images', data_dir=data_dir, image_size=16,
                eval_split='', model='SmallResNet', num_layers=1, width=8,
                scan_unroll=8, half_precision=False, batch_size=8,
                num_train_steps=2, log_every_steps=1, eval_every_steps=2,
                checkpoint_every_steps=2)
  workdir = str(tmp_path_factory.mktemp('tfds_run'))
  train.train_and_evaluate(config, workdir)
  return workdir, config, source


def parse_line(line):
  path, *top = line.split(' ')
  return path, [(n, float(p)) for n, p in (t.rsplit(':', 1) for t in top)]


@pytest.mark.xdist_group('tfds_run')
def test_predict_gives_the_eval_pipelines_top5(tfds_run, tmp_path):
  """The test split's PNGs through predict, against the model applied to
  the eval pipeline's own batches of the same images."""
  workdir, config, source = tfds_run
  paths = [str(source / 'test' / f'{i}.png') for i in range(7)]
  lines = predict.predict(workdir, paths, batch_size=4)
  model = run_state.load_trained(workdir, default.get_config())[1].model()
  dataset = datasets.create_dataset(config)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
  batch_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('data'))
  expected, pipeline_images = {}, {}
  for batch in dataset.eval_batches(8, batch_sharding, jnp.float32):
    probabilities = np.asarray(jax.nn.softmax(model(batch['image'],
                                                    train=False)))
    for label, mask, image, p in zip(
        np.asarray(batch['label']), np.asarray(batch['mask']),
        np.asarray(batch['image']), probabilities):
      if mask:
        expected[int(label)], pipeline_images[int(label)] = p, image
  for i, path in enumerate(paths):  # the same pixels, bit for bit
    np.testing.assert_array_equal(
        datasets.eval_image_file(config, path, 3, np.float32),
        pipeline_images[i])
  assert len(lines) == 7
  for i, line in enumerate(lines):
    path, top = parse_line(line)
    assert path == paths[i]
    p = expected[i]  # test image i has label i
    assert [name for name, _ in top] == [
        str(k) for k in np.argsort(-p, kind='stable')[:5]]
    np.testing.assert_allclose([q for _, q in top],
                               np.sort(p)[::-1][:5], atol=6e-5)


@pytest.mark.xdist_group('tfds_run')
def test_predict_reads_jpeg_and_png_of_any_size(tfds_run, tmp_path):
  """In process: the command's printing of these lines is
  tests/test_console.py's."""
  import PIL.Image
  workdir, _, source = tfds_run
  jpeg = str(tmp_path / 'photo.jpg')
  PIL.Image.fromarray(np.random.default_rng(1).integers(
      0, 256, (300, 451, 3), np.uint8)).save(jpeg, quality=90)
  png = str(source / 'train' / '3.png')
  lines = predict.predict(workdir, [jpeg, png])
  assert [parse_line(line)[0] for line in lines] == [jpeg, png]
  for line in lines:
    top = parse_line(line)[1]
    probabilities = [p for _, p in top]
    assert len(top) == 5 and probabilities == sorted(probabilities,
                                                     reverse=True)
    assert {name for name, _ in top} <= {str(k) for k in range(19)}
    assert 0 < sum(probabilities) <= 1.0001
  # Each image is predicted on its own: in a batch with others or alone.
  assert lines[1] == predict.predict(workdir, [png])[0]
  assert_refuses_a_file_that_is_not_an_image(
      tmp_path, lambda bad: predict.predict(workdir, [png, bad]))


# ------------------------------------------------------------ fine-tuning


# Per transfer preset: the conventions of its published weights and its
# learning rate per 256 examples.
TRANSFER_PRESETS = {
    'resnet50': (dict(model='ResNet50', resnet_padding='symmetric'), 0.01),
    'vit_s16': (dict(model='ViT_S16', vit_pool='cls', vit_posemb='learn',
                     vit_gelu='exact'), 0.003),
    'convnext_t': (dict(model='ConvNeXt_T', layer_scale_init=1e-6), 0.003),
    'swin_t': (dict(model='Swin_T'), 0.003),
    'regnety_040': (dict(model='RegNetY_4GF'), 0.01),
    'dinov2_b14': (dict(model='ViT_B14', vit_pool='cls', vit_posemb='learn',
                        vit_gelu='exact', vit_layer_scale=True,
                        layer_scale_init=1e-5), 0.003),
    'clip_b16': (dict(model='ViT_B16', vit_pool='cls', vit_posemb='learn',
                      vit_gelu='exact', vit_norm_pre=True,
                      vit_norm_eps=1e-5), 0.003),
    'siglip_b16': (dict(model='ViT_B16', vit_pool='map', vit_posemb='learn',
                        vit_gelu='exact'), 0.003),
}


@pytest.mark.parametrize('preset', sorted(TRANSFER_PRESETS))
def test_finetune_config_presets_build_their_published_models(preset):
  conventions, learning_rate = TRANSFER_PRESETS[preset]
  config = finetune.get_config(preset)
  config_checks.validate_config(config)
  assert {key: config[key] for key in conventions} == conventions
  assert (config.dataset, config.image_size, config.optimizer,
          config.batch_size, config.num_train_steps, config.warmup_steps,
          config.weight_decay, config.grad_clip_norm) == (
              'oxford_flowers102:2.*.*', 224, 'sgd', 512, 500, 50, 0.0, 1.0)
  assert optimizer.peak_learning_rate(config) == pytest.approx(
      learning_rate * 512 / 256)
  # The model at 224 px with Flowers' 102 classes, abstractly.
  model = nnx.eval_shape(lambda: models.create_model(
      config.model, 102, 3, rngs=nnx.Rngs(0), **models.options(config)))
  logits = nnx.eval_shape(lambda m: m(jnp.zeros((1, 224, 224, 3)),
                                      train=False), model)
  assert logits.shape == (1, 102)
  names = {'/'.join(str(k) for k in path)
           for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert any(name.endswith('layer_scale') for name in names) == (
      preset == 'convnext_t')


def test_finetune_config_refuses_unknown_and_repeated_presets():
  for options, what in [('vit_b16', 'unknown preset or option vit_b16'),
                        ('linear_probes', 'unknown preset or option '
                         'linear_probes'),
                        ('resnet50,vit_s16',
                         r'more than one preset \(resnet50,vit_s16\)')]:
    with pytest.raises(ValueError, match=(
        f'{what}; valid: one preset of resnet50, vit_s16, vit_b16_mae, '
        'convnext_t, swin_t, regnety_040, dinov2_b14, clip_b16, siglip_b16, '
        'then optionally linear_probe')):
      finetune.get_config(options)


def test_finetune_mae_options_are_maes_recipes():
  """FINETUNE.md's ViT-B command and main_finetune.py's defaults; its linear
  probe command and main_linprobe.py's, value by value."""
  tuned = finetune.get_config('vit_b16_mae')
  config_checks.validate_config(tuned)
  assert {k: tuned[k] for k in (
      'model', 'vit_pool', 'vit_posemb', 'vit_gelu', 'dataset', 'batch_size',
      'num_epochs', 'warmup_epochs', 'optimizer', 'weight_decay',
      'weight_decay_form', 'layer_decay', 'drop_path_rate',
      'random_erase_prob', 'mixup_alpha', 'cutmix_alpha', 'mixup_switch_prob',
      'label_smoothing', 'min_learning_rate', 'randaug_num_layers',
      'randaug_magnitude', 'randaug_magnitude_std', 'randaug_ops',
      'repeated_augments', 'ema_decay', 'grad_clip_norm', 'trainable')} == dict(
          model='ViT_B16', vit_pool='cls', vit_posemb='learn', vit_gelu='exact',
          dataset='imagenet2012:5.*.*', batch_size=1024, num_epochs=100.0,
          warmup_epochs=5.0, optimizer='adamw', weight_decay=0.05,
          weight_decay_form='pytorch', layer_decay=0.65, drop_path_rate=0.1,
          random_erase_prob=0.25, mixup_alpha=0.8, cutmix_alpha=1.0,
          mixup_switch_prob=0.5, label_smoothing=0.1, min_learning_rate=1e-6,
          randaug_num_layers=2, randaug_magnitude=9, randaug_magnitude_std=0.5,
          randaug_ops='timm_increasing', repeated_augments=1, ema_decay=0.0,
          grad_clip_norm=0.0, trainable='')
  assert optimizer.peak_learning_rate(tuned) == pytest.approx(5e-4 * 4)

  probe = finetune.get_config('vit_b16_mae,linear_probe')
  config_checks.validate_config(probe)
  assert {k: probe[k] for k in (
      'model', 'vit_pool', 'trainable', 'feature_batch_norm', 'optimizer',
      'weight_decay', 'layer_decay', 'batch_size', 'num_epochs',
      'warmup_epochs', 'min_learning_rate', 'drop_path_rate',
      'label_smoothing', 'mixup_alpha', 'cutmix_alpha', 'randaug_num_layers',
      'random_erase_prob', 'crop_min_area')} == dict(
          model='ViT_B16', vit_pool='cls', trainable='head/.*',
          feature_batch_norm=True, optimizer='lars', weight_decay=0.0,
          layer_decay=1.0, batch_size=16384, num_epochs=90.0,
          warmup_epochs=10.0, min_learning_rate=0.0, drop_path_rate=0.0,
          label_smoothing=0.0, mixup_alpha=0.0, cutmix_alpha=0.0,
          randaug_num_layers=0, random_erase_prob=0.0, crop_min_area=0.08)
  assert optimizer.peak_learning_rate(probe) == pytest.approx(0.1 * 64)
  flowers_probe = finetune.get_config('linear_probe')
  assert (flowers_probe.model, flowers_probe.trainable,
          flowers_probe.dataset, flowers_probe.num_train_steps) == (
              'ResNet50', 'head/.*', 'oxford_flowers102:2.*.*', 500)


@pytest.mark.slow
@pytest.mark.xdist_group('quick_start')
def test_finetuning_from_a_checkpoint_starts_below_a_fresh_run(quick_start,
                                                               tmp_path,
                                                               caplog):
  """From the quick start's model of the ten digits, fine-tune
  configs/finetune.py's recipe (shrunk to that model) on the digits 0-4
  with a new head: its first logged loss is below a fresh start's."""
  caplog.set_level(logging.INFO)
  pretrained_model = default.get_config()

  def finetune_run(name, init_from):
    config = finetune.get_config()
    config.update(
        dataset='digits_0to4', image_size=8, model='SmallResNet',
        width=pretrained_model.width, num_layers=pretrained_model.num_layers,
        resnet_padding='same', scan_unroll=64, half_precision=False,
        remat_policy='full', batch_size=64, num_train_steps=10,
        warmup_steps=0, log_every_steps=5, eval_every_steps=10,
        checkpoint_every_steps=10, init_from=init_from)
    workdir = str(tmp_path / name)
    train.train_and_evaluate(config, workdir)
    return read_scalars(workdir)

  tuned = finetune_run('tuned', str(quick_start[0]))
  assert ('head re-initialised to zeros: the file has 10 classes, the '
          'model 5') in caplog.text
  fresh = finetune_run('fresh', '')
  assert tuned['train_loss'][5] < fresh['train_loss'][5]
  assert tuned['eval_accuracy'][10] > fresh['eval_accuracy'][10]
