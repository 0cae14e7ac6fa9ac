"""Published networks written here: state dicts and checkpoints in each
project's layout (torchvision, timm, the Flax ImageNet example, big_vision)
with a small variant's shapes, the networks they hold computed by
independent references in plain jax.numpy, and this project's models of
the same shapes."""

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import ml_collections
import numpy as np
import safetensors.numpy
from flax import nnx

from configs import default
from families import resnet as resnet_family
from families import vit as vit_family

WIDTH = 8  # ResNet fixtures: stage widths 8, 16, 32, 64
VIT = dict(width=32, depth=2, heads=4, mlp_dim=64)
IMAGE_SIZE = 32
NUM_CLASSES = 7


def config_for(**overrides) -> ml_collections.ConfigDict:
  config = default.get_config()
  config.update(overrides)
  return config


def run_config(**overrides):
  """The default config, tiny: SmallResNet (2 stacked blocks, width 8) on
  digits, 4 steps."""
  config = config_for(num_layers=2, width=8, batch_size=16, num_train_steps=4,
                      log_every_steps=2, eval_every_steps=4,
                      checkpoint_every_steps=4)
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


def timm_vit_state_dict(grid, cls=True, seed=0, *, width=VIT['width'],
                        mlp=VIT['mlp_dim'], depth=VIT['depth'],
                        classes=NUM_CLASSES, dist_token=False) -> dict:
  """timm's VisionTransformer names: fused qkv, (out, in) linears, a
  position embedding with the prefix tokens' entries first; with
  `dist_token`, `VisionTransformerDistilled`'s (a second token and head)."""
  rng = np.random.default_rng(seed)

  def linear(prefix, out, inp):
    state[f'{prefix}.weight'] = rng.normal(0, 1 / math.sqrt(inp), (out, inp))
    state[f'{prefix}.bias'] = rng.normal(0, 0.1, out)

  def norm(prefix):
    state[f'{prefix}.weight'] = rng.uniform(0.5, 1.5, width)
    state[f'{prefix}.bias'] = rng.normal(0, 0.1, width)

  prefix_tokens = ['cls_token'] * cls + ['dist_token'] * dist_token
  state = {'patch_embed.proj.weight': rng.normal(
      0, 1 / math.sqrt(3 * 16 * 16), (width, 3, 16, 16)),
           'patch_embed.proj.bias': rng.normal(0, 0.1, width),
           'pos_embed': rng.normal(
               0, 0.5, (1, grid * grid + len(prefix_tokens), width))}
  for token in prefix_tokens:
    state[token] = rng.normal(0, 0.5, (1, 1, width))
  for i in range(depth):
    norm(f'blocks.{i}.norm1')
    linear(f'blocks.{i}.attn.qkv', 3 * width, width)
    linear(f'blocks.{i}.attn.proj', width, width)
    norm(f'blocks.{i}.norm2')
    linear(f'blocks.{i}.mlp.fc1', mlp, width)
    linear(f'blocks.{i}.mlp.fc2', width, mlp)
  norm('norm')
  linear('head', classes, width)
  if dist_token:
    linear('head_dist', classes, width)
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


# One program: op by op, each operation would compile.
@functools.partial(jax.jit, static_argnames=('stage_sizes', 'bottleneck'))
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


# One program: op by op, each operation would compile.
@functools.partial(jax.jit, static_argnames=('stage_sizes', 'bottleneck'))
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


def write_timm_vit_ti16(path, depth: int, classes: int = 10) -> None:
  """A timm ViT-Ti/16 file (width 192, mlp 768) of `depth` blocks, random
  weights, for a 32 px image (a 2 x 2 grid)."""
  rng = np.random.default_rng(0)
  width, mlp = 192, 768
  shapes = {'patch_embed.proj.weight': (width, 3, 16, 16),
            'patch_embed.proj.bias': (width,), 'cls_token': (1, 1, width),
            'pos_embed': (1, 5, width), 'norm.weight': (width,),
            'norm.bias': (width,), 'head.weight': (classes, width),
            'head.bias': (classes,)}
  for i in range(depth):
    for name, shape in [('norm1.weight', (width,)), ('norm1.bias', (width,)),
                        ('attn.qkv.weight', (3 * width, width)),
                        ('attn.qkv.bias', (3 * width,)),
                        ('attn.proj.weight', (width, width)),
                        ('attn.proj.bias', (width,)),
                        ('norm2.weight', (width,)), ('norm2.bias', (width,)),
                        ('mlp.fc1.weight', (mlp, width)),
                        ('mlp.fc1.bias', (mlp,)),
                        ('mlp.fc2.weight', (width, mlp)),
                        ('mlp.fc2.bias', (width,))]:
      shapes[f'blocks.{i}.{name}'] = shape
  safetensors.numpy.save_file(
      {k: rng.normal(0, 0.02, s).astype(np.float32)
       for k, s in shapes.items()}, path)
