"""The RegNetY family (Radosavovic et al. 2020, "Designing Network Design
Spaces"), as timm's `regnety_*` models compute it.

A 3x3 stride-2 stem, then four stages whose widths and depths follow from
five numbers (`RegNetDesign`: the quantised linear rule of the paper's
section 3.3). Each stage is its first block, which halves the resolution
and projects the shortcut, followed by a `StackedBlocks` of its identical
rest. A block is the paper's figure 4 with squeeze-and-excitation: 1x1
convolution, 3x3 group convolution (stride 2 in a stage's first block),
SE, 1x1 convolution, each convolution followed by BatchNorm and the first
two by ReLU; ReLU again after the residual sum. The head pools and
classifies. Every convolution pads kernel // 2 on each side, as PyTorch's,
so timm's weights compute the same function.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import classifier
from layers import norms
from layers import stacked
from layers import stages as staging

# Channels of the stem's convolution (timm's `stem_width`).
STEM_WIDTH = 32
# Block widths are multiples of this (the paper's q).
WIDTH_QUANTUM = 8


@dataclasses.dataclass(frozen=True)
class RegNetDesign:
  """A RegNetY in the paper's parameters: `depth` blocks whose widths grow
  linearly from `w0` by `wa` per block, rounded to powers of `wm` times
  `w0`; group convolutions of `group_size` channels per group; SE reducing
  to `se_ratio` of the block's input channels."""
  depth: int
  w0: int
  wa: float
  wm: float
  group_size: int
  se_ratio: float = 0.25


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage of a RegNet: its blocks' width, their number, and the
  channels per group of their 3x3 convolutions."""
  width: int
  depth: int
  group_size: int


def stages(design: RegNetDesign) -> tuple[Stage, ...]:
  """The stages of `design`: per-block widths by the paper's quantised
  linear rule, blocks of one width forming a stage, then each stage's
  width rounded to a multiple of its group size (a group no wider than
  the stage), as timm's `generate_regnet` and
  `adjust_widths_groups_comp` compute them (bottleneck ratio 1)."""
  linear = np.arange(design.depth) * design.wa + design.w0
  exponents = np.round(np.log(linear / design.w0) / np.log(design.wm))
  widths = np.round(design.w0 * np.power(design.wm, exponents)
                    / WIDTH_QUANTUM) * WIDTH_QUANTUM
  stage_widths, depths = np.unique(widths.astype(int), return_counts=True)
  result = []
  for width, depth in zip(stage_widths.tolist(), depths.tolist()):
    group_size = min(design.group_size, width)
    result.append(Stage(int(round(width / group_size) * group_size),
                        depth, group_size))
  return tuple(result)


def _conv_init(kernel: int, features: int, groups: int = 1):
  """He initialisation over the fan-out of each group (timm's RegNet)."""
  return nnx.initializers.normal(
      math.sqrt(2.0 * groups / (kernel * kernel * features)))


def image_size_problem(image_size: int) -> str | None:
  """Why a RegNet cannot take images of `image_size` pixels square, naming
  the sizes it can; None when it can. Every strided convolution pads
  kernel // 2 on each side, rounding its map's side up, so any size keeps
  at least one pixel to the head and none unseen."""
  if image_size >= 1:
    return None
  return ('its padded convolutions need a pixel; use any size of at least '
          '1')


def _conv(in_features, features, kernel, strides=1, groups=1, *, dtype,
          rngs):
  """A bias-free convolution padding kernel // 2 on every side (a tuple:
  the graph of a module jitted as a static argument must hash)."""
  return nnx.Conv(in_features, features, (kernel, kernel),
                  strides=(strides, strides),
                  padding=((kernel // 2, kernel // 2),) * 2,
                  feature_group_count=groups, use_bias=False, dtype=dtype,
                  kernel_init=_conv_init(kernel, features, groups),
                  rngs=rngs)


def _batch_norm(features, dtype, rngs, zero_scale=False):
  return norms.BatchNorm(
      features, momentum=0.9, epsilon=1e-5, dtype=dtype,
      scale_init=nnx.initializers.zeros if zero_scale else
      nnx.initializers.ones, rngs=rngs)


class SqueezeExcite(nnx.Module):
  """Squeeze-and-excitation (Hu et al. 2018): the image's mean of each
  channel, reduced to `reduced` channels (ReLU), expanded back (sigmoid),
  scales that channel. The paper's 1x1 convolutions on a 1x1 image are
  dense layers here."""

  def __init__(self, features, reduced, *, dtype, rngs: nnx.Rngs):
    self.reduce = nnx.Linear(features, reduced, dtype=dtype,
                             kernel_init=_conv_init(1, reduced), rngs=rngs)
    self.expand = nnx.Linear(reduced, features, dtype=dtype,
                             kernel_init=_conv_init(1, features), rngs=rngs)

  def __call__(self, x):
    squeezed = jnp.mean(x, axis=(1, 2))
    gate = jax.nn.sigmoid(self.expand(nnx.relu(self.reduce(squeezed))))
    return x * gate[:, None, None, :]


class RegNetYBlock(staging.ResidualBlock):
  """The paper's bottleneck block (ratio 1) with SE after the group
  convolution; a 1x1 convolution and BatchNorm on the shortcut when the
  block changes the width or the resolution."""

  def __init__(self, in_features, features, strides=1, *, group_size,
               se_ratio, dtype=jnp.float32, zero_init_last=True,
               rngs: nnx.Rngs):
    groups = features // group_size
    self.conv1 = _conv(in_features, features, 1, dtype=dtype, rngs=rngs)
    self.bn1 = _batch_norm(features, dtype, rngs)
    self.conv2 = _conv(features, features, 3, strides, groups, dtype=dtype,
                       rngs=rngs)
    self.bn2 = _batch_norm(features, dtype, rngs)
    # SE's width counts the block's input channels, as timm's and pycls's.
    self.se = SqueezeExcite(features, int(round(se_ratio * in_features)),
                            dtype=dtype, rngs=rngs)
    self.conv3 = _conv(features, features, 1, dtype=dtype, rngs=rngs)
    # A zero last scale starts the block as its shortcut (timm's
    # `zero_init_last`).
    self.bn3 = _batch_norm(features, dtype, rngs, zero_scale=zero_init_last)
    if strides != 1 or in_features != features:
      self.proj = _conv(in_features, features, 1, strides, dtype=dtype,
                        rngs=rngs)
      self.proj_bn = _batch_norm(features, dtype, rngs)
    else:
      self.proj = self.proj_bn = None

  def branch(self, x, *, train: bool):
    y = nnx.relu(self.bn1(self.conv1(x), use_running_average=not train))
    y = nnx.relu(self.bn2(self.conv2(y), use_running_average=not train))
    return self.bn3(self.conv3(self.se(y)), use_running_average=not train)


def regnet_stage(in_features, stage: Stage, *, se_ratio, dtype, zero_init_last,
                 stack_options, drop_path_rates=None, rngs: nnx.Rngs):
  """The first block (stride 2, projected shortcut), then a scanned stack
  of the identical rest."""
  block_options = dict(group_size=stage.group_size, se_ratio=se_ratio,
                       dtype=dtype, zero_init_last=zero_init_last)
  return staging.ProjectedStage(
      RegNetYBlock(in_features, stage.width, 2, **block_options, rngs=rngs),
      lambda r: RegNetYBlock(stage.width, stage.width, 1, **block_options,
                             rngs=r),
      stage.depth, stack_options=stack_options,
      drop_path_rates=drop_path_rates, rngs=rngs)


class RegNet(classifier.Classifier):
  """RegNetY: stem, the `stages` (see `stages(design)`), pooled head.

  Stochastic depth counts blocks across all stages (timm's linspace); every
  block's output is recorded for the intermediate gradients.
  """

  def __init__(self, stage_list, num_classes, *, se_ratio=0.25,
               in_channels=3, dtype=jnp.float32, stack_options=None,
               drop_path_rate=0.0, feature_batch_norm=False,
               zero_init_last=True, rngs: nnx.Rngs):
    rates = staging.drop_path_rates_by_stage(
        drop_path_rate, [stage.depth for stage in stage_list])
    self.dtype = dtype
    self.stem = _conv(in_channels, STEM_WIDTH, 3, 2, dtype=dtype, rngs=rngs)
    self.stem_bn = _batch_norm(STEM_WIDTH, dtype, rngs)
    stage_modules, in_features = [], STEM_WIDTH
    for stage, stage_rates in zip(stage_list, rates):
      stage_modules.append(regnet_stage(
          in_features, stage, se_ratio=se_ratio, dtype=dtype,
          zero_init_last=zero_init_last, stack_options=stack_options or {},
          drop_path_rates=stage_rates, rngs=rngs))
      in_features = stage.width
    self.stages = nnx.List(stage_modules)
    self.feature_norm = norms.feature_norm(in_features, feature_batch_norm,
                                           dtype, rngs)
    self.head = nnx.Linear(in_features, num_classes, dtype=dtype,
                           kernel_init=nnx.initializers.normal(0.01),
                           rngs=rngs)

  def features(self, x, *, train: bool = False, dropout_key=None):
    """The pooled pre-logit features (N, D) the head reads (before the
    feature BatchNorm, which belongs to the head): what few-shot linear
    probes fit."""
    x = self.stem(x.astype(self.dtype))
    x = nnx.relu(self.stem_bn(x, use_running_average=not train))
    x = self.record(self, stacked.STEM_OUTPUT, x)
    x = staging.apply_stages(self.stages, x, train=train,
                             dropout_key=dropout_key)
    x = jnp.mean(x, axis=(1, 2))
    return x

  def layer_depth(self, name: str) -> int:
    """The depth of parameter `name` (its '/'-joined path) for layer-wise
    learning-rate decay, as the ResNets': 0 for the stem, i + 1 for stage
    i, one more than the last stage for the head (and the feature norm)."""
    top = name.split('/')[0]
    if top in ('stem', 'stem_bn'):
      return 0
    if top == 'stages':
      return 1 + int(name.split('/')[1])
    return len(self.stages) + 1
