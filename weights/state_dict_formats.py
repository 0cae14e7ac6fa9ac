"""Which reader a PyTorch state dict needs, told from its keys alone: the
one detector that `factory.detect_format` (for pickles and `.safetensors`
files alike) and timm's reader use."""

from weights import timm_convnext
from weights import timm_regnet
from weights import timm_swin


def state_dict_format(keys) -> str | None:
  """The READERS name of a state dict with these `keys` (a dict or a set);
  None when no family's keys are there."""
  # Before the ViT's check: a Swin has a `patch_embed.proj` too.
  if timm_swin.is_swin(keys):
    return 'timm_swin'
  if 'patch_embed.proj.weight' in keys:
    return 'timm'  # a ViT: timm's, DeiT's or MAE's
  if timm_convnext.is_convnext(keys):
    return 'timm_convnext'
  if timm_regnet.is_regnet(keys):
    return 'timm_regnet'
  if 'conv1.weight' in keys:
    return 'torchvision'  # a ResNet: torchvision's names, timm's too
  return None
