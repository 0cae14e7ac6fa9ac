"""`export.py --format=timm`: a trained model as timm's state dict, in
timm's names and layout, with timm's model name (and the keyword
arguments of `timm.create_model` that differ from its defaults: image
size, depth, pooling, GELU) in the file's metadata:

    metadata = safetensors.safe_open(F, 'pt').metadata()
    model = timm.create_model(metadata['timm_model'], num_classes=K,
                              **json.loads(metadata['timm_model_args']))
    model.load_state_dict(safetensors.torch.load_file(F), strict=True)

The names come from the readers of timm's files (`weights/timm_*.py`,
`weights/torch_resnet.py`), each table read the other way.
"""

import json

import numpy as np

from weights import fitting
from weights import pretrained
from weights import records
from weights import timm_convnext
from weights import timm_regnet
from weights import timm_swin
from weights import timm_vit
from weights import torch_resnet
import models

MODEL_KEY = 'timm_model'
ARGS_KEY = 'timm_model_args'
# This project's models -> timm's.
TIMM_MODELS = {
    'ResNet18': 'resnet18', 'ResNet34': 'resnet34', 'ResNet50': 'resnet50',
    'ResNet101': 'resnet101', 'ResNet152': 'resnet152',
    'ResNet200': 'resnet200',
    'ViT_Ti16': 'vit_tiny_patch16_224', 'ViT_S16': 'vit_small_patch16_224',
    'ViT_B16': 'vit_base_patch16_224', 'ViT_L16': 'vit_large_patch16_224',
    'ConvNeXt_Atto': 'convnext_atto', 'ConvNeXt_T': 'convnext_tiny',
    'ConvNeXt_S': 'convnext_small', 'ConvNeXt_B': 'convnext_base',
    'ConvNeXt_L': 'convnext_large', 'ConvNeXtV2_Atto': 'convnextv2_atto',
    'ConvNeXtV2_T': 'convnextv2_tiny', 'ConvNeXtV2_B': 'convnextv2_base',
    'Swin_T': 'swin_tiny_patch4_window7_224',
    'Swin_S': 'swin_small_patch4_window7_224',
    'Swin_B': 'swin_base_patch4_window7_224',
    'RegNetY_200MF': 'regnety_002', 'RegNetY_4GF': 'regnety_040',
    'RegNetY_16GF': 'regnety_160',
}
# timm's ConvNeXts whose blocks hold their MLPs as 1x1 convolutions.
TIMM_CONV_MLP = ('ConvNeXt_Atto', 'ConvNeXtV2_Atto')
# DeiT's ViTs with a distillation token (timm's VisionTransformerDistilled).
TIMM_DISTILLED = {'ViT_Ti16': 'deit_tiny_distilled_patch16_224',
                  'ViT_S16': 'deit_small_distilled_patch16_224',
                  'ViT_B16': 'deit_base_distilled_patch16_224'}
_WRITERS = {'resnet': torch_resnet.to_state_dict,
            'vit': timm_vit.to_state_dict,
            'convnext': timm_convnext.to_state_dict,
            'swin': timm_swin.to_state_dict,
            'regnet': timm_regnet.to_state_dict}
# The ViT options a plain timm VisionTransformer (as written) has.
_PLAIN_VIT = {'vit_layer_scale': False, 'vit_registers': 0,
              'vit_norm_pre': False, 'vit_projection': 0,
              'vit_norm_eps': 1e-6}
_NOT_WRITTEN = {'vit_pool': 'map', 'vit_gelu': 'quick'}
TIMM_IMAGE_SIZE = 224  # the image size of timm's models named above
TIMM_SWIN_WINDOW = 7  # and the window of its Swins


def problem(config) -> str | None:
  """Why the model `config` trained cannot be written as timm's; None when
  it can."""
  if config.model not in TIMM_MODELS:
    return (f'no timm model is written for {config.model} (written: '
            f'{", ".join(TIMM_MODELS)})')
  if config.feature_batch_norm:
    return 'timm has no BatchNorm of the features (feature_batch_norm)'
  family = models.family(config.model)
  if family == 'resnet' and config.resnet_padding != 'symmetric':
    return (f'the model pads as resnet_padding={config.resnet_padding!r}, '
            "timm's ResNets symmetrically")
  if family == 'vit' and config.vit_pre_logits:
    return "timm's ViTs have no pre-logits layer (vit_pre_logits)"
  backbone_options = [key for key, plain in _PLAIN_VIT.items()
                      if config[key] != plain] + [
                          key for key, value in _NOT_WRITTEN.items()
                          if config[key] == value]
  if family == 'vit' and backbone_options:
    return ('the ViT is written as timm\'s plain VisionTransformer, without '
            + ', '.join(f'{key}={config[key]!r}' for key in backbone_options))
  if (family == 'vit' and config.vit_distillation_token and
      config.model not in TIMM_DISTILLED):
    return f'timm has no {config.model} with a distillation token'
  return None


def timm_model(config, in_channels: int) -> tuple[str, dict]:
  """timm's model name and the `create_model` keyword arguments of the
  model `config` trained (`problem` is None) on images of `in_channels`,
  beyond `num_classes`."""
  family = models.family(config.model)
  name = (TIMM_DISTILLED[config.model]
          if family == 'vit' and config.vit_distillation_token
          else TIMM_MODELS[config.model])
  args = {} if in_channels == 3 else {'in_chans': in_channels}
  if family in ('vit', 'swin') and config.image_size != TIMM_IMAGE_SIZE:
    args['img_size'] = config.image_size
  if family == 'swin' and config.swin_window != TIMM_SWIN_WINDOW:
    args['window_size'] = config.swin_window
  if family == 'vit':
    if config.num_layers > 0:
      args['depth'] = config.num_layers
    if config.vit_pool == 'gap':  # the encoder's norm, then the mean
      args.update(class_token=False, global_pool='avg', fc_norm=False)
    if config.vit_gelu == 'tanh':
      args['act_layer'] = 'gelu_tanh'
  return name, args


def state_dict(model, config) -> dict:
  """timm's state dict of a trained model (its `pretrained.trained_arrays`)."""
  family = models.family(config.model)
  arrays = fitting.unstacked_layout(pretrained.trained_arrays(model))
  if family == 'vit' and config.vit_posemb == 'sincos2d':
    # Fixed, not learned here (the model's own table, as restored); a
    # learned table of the same values in timm.
    arrays[records.POSEMB] = np.asarray(model.posemb[...])
  # Contiguous: safetensors writes an array's buffer, not its view.
  options = ({'conv_mlp': config.model in TIMM_CONV_MLP}
             if family == 'convnext' else {})
  written = {key: np.ascontiguousarray(value)
             for key, value in _WRITERS[family](arrays, **options).items()}
  for key in list(written):
    if key.endswith('.running_mean'):  # PyTorch's BatchNorm counts updates
      written[key.replace('running_mean', 'num_batches_tracked')] = np.zeros(
          (), np.int64)
  return written


def metadata(config, arrays: dict) -> dict:
  """The file's metadata: timm's model and its arguments."""
  name, args = timm_model(config, fitting.image_channels(
      {key: array.shape for key, array in arrays.items()}))
  return {MODEL_KEY: name, ARGS_KEY: json.dumps(args), 'format': 'pt'}
