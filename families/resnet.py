"""The ResNet family (v1.5, as the Flax ImageNet example): a stage is its
first (projecting, maybe strided) block followed by a `StackedBlocks` of the
identical rest."""

import jax.numpy as jnp
from flax import nnx

from layers import classifier
from layers import norms
from layers import stacked
from layers import stages


# How the ResNets pad: 'same' is XLA's SAME (the Flax ImageNet example;
# stride-2 layers pad only after), 'symmetric' pads kernel // 2 on every side
# (PyTorch: torchvision and timm weights compute the same function only so).
RESNET_PADDINGS = ('same', 'symmetric')


def _batch_norm(features, dtype, rngs, zero_scale=False):
  return norms.BatchNorm(
      features, momentum=0.9, epsilon=1e-5, dtype=dtype,
      scale_init=nnx.initializers.zeros if zero_scale else
      nnx.initializers.ones, rngs=rngs)


def _padding(kernel: int, padding: str):
  """nnx padding of a square `kernel` under a RESNET_PADDINGS convention."""
  if padding not in RESNET_PADDINGS:
    raise ValueError(f'unknown resnet_padding {padding!r}; valid names: '
                     f'{", ".join(RESNET_PADDINGS)}')
  return 'SAME' if padding == 'same' else [(kernel // 2, kernel // 2)] * 2


def image_size_problem(image_size: int) -> str | None:
  """Why a ResNet cannot take images of `image_size` pixels square, naming
  the sizes it can; None when it can. Under either padding every strided
  layer rounds its map's side up, so any size keeps at least one pixel to
  the head and none unseen."""
  if image_size >= 1:
    return None
  return ('its padded convolutions need a pixel; use any size of at least '
          '1')


def _conv(in_features, features, kernel, strides=1, dtype=jnp.float32,
          padding='same', *, rngs):
  return nnx.Conv(in_features, features, (kernel, kernel),
                  strides=(strides, strides), padding=_padding(kernel, padding),
                  use_bias=False, dtype=dtype, rngs=rngs)


class BasicBlock(stages.ResidualBlock):
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

  def branch(self, x, *, train: bool):
    y = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
    return self.bn2(self.conv2(y), use_running_average=not train)


class BottleneckBlock(stages.ResidualBlock):
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

  def branch(self, x, *, train: bool):
    y = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
    y = nnx.relu(self.bn2(self.conv2(y), use_running_average=not train))
    return self.bn3(self.conv3(y), use_running_average=not train)


def resnet_stage(block_cls, in_features, features, num_blocks, strides, *,
                 dtype, padding, stack_options, drop_path_rates=None,
                 rngs: nnx.Rngs):
  """The first (projecting, maybe strided) block, then a stack of the rest."""
  out_features = features * block_cls.expansion
  return stages.ProjectedStage(
      block_cls(in_features, features, strides, dtype=dtype, padding=padding,
                rngs=rngs),
      lambda r: block_cls(out_features, features, 1, dtype=dtype,
                          padding=padding, rngs=r),
      num_blocks, stack_options=stack_options,
      drop_path_rates=drop_path_rates, rngs=rngs)


class ResNet(classifier.Classifier):
  """ResNet v1.5 (stride on the 3x3 convolution), as in the Flax example."""

  def __init__(self, stage_sizes, block_cls, num_classes, *, in_channels=3,
               width=64, small_input=False, dtype=jnp.float32,
               padding='same', stack_options=None, drop_path_rate=0.0,
               feature_batch_norm=False, rngs: nnx.Rngs):
    stack_options = stack_options or {}
    # Stochastic depth counts blocks across all stages (timm's rule).
    rates = stages.drop_path_rates_by_stage(drop_path_rate, stage_sizes)
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
    stage_modules = []
    in_features = width
    for i, num_blocks in enumerate(stage_sizes):
      features = width * 2**i
      stage_modules.append(resnet_stage(
          block_cls, in_features, features, num_blocks,
          strides=1 if i == 0 else 2, dtype=dtype, padding=padding,
          stack_options=stack_options, drop_path_rates=rates[i], rngs=rngs))
      in_features = features * block_cls.expansion
    self.stages = nnx.List(stage_modules)
    self.feature_norm = norms.feature_norm(in_features, feature_batch_norm,
                                           dtype, rngs)
    self.head = nnx.Linear(in_features, num_classes, dtype=dtype, rngs=rngs)

  def features(self, x, *, train: bool = False, dropout_key=None):
    """The pooled pre-logit features (N, D) the head reads (before the
    feature BatchNorm, which belongs to the head): what few-shot linear
    probes fit."""
    x = x.astype(self.dtype)
    x = nnx.relu(self.stem_bn(self.stem(x), use_running_average=not train))
    if not self.small_input:
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=self.pool_padding)
    x = self.record(self, stacked.STEM_OUTPUT, x)
    x = stages.apply_stages(self.stages, x, train=train,
                            dropout_key=dropout_key)
    x = jnp.mean(x, axis=(1, 2))
    return x

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
