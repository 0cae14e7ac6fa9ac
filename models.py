"""The one table from a model name to its family's constructor and
arguments: `create_model`, `MODEL_NAMES`.

The families live in `families/`, one module each, and take explicit
arguments; every deep part of a model is a `layers.stacked.StackedBlocks`,
the scanned stack `scan(remat(Block))`. The models pick no dtype: the caller
passes it.
"""

import inspect

import jax.numpy as jnp
from flax import nnx

from families import convnext
from families import regnet
from families import resnet
from families import swin
from families import vit
from layers import stacked
from runtime import mixed_precision


_RESNETS = {
    'ResNet18': ([2, 2, 2, 2], resnet.BasicBlock),
    'ResNet34': ([3, 4, 6, 3], resnet.BasicBlock),
    'ResNet50': ([3, 4, 6, 3], resnet.BottleneckBlock),
    'ResNet101': ([3, 4, 23, 3], resnet.BottleneckBlock),
    'ResNet152': ([3, 8, 36, 3], resnet.BottleneckBlock),
    'ResNet200': ([3, 24, 36, 3], resnet.BottleneckBlock),
}
# (patch, width, depth, heads, mlp_dim) of the ViT variants.
_VITS = {
    'ViT_Ti16': (16, 192, 12, 3, 768),
    'ViT_S16': (16, 384, 12, 6, 1536),
    'ViT_B16': (16, 768, 12, 12, 3072),
    'ViT_L16': (16, 1024, 24, 16, 4096),
}
# Patch 14: DINOv2's and CLIP's ViT-L/14.
_VITS_14 = {
    'ViT_S14': (14, 384, 12, 6, 1536),
    'ViT_B14': (14, 768, 12, 12, 3072),
    'ViT_L14': (14, 1024, 24, 16, 4096),
}
# (stage depths, stage widths, V2) of the ConvNeXts.
_CONVNEXTS = {
    'ConvNeXt_Atto': ((2, 2, 6, 2), (40, 80, 160, 320), False),
    'ConvNeXt_T': ((3, 3, 9, 3), (96, 192, 384, 768), False),
    'ConvNeXt_S': ((3, 3, 27, 3), (96, 192, 384, 768), False),
    'ConvNeXt_B': ((3, 3, 27, 3), (128, 256, 512, 1024), False),
    'ConvNeXt_L': ((3, 3, 27, 3), (192, 384, 768, 1536), False),
    'ConvNeXtV2_Atto': ((2, 2, 6, 2), (40, 80, 160, 320), True),
    'ConvNeXtV2_T': ((3, 3, 9, 3), (96, 192, 384, 768), True),
    'ConvNeXtV2_B': ((3, 3, 27, 3), (128, 256, 512, 1024), True),
}
# (embed width, stage depths, stage heads) of the Swins: patch 4; their
# window is `swin_window` (7 by default, 12 for the 384 px weights).
_SWINS = {
    'Swin_T': (96, (2, 2, 6, 2), (3, 6, 12, 24)),
    'Swin_S': (96, (2, 2, 18, 2), (3, 6, 12, 24)),
    'Swin_B': (128, (2, 2, 18, 2), (4, 8, 16, 32)),
}
SWIN_WINDOW = 7  # the default `swin_window`
# timm's `regnety_002`, `regnety_040` and `regnety_160` in the paper's
# parameters; their stages follow by `regnet.stages`.
_REGNETS = {
    'RegNetY_200MF': regnet.RegNetDesign(depth=13, w0=24, wa=36.44, wm=2.49,
                                         group_size=8),
    'RegNetY_4GF': regnet.RegNetDesign(depth=22, w0=96, wa=31.41, wm=2.24,
                                       group_size=64),
    'RegNetY_16GF': regnet.RegNetDesign(depth=18, w0=200, wa=106.23,
                                        wm=2.48, group_size=112),
}
# The default config's model: a 3x3 stem and one scanned stack of basic
# blocks, no downsampling, for 8x8 images.
SMALL_RESNET = 'SmallResNet'

MODEL_NAMES = (*_RESNETS, *_VITS, SMALL_RESNET, *_CONVNEXTS, *_SWINS,
               *_REGNETS, *_VITS_14)
_ALL_VITS = {**_VITS, **_VITS_14}


def family(name: str) -> str:
  """'resnet', 'vit', 'convnext', 'swin' or 'regnet': the family of model
  `name`."""
  if name in _ALL_VITS:
    return 'vit'
  if name in _SWINS:
    return 'swin'
  if name in _REGNETS:
    return 'regnet'
  return 'convnext' if name in _CONVNEXTS else 'resnet'


def check_image_size(name: str, image_size: int,
                     swin_window: int = SWIN_WINDOW) -> None:
  """Raises ValueError, in one line naming the sizes it can take, unless
  model `name` (a Swin with windows of `swin_window`) can take images of
  `image_size` pixels square. Its family says which, from its own
  strides, patches and windows."""
  if name in _SWINS:
    _check_swin_window(swin_window)
  problem = _image_size_problem(name, image_size, swin_window)
  if problem:
    raise ValueError(f'{name} cannot take image_size {image_size}: {problem}')


def _image_size_problem(name: str, image_size: int,
                        swin_window: int) -> str | None:
  if name in _RESNETS or name == SMALL_RESNET:
    return resnet.image_size_problem(image_size)
  if name in _ALL_VITS:
    return vit.image_size_problem(image_size, _ALL_VITS[name][0])
  if name in _CONVNEXTS:
    depths, _, _ = _CONVNEXTS[name]
    return convnext.image_size_problem(image_size, len(depths))
  if name in _SWINS:
    _, depths, _ = _SWINS[name]
    return swin.image_size_problem(image_size, swin_window, len(depths))
  if name in _REGNETS:
    return regnet.image_size_problem(image_size)
  raise _unknown_model(name)


