"""The Swin Transformer family (Liu et al. 2021).

A 4x4 stride-4 patch embedding with a LayerNorm, then four stages; each
stage after the first starts with patch merging (each 2x2 neighbourhood's
features concatenated, LayerNorm, a linear map from 4C to 2C without bias)
and continues with one `StackedBlocks` whose step is a pair of blocks: window
attention, then shifted-window attention (the map rolled by half a window,
regions that the roll brought together masked apart). Each block: LayerNorm,
multi-head self-attention within windows with a relative position bias,
residual; LayerNorm, a 4x wide MLP with exact GELU, residual; drop path on
both branches. The head normalises every token, pools and classifies.
Channels last throughout.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import drop
from layers import stacked
from layers import stages

# PyTorch's nn.LayerNorm default, which every Swin norm uses.
LAYER_NORM_EPSILON = 1e-5
MLP_RATIO = 4
PATCH_SIZE = 4
# Image sizes that a refusal lists, up to this one.
LISTED_SIZES_UP_TO = 1024
# The attention logit added between tokens of different regions of a
# shifted window: exp(-100) is zero in float32 and bfloat16 alike.
MASKED = -100.0


def _layer_norm(features, dtype, rngs):
  return stages.layer_norm(features, LAYER_NORM_EPSILON, dtype, rngs)


# ------------------------------------------------------ the stage geometry


def window_and_shift(map_size: int, window: int) -> tuple[int, int]:
  """A stage's (window, shift): a map no larger than the window is one
  window with no shift, as timm and the original code set it."""
  if map_size <= window:
    return map_size, 0
  return window, window // 2


def stage_map_sizes(image_size: int, window: int, num_stages: int):
  """Each stage's feature map side; a ValueError in one line, naming the
  sizes that work, when the patches, the merging or the windows do not tile
  a stage's map."""
  sizes = _tiled_map_sizes(image_size, window, num_stages)
  if sizes is None:
    raise ValueError(f'Swin cannot take image_size {image_size}: '
                     f'{image_size_problem(image_size, window, num_stages)}')
  return sizes


def image_size_problem(image_size: int, window: int,
                       num_stages: int) -> str | None:
  """Why a Swin of `num_stages` stages and windows of `window` cannot take
  images of `image_size` pixels square, naming the sizes up to
  LISTED_SIZES_UP_TO it can; None when it can."""
  if _tiled_map_sizes(image_size, window, num_stages) is not None:
    return None
  valid = [size for size in range(1, LISTED_SIZES_UP_TO + 1)
           if _tiled_map_sizes(size, window, num_stages) is not None]
  tiles = (f'only {", ".join(map(str, valid))} of the sizes up to '
           f'{LISTED_SIZES_UP_TO}; use one of them' if valid else
           f'no size up to {LISTED_SIZES_UP_TO}')
  return (f'its patches of {PATCH_SIZE}, {num_stages - 1} patch merges and '
          f'windows of {window} tile {tiles}')


def _tiled_map_sizes(image_size: int, window: int,
                     num_stages: int) -> list[int] | None:
  """Each stage's feature map side, or None when the patches, the merging
  (halving) or the windows (a map larger than the window must be a
  multiple of it) do not tile a stage's map."""
  sizes, size = [], image_size
  for stage in range(num_stages):
    divisor = PATCH_SIZE if stage == 0 else 2
    if size < divisor or size % divisor:
      return None
    size //= divisor
    if size > window and size % window:
      return None
    sizes.append(size)
  return sizes


def relative_position_index(window: int) -> np.ndarray:
  """(N, N) for N = window^2 tokens: the row of the bias table that each
  (query, key) pair reads, from their offset (dy, dx), each in
  [-(window - 1), window - 1], numbered row-major."""
  coords = np.stack(np.meshgrid(np.arange(window), np.arange(window),
                                indexing='ij')).reshape(2, -1)
  offset = coords[:, :, None] - coords[:, None, :] + (window - 1)
  return offset[0] * (2 * window - 1) + offset[1]


