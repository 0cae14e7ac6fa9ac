"""The ConvNeXt family (Liu et al. 2022) and ConvNeXt V2 (Woo et al. 2023).

A 4x4 stride-4 patchify stem, then four stages; each stage after the first
starts with a LayerNorm and a 2x2 stride-2 convolution that halves the
resolution and doubles the width, followed by a `StackedBlocks` of its
identical blocks: depthwise 7x7 convolution, LayerNorm, a 4x wide MLP with
GELU (V2: global response normalisation after it), layer scale (V1), drop
path, residual. The head pools, normalises and classifies. Channels last
throughout, so every LayerNorm normalises the last axis.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import drop
from layers import layer_scale
from layers import stacked
from layers import stages

# The papers' LayerNorm epsilon, stem to head.
LAYER_NORM_EPSILON = 1e-6
# The MLP's width relative to the block's.
MLP_RATIO = 4
# facebookresearch/ConvNeXt's layer-decay groups: 12 for 3-3-27-3 stages.
NUM_LAYER_GROUPS = 12
# The strides of the patchify stem and of each later stage's downsampling.
STEM_STRIDE = 4
DOWNSAMPLE_STRIDE = 2


def _layer_norm(features, dtype, rngs):
  return stages.layer_norm(features, LAYER_NORM_EPSILON, dtype, rngs)


def _patchify(in_features, features, size, dtype, rngs):
  """A size x size convolution with stride size: the stem (4) and the
  downsampling layers (2) alike."""
  return nnx.Conv(in_features, features, (size, size), strides=(size, size),
                  padding='VALID', dtype=dtype,
                  kernel_init=stages.TRUNCATED_NORMAL_INIT, rngs=rngs)


def image_size_problem(image_size: int, num_stages: int) -> str | None:
  """Why a ConvNeXt of `num_stages` stages cannot take images of
  `image_size` pixels square, naming the sizes it can; None when it can.

  The stem and the downsamplings are unpadded strided convolutions: a size
  below their strides' product leaves no pixel (the pooled features are
  NaN), and one the stem's stride does not divide leaves its last rows and
  columns unseen, as the ViT's patches would. A downsampling of an odd map
  drops a row that the 7x7 convolutions before it have already mixed into
  its neighbours, so its stride does not constrain the size."""
  smallest = STEM_STRIDE * DOWNSAMPLE_STRIDE ** (num_stages - 1)
  fix = f'use a multiple of {STEM_STRIDE}, at least {smallest}'
  if image_size < smallest:
    return (f'its stem of stride {STEM_STRIDE} and {num_stages - 1} '
            f'downsamplings of stride {DOWNSAMPLE_STRIDE} leave no pixel of '
            f'it; {fix}')
  if image_size % STEM_STRIDE:
    return (f'its stem of stride {STEM_STRIDE} leaves its last '
            f'{image_size % STEM_STRIDE} rows and columns unseen; {fix}')
  return None


class GlobalResponseNorm(nnx.Module):
  """ConvNeXt V2's GRN: each channel's L2 norm over the image, relative to
  the mean of those norms over the channels, rescales that channel
  (gamma), plus a bias (beta), plus the input. Both start at zero, so the
  layer starts as the identity."""

  def __init__(self, features, *, epsilon=1e-6):
    self.gamma = nnx.Param(jnp.zeros((features,), jnp.float32))
    self.beta = nnx.Param(jnp.zeros((features,), jnp.float32))
    self.epsilon = epsilon

  def __call__(self, x):
    # The norms in float32: a sum of squares over the image overflows
    # float16 and loses most digits in bfloat16.
    spatial_norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)),
                                    axis=(1, 2), keepdims=True))
    relative = spatial_norm / (
        jnp.mean(spatial_norm, axis=-1, keepdims=True) + self.epsilon)
    gamma = self.gamma[...].astype(x.dtype)
    beta = self.beta[...].astype(x.dtype)
    return x + gamma * (x * relative.astype(x.dtype)) + beta


class ConvNeXtBlock(nnx.Module):
  """Depthwise 7x7, LayerNorm, MLP (4x, exact GELU, GRN in V2), layer
  scale (none when `layer_scale_init` is None or 0), drop path, residual."""

  def __init__(self, features, *, grn=False, layer_scale_init=None,
               dtype=jnp.float32, rngs: nnx.Rngs):
    self.conv_dw = nnx.Conv(features, features, (7, 7),
                            padding=((3, 3), (3, 3)),
                            feature_group_count=features, dtype=dtype,
                            kernel_init=stages.TRUNCATED_NORMAL_INIT,
                            rngs=rngs)
    self.norm = _layer_norm(features, dtype, rngs)
    self.fc1 = stages.linear(features, MLP_RATIO * features, dtype, rngs)
    self.grn = GlobalResponseNorm(MLP_RATIO * features) if grn else None
    self.fc2 = stages.linear(MLP_RATIO * features, features, dtype, rngs)
    self.layer_scale = (nnx.Param(jnp.full((features,), layer_scale_init,
                                           jnp.float32))
                        if layer_scale_init else None)

  def __call__(self, x, *, train: bool, dropout_key=None,
               drop_path_rate=None):
    y = self.norm(self.conv_dw(x))
    y = nnx.gelu(self.fc1(y), approximate=False)
    if self.grn is not None:
      y = self.grn(y)
    y = (self.fc2(y) if self.layer_scale is None else
         layer_scale.scaled_linear(self.fc2, y, self.layer_scale[...]))
    return x + drop.drop_path(y, drop_path_rate, dropout_key, 0, train)


def convnext_stage(in_features, features, depth, *, downsample: bool, grn,
                   layer_scale_init, dtype, stack_options,
                   drop_path_rates=None, rngs: nnx.Rngs):
  """Downsampling (LayerNorm, 2x2 stride-2 convolution; none in the first
  stage, after the stem), then a scanned stack of identical blocks."""
  downsampling = {}
  if downsample:
    downsampling = dict(
        downsample_norm=_layer_norm(in_features, dtype, rngs),
        downsample=_patchify(in_features, features, DOWNSAMPLE_STRIDE, dtype,
                             rngs))
  blocks = stacked.StackedBlocks(
      lambda r: ConvNeXtBlock(features, grn=grn,
                              layer_scale_init=layer_scale_init,
                              dtype=dtype, rngs=r),
      depth, rngs=rngs, **stack_options, drop_path_rates=drop_path_rates)
  return stages.DownsampledStage(blocks, **downsampling)


class ConvNeXt(stages.LayerNormedClassifier):
  """ConvNeXt (V1), or V2 with `grn=True` and `layer_scale_init=None`.

  `depths` and `widths` give each stage's blocks and channels. Stochastic
  depth counts blocks across all stages, as timm's rule; every block's
  output is recorded by its stack for the intermediate gradients.
  """

  def __init__(self, depths, widths, num_classes, *, in_channels=3,
               grn=False, layer_scale_init=1e-6, dtype=jnp.float32,
               stack_options=None, drop_path_rate=0.0,
               feature_batch_norm=False, rngs: nnx.Rngs):
    if len(depths) != len(widths):
      raise ValueError(f'ConvNeXt depths {depths} and widths {widths} '
                       'differ in length: one of each per stage')
    rates = stages.drop_path_rates_by_stage(drop_path_rate, depths)
    self.dtype = dtype
    self.stem = _patchify(in_channels, widths[0], STEM_STRIDE, dtype, rngs)
    self.stem_norm = _layer_norm(widths[0], dtype, rngs)
    self.stages = nnx.List([
        convnext_stage(
            widths[max(i - 1, 0)], features, depth, downsample=i > 0,
            grn=grn, layer_scale_init=layer_scale_init, dtype=dtype,
            stack_options=stack_options or {}, drop_path_rates=rates[i],
            rngs=rngs)
        for i, (depth, features) in enumerate(zip(depths, widths))])
    self.build_head(widths[-1], num_classes, LAYER_NORM_EPSILON,
                    feature_batch_norm=feature_batch_norm, dtype=dtype,
                    rngs=rngs)

  def embed(self, x):
    return self.stem_norm(self.stem(x))

  def layer_depth(self, name: str):
    """The depth of parameter `name` (its '/'-joined path) for layer-wise
    learning-rate decay, as facebookresearch/ConvNeXt's
    `get_num_layer_for_convnext` groups a 3-3-27-3 model's layers into 12:
    the stem 0; stage 0's blocks 1; stage 1's downsampling and blocks 2;
    stage 2's downsampling 3 and its block b 3 + b // 3 (a vector along the
    stack's layer axis); stage 3's downsampling and blocks 12; the head's
    norm and the head 13."""
    parts = name.split('/')
    if parts[0] in ('stem', 'stem_norm'):
      return 0
    if parts[0] != 'stages':
      return NUM_LAYER_GROUPS + 1
    stage = int(parts[1])
    if parts[2] != 'blocks':  # the stage's downsampling layers
      return NUM_LAYER_GROUPS if stage == 3 else stage + 1
    num_blocks = self.stages[stage].blocks.num_layers
    if stage == 3:
      return np.full(num_blocks, NUM_LAYER_GROUPS)
    if stage == 2:
      return 3 + np.arange(num_blocks) // 3
    return np.full(num_blocks, stage + 1)
