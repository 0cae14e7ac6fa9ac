"""Flax NNX models: the ResNet and ViT families, and `create_model`.

Every deep part of a model is a `layers.stacked.StackedBlocks`, the scanned
stack `scan(remat(Block))`: a ResNet stage is its first (projecting) block
followed by a stack of the identical rest; a ViT encoder is one stack. The
models pick no dtype: the caller passes it.
"""

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import drop
from layers import stacked


# How the ResNets pad: 'same' is XLA's SAME (the Flax ImageNet example;
# stride-2 layers pad only after), 'symmetric' pads kernel // 2 on every side
# (PyTorch: torchvision and timm weights compute the same function only so).
RESNET_PADDINGS = ('same', 'symmetric')
# The ViT MLP's GELU: 'tanh' is the approximation (Flax's default, big_vision);
# 'exact' uses erf (PyTorch's nn.GELU, timm).
VIT_GELUS = ('tanh', 'exact')


# ---------------------------------------------------------------- ResNet


class BatchNorm(nnx.BatchNorm):
  """nnx.BatchNorm that, once `frozen` is set, normalises with its running
  statistics and leaves them as they are in training too (timm's frozen
  BatchNorm): a layer whose scale and bias do not train keeps the
  statistics its weights were trained with."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.frozen = False

  def __call__(self, x, use_running_average=None, **kwargs):
    return super().__call__(
        x, use_running_average=True if self.frozen else use_running_average,
        **kwargs)


def _feature_norm(features, enabled, dtype, rngs):
  """The BatchNorm without scale or bias between the pooled features and the
  head (`feature_batch_norm`), or None: MoCo v3's and MAE's linear probes
  normalise the frozen features so; the head can absorb it after training."""
  if not enabled:
    return None
  return BatchNorm(features, momentum=0.9, epsilon=1e-6, use_scale=False,
                   use_bias=False, dtype=dtype, rngs=rngs)


def _batch_norm(features, dtype, rngs, zero_scale=False):
  return BatchNorm(
      features, momentum=0.9, epsilon=1e-5, dtype=dtype,
      scale_init=nnx.initializers.zeros if zero_scale else
      nnx.initializers.ones, rngs=rngs)


def _padding(kernel: int, padding: str):
  """nnx padding of a square `kernel` under a RESNET_PADDINGS convention."""
  if padding not in RESNET_PADDINGS:
    raise ValueError(f'unknown resnet_padding {padding!r}; valid names: '
                     f'{", ".join(RESNET_PADDINGS)}')
  return 'SAME' if padding == 'same' else [(kernel // 2, kernel // 2)] * 2


def _conv(in_features, features, kernel, strides=1, dtype=jnp.float32,
          padding='same', *, rngs):
  return nnx.Conv(in_features, features, (kernel, kernel),
                  strides=(strides, strides), padding=_padding(kernel, padding),
                  use_bias=False, dtype=dtype, rngs=rngs)


def _named(conv_output):
  """A convolution's output, named for the `conv_outputs` remat policy."""
  return checkpoint_name(conv_output, stacked.CONV_OUTPUT)


class BasicBlock(nnx.Module):
  """ResNet-18/34 block: two 3x3 convolutions and a residual connection."""

  expansion = 1

  def __init__(self, in_features, features, strides=1, *, dtype=jnp.float32,
               padding='same', rngs: nnx.Rngs):
    self.conv1 = _conv(in_features, features, 3, strides, dtype, padding,
                       rngs=rngs)
    self.bn1 = _batch_norm(features, dtype, rngs)
    self.conv2 = _conv(features, features, 3, 1, dtype, padding, rngs=rngs)
    self.bn2 = _batch_norm(features, dtype, rngs, zero_scale=True)
    if strides != 1 or in_features != features:
      self.proj = _conv(in_features, features, 1, strides, dtype, rngs=rngs)
      self.proj_bn = _batch_norm(features, dtype, rngs)
    else:
      self.proj = self.proj_bn = None

  def __call__(self, x, *, train: bool, dropout_key=None,
               drop_path_rate=None):
    ura = not train
    y = nnx.relu(self.bn1(_named(self.conv1(x)), use_running_average=ura))
    y = self.bn2(_named(self.conv2(y)), use_running_average=ura)
    y = drop.drop_path(y, drop_path_rate, dropout_key, 0, train)
    if self.proj is not None:
      x = self.proj_bn(_named(self.proj(x)), use_running_average=ura)
    return nnx.relu(x + y)