def partition_windows(x, window: int):
  """(B, H, W, C) -> (B * windows, window^2, C), windows row-major per image."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // window, window, w // window, window, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, window * window, c)


def merge_windows(windows, window: int, height: int, width: int):
  """The inverse of `partition_windows`: (B * windows, window^2, C) -> (B, H,
  W, C)."""
  c = windows.shape[-1]
  x = windows.reshape(-1, height // window, width // window, window, window,
                      c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, height, width, c)


def shifted_window_mask(map_size: int, window: int, shift: int) -> np.ndarray:
  """(windows, N, N): 0 between tokens of one region of the rolled map,
  MASKED between regions. Rolling by -shift brings the map's last `shift`
  rows and columns next to its first ones; the regions are the 3 x 3 bands
  [0, -window), [-window, -shift), [-shift, end) along each axis."""
  bands = np.zeros(map_size, np.int32)
  bands[map_size - window:] = 1
  bands[map_size - shift:] = 2
  regions = (3 * bands[:, None] + bands[None, :]).astype(np.float32)
  region_windows = np.asarray(partition_windows(
      regions[None, :, :, None], window))[..., 0]
  differs = region_windows[:, :, None] != region_windows[:, None, :]
  return np.where(differs, MASKED, 0.0).astype(np.float32)


# ------------------------------------------------------------- the blocks


class WindowAttention(nnx.Module):
  """Multi-head self-attention within each window, plus a learned bias per
  head for each relative position ((2 window - 1)^2 of them), plus the mask
  of a shifted window."""

  def __init__(self, features, num_heads, window, *, dtype, rngs: nnx.Rngs):
    if features % num_heads:
      raise ValueError(f'Swin width {features} is not divisible by its '
                       f'{num_heads} heads')
    self.num_heads = num_heads
    self.window = window
    self.qkv = stages.linear(features, 3 * features, dtype, rngs)
    self.proj = stages.linear(features, features, dtype, rngs)
    self.relative_position_bias_table = nnx.Param(stages.TRUNCATED_NORMAL_INIT(
        rngs.params(), ((2 * window - 1) ** 2, num_heads), jnp.float32))

  def relative_position_bias(self):
    """(heads, N, N): each (query, key) pair's row of the table."""
    n = self.window * self.window
    index = relative_position_index(self.window).reshape(-1)
    bias = self.relative_position_bias_table[...][index]
    return bias.reshape(n, n, self.num_heads).transpose(2, 0, 1)

  def __call__(self, windows, mask=None):
    """`windows` (B * windows, N, C); `mask` (windows, N, N) or None."""
    b, n, c = windows.shape
    head_dim = c // self.num_heads
    qkv = self.qkv(windows).reshape(b, n, 3, self.num_heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum('bqhd,bkhd->bhqk', q * head_dim ** -0.5, k)
    # The logits in float32: the bias and the mask's -100 would lose the
    # softmax's small differences in half precision.
    logits = logits.astype(jnp.float32) + self.relative_position_bias()
    if mask is not None:
      num_windows = mask.shape[0]
      logits = (logits.reshape(-1, num_windows, self.num_heads, n, n)
                + mask[None, :, None]).reshape(b, self.num_heads, n, n)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum('bhqk,bkhd->bqhd', weights, v).reshape(b, n, c)
    return self.proj(out)


class SwinBlock(nnx.Module):
  """LayerNorm, (shifted) window attention, residual; LayerNorm, MLP (4x,
  exact GELU), residual; drop path on both branches. `window` and `shift`
  are static: a stack of such blocks shares them."""

  def __init__(self, features, num_heads, map_size, window, shift, *, dtype,
               rngs: nnx.Rngs):
    self.map_size = map_size
    self.window = window
    self.shift = shift
    self.norm1 = _layer_norm(features, dtype, rngs)
    self.attn = WindowAttention(features, num_heads, window, dtype=dtype,
                                rngs=rngs)
    self.norm2 = _layer_norm(features, dtype, rngs)
    self.fc1 = stages.linear(features, MLP_RATIO * features, dtype, rngs)
    self.fc2 = stages.linear(MLP_RATIO * features, features, dtype, rngs)

  def __call__(self, x, *, train: bool, dropout_key=None,
               drop_path_rate=None):
    _, h, w, _ = x.shape
    y = self.norm1(x)
    mask = None
    if self.shift:
      y = jnp.roll(y, (-self.shift, -self.shift), axis=(1, 2))
      mask = jnp.asarray(shifted_window_mask(self.map_size, self.window,
                                             self.shift))
    y = self.attn(partition_windows(y, self.window), mask)
    y = merge_windows(y, self.window, h, w)
    if self.shift:
      y = jnp.roll(y, (self.shift, self.shift), axis=(1, 2))
    x = x + drop.drop_path(y, drop_path_rate, dropout_key, 0, train)
    y = self.fc2(nnx.gelu(self.fc1(self.norm2(x)), approximate=False))
    return x + drop.drop_path(y, drop_path_rate, dropout_key, 1, train)


class SwinBlockPair(stacked.RecordsIntermediates):
  """One step of a stage's stack: a window block (`first`), then a
  shifted-window block (`second`; unshifted when the map is one window).
  The first block's output is recorded here, the pair's (the second
  block's) by the stack, so every block has its intermediate gradients."""

  def __init__(self, features, num_heads, map_size, window, *, dtype,
               rngs: nnx.Rngs):
    window, shift = window_and_shift(map_size, window)
    self.first = SwinBlock(features, num_heads, map_size, window, 0,
                           dtype=dtype, rngs=rngs)
    self.second = SwinBlock(features, num_heads, map_size, window, shift,
                            dtype=dtype, rngs=rngs)

  def __call__(self, x, *, train: bool, dropout_key=None,
               drop_path_rate=None):
    """`drop_path_rate`: None or the two blocks' rates, shape (2,)."""
    keys = (jax.random.split(dropout_key) if dropout_key is not None
            else (None, None))
    rates = ((None, None) if drop_path_rate is None
             else (drop_path_rate[0], drop_path_rate[1]))
    x = self.record(self.first, stacked.LAYER_OUTPUT, self.first(
        x, train=train, dropout_key=keys[0], drop_path_rate=rates[0]))
    return self.second(x, train=train, dropout_key=keys[1],
                       drop_path_rate=rates[1])


# --------------------------------------------------- stages and the model


def merge_patches(x):
  """(B, H, W, C) -> (B, H/2, W/2, 4C): each 2x2 neighbourhood's features in
  the original code's order, (row, column) offsets (0, 0), (1, 0), (0, 1),
  (1, 1)."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 4, 2, 5)
  return x.reshape(b, h // 2, w // 2, 4 * c)


def swin_stage(in_features, features, depth, num_heads, map_size, window, *,
               downsample: bool, dtype, stack_options, drop_path_rates=None,
               rngs: nnx.Rngs):
  """Patch merging (none in the first stage, after the patch embedding),
  then a scanned stack of identical block pairs."""
  downsampling = {}
  if downsample:
    downsampling = dict(
        regroup=merge_patches,
        downsample_norm=_layer_norm(4 * in_features, dtype, rngs),
        downsample=stages.linear(4 * in_features, features, dtype, rngs,
                                 use_bias=False))
  pair_rates = (None if drop_path_rates is None else
                list(zip(drop_path_rates[::2], drop_path_rates[1::2])))
  blocks = stacked.StackedBlocks(
      lambda r: SwinBlockPair(features, num_heads, map_size, window,
                              dtype=dtype, rngs=r),
      depth // 2, rngs=rngs, **stack_options, drop_path_rates=pair_rates)
  return stages.DownsampledStage(blocks, **downsampling)


class Swin(stages.LayerNormedClassifier):
  """Swin Transformer: patch embedding, stages of (window, shifted-window)
  block pairs, head.

  `depths` (even) and `num_heads` give each stage's blocks and heads; the
  width starts at `embed_dim` and doubles per stage. Stochastic depth counts
  blocks across all stages, as timm's rule; each block's output is
  recorded for the intermediate gradients (tags `stages.i.blocks.first` for
  the window blocks, `stages.i.blocks` for the pairs' shifted ones).
  """

  NORM_BEFORE_POOLING = True

  def __init__(self, depths, num_heads, num_classes, *, embed_dim,
               window=7, image_size=224, in_channels=3, dtype=jnp.float32,
               stack_options=None, drop_path_rate=0.0,
               feature_batch_norm=False, rngs: nnx.Rngs):
    if len(depths) != len(num_heads) or any(d % 2 or d < 2 for d in depths):
      raise ValueError(f'Swin depths {depths} must be even, one per stage '
                       f'as the heads {num_heads}: blocks come in pairs')
    map_sizes = stage_map_sizes(image_size, window, len(depths))
    widths = [embed_dim * 2 ** i for i in range(len(depths))]
    rates = stages.drop_path_rates_by_stage(drop_path_rate, depths)
    self.dtype = dtype
    self.depths = tuple(depths)
    self.patch_embed = nnx.Conv(
        in_channels, embed_dim, (PATCH_SIZE, PATCH_SIZE),
        strides=(PATCH_SIZE, PATCH_SIZE), padding='VALID', dtype=dtype,
        kernel_init=stages.TRUNCATED_NORMAL_INIT, rngs=rngs)
    self.patch_embed_norm = _layer_norm(embed_dim, dtype, rngs)
    self.stages = nnx.List([
        swin_stage(
            widths[max(i - 1, 0)], widths[i], depth, num_heads[i],
            map_sizes[i], window, downsample=i > 0, dtype=dtype,
            stack_options=stack_options or {}, drop_path_rates=rates[i],
            rngs=rngs)
        for i, depth in enumerate(depths)])
    self.build_head(widths[-1], num_classes, LAYER_NORM_EPSILON,
                    feature_batch_norm=feature_batch_norm, dtype=dtype,
                    rngs=rngs)

  def embed(self, x):
    return self.patch_embed_norm(self.patch_embed(x))

  def layer_depth(self, name: str):
    """The depth of parameter `name` (its '/'-joined path) for layer-wise
    learning-rate decay, as Swin's fine-tuning code (SimMIM's
    `get_swin_layer`) numbers a model of B blocks: the patch embedding 0;
    block b (counted over all stages) b + 1, so a pair's `first` and
    `second` are vectors along the stack's layer axis; patch merging goes
    with the block before it (the original code ends the previous stage with
    it), so stage s's merging is sum(depths[:s]); the head's norm and the
    head B + 1."""
    parts = name.split('/')
    if parts[0] in ('patch_embed', 'patch_embed_norm'):
      return 0
    if parts[0] != 'stages':
      return sum(self.depths) + 1
    stage = int(parts[1])
    before = sum(self.depths[:stage])
    if parts[2] != 'blocks':  # the stage's patch merging
      return before
    num_pairs = self.depths[stage] // 2
    offset = 1 if 'first' in parts else 2
    return before + offset + 2 * np.arange(num_pairs)
