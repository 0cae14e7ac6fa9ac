"""The stages the families share: each stage's share of the
stochastic-depth rates, the stages applied in turn, and the two kinds of
stage, each ending in a scanned stack of identical blocks: a downsampling
before it (ConvNeXt, Swin; with the layers they build it of, and the
classifier around their stages) or a first, projecting block (ResNet,
RegNet; with the residual sum their blocks end in)."""

from typing import Callable

from flax import nnx
import jax
import jax.numpy as jnp

from layers import classifier
from layers import drop
from layers import norms
from layers import stacked

# ConvNeXt's and Swin's initialisation of convolutions, dense layers and
# bias tables (biases zero).
TRUNCATED_NORMAL_INIT = nnx.initializers.truncated_normal(0.02)


def layer_norm(features, epsilon, dtype, rngs):
  return nnx.LayerNorm(features, epsilon=epsilon, dtype=dtype, rngs=rngs)


def linear(in_features, features, dtype, rngs, use_bias=True):
  """A dense layer initialised as ConvNeXt's and Swin's."""
  return nnx.Linear(in_features, features, use_bias=use_bias, dtype=dtype,
                    kernel_init=TRUNCATED_NORMAL_INIT, rngs=rngs)


def drop_path_rates_by_stage(rate: float, depths) -> list:
  """Each stage's slice of its blocks' stochastic-depth rates, counted
  across all stages by timm's rule (`drop.drop_path_rates`); a None per
  stage when `rate` is 0 (no stochastic depth)."""
  if not rate:
    return [None] * len(depths)
  rates = drop.drop_path_rates(rate, sum(depths))
  starts = [sum(depths[:i]) for i in range(len(depths))]
  return [rates[start:start + depth] for start, depth in zip(starts, depths)]


def apply_stages(stage_modules, x, *, train: bool, dropout_key=None):
  """`x` through each stage in turn, each with a dropout key of its own."""
  keys = drop.split_key(dropout_key, len(stage_modules))
  for stage, key in zip(stage_modules, keys):
    x = stage(x, train=train, dropout_key=key)
  return x


class LayerNormedClassifier(classifier.Classifier):
  """A classifier of an embedding (`embed`, the family's stem), `stages`
  applied in turn and a head whose LayerNorm meets the global average
  pooling after it (ConvNeXt) or before it (Swin: `NORM_BEFORE_POOLING`)."""

  NORM_BEFORE_POOLING = False

  def build_head(self, features, num_classes, epsilon, *, feature_batch_norm,
                 dtype, rngs):
    """The head's LayerNorm, the optional feature BatchNorm and the linear
    classifier, over `features` channels."""
    self.head_norm = layer_norm(features, epsilon, dtype, rngs)
    self.feature_norm = norms.feature_norm(features, feature_batch_norm,
                                           dtype, rngs)
    self.head = linear(features, num_classes, dtype, rngs)

  def features(self, x, *, train: bool = False, dropout_key=None):
    """The pooled pre-logit features (N, D) the head reads (before the
    feature BatchNorm, which belongs to the head): what few-shot linear
    probes fit."""
    x = self.record(self, stacked.STEM_OUTPUT, self.embed(
        x.astype(self.dtype)))
    x = apply_stages(self.stages, x, train=train, dropout_key=dropout_key)
    if self.NORM_BEFORE_POOLING:
      return jnp.mean(self.head_norm(x), axis=(1, 2))
    return self.head_norm(jnp.mean(x, axis=(1, 2)))


class DownsampledStage(nnx.Module):
  """A stage: its downsampling (the map's pixels regrouped by
  `regroup`, if given, then `downsample_norm`, then `downsample`, which
  changes resolution and width; none in a stage right after the stem),
  then `blocks`, a scanned stack of identical blocks."""

  def __init__(self, blocks: stacked.StackedBlocks, *,
               downsample_norm: nnx.Module | None = None,
               downsample: nnx.Module | None = None,
               regroup: Callable | None = None):
    self.downsample_norm = downsample_norm
    self.downsample = downsample
    self.regroup = regroup
    self.blocks = blocks

  def __call__(self, x, *, train: bool, dropout_key=None):
    if self.downsample is not None:
      if self.regroup is not None:
        x = self.regroup(x)
      x = self.downsample(self.downsample_norm(x))
    return self.blocks(x, train=train, dropout_key=dropout_key)


class ResidualBlock(nnx.Module):
  """A ResNet or RegNet block: its residual branch (`branch`), dropped per
  example at `drop_path_rate`, plus the shortcut (through `proj` and
  `proj_bn` where the block changes the width or the resolution; None
  elsewhere), through a ReLU."""

  def __call__(self, x, *, train: bool, dropout_key=None,
               drop_path_rate=None):
    y = drop.drop_path(self.branch(x, train=train), drop_path_rate,
                       dropout_key, 0, train)
    if self.proj is not None:
      x = self.proj_bn(self.proj(x), use_running_average=not train)
    return nnx.relu(x + y)


class ProjectedStage(stacked.RecordsIntermediates):
  """A stage: its `first` block, which projects the shortcut (changing the
  width, maybe halving the resolution), then a scanned stack of `depth - 1`
  identical blocks from `make_block` (none in a stage of one block). The
  first block's output is recorded here, the rest's by their stack."""

  def __init__(self, first: nnx.Module,
               make_block: Callable[[nnx.Rngs], nnx.Module], depth: int, *,
               stack_options, drop_path_rates=None, rngs: nnx.Rngs):
    self.first = first
    self.first_drop_path_rate = (None if drop_path_rates is None else
                                 drop_path_rates[0])
    self.rest = stacked.StackedBlocks(
        make_block, depth - 1, rngs=rngs, **stack_options,
        drop_path_rates=(None if drop_path_rates is None else
                         drop_path_rates[1:])) if depth > 1 else None

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
