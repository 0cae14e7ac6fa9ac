"""`export.py --format=timm`: a trained model as timm's state dict, in
timm's names and layout, with timm's model name (a ViT's:
`exporting/timm_vits.py`), the keyword arguments of `timm.create_model`
that differ from its defaults (image size, depth, a ViT's tokens, pooling,
layer scale, norms and GELU, a Swin's window) and the run's evaluation
preprocessing as timm's `pretrained_cfg` in the file's metadata:

    metadata = safetensors.safe_open(F, 'pt').metadata()
    model = timm.create_model(
        metadata['timm_model'], num_classes=K,
        pretrained_cfg_overlay=json.loads(metadata['timm_pretrained_cfg']),
        **json.loads(metadata['timm_model_args']))
    model.load_state_dict(safetensors.torch.load_file(F), strict=True)
    transform = timm.data.create_transform(
        **timm.data.resolve_data_config(model=model))

The names come from the readers of timm's files (`weights/timm_*.py`,
`weights/torch_resnet.py`), each table read the other way; `init_from`
reads a ViT's GELU and norm epsilon back from the metadata.
"""

import json

import numpy as np

from data import datasets
from exporting import timm_vits
from weights import fitting
from weights import pretrained
from weights import records
from weights import timm_convnext
from weights import timm_regnet
from weights import timm_swin
from weights import timm_vit
from weights import torch_resnet
import input_pipeline
import models

PRETRAINED_CFG_KEY = 'timm_pretrained_cfg'
# This project's models -> timm's (a ViT's plainest name: see timm_vits).
TIMM_MODELS = {
    'ResNet18': 'resnet18', 'ResNet34': 'resnet34', 'ResNet50': 'resnet50',
    'ResNet101': 'resnet101', 'ResNet152': 'resnet152',
    'ResNet200': 'resnet200',
    **{model: next(iter(names)) for model, names in timm_vits.NAMES.items()},
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
_WRITERS = {'resnet': torch_resnet.to_state_dict,
            'vit': timm_vit.to_state_dict,
            'convnext': timm_convnext.to_state_dict,
            'swin': timm_swin.to_state_dict,
            'regnet': timm_regnet.to_state_dict}
TIMM_IMAGE_SIZE = 224  # the image size of timm's Swins named above
TIMM_SWIN_WINDOW = 7  # and their window
# The evaluation resizes of this project -> the Pillow filters timm's
# transforms resize with (none resizes as `lanczos5`, `gaussian` or
# `mitchellcubic` do).
TIMM_INTERPOLATIONS = {'bilinear': 'bilinear', 'bicubic': 'bicubic',
                       'area': 'box', 'lanczos3': 'lanczos',
                       'nearest': 'nearest'}


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
  if family == 'vit' and (vit_problem := timm_vits.problem(config)):
    return vit_problem
  if (not _is_digits(config) and
      config.eval_resize_method not in TIMM_INTERPOLATIONS):
    return (f"timm's transforms have no resize like eval_resize_method="
            f'{config.eval_resize_method!r} (theirs: '
            f'{", ".join(TIMM_INTERPOLATIONS)})')
  return None


def timm_model(config, in_channels: int) -> tuple[str, dict]:
  """timm's model name and the `create_model` keyword arguments of the
  model `config` trained (`problem` is None) on images of `in_channels`,
  beyond `num_classes`."""
  family = models.family(config.model)
  name, args = (timm_vits.timm_vit(config) if family == 'vit' else
                (TIMM_MODELS[config.model], {}))
  if in_channels != 3:
    args['in_chans'] = in_channels
  if family == 'swin' and config.image_size != TIMM_IMAGE_SIZE:
    args['img_size'] = config.image_size
  if family == 'swin' and config.swin_window != TIMM_SWIN_WINDOW:
    args['window_size'] = config.swin_window
  return name, args


def pretrained_cfg(config, in_channels: int) -> dict | None:
  """The run's evaluation preprocessing as timm's `pretrained_cfg` keys
  (`resolve_data_config` reads them): the shorter side resized to
  image_size / crop_pct, the central image_size square, normalised with
  the mean and standard deviation of pixels in 0-1. None on the digits,
  whose preprocessing (datasets.digit_image) is none of timm's."""
  if _is_digits(config):
    return None
  mean, stddev = input_pipeline.channel_normalization(
      config.normalization, in_channels)
  return {'input_size': [in_channels, config.image_size, config.image_size],
          'interpolation': TIMM_INTERPOLATIONS[config.eval_resize_method],
          'mean': (mean / 255).tolist(), 'std': (stddev / 255).tolist(),
          'crop_pct': input_pipeline.EVAL_CROP_FRACTION,
          'crop_mode': 'center'}


def _is_digits(config) -> bool:
  return config.dataset in (datasets.DIGITS, datasets.DIGITS_0TO4)


def state_dict(model, config) -> dict:
  """timm's state dict of a trained model (its `pretrained.trained_arrays`)."""
  family = models.family(config.model)
  arrays = fitting.unstacked_layout(pretrained.trained_arrays(model))
  options = {}
  if family == 'vit':
    if config.vit_posemb == 'sincos2d':
      # Fixed, not learned here (the model's own table, as restored); a
      # learned table of the same values in timm.
      arrays[records.POSEMB] = np.asarray(model.posemb[...])
    options['no_embed_class'] = timm_vits.no_embed_class(config)
  if family == 'convnext':
    options['conv_mlp'] = config.model in TIMM_CONV_MLP
  # Contiguous: safetensors writes an array's buffer, not its view.
  written = {key: np.ascontiguousarray(value)
             for key, value in _WRITERS[family](arrays, **options).items()}
  for key in list(written):
    if key.endswith('.running_mean'):  # PyTorch's BatchNorm counts updates
      written[key.replace('running_mean', 'num_batches_tracked')] = np.zeros(
          (), np.int64)
  return written


def metadata(config, arrays: dict) -> dict:
  """The file's metadata: timm's model, its arguments and (not on the
  digits) the evaluation preprocessing."""
  channels = fitting.image_channels(
      {key: array.shape for key, array in arrays.items()})
  name, args = timm_model(config, channels)
  written = {timm_vit.MODEL_KEY: name, timm_vit.ARGS_KEY: json.dumps(args),
             'format': 'pt'}
  if (cfg := pretrained_cfg(config, channels)) is not None:
    written[PRETRAINED_CFG_KEY] = json.dumps(cfg)
  return written