class BottleneckBlock(nnx.Module):
  """ResNet-50+ block: 1x1 reduce, 3x3 (strided), 1x1 expand, residual."""

  expansion = 4

  def __init__(self, in_features, features, strides=1, *, dtype=jnp.float32,
               padding='same', rngs: nnx.Rngs):
    out_features = features * 4
    self.conv1 = _conv(in_features, features, 1, 1, dtype, rngs=rngs)
    self.bn1 = _batch_norm(features, dtype, rngs)
    self.conv2 = _conv(features, features, 3, strides, dtype, padding,
                       rngs=rngs)
    self.bn2 = _batch_norm(features, dtype, rngs)
    self.conv3 = _conv(features, out_features, 1, 1, dtype, rngs=rngs)
    self.bn3 = _batch_norm(out_features, dtype, rngs, zero_scale=True)
    if strides != 1 or in_features != out_features:
      self.proj = _conv(in_features, out_features, 1, strides, dtype,
                        rngs=rngs)
      self.proj_bn = _batch_norm(out_features, dtype, rngs)
    else:
      self.proj = self.proj_bn = None

  def __call__(self, x, *, train: bool, dropout_key=None,
               drop_path_rate=None):
    ura = not train
    y = nnx.relu(self.bn1(_named(self.conv1(x)), use_running_average=ura))
    y = nnx.relu(self.bn2(_named(self.conv2(y)), use_running_average=ura))
    y = self.bn3(_named(self.conv3(y)), use_running_average=ura)
    y = drop.drop_path(y, drop_path_rate, dropout_key, 0, train)
    if self.proj is not None:
      x = self.proj_bn(_named(self.proj(x)), use_running_average=ura)
    return nnx.relu(x + y)


class ResNetStage(stacked.RecordsIntermediates):
  """The first (projecting, maybe strided) block, then a stack of the rest."""

  def __init__(self, block_cls, in_features, features, num_blocks, strides,
               *, dtype, padding, stack_options, drop_path_rates=None,
               rngs: nnx.Rngs):
    self.first = block_cls(in_features, features, strides, dtype=dtype,
                           padding=padding, rngs=rngs)
    self.first_drop_path_rate = (None if drop_path_rates is None else
                                 drop_path_rates[0])
    out_features = features * block_cls.expansion
    self.rest = stacked.StackedBlocks(
        lambda r: block_cls(out_features, features, 1, dtype=dtype,
                            padding=padding, rngs=r),
        num_blocks - 1, rngs=rngs, **stack_options,
        drop_path_rates=(None if drop_path_rates is None else
                         drop_path_rates[1:])) if num_blocks > 1 else None

  def __call__(self, x, *, train: bool, dropout_key=None):
    first_key = rest_key = dropout_key
    if self.first_drop_path_rate is not None and dropout_key is not None:
      first_key, rest_key = jax.random.split(dropout_key)
    x = self.record(self, stacked.FIRST_BLOCK_OUTPUT, self.first(
        x, train=train, dropout_key=first_key,
        drop_path_rate=self.first_drop_path_rate))
    if self.rest is not None:
      x = self.rest(x, train=train, dropout_key=rest_key)
    return x


