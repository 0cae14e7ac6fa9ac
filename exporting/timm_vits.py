"""The timm model a ViT of this project is written as: of timm's names of
its size (the plain ViT, DeiT III, DINOv2 with and without registers, CLIP
with exact and quick GELU, SigLIP; DeiT's distilled ViTs), the one whose
own architecture differs least from the run's options, with the
`timm.create_model` arguments that make up the difference (image size,
depth, `class_token`, `global_pool`, `fc_norm`, `pool_include_prefix`,
`init_values`, `reg_tokens`, `no_embed_class`, `pre_norm`,
`act_layer`)."""

# timm's VisionTransformer's defaults of the arguments a run's options set.
DEFAULTS = dict(img_size=224, class_token=True, global_pool='token',
                fc_norm=None, pool_include_prefix=False, init_values=None,
                reg_tokens=0, no_embed_class=False, pre_norm=False,
                act_layer=None)
# The epsilon of timm's ViTs' LayerNorms; no argument of `create_model`
# sets it (JSON holds no norm layer), so a name carries it: CLIP's use 1e-5.
NORM_EPS = 1e-6

_DEIT3 = dict(init_values=1e-6, no_embed_class=True)
_DINOV2 = dict(img_size=518, init_values=1e-5)
_DINOV2_REG4 = dict(_DINOV2, reg_tokens=4, no_embed_class=True)
_CLIP = dict(pre_norm=True, norm_eps=1e-5)
_CLIP_QUICKGELU = dict(_CLIP, act_layer='quick_gelu')
_SIGLIP = dict(class_token=False, global_pool='map')
# This project's ViTs -> timm's names of the same patch, width, depth and
# heads, each with what its model sets beyond DEFAULTS (and `norm_eps`
# beyond NORM_EPS); on a tie the first wins.
NAMES = {
    'ViT_Ti16': {'vit_tiny_patch16_224': {}},
    'ViT_S16': {'vit_small_patch16_224': {},
                'deit3_small_patch16_224': _DEIT3},
    'ViT_B16': {'vit_base_patch16_224': {},
                'deit3_base_patch16_224': _DEIT3,
                'vit_base_patch16_clip_224': _CLIP,
                'vit_base_patch16_clip_quickgelu_224': _CLIP_QUICKGELU,
                'vit_base_patch16_siglip_224': _SIGLIP},
    'ViT_L16': {'vit_large_patch16_224': {},
                'deit3_large_patch16_224': _DEIT3,
                'vit_large_patch16_siglip_256': dict(_SIGLIP, img_size=256)},
    'ViT_S14': {'vit_small_patch14_dinov2': _DINOV2,
                'vit_small_patch14_reg4_dinov2': _DINOV2_REG4},
    'ViT_B14': {'vit_base_patch14_dinov2': _DINOV2,
                'vit_base_patch14_reg4_dinov2': _DINOV2_REG4},
    'ViT_L14': {'vit_large_patch14_dinov2': _DINOV2,
                'vit_large_patch14_reg4_dinov2': _DINOV2_REG4,
                'vit_large_patch14_clip_224': _CLIP,
                'vit_large_patch14_clip_quickgelu_224': _CLIP_QUICKGELU},
}
# DeiT's ViTs with a distillation token (timm's VisionTransformerDistilled,
# whose `pos_embed` always has the two tokens' entries).
DISTILLED = {'ViT_Ti16': {'deit_tiny_distilled_patch16_224': {}},
             'ViT_S16': {'deit_small_distilled_patch16_224': {}},
             'ViT_B16': {'deit_base_distilled_patch16_224': {}}}
_GELUS = {'exact': None, 'tanh': 'gelu_tanh', 'quick': 'quick_gelu'}
_POOLS = {'cls': 'token', 'gap': 'avg', 'map': 'map'}


def _names(config) -> dict:
  return (DISTILLED if config.vit_distillation_token else NAMES).get(
      config.model, {})


def problem(config) -> str | None:
  """Why the ViT `config` trained (a model of NAMES) cannot be written as a
  timm model, naming the option; None when it can."""
  if config.vit_pre_logits:
    return "timm's ViTs have no pre-logits layer (vit_pre_logits)"
  if config.vit_projection:
    return ("timm's ViTs have no layer between the pooled features and the "
            'head (vit_projection; timm holds CLIP\'s projection as the head)')
  if config.vit_distillation_token and config.model not in DISTILLED:
    return f'timm has no {config.model} with a distillation token'
  if config.vit_distillation_token and config.vit_registers:
    return "timm's distilled ViTs have no register tokens (vit_registers)"
  if not any(_norm_eps(own) == config.vit_norm_eps
             for own in _names(config).values()):
    return (f'timm has no {config.model} with LayerNorms of epsilon '
            f'{config.vit_norm_eps} (vit_norm_eps; timm\'s ViTs: {NORM_EPS}, '
            "its CLIPs, B16 and L14: 1e-05)")
  return None


def timm_vit(config) -> tuple[str, dict]:
  """timm's name and the `create_model` arguments (beyond `num_classes`
  and `in_chans`) of the ViT `config` trained (`problem` is None)."""
  candidates = []
  for name, own in _names(config).items():
    if _norm_eps(own) == config.vit_norm_eps:
      model = _arguments(own)
      args = {key: value for key, value in _wanted(config, model).items()
              if value != model[key]}
      candidates.append((_architecture_changes(args, model), name, args))
  _, name, args = min(candidates, key=lambda candidate: candidate[0])
  if config.num_layers > 0:
    args['depth'] = config.num_layers
  return name, args


def no_embed_class(config) -> bool:
  """Whether timm's model of `timm_vit(config)` has position embeddings
  for the patches alone (none for its class, distillation and register
  tokens)."""
  name, args = timm_vit(config)
  return args.get('no_embed_class', _arguments(_names(config)[name])[
      'no_embed_class'])


def _norm_eps(own: dict) -> float:
  return own.get('norm_eps', NORM_EPS)


def _arguments(own: dict) -> dict:
  """DEFAULTS' arguments as a name's model (`own`, of NAMES) sets them."""
  return dict(DEFAULTS, **{key: value for key, value in own.items()
                           if key != 'norm_eps'})


def _wanted(config, model: dict) -> dict:
  """The arguments DEFAULTS names, as the run's options set them on top of
  `model` (a name's own: where the model computes the same either way, its
  value)."""
  layer_scale = config.layer_scale_init if config.vit_layer_scale else None
  return dict(
      img_size=config.image_size, class_token=config.vit_pool == 'cls',
      global_pool=_POOLS[config.vit_pool],
      # Pooled by the mean after the encoder's norm, as this project does.
      fc_norm=False if config.vit_pool == 'gap' else None,
      # This project's MAP head attends to the register tokens too.
      pool_include_prefix=config.vit_pool == 'map' and config.vit_registers > 0,
      init_values=layer_scale, reg_tokens=config.vit_registers,
      # Registers have no position here: none in timm either (the class
      # token's folded-in position is written either way).
      no_embed_class=model['no_embed_class'] or config.vit_registers > 0,
      pre_norm=config.vit_norm_pre, act_layer=_GELUS[config.vit_gelu])


def _architecture_changes(args: dict, model: dict) -> int:
  """How many of `args` change the architecture of `model`: not the image
  size, nor the starting value of a layer scale it has (the file holds the
  trained one)."""
  return sum(key != 'img_size' and not (
      key == 'init_values' and None not in (args[key], model[key]))
             for key in args)
