"""What every reader returns: `Weights`, the arrays of a file in this
project's names, and the conversions of published arrays that readers share.
"""

import dataclasses
import math
import re

import jax
import numpy as np

# A model's classifiers (the class head, and a distillation token's):
# zeros when the file's have another number of classes (or none).
HEAD = ('head.', 'head_dist.')
POSEMB = 'posemb'
# Layers a run may add to published models (`feature_batch_norm`): a file
# without them leaves them as the model initialised them.
ADDED_LAYERS = ('feature_norm.',)


@dataclasses.dataclass
class Weights:
  """The arrays a reader found in a file, in this project's names."""
  arrays: dict
  source: str  # what the file is, for messages: 'a torchvision ResNet'
  # 'resnet', 'vit', 'convnext', 'swin' or 'regnet' (`family_of`)
  family: str
  # Config values the weights compute with, e.g. {'resnet_padding': ...}.
  conventions: dict = dataclasses.field(default_factory=dict)
  # Names in the file that no rule maps.
  unmatched: list = dataclasses.field(default_factory=list)
  # Config values that build the file's model ({} = find them by trying
  # models).
  suggestion: dict = dataclasses.field(default_factory=dict)
  # Config keys of the model's shape the file was trained with, when it
  # says (this project's files): a teacher is built with them.
  model_options: dict = dataclasses.field(default_factory=dict)
  # Config keys whose value the file does not tell, each with the values it
  # may compute with, likeliest first: {'vit_gelu': ('quick', 'exact')}.
  choices: dict = dataclasses.field(default_factory=dict)
  # What the file's head is when it is no classifier, for messages: "CLIP's
  # image projection" ('': a classifier, its outputs classes).
  head_is: str = ''


def family_of(names) -> str:
  """'swin', 'vit', 'convnext', 'regnet' or 'resnet': the model family
  whose parameter names (a model's or a file's, in this project's names)
  include `names`."""
  if 'patch_embed_norm.scale' in names:  # before the ViT's patch_embed
    return 'swin'
  if 'patch_embed.kernel' in names:
    return 'vit'
  # Only RegNets' blocks have squeeze-and-excitation.
  if any(name.endswith('.se.reduce.kernel') for name in names):
    return 'regnet'
  return 'convnext' if 'stem_norm.scale' in names else 'resnet'


def float32(value) -> np.ndarray:
  """float32 numpy; numpy's bfloat16-less `.npz` stores bfloat16 as 2-byte
  void (as big_vision writes it)."""
  value = np.asarray(value)
  if value.dtype.kind == 'V' and value.dtype.itemsize == 2:
    value = value.view(jax.numpy.bfloat16)
  return value.astype(np.float32)


def flatten(tree: dict, prefix: str = '') -> dict:
  """{'a/b/c': leaf} of nested dicts."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f'{prefix}{key}/'))
    else:
      flat[f'{prefix}{key}'] = float32(value)
  return flat


def dotted(path_keys) -> str:
  """'stages.0.first.conv1.kernel' of a jax key path (without `.value`)."""
  keys = [str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))))
          for k in path_keys]
  return '.'.join(keys[:-1] if keys and keys[-1] == 'value' else keys)


def conv_kernel(value: np.ndarray) -> np.ndarray:
  """PyTorch's (out, in, height, width) as Flax's (height, width, in,
  out)."""
  return value.transpose(2, 3, 1, 0)


def torch_weight(value: np.ndarray) -> np.ndarray:
  """Flax's kernel as PyTorch's weight: a convolution's (height, width, in,
  out) as (out, in, height, width), a dense layer's (in, out) transposed."""
  return value.transpose(3, 2, 0, 1) if value.ndim == 4 else value.T


# PyTorch's parameter and BatchNorm statistic names -> this project's (a
# norm's `weight` is its `scale`, any other layer's its `kernel`).
BATCH_NORM = {'weight': 'scale', 'bias': 'bias', 'running_mean': 'mean',
              'running_var': 'var'}
_TORCH_KINDS = {'kernel': 'weight', 'scale': 'weight', 'bias': 'bias',
                'mean': 'running_mean', 'var': 'running_var'}


def torch_kind(kind: str) -> str:
  """PyTorch's name of this project's `kernel`, `scale`, `bias`, `mean` or
  `var`: the inverse of `param_name`, `torch_param` and `BATCH_NORM`."""
  return _TORCH_KINDS[kind]


def inverse(table: dict) -> dict:
  """{value: key} of a one-to-one name table: a reader's table, read the
  other way by its writer."""
  inverted = {value: key for key, value in table.items()}
  assert len(inverted) == len(table), table
  return inverted


def param_name(torch_name: str) -> str:
  """Flax's name of a PyTorch parameter: `kernel` for `weight`."""
  return 'kernel' if torch_name == 'weight' else 'bias'


def torch_param(layer: str, kind: str) -> str:
  """The name of PyTorch's `weight` or `bias` of `layer` (this project's
  name): a norm's weight is its scale, any other layer's its kernel."""
  if re.search(r'(norm\d?|\bln\d)$', layer):
    return f'{layer}.{"scale" if kind == "weight" else "bias"}'
  return f'{layer}.{param_name(kind)}'


def is_square(n: int) -> bool:
  return n > 0 and math.isqrt(n) ** 2 == n


def first_line(error: Exception) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def join_class_token_position(arrays: dict) -> None:
  """The inverse of `separate_class_token_position`, in place: the position
  embedding gets a zero entry per token before the grid's (the tokens keep
  their own positions folded in, so the sums are the same and reading back
  adds zeros)."""
  tokens = [name for name in ('cls', 'dist') if name in arrays]
  posemb = arrays.get(POSEMB)
  if posemb is not None and tokens:
    zeros = np.zeros((1, len(tokens), posemb.shape[2]), posemb.dtype)
    arrays[POSEMB] = np.concatenate([zeros, posemb], axis=1)


def separate_class_token_position(arrays: dict) -> None:
  """Adds the class token's (and a distillation token's, and register
  tokens') own position embedding to the tokens themselves.

  Files whose position embedding has entries for these tokens before the
  grid's add it after prepending the tokens; this model adds the grid's
  part first, then prepends the tokens: the same sums.
  """
  posemb = arrays.get(POSEMB)
  tokens = [name for name in ('cls', 'dist', 'registers') if name in arrays]
  if posemb is None or not tokens or is_square(posemb.shape[1]):
    return
  count = sum(arrays[name].shape[1] for name in tokens)
  if is_square(posemb.shape[1] - count):
    start = 0
    for name in tokens:
      end = start + arrays[name].shape[1]
      arrays[name] = arrays[name] + posemb[:, start:end]
      start = end
    arrays[POSEMB] = posemb[:, count:]