class ResNet(stacked.RecordsIntermediates):
  """ResNet v1.5 (stride on the 3x3 convolution), as in the Flax example."""

  def __init__(self, stage_sizes, block_cls, num_classes, *, in_channels=3,
               width=64, small_input=False, dtype=jnp.float32,
               padding='same', stack_options=None, drop_path_rate=0.0,
               feature_batch_norm=False, rngs: nnx.Rngs):
    stack_options = stack_options or {}
    # Stochastic depth counts blocks across all stages (timm's rule).
    rates = (drop.drop_path_rates(drop_path_rate, sum(stage_sizes))
             if drop_path_rate else None)
    self.dtype = dtype
    self.small_input = small_input
    self.pool_padding = _padding(3, padding)
    if small_input:  # 3x3 stem, no pooling: for images of a few pixels
      self.stem = _conv(in_channels, width, 3, 1, dtype, padding, rngs=rngs)
    else:
      self.stem = nnx.Conv(in_channels, width, (7, 7), strides=(2, 2),
                           padding=[(3, 3), (3, 3)], use_bias=False,
                           dtype=dtype, rngs=rngs)
    self.stem_bn = _batch_norm(width, dtype, rngs)
    stages = []
    in_features = width
    for i, num_blocks in enumerate(stage_sizes):
      features = width * 2**i
      first = sum(stage_sizes[:i])
      stages.append(ResNetStage(
          block_cls, in_features, features, num_blocks,
          strides=1 if i == 0 else 2, dtype=dtype, padding=padding,
          stack_options=stack_options,
          drop_path_rates=(None if rates is None else
                           rates[first:first + num_blocks]), rngs=rngs))
      in_features = features * block_cls.expansion
    self.stages = nnx.List(stages)
    self.feature_norm = _feature_norm(in_features, feature_batch_norm, dtype,
                                      rngs)
    self.head = nnx.Linear(in_features, num_classes, dtype=dtype, rngs=rngs)

  def __call__(self, x, *, train: bool, dropout_key=None):
    x = x.astype(self.dtype)
    x = nnx.relu(self.stem_bn(self.stem(x), use_running_average=not train))
    if not self.small_input:
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=self.pool_padding)
    x = self.record(self, stacked.STEM_OUTPUT, x)
    keys = (jax.random.split(dropout_key, len(self.stages))
            if dropout_key is not None else [None] * len(self.stages))
    for stage, key in zip(self.stages, keys):
      x = stage(x, train=train, dropout_key=key)
    x = jnp.mean(x, axis=(1, 2))
    if self.feature_norm is not None:
      x = self.feature_norm(x, use_running_average=not train)
    return self.record(self, stacked.LOGITS, self.head(x).astype(jnp.float32))

  def layer_depth(self, name: str) -> int:
    """The depth of parameter `name` (its '/'-joined path) for layer-wise
    learning-rate decay: 0 for the stem, i + 1 for stage i, one more than
    the last stage for the head."""
    top = name.split('/')[0]
    if top in ('stem', 'stem_bn'):
      return 0
    if top == 'stages':
      return 1 + int(name.split('/')[1])
    return len(self.stages) + 1


# ------------------------------------------------------------------- ViT


def sincos_2d_position_embedding(height, width, dim, temperature=10_000.):
  """Fixed 2-D sine-cosine position embedding (MoCo v3 / big_vision)."""
  if dim % 4:
    raise ValueError(f'ViT width {dim} must be divisible by 4 for sincos2d')
  y, x = np.mgrid[:height, :width]
  omega = 1.0 / temperature**(np.arange(dim // 4) / (dim // 4 - 1))
  y = y.reshape(-1)[:, None] * omega[None]
  x = x.reshape(-1)[:, None] * omega[None]
  pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
  return jnp.asarray(pe[None], jnp.float32)


class EncoderBlock(nnx.Module):
  """Pre-LN Transformer block: attention and MLP, each with a residual."""

  def __init__(self, width, num_heads, mlp_dim, dropout_rate=0.0, *,
               gelu='tanh', dtype=jnp.float32, rngs: nnx.Rngs):
    if gelu not in VIT_GELUS:
      raise ValueError(f'unknown vit_gelu {gelu!r}; valid names: '
                       f'{", ".join(VIT_GELUS)}')
    self.gelu_approximate = gelu == 'tanh'
    self.ln1 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=num_heads, in_features=width, decode=False, dtype=dtype,
        kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs)
    self.ln2 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(
        width, mlp_dim, dtype=dtype,
        kernel_init=nnx.initializers.xavier_uniform(),
        bias_init=nnx.initializers.normal(1e-6), rngs=rngs)
    self.mlp_out = nnx.Linear(
        mlp_dim, width, dtype=dtype,
        kernel_init=nnx.initializers.xavier_uniform(),
        bias_init=nnx.initializers.normal(1e-6), rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate)

  def __call__(self, x, *, train: bool, dropout_key=None,
               drop_path_rate=None):
    attn_key, mlp_key = (jax.random.split(dropout_key) if train
                         else (None, None))
    y = self.attention(self.ln1(x))
    y = self.dropout(y, deterministic=not train, rngs=attn_key)
    x = x + drop.drop_path(y, drop_path_rate, dropout_key, 0, train)
    y = self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(x)),
                              approximate=self.gelu_approximate))
    y = self.dropout(y, deterministic=not train, rngs=mlp_key)
    return x + drop.drop_path(y, drop_path_rate, dropout_key, 1, train)


