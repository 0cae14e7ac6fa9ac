"""The one table from a model name to its family's constructor and
arguments: `create_model`, `MODEL_NAMES`.

The families live in `families/`, one module each, and take explicit
arguments; every deep part of a model is a `layers.stacked.StackedBlocks`,
the scanned stack `scan(remat(Block))`. The models pick no dtype: the caller
passes it.
"""

import jax.numpy as jnp
from flax import nnx

from families import convnext
from families import regnet
from families import resnet
from families import swin
from families import vit
from layers import stacked


_RESNETS = {
    'ResNet18': ([2, 2, 2, 2], resnet.BasicBlock),
    'ResNet34': ([3, 4, 6, 3], resnet.BasicBlock),
    'ResNet50': ([3, 4, 6, 3], resnet.BottleneckBlock),
    'ResNet101': ([3, 4, 23, 3], resnet.BottleneckBlock),
    'ResNet152': ([3, 8, 36, 3], resnet.BottleneckBlock),
    'ResNet200': ([3, 24, 36, 3], resnet.BottleneckBlock),
}
# (width, depth, heads, mlp_dim) of the ViT variants, patch 16.
_VITS = {
    'ViT_Ti16': (192, 12, 3, 768),
    'ViT_S16': (384, 12, 6, 1536),
    'ViT_B16': (768, 12, 12, 3072),
    'ViT_L16': (1024, 24, 16, 4096),
}
# (stage depths, stage widths, V2) of the ConvNeXts.
_CONVNEXTS = {
    'ConvNeXt_T': ((3, 3, 9, 3), (96, 192, 384, 768), False),
    'ConvNeXt_S': ((3, 3, 27, 3), (96, 192, 384, 768), False),
    'ConvNeXt_B': ((3, 3, 27, 3), (128, 256, 512, 1024), False),
    'ConvNeXt_L': ((3, 3, 27, 3), (192, 384, 768, 1536), False),
    'ConvNeXtV2_T': ((3, 3, 9, 3), (96, 192, 384, 768), True),
    'ConvNeXtV2_B': ((3, 3, 27, 3), (128, 256, 512, 1024), True),
}
# (embed width, stage depths, stage heads) of the Swins: patch 4, window 7.
_SWINS = {
    'Swin_T': (96, (2, 2, 6, 2), (3, 6, 12, 24)),
    'Swin_S': (96, (2, 2, 18, 2), (3, 6, 12, 24)),
    'Swin_B': (128, (2, 2, 18, 2), (4, 8, 16, 32)),
}
SWIN_WINDOW = 7
# timm's `regnety_040` and `regnety_160` in the paper's parameters; their
# stages follow by `regnet.stages`.
_REGNETS = {
    'RegNetY_4GF': regnet.RegNetDesign(depth=22, w0=96, wa=31.41, wm=2.24,
                                       group_size=64),
    'RegNetY_16GF': regnet.RegNetDesign(depth=18, w0=200, wa=106.23,
                                        wm=2.48, group_size=112),
}
# The default config's model: a 3x3 stem and one scanned stack of basic
# blocks, no downsampling, for 8x8 images.
SMALL_RESNET = 'SmallResNet'

MODEL_NAMES = (*_RESNETS, *_VITS, SMALL_RESNET, *_CONVNEXTS, *_SWINS,
               *_REGNETS)


def family(name: str) -> str:
  """'resnet', 'vit', 'convnext', 'swin' or 'regnet': the family of model
  `name`."""
  if name in _VITS:
    return 'vit'
  if name in _SWINS:
    return 'swin'
  if name in _REGNETS:
    return 'regnet'
  return 'convnext' if name in _CONVNEXTS else 'resnet'


def create_model(config, num_classes: int, in_channels: int, *,
                 dtype=jnp.float32, rngs: nnx.Rngs) -> nnx.Module:
  """Builds `config.model`, computing in `dtype` (the caller picks it from
  the precision settings); `config.num_layers` > 0 sets the stack depth of
  the ViTs and of the small model (the other families have fixed stage
  depths)."""
  stack_options = dict(remat_policy=config.remat_policy,
                       scan_layers=config.scan_layers,
                       scan_unroll=config.scan_unroll,
                       scan_segments=config.scan_segments)
  stacked.remat_policy_by_name(config.remat_policy)
  name = config.model
  if name in _RESNETS:
    stage_sizes, block_cls = _RESNETS[name]
    return resnet.ResNet(stage_sizes, block_cls, num_classes,
                         in_channels=in_channels, dtype=dtype,
                         padding=config.resnet_padding,
                         stack_options=stack_options,
                         drop_path_rate=config.drop_path_rate,
                         feature_batch_norm=config.feature_batch_norm,
                         rngs=rngs)
  if name in _VITS:
    width, depth, heads, mlp_dim = _VITS[name]
    return vit.ViT(num_classes, patch_size=16, width=width,
                   depth=config.num_layers if config.num_layers > 0 else depth,
                   num_heads=heads, mlp_dim=mlp_dim,
                   image_size=config.image_size, in_channels=in_channels,
                   pool=config.vit_pool, posemb=config.vit_posemb,
                   pre_logits=config.vit_pre_logits,
                   dropout_rate=config.dropout_rate, gelu=config.vit_gelu,
                   dtype=dtype, stack_options=stack_options,
                   drop_path_rate=config.drop_path_rate,
                   feature_batch_norm=config.feature_batch_norm, rngs=rngs)
  if name == SMALL_RESNET:
    return resnet.ResNet([config.num_layers + 1], resnet.BasicBlock,
                         num_classes, in_channels=in_channels,
                         width=config.width, small_input=True, dtype=dtype,
                         padding=config.resnet_padding,
                         stack_options=stack_options,
                         drop_path_rate=config.drop_path_rate,
                         feature_batch_norm=config.feature_batch_norm,
                         rngs=rngs)
  if name in _CONVNEXTS:
    depths, widths, v2 = _CONVNEXTS[name]
    # V2 replaces layer scale by GRN.
    return convnext.ConvNeXt(
        depths, widths, num_classes, in_channels=in_channels, grn=v2,
        layer_scale_init=None if v2 else config.layer_scale_init,
        dtype=dtype, stack_options=stack_options,
        drop_path_rate=config.drop_path_rate,
        feature_batch_norm=config.feature_batch_norm, rngs=rngs)
  if name in _SWINS:
    embed_dim, depths, heads = _SWINS[name]
    return swin.Swin(depths, heads, num_classes, embed_dim=embed_dim,
                     window=SWIN_WINDOW, image_size=config.image_size,
                     in_channels=in_channels, dtype=dtype,
                     stack_options=stack_options,
                     drop_path_rate=config.drop_path_rate,
                     feature_batch_norm=config.feature_batch_norm, rngs=rngs)
  if name in _REGNETS:
    design = _REGNETS[name]
    return regnet.RegNet(
        regnet.stages(design), num_classes, se_ratio=design.se_ratio,
        in_channels=in_channels, dtype=dtype, stack_options=stack_options,
        drop_path_rate=config.drop_path_rate,
        feature_batch_norm=config.feature_batch_norm, rngs=rngs)
  raise ValueError(f'unknown model {name!r}; valid names: '
                   f'{", ".join(MODEL_NAMES)}')