def _check_swin_window(window) -> None:
  if not isinstance(window, int) or window < 1:
    raise ValueError(f'swin_window {window!r} must be a whole number >= 1 '
                     '(7; 12 for the 384 px weights)')


def _unknown_model(name: str) -> ValueError:
  return ValueError(f'unknown model {name!r}; valid names: '
                    f'{", ".join(MODEL_NAMES)}')


def create_model(name: str, num_classes: int, in_channels: int, *,
                 dtype=jnp.float32, rngs: nnx.Rngs, num_layers: int = 0,
                 width: int = 32, image_size: int = 224,
                 dropout_rate: float = 0.0, drop_path_rate: float = 0.0,
                 layer_scale_init: float = 1e-6, vit_pool: str = 'gap',
                 vit_posemb: str = 'sincos2d', vit_pre_logits: bool = False,
                 vit_gelu: str = 'tanh', vit_distillation_token: bool = False,
                 vit_layer_scale: bool = False, vit_registers: int = 0,
                 vit_norm_pre: bool = False, vit_projection: int = 0,
                 vit_norm_eps: float = 1e-6, vit_float32_logits: bool = True,
                 swin_window: int = SWIN_WINDOW,
                 feature_batch_norm: bool = False,
                 resnet_padding: str = 'same', remat_policy: str = 'full',
                 scan_layers: bool = True, scan_unroll: int = 1,
                 scan_segments: int = 1) -> nnx.Module:
  """Builds model `name`, computing in `dtype` (the caller picks it from
  the precision settings). The keyword arguments are the config keys of
  the same names (README); each family takes those it uses. `num_layers`
  > 0 sets the stack depth of the ViTs and of the small model (the other
  families have fixed stage depths)."""
  stacked.remat_policy_by_name(remat_policy)
  common = dict(in_channels=in_channels, dtype=dtype,
                stack_options=dict(remat_policy=remat_policy,
                                   scan_layers=scan_layers,
                                   scan_unroll=scan_unroll,
                                   scan_segments=scan_segments),
                drop_path_rate=drop_path_rate,
                feature_batch_norm=feature_batch_norm, rngs=rngs)
  if name in _RESNETS:
    stage_sizes, block_cls = _RESNETS[name]
    return resnet.ResNet(stage_sizes, block_cls, num_classes,
                         padding=resnet_padding, **common)
  if name == SMALL_RESNET:
    return resnet.ResNet([num_layers + 1], resnet.BasicBlock, num_classes,
                         width=width, small_input=True,
                         padding=resnet_padding, **common)
  if name in _ALL_VITS:
    patch, vit_width, depth, heads, mlp_dim = _ALL_VITS[name]
    return vit.ViT(num_classes, patch_size=patch, width=vit_width,
                   depth=num_layers if num_layers > 0 else depth,
                   num_heads=heads, mlp_dim=mlp_dim, image_size=image_size,
                   pool=vit_pool, posemb=vit_posemb,
                   pre_logits=vit_pre_logits, dropout_rate=dropout_rate,
                   gelu=vit_gelu, distillation_token=vit_distillation_token,
                   layer_scale_init=(layer_scale_init if vit_layer_scale
                                     else None),
                   registers=vit_registers, norm_pre=vit_norm_pre,
                   projection=vit_projection, norm_eps=vit_norm_eps,
                   float32_logits=vit_float32_logits, **common)
  if name in _CONVNEXTS:
    depths, widths, v2 = _CONVNEXTS[name]
    # V2 replaces layer scale by GRN.
    return convnext.ConvNeXt(
        depths, widths, num_classes, grn=v2,
        layer_scale_init=None if v2 else layer_scale_init, **common)
  if name in _SWINS:
    _check_swin_window(swin_window)
    embed_dim, depths, heads = _SWINS[name]
    return swin.Swin(depths, heads, num_classes, embed_dim=embed_dim,
                     window=swin_window, image_size=image_size, **common)
  if name in _REGNETS:
    design = _REGNETS[name]
    return regnet.RegNet(regnet.stages(design), num_classes,
                         se_ratio=design.se_ratio, **common)
  raise _unknown_model(name)


# The config keys `create_model` reads: its keyword arguments.
MODEL_KEYS = tuple(
    p.name for p in inspect.signature(create_model).parameters.values()
    if p.kind is p.KEYWORD_ONLY and p.name not in ('dtype', 'rngs'))


def options(config) -> dict:
  """The model's keyword arguments of `create_model` from a flat config
  (or from `settings`)."""
  return {key: config[key] for key in MODEL_KEYS}


def settings(config) -> dict:
  """What builds the model of a flat config: its name ('model') and its
  keyword arguments of `create_model`."""
  return {'model': config.model, **options(config)}


def compute_dtype(config):
  """The dtype the model computes in under a flat config's `half_precision`
  and `half_precision_dtype`: the `dtype` of `create_model`."""
  if config.half_precision_dtype not in mixed_precision.HALF_PRECISION_DTYPES:
    raise ValueError(
        f'unknown half_precision_dtype {config.half_precision_dtype!r}; '
        f'valid names: {", ".join(mixed_precision.HALF_PRECISION_DTYPES)}')
  if not config.half_precision:
    return jnp.float32
  return mixed_precision.HALF_PRECISION_DTYPES[config.half_precision_dtype]