class ViT(stacked.RecordsIntermediates):
  """Vision Transformer: patchify, position embedding, one scanned encoder."""

  def __init__(self, num_classes, *, patch_size, width, depth, num_heads,
               mlp_dim, image_size, in_channels=3, pool='gap',
               posemb='sincos2d', pre_logits=False, dropout_rate=0.0,
               gelu='tanh', dtype=jnp.float32, stack_options=None,
               drop_path_rate=0.0, feature_batch_norm=False,
               rngs: nnx.Rngs):
    if image_size % patch_size:
      raise ValueError(
          f'image_size {image_size} is not divisible by the ViT patch size '
          f'{patch_size}; set --config.image_size to a multiple of it')
    if pool not in ('gap', 'cls'):
      raise ValueError(f"unknown vit_pool {pool!r}; valid: 'gap', 'cls'")
    if posemb not in ('sincos2d', 'learn'):
      raise ValueError(
          f"unknown vit_posemb {posemb!r}; valid: 'sincos2d', 'learn'")
    self.dtype = dtype
    self.pool = pool
    grid = image_size // patch_size
    self.patch_embed = nnx.Conv(
        in_channels, width, (patch_size, patch_size),
        strides=(patch_size, patch_size), padding='VALID', dtype=dtype,
        rngs=rngs)
    if posemb == 'sincos2d':
      self.posemb = nnx.Variable(sincos_2d_position_embedding(grid, grid,
                                                              width))
    else:
      self.posemb = nnx.Param(
          nnx.initializers.normal(1 / np.sqrt(width))(
              rngs.params(), (1, grid * grid, width)))
    self.cls = (nnx.Param(jnp.zeros((1, 1, width))) if pool == 'cls'
                else None)
    self.encoder = stacked.StackedBlocks(
        lambda r: EncoderBlock(width, num_heads, mlp_dim, dropout_rate,
                               gelu=gelu, dtype=dtype, rngs=r),
        depth, rngs=rngs, **(stack_options or {}),
        drop_path_rates=(drop.drop_path_rates(drop_path_rate, depth)
                         if drop_path_rate else None))
    self.encoder_norm = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    # big_vision's `rep_size=True`: a width x width layer and tanh between
    # the pooled representation and the head.
    self.pre_logits = (nnx.Linear(width, width, dtype=dtype, rngs=rngs)
                       if pre_logits else None)
    self.feature_norm = _feature_norm(width, feature_batch_norm, dtype, rngs)
    self.head = nnx.Linear(width, num_classes, dtype=dtype,
                           kernel_init=nnx.initializers.zeros, rngs=rngs)

  def __call__(self, x, *, train: bool, dropout_key=None):
    x = self.patch_embed(x.astype(self.dtype))
    n, h, w, c = x.shape
    x = x.reshape(n, h * w, c) + self.posemb[...].astype(self.dtype)
    if self.cls is not None:
      cls = jnp.broadcast_to(self.cls[...].astype(self.dtype), (n, 1, c))
      x = jnp.concatenate([cls, x], axis=1)
    x = self.record(self, stacked.STEM_OUTPUT, x)
    x = self.encoder(x, train=train, dropout_key=dropout_key)
    x = self.encoder_norm(x)
    x = x[:, 0] if self.pool == 'cls' else jnp.mean(x, axis=1)
    if self.pre_logits is not None:
      x = jnp.tanh(self.pre_logits(x))
    if self.feature_norm is not None:
      x = self.feature_norm(x, use_running_average=not train)
    return self.record(self, stacked.LOGITS, self.head(x).astype(jnp.float32))

  def layer_depth(self, name: str):
    """The depth of parameter `name` (its '/'-joined path) for layer-wise
    learning-rate decay, as BEiT and MAE number a ViT's layers: 0 for the
    patch and position embeddings and the class token, 1 to L for the
    encoder's blocks (a vector along the stack's layer axis), L + 1 for the
    final norm, pre-logits and head."""
    top = name.split('/')[0]
    if top in ('patch_embed', 'posemb', 'cls'):
      return 0
    if top == 'encoder':
      return 1 + np.arange(self.encoder.num_layers)
    return self.encoder.num_layers + 1


