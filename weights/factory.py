"""Format names -> readers: `--config.init_format` picks one (`auto`: told
from the file by `detect_format`).

Every reader takes (path, target {name: shape} of the model) and returns an
`records.Weights` in this project's names, one entry per block. Readers import
what their format needs (PyTorch, safetensors, flax.training) only when
they read.
"""

import os
import re
from typing import Callable

from runtime import checkpoint_reads
from runtime import checkpointing
from runtime import paths
from weights import records
from weights import big_vision_vit
from weights import flax_resnet
from weights import project_files
from weights import state_dict_formats
from weights import timm_convnext
from weights import timm_regnet
from weights import timm_swin
from weights import timm_vit
from weights import torch_files
from weights import torch_resnet

READERS: dict[str, Callable[[str, dict], records.Weights]] = {
    'checkpoint': project_files.read_checkpoint,
    # The same checkpoints' moving average of the weights (`ema_decay`).
    'checkpoint_ema': project_files.read_checkpoint_ema,
    'export': project_files.read_export,
    'torchvision': torch_resnet.read_torchvision,
    'timm': timm_vit.read_timm,
    # timm's ConvNeXts (V1, V2) and facebookresearch's originals.
    'timm_convnext': timm_convnext.read_timm_convnext,
    # timm's Swin Transformers and microsoft's originals.
    'timm_swin': timm_swin.read_timm_swin,
    'timm_regnet': timm_regnet.read_timm_regnet,
    'big_vision': big_vision_vit.read_big_vision,
    'flax_imagenet': flax_resnet.read_flax_imagenet,
}
INIT_FORMATS = ('auto', *READERS)


def detect_format(path: str) -> str:
  """The READERS name for `path`, from its name and, for PyTorch's files,
  their keys (and a safetensors file's metadata)."""
  name = os.path.basename(os.path.normpath(path))
  if paths.path(path).is_dir():
    if checkpointing.checkpoint_dir(path) is not None:
      return 'checkpoint'
    if re.fullmatch(r'checkpoint_\d+', name) or any(
        re.fullmatch(r'checkpoint_\d+', entry.name)
        for entry in paths.path(path).iterdir()):
      return 'flax_imagenet'
  elif re.fullmatch(r'checkpoint_\d+', name):
    return 'flax_imagenet'
  elif name.endswith('.npz'):
    return 'big_vision'
  elif name.endswith(torch_files.TORCH_SUFFIXES):
    # A ViT pickle (timm's, MAE's), a ConvNeXt's, a Swin's, a RegNet's or a
    # ResNet's: its keys tell.
    detected = state_dict_formats.state_dict_format(
        torch_files.read_state_dict(path))
    if detected:
      return detected
  elif name.endswith('.safetensors'):
    metadata, keys = torch_files.safetensors_header(path)
    if project_files.EXPORT_CONFIG_KEY in metadata:
      return 'export'
    detected = state_dict_formats.state_dict_format(keys)
    if detected:
      return detected
  raise ValueError(f'cannot tell the format of init_from {path!r}; set '
                   f'--config.init_format to one of {", ".join(READERS)}')


def read(path: str, init_format: str, target: dict) -> records.Weights:
  """The weights in `path`, read as `init_format` (`auto`: detected)."""
  if init_format not in INIT_FORMATS:
    raise ValueError(f'unknown init_format {init_format!r}; valid names: '
                     f'{", ".join(INIT_FORMATS)}')
  if not paths.path(path).exists():
    raise ValueError(f'init_from {path!r} does not exist; pass a workdir, '
                     'checkpoint or weights file')
  # A download is read as a restore reads: again after storage errors,
  # until a stall.
  with paths.local_copy(path, lambda copy: checkpoint_reads.read_retried(
      copy, f'init_from {path}')) as local:
    if init_format == 'auto':
      init_format = detect_format(local)
    return READERS[init_format](local, target)