# --------------------------------------------------------------- factory

_RESNETS = {
    'ResNet18': ([2, 2, 2, 2], BasicBlock),
    'ResNet34': ([3, 4, 6, 3], BasicBlock),
    'ResNet50': ([3, 4, 6, 3], BottleneckBlock),
    'ResNet101': ([3, 4, 23, 3], BottleneckBlock),
    'ResNet152': ([3, 8, 36, 3], BottleneckBlock),
    'ResNet200': ([3, 24, 36, 3], BottleneckBlock),
}
# (width, depth, heads, mlp_dim) of the ViT variants, patch 16.
_VITS = {
    'ViT_Ti16': (192, 12, 3, 768),
    'ViT_S16': (384, 12, 6, 1536),
    'ViT_B16': (768, 12, 12, 3072),
    'ViT_L16': (1024, 24, 16, 4096),
}
# The default config's model: a 3x3 stem and one scanned stack of basic
# blocks, no downsampling, for 8x8 images.
SMALL_RESNET = 'SmallResNet'

MODEL_NAMES = (*_RESNETS, *_VITS, SMALL_RESNET)


def create_model(config, num_classes: int, in_channels: int, *,
                 dtype=jnp.float32, rngs: nnx.Rngs) -> nnx.Module:
  """Builds `config.model`, computing in `dtype` (the caller picks it from
  the precision settings); `config.num_layers` > 0 sets the stack depth of
  the ViTs and of the small model (ResNets have fixed stage depths)."""
  stack_options = dict(remat_policy=config.remat_policy,
                       scan_layers=config.scan_layers,
                       scan_unroll=config.scan_unroll,
                       scan_segments=config.scan_segments)
  stacked.remat_policy_by_name(config.remat_policy)
  name = config.model
  if name in _RESNETS:
    stage_sizes, block_cls = _RESNETS[name]
    return ResNet(stage_sizes, block_cls, num_classes,
                  in_channels=in_channels, dtype=dtype,
                  padding=config.resnet_padding,
                  stack_options=stack_options,
                  drop_path_rate=config.drop_path_rate,
                  feature_batch_norm=config.feature_batch_norm, rngs=rngs)
  if name in _VITS:
    width, depth, heads, mlp_dim = _VITS[name]
    return ViT(num_classes, patch_size=16, width=width,
               depth=config.num_layers if config.num_layers > 0 else depth,
               num_heads=heads, mlp_dim=mlp_dim, image_size=config.image_size,
               in_channels=in_channels, pool=config.vit_pool,
               posemb=config.vit_posemb, pre_logits=config.vit_pre_logits,
               dropout_rate=config.dropout_rate, gelu=config.vit_gelu,
               dtype=dtype, stack_options=stack_options,
               drop_path_rate=config.drop_path_rate,
               feature_batch_norm=config.feature_batch_norm, rngs=rngs)
  if name == SMALL_RESNET:
    return ResNet([config.num_layers + 1], BasicBlock, num_classes,
                  in_channels=in_channels, width=config.width,
                  small_input=True, dtype=dtype,
                  padding=config.resnet_padding, stack_options=stack_options,
                  drop_path_rate=config.drop_path_rate,
                  feature_batch_norm=config.feature_batch_norm, rngs=rngs)
  raise ValueError(f'unknown model {name!r}; valid names: '
                   f'{", ".join(MODEL_NAMES)}')
