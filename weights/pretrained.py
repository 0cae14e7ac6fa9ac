"""Pretrained weights: this project's checkpoints and exports, and published
ResNets and ViTs, loaded into a model of this project.

`--config.init_from=PATH` starts a new run (step 0, fresh optimizer) from
the weights of PATH, read by one of READERS (`--config.init_format`, `auto`
to tell from the file). Every reader turns its file into one flat dict
{name: array} in this project's names, one entry per block
(`stages.1.blocks.3.conv1.kernel`, `encoder.blocks.5.mlp_in.kernel`).
`scanned_layout` then stacks the blocks as the model holds them: a ResNet
stage's first block apart, the rest on a leading layer axis; a ViT encoder
as one stack. Scanned, unrolled and segmented models share that layout, so
they all load the same file. `fit` checks every name and shape against the
model, resamples a ViT position embedding to the model's grid and starts a
new head from zeros when the file's has another number of classes.

Every mistake is one ValueError line naming the fix, raised before anything
is written.
"""

import dataclasses
import json
import math
import os
import re
from typing import Callable

from absl import logging
from flax import nnx
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from runtime import checkpointing
from configs import default
from data import datasets
import models
from training import mixed_precision

# This project's checkpoints: WORKDIR/checkpoints/STEP/{state,config}.
CHECKPOINTS_DIR = 'checkpoints'
# Metadata key of export.py's files: the config the weights were trained with.
EXPORT_CONFIG_KEY = 'config'
EXPORT_STEP_KEY = 'step'
EXPORT_CLASSES_KEY = 'class_names'
TORCH_SUFFIXES = ('.pth', '.pt', '.bin')
# A model's classifier: zeros when the file's has another number of classes
# (or none).
HEAD = 'head.'
POSEMB = 'posemb'


@dataclasses.dataclass
class Weights:
  """The arrays a reader found in a file, in this project's names."""
  arrays: dict
  source: str  # what the file is, for messages: 'a torchvision ResNet'
  family: str  # 'resnet' or 'vit'
  # Config values the weights compute with, e.g. {'resnet_padding': ...}.
  conventions: dict = dataclasses.field(default_factory=dict)
  # Names in the file that no rule maps.
  unmatched: list = dataclasses.field(default_factory=list)
  # Overrides that build the file's model ('' = find them by trying models).
  suggestion: str = ''


# ------------------------------------------------------------ the readers


def read_checkpoint(path: str, target: dict) -> Weights:
  """This project's workdir, its checkpoints directory, or one checkpoint."""
  del target  # stored in this project's names already
  step_dir = checkpoint_dir(path)
  if step_dir is None:
    raise ValueError(f'init_from {path!r} holds no checkpoint of this '
                     f'project (no {CHECKPOINTS_DIR}/STEP with a state); pass '
                     'a workdir, its checkpoints directory or one checkpoint')
  config = saved_config(step_dir)
  state_dir = os.path.join(step_dir, 'state')
  try:
    with ocp.PyTreeCheckpointer() as reader:
      tree = reader.metadata(state_dir).item_metadata.tree
      wanted = {key: tree[key] for key in ('params', 'model_state')}
      restored = reader.restore(state_dir, args=ocp.args.PyTreeRestore(
          item=wanted, partial_restore=True,
          restore_args=jax.tree.map(
              lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)))
  except Exception as e:  # pylint: disable=broad-except
    # Orbax and TensorStore report damaged files with many exception types.
    raise ValueError(f'cannot read checkpoint {step_dir!r}: '
                     f'{_first_line(e)}') from None
  arrays = {}
  for part in restored.values():
    for path_keys, value in jax.tree_util.tree_flatten_with_path(part)[0]:
      arrays[_dotted(path_keys)] = value
  if config.get('vit_posemb') == 'sincos2d':
    arrays.pop(POSEMB, None)  # computed, not learned
  return _own_weights(arrays, config, f"this project's checkpoint {step_dir}")


def read_export(path: str, target: dict) -> Weights:
  """A `.safetensors` file written by export.py."""
  del target
  metadata, arrays = _read_safetensors(path)
  if EXPORT_CONFIG_KEY not in metadata:
    raise ValueError(f'init_from {path!r} has no config in its metadata, so '
                     'export.py did not write it; pass --config.init_format '
                     'for its source (timm, torchvision)')
  config = json.loads(metadata[EXPORT_CONFIG_KEY])
  return _own_weights(arrays, config, f"this project's export {path}")


def _own_weights(arrays: dict, config: dict, source: str) -> Weights:
  """Weights of this project, with the conventions of the config they were
  trained with."""
  family = 'vit' if 'patch_embed.kernel' in arrays else 'resnet'
  keys = (('model', 'vit_pool', 'vit_posemb', 'vit_gelu', 'vit_pre_logits')
          if family == 'vit' else ('model', 'resnet_padding'))
  conventions = {key: config[key] for key in keys if key in config}
  shape_keys = ('model', 'num_layers', 'width')
  suggestion = ' '.join(f'--config.{key}={config[key]}' for key in shape_keys
                        if key in config)
  return Weights(arrays, source, family, conventions, suggestion=suggestion)


def read_torchvision(path: str, target: dict) -> Weights:
  """A torchvision (or timm) ResNet state dict: `.pth` (needs PyTorch) or
  `.safetensors`."""
  del target
  return _torch_resnet(_read_torch_state_dict(path), 'a torchvision ResNet')


def read_timm(path: str, target: dict) -> Weights:
  """timm's `model.safetensors` (or `.pth`) of a ResNet or a ViT with
  16 x 16 patches."""
  state_dict = _read_torch_state_dict(path)
  if 'patch_embed.proj.weight' in state_dict:
    return _timm_vit(state_dict, target)
  return _torch_resnet(state_dict, 'a timm ResNet')


def read_big_vision(path: str, target: dict) -> Weights:
  """big_vision's ViT `.npz` (also the older vit_jax names), with flat
  `Transformer/encoderblock_{i}` or scanned `Transformer/encoderblock`."""
  del target
  try:
    with np.load(path, allow_pickle=False) as npz:
      flat = {key: _float32(npz[key]) for key in npz.files}
  except (OSError, ValueError) as e:
    raise ValueError(f'cannot read init_from {path!r} as a big_vision .npz: '
                     f'{_first_line(e)}') from None
  for prefix in ('params/', 'opt/target/'):  # checkpoints with optimizer
    if any(key.startswith(prefix) for key in flat):
      flat = {key[len(prefix):]: value for key, value in flat.items()
              if key.startswith(prefix)}
      break
  return _big_vision_vit(_linen_numbering(flat))


def read_flax_imagenet(path: str, target: dict) -> Weights:
  """A checkpoint of the Flax ImageNet example (Linen ResNet; msgpack file
  or orbax directory `checkpoint_N`, or the workdir holding them)."""
  del target
  from flax.training import checkpoints  # pylint: disable=g-import-not-at-top
  try:
    restored = checkpoints.restore_checkpoint(path, target=None)
  except Exception as e:  # pylint: disable=broad-except
    # msgpack, orbax and the file system each raise their own types.
    raise ValueError(f'cannot read init_from {path!r} as a Flax ImageNet '
                     f'checkpoint: {_first_line(e)}') from None
  if not isinstance(restored, dict) or 'params' not in restored:
    raise ValueError(f'init_from {path!r} holds no Flax ImageNet checkpoint '
                     '(no params); pass a checkpoint_N or the workdir with '
                     'them')
  return _flax_resnet(_flatten(restored['params']),
                      _flatten(restored.get('batch_stats') or {}))


READERS: dict[str, Callable[[str, dict], Weights]] = {
    'checkpoint': read_checkpoint,
    'export': read_export,
    'torchvision': read_torchvision,
    'timm': read_timm,
    'big_vision': read_big_vision,
    'flax_imagenet': read_flax_imagenet,
}
INIT_FORMATS = ('auto', *READERS)


def detect_format(path: str) -> str:
  """The READERS name for `path`, from its name and, for safetensors, its
  metadata and keys."""
  name = os.path.basename(os.path.normpath(path))
  if os.path.isdir(path):
    if checkpoint_dir(path) is not None:
      return 'checkpoint'
    if re.fullmatch(r'checkpoint_\d+', name) or any(
        re.fullmatch(r'checkpoint_\d+', entry) for entry in os.listdir(path)):
      return 'flax_imagenet'
  elif re.fullmatch(r'checkpoint_\d+', name):
    return 'flax_imagenet'
  elif name.endswith('.npz'):
    return 'big_vision'
  elif name.endswith(TORCH_SUFFIXES):
    return 'torchvision'
  elif name.endswith('.safetensors'):
    metadata, keys = _safetensors_header(path)
    if EXPORT_CONFIG_KEY in metadata:
      return 'export'
    if 'patch_embed.proj.weight' in keys:
      return 'timm'
    if 'conv1.weight' in keys:
      return 'torchvision'
  raise ValueError(f'cannot tell the format of init_from {path!r}; set '
                   f'--config.init_format to one of {", ".join(READERS)}')


def read(path: str, init_format: str, target: dict) -> Weights:
  """The weights in `path`, read as `init_format` (`auto`: detected)."""
  if init_format not in INIT_FORMATS:
    raise ValueError(f'unknown init_format {init_format!r}; valid names: '
                     f'{", ".join(INIT_FORMATS)}')
  if not os.path.exists(path):
    raise ValueError(f'init_from {path!r} does not exist; pass a workdir, '
                     'checkpoint or weights file')
  if init_format == 'auto':
    init_format = detect_format(path)
  return READERS[init_format](path, target)


# ------------------------------------------------- published name layouts


def _torch_resnet(state_dict: dict, source: str) -> Weights:
  """torchvision's ResNet names (timm's plain ResNets use the same)."""
  bn = {'weight': 'scale', 'bias': 'bias', 'running_mean': 'mean',
        'running_var': 'var'}
  arrays, unmatched = {}, []
  for key, value in state_dict.items():
    parts = key.split('.')
    if parts[-1] == 'num_batches_tracked':
      continue  # a counter of BatchNorm updates, not a weight
    m = re.fullmatch(r'layer(\d)\.(\d+)\.(.+)', key)
    prefix = f'stages.{int(m[1]) - 1}.blocks.{m[2]}.' if m else ''
    inner = m[3] if m else key
    if m and (c := re.fullmatch(r'conv(\d)\.weight', inner)):
      arrays[f'{prefix}conv{c[1]}.kernel'] = _conv_kernel(value)
    elif m and (c := re.fullmatch(r'bn(\d)\.(\w+)', inner)) and c[2] in bn:
      arrays[f'{prefix}bn{c[1]}.{bn[c[2]]}'] = value
    elif m and inner == 'downsample.0.weight':
      arrays[f'{prefix}proj.kernel'] = _conv_kernel(value)
    elif m and (c := re.fullmatch(r'downsample\.1\.(\w+)', inner)) and (
        c[1] in bn):
      arrays[f'{prefix}proj_bn.{bn[c[1]]}'] = value
    elif key == 'conv1.weight':
      arrays['stem.kernel'] = _conv_kernel(value)
    elif parts[0] == 'bn1' and len(parts) == 2 and parts[1] in bn:
      arrays[f'stem_bn.{bn[parts[1]]}'] = value
    elif key == 'fc.weight':
      arrays['head.kernel'] = value.T
    elif key == 'fc.bias':
      arrays['head.bias'] = value
    else:
      unmatched.append(key)
  return Weights(arrays, source, 'resnet', {'resnet_padding': 'symmetric'},
                 unmatched)


def _timm_vit(state_dict: dict, target: dict) -> Weights:
  """timm's VisionTransformer names; q, k and v split into heads."""
  # (layers, width, heads, head_dim); one head when the model is no ViT,
  # which `fit` refuses with its own message.
  heads = target.get('encoder.layers.attention.query.kernel', (1,) * 4)[-2]
  arrays, unmatched = {}, []
  linear = {'norm1': 'ln1', 'norm2': 'ln2', 'mlp.fc1': 'mlp_in',
            'mlp.fc2': 'mlp_out'}
  norm = {'weight': 'scale', 'bias': 'bias'}
  for key, value in state_dict.items():
    m = re.fullmatch(r'blocks\.(\d+)\.(.+)\.(weight|bias)', key)
    if m:
      block, layer, kind = f'encoder.blocks.{m[1]}.', m[2], m[3]
      if layer in ('norm1', 'norm2'):
        arrays[f'{block}{linear[layer]}.{norm[kind]}'] = value
      elif layer in linear:
        arrays[f'{block}{linear[layer]}.{_kind(kind)}'] = (
            value.T if kind == 'weight' else value)
      elif layer == 'attn.qkv':
        for name, part in zip(('query', 'key', 'value'),
                              _split_qkv(value, heads)):
          arrays[f'{block}attention.{name}.{_kind(kind)}'] = part
      elif layer == 'attn.proj':
        arrays[f'{block}attention.out.{_kind(kind)}'] = (
            value.T.reshape(heads, -1, value.shape[0]) if kind == 'weight'
            else value)
      else:
        unmatched.append(key)
    elif key == 'patch_embed.proj.weight':
      arrays['patch_embed.kernel'] = _conv_kernel(value)
    elif key == 'patch_embed.proj.bias':
      arrays['patch_embed.bias'] = value
    elif key == 'cls_token':
      arrays['cls'] = value
    elif key == 'pos_embed':
      arrays[POSEMB] = value
    elif key in ('norm.weight', 'norm.bias'):
      arrays[f'encoder_norm.{norm[key.split(".")[1]]}'] = value
    elif key in ('head.weight', 'head.bias'):
      arrays[f'head.{_kind(key.split(".")[1])}'] = (
          value.T if key == 'head.weight' else value)
    else:
      unmatched.append(key)
  _separate_class_token_position(arrays)
  return Weights(arrays, 'a timm ViT', 'vit', {
      'vit_gelu': 'exact', 'vit_pool': 'cls' if 'cls' in arrays else 'gap',
      'vit_posemb': 'learn', 'vit_pre_logits': False}, unmatched)


def _big_vision_vit(flat: dict) -> Weights:
  """big_vision's ViT names (Linen numbering); pool `gap` or `tok`."""
  block_layers = {'LayerNorm_0': 'ln1', 'LayerNorm_1': 'ln2',
                  'MlpBlock_0/Dense_0': 'mlp_in',
                  'MlpBlock_0/Dense_1': 'mlp_out'}
  top = {'embedding': 'patch_embed', 'Transformer/encoder_norm':
         'encoder_norm', 'pre_logits': 'pre_logits', 'head': 'head'}
  posembs = ('pos_embedding', 'Transformer/pos_embedding',
             'Transformer/posembed_input/pos_embedding')
  arrays, unmatched = {}, []
  for key, value in flat.items():
    m = re.fullmatch(r'Transformer/encoderblock(_\d+)?/(.+)/(\w+)', key)
    if m:
      layer, leaf = m[2], m[3]
      a = re.fullmatch(r'MultiHeadDotProductAttention_0/(query|key|value|out)',
                       layer)
      if a:
        name = f'attention.{a[1]}.{leaf}'
      elif layer in block_layers:
        name = f'{block_layers[layer]}.{leaf}'
      else:
        unmatched.append(key)
        continue
      if m[1]:  # one block
        arrays[f'encoder.blocks.{m[1][1:]}.{name}'] = value
      else:  # the scanned encoder: every block on the leading axis
        for i, block_value in enumerate(value):
          arrays[f'encoder.blocks.{i}.{name}'] = block_value
    elif key in posembs:
      arrays[POSEMB] = value
    elif key == 'cls':
      arrays['cls'] = value
    elif (layer := key.rpartition('/')[0]) in top:
      arrays[f'{top[layer]}.{key.rpartition("/")[2]}'] = value
    else:
      unmatched.append(key)
  _separate_class_token_position(arrays)
  return Weights(arrays, 'a big_vision ViT', 'vit', {
      'vit_gelu': 'tanh', 'vit_pool': 'cls' if 'cls' in arrays else 'gap',
      'vit_posemb': 'learn' if POSEMB in arrays else 'sincos2d',
      'vit_pre_logits': 'pre_logits.kernel' in arrays}, unmatched)


def _flax_resnet(params: dict, batch_stats: dict) -> Weights:
  """The Flax ImageNet example's Linen ResNet names: blocks numbered across
  stages; a stage starts where a block projects its input (`conv_proj`)."""
  merged = {**params, **batch_stats}
  blocks = sorted({int(m[1]) for key in merged
                   if (m := re.match(r'\w*ResNetBlock_(\d+)/', key))})
  starts = [n for n in blocks if n == blocks[0] or any(
      re.match(rf'\w*ResNetBlock_{n}/conv_proj/', key) for key in merged)]
  position = {}  # block number -> (stage, index in stage)
  for n in blocks:
    stage = sum(start <= n for start in starts) - 1
    position[n] = (stage, n - starts[stage])
  arrays, unmatched = {}, []
  for key, value in merged.items():
    m = re.fullmatch(r'(?:\w*ResNetBlock_(\d+)/)?(\w+)/(\w+)', key)
    layer = _flax_resnet_layer(m[2], inside_block=bool(m[1])) if m else None
    if layer is None:
      unmatched.append(key)
      continue
    if m[1]:
      stage, index = position[int(m[1])]
      layer = f'stages.{stage}.blocks.{index}.{layer}'
    arrays[f'{layer}.{m[3]}'] = value
  return Weights(arrays, 'a Flax ImageNet example ResNet', 'resnet',
                 {'resnet_padding': 'same'}, unmatched)


def _flax_resnet_layer(name: str, inside_block: bool) -> str | None:
  """This project's name of a Linen ResNet layer, or None."""
  if not inside_block:
    return {'conv_init': 'stem', 'bn_init': 'stem_bn',
            'Dense_0': 'head'}.get(name)
  m = re.fullmatch(r'(Conv|BatchNorm)_(\d)', name)
  if m:  # Linen counts from 0, the blocks here from 1
    return f'{"conv" if m[1] == "Conv" else "bn"}{int(m[2]) + 1}'
  return {'conv_proj': 'proj', 'norm_proj': 'proj_bn'}.get(name)


def _split_qkv(value: np.ndarray, heads: int) -> list:
  """timm's fused q, k, v (3 * width outputs, head-major within each) as
  nnx.MultiHeadAttention kernels (width, heads, head_dim) or biases."""
  if value.ndim == 2:  # (3 * width, width): outputs x inputs
    return list(value.reshape(3, heads, -1, value.shape[1]).transpose(
        0, 3, 1, 2))
  return list(value.reshape(3, heads, -1))


def _separate_class_token_position(arrays: dict) -> None:
  """Adds the class token's own position embedding to the token itself.

  Files whose position embedding has 1 + grid x grid entries add it after
  prepending the class token; this model adds the grid's part first, then
  prepends the token: the same sums.
  """
  posemb, cls = arrays.get(POSEMB), arrays.get('cls')
  if posemb is None or cls is None or _is_square(posemb.shape[1]):
    return
  if _is_square(posemb.shape[1] - 1):
    arrays['cls'] = cls + posemb[:, :1]
    arrays[POSEMB] = posemb[:, 1:]


def _linen_numbering(flat: dict) -> dict:
  """Keys with Linen's module numbering (`Name_k` counted per name); files
  of the older vit_jax code count every module of a scope together
  (`MultiHeadDotProductAttention_1`, `MlpBlock_3`). Linen names stay."""
  children = {}
  for key in flat:
    parts = key.split('/')
    for depth in range(len(parts) - 1):
      children.setdefault('/'.join(parts[:depth]), set()).add(parts[depth])
  renames = {}
  for scope, names in children.items():
    numbered = sorted((m[1], int(m[2]), name) for name in names
                      if (m := re.fullmatch(r'(.+)_(\d+)', name)))
    counts = {}
    for base, _, name in numbered:
      renames[(scope, name)] = f'{base}_{counts.setdefault(base, 0)}'
      counts[base] += 1
  renamed = {}
  for key, value in flat.items():
    parts = key.split('/')
    renamed['/'.join(
        renames.get(('/'.join(parts[:depth]), part), part)
        if depth < len(parts) - 1 else part
        for depth, part in enumerate(parts))] = value
  return renamed


# ------------------------------------------------------ fitting the model


def scanned_layout(arrays: dict) -> dict:
  """Per-block names stacked as the model holds them: `stages.S.blocks.0`
  -> `stages.S.first`, `stages.S.blocks.1..` -> `stages.S.rest.layers` and
  `encoder.blocks.*` -> `encoder.layers`, on a leading layer axis."""
  laid_out, stacks = {}, {}
  for name, value in arrays.items():
    m = re.fullmatch(r'(stages\.\d+)\.blocks\.(\d+)\.(.+)', name)
    e = re.fullmatch(r'encoder\.blocks\.(\d+)\.(.+)', name)
    if m and m[2] == '0':
      laid_out[f'{m[1]}.first.{m[3]}'] = value
    elif m:
      stacks.setdefault(f'{m[1]}.rest.layers.{m[3]}', {})[int(m[2]) - 1] = (
          value)
    elif e:
      stacks.setdefault(f'encoder.layers.{e[2]}', {})[int(e[1])] = value
    else:
      laid_out[name] = value
  for name, layers in stacks.items():
    absent = sorted(set(range(max(layers) + 1)) - set(layers))
    if absent:
      raise ValueError(f'{name}: the file lacks it in layers '
                       f'{_ranges(absent)} of that stack')
    if len({layer.shape for layer in layers.values()}) > 1:
      raise ValueError(f'{name}: the file has other shapes in different '
                       'layers of one stack')
    laid_out[name] = np.stack([layers[i] for i in range(len(layers))])
  return laid_out


def fit(weights: Weights, target: dict, config,
        new_head: bool = True) -> tuple[dict, list]:
  """The arrays of `weights` for a model of `target` shapes
  {name: shape}, and notes for the log. Raises ValueError, naming the fix,
  when they do not fit; also when the head does not and `new_head` is
  False."""
  family = 'vit' if 'patch_embed.kernel' in target else 'resnet'
  if weights.family != family:
    raise ValueError(
        f'init_from is {weights.source}, but --config.model={config.model} '
        f'is a {_FAMILY[family]}; {_fix(weights, config)}')
  for key, value in weights.conventions.items():
    if key in config and config[key] != value:
      raise ValueError(
          f'init_from is {weights.source} with {key}={value!r}; set '
          f'--config.{key}={value} (the model has {config[key]!r})')
  arrays = scanned_layout(weights.arrays)
  notes = []
  if POSEMB in arrays and POSEMB in target and (
      arrays[POSEMB].shape != target[POSEMB]):
    arrays[POSEMB], note = _fit_posemb(arrays[POSEMB], target[POSEMB])
    notes.append(note)
  head = sorted(name for name in target if name.startswith(HEAD))
  if any(name not in arrays or arrays[name].shape != target[name]
         for name in head):
    found = arrays.get('head.bias')
    classes = (f'the file has {found.shape[0] if found is not None else "no"}'
               f' classes, the model {target["head.bias"][0]}')
    if not new_head:
      raise ValueError(f'init_from ({weights.source}) does not fit the data '
                       f'set: {classes}; evaluate on the data set it was '
                       'trained on (--config.dataset)')
    # Zeros, as transfer recipes start a new head (BiT, ViT): the first
    # logits are all equal instead of random projections of pretrained
    # features.
    notes.append(f'head re-initialised to zeros: {classes}')
    for name in head:
      arrays[name] = np.zeros(target[name], np.float32)
  missing = [name for name in target
             if name not in arrays and name not in head]
  unexpected = weights.unmatched + [name for name in arrays
                                    if name not in target]
  if missing or unexpected:
    raise ValueError(
        f'init_from ({weights.source}) does not fit --config.model='
        f'{config.model}: '
        + '; '.join(f'{what} {_summarize(names)}' for what, names in (
            ('missing in the file:', missing),
            ('not in the model:', unexpected)) if names)
        + f'; {_fix(weights, config)}')
  wrong = [f'{name} {arrays[name].shape} (model {target[name]})'
           for name in sorted(arrays) if arrays[name].shape != target[name]]
  if wrong:
    raise ValueError(
        f'init_from ({weights.source}) has other shapes than --config.model='
        f'{config.model}: {", ".join(wrong)}; {_fix(weights, config)}')
  return {name: np.asarray(value, np.float32)
          for name, value in arrays.items()}, notes


_FAMILY = {'resnet': 'ResNet', 'vit': 'ViT'}


def _fit_posemb(posemb: np.ndarray, shape: tuple) -> tuple:
  """A position embedding on a square grid resampled (bicubic) to the
  model's grid, and a note; other shapes are left to the shape check."""
  old, new = posemb.shape[1], shape[1]
  if not (_is_square(old) and _is_square(new) and posemb.shape[2] ==
          shape[2]):
    return posemb, ''
  return resample_posemb(posemb, math.isqrt(new)), (
      f'position embedding resampled from a {math.isqrt(old)}x'
      f'{math.isqrt(old)} to a {math.isqrt(new)}x{math.isqrt(new)} grid')


def resample_posemb(posemb: np.ndarray, grid: int) -> np.ndarray:
  """(1, n*n, width) on an n x n grid -> (1, grid*grid, width), bicubic."""
  n, width = math.isqrt(posemb.shape[1]), posemb.shape[2]
  resized = jax.image.resize(posemb.reshape(n, n, width),
                             (grid, grid, width), method='bicubic')
  return np.asarray(resized, np.float32).reshape(1, grid * grid, width)


def _fix(weights: Weights, config) -> str:
  """The overrides that build the file's model, or what to check."""
  suggestion = weights.suggestion or _matching_model(weights, config)
  if suggestion:
    return f'its model needs {suggestion}'
  return 'choose the --config.model (and num_layers) the file was trained as'


def _matching_model(weights: Weights, config) -> str:
  """`--config.model=...` (and num_layers) of the first model whose names
  and shapes, head and position embedding aside, the file's arrays fit."""
  try:
    arrays = scanned_layout(weights.arrays)
  except ValueError:
    return ''
  stem = arrays.get('stem.kernel', arrays.get('patch_embed.kernel'))
  if stem is None:
    return ''
  depth = arrays.get('encoder.layers.ln1.scale', np.zeros((0,))).shape[0]
  comparable = lambda shapes: {n: _without_heads(n, s)
                               for n, s in shapes.items()
                               if not n.startswith(HEAD) and n != POSEMB}
  found = comparable({n: a.shape for n, a in arrays.items()})
  for name in models.MODEL_NAMES:
    if (name.startswith('ViT') != (weights.family == 'vit')):
      continue
    candidate = ml_collections.ConfigDict(config.to_dict())
    candidate.update(weights.conventions)
    candidate.update(model=name, num_layers=depth)
    try:
      shapes = model_shapes(nnx.eval_shape(lambda c=candidate: (
          models.create_model(c, 2, stem.shape[2], rngs=nnx.Rngs(0)))))
    except (ValueError, AttributeError):
      continue
    if comparable(shapes) == found:
      return f'--config.model={name}' + (
          f' --config.num_layers={depth}' if depth else '')
  return ''


def _without_heads(name: str, shape: tuple) -> tuple:
  """An attention array's shape with (heads, head_dim) as one axis: a
  file's fused heads were split by the model's head count."""
  if '.attention.' not in name:
    return shape
  if name.endswith('out.kernel'):  # (..., heads, head_dim, width)
    return (*shape[:-3], shape[-3] * shape[-2], shape[-1])
  return (*shape[:-2], shape[-2] * shape[-1])


# ------------------------------------------------ loading into the trainer


def model_shapes(model_or_states) -> dict:
  """{name: shape} of the parameters and BatchNorm statistics (what a file
  provides) of a model, or of its states."""
  return {name: tuple(variable.shape)
          for name, variable in _named_variables(model_or_states).items()
          if isinstance(variable, (nnx.Param, nnx.BatchStat))}


def _named_variables(model_or_states) -> dict:
  states = (nnx.state(model_or_states)
            if isinstance(model_or_states, nnx.Module) else model_or_states)
  if not isinstance(states, (list, tuple)):
    states = [states]
  return {'.'.join(map(str, path)): variable
          for state in states for path, variable in nnx.to_flat_state(state)}


def load(path: str, init_format: str, config, states: list,
         new_head: bool = True) -> list:
  """`states` (nnx.States: parameters, BatchNorm statistics, ...) with the
  weights of `path`; every array keeps its sharding. With `new_head`, a
  head that does not fit the file's starts from zeros; the log says so."""
  target = model_shapes(states)
  weights = read(path, init_format, target)
  arrays, notes = fit(weights, target, config, new_head)
  logging.info('Initialised %d arrays from %s (%s)%s', len(arrays), path,
               weights.source, ''.join(f'; {n}' for n in notes if n))
  return [_replace(state, arrays) for state in states]


def _replace(state, arrays: dict):
  """`state` with the arrays named in `arrays`, placed like the old ones."""
  def new_value(path, variable):
    name = '.'.join(map(str, path))
    if name not in arrays:
      return variable
    old = variable.get_value()
    value = arrays[name].astype(old.dtype)
    return variable.replace(jax.make_array_from_callback(
        value.shape, old.sharding, lambda index: value[index]))
  return nnx.from_flat_state([(path, new_value(path, variable))
                              for path, variable in nnx.to_flat_state(state)])


def load_into_model(model: nnx.Module, config, path: str,
                    init_format: str = 'auto') -> None:
  """Loads the weights of `path` into `model` (built from `config`)."""
  graphdef, *states = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
  nnx.update(model, *load(path, init_format, config, states))
  del graphdef


def initialize(state, config, workdir: str):
  """The train state with the weights of `config.init_from` when it is set
  and the run starts fresh: `workdir` holds no checkpoint to resume."""
  if not config.init_from or checkpoint_dir(workdir) is not None:
    return state
  params, model_state = load(config.init_from, config.init_format, config,
                             [state.params, state.model_state])
  return state.replace(params=params, model_state=model_state)


# ------------------------------------------ this project's trained models


def checkpoint_dir(path: str) -> str | None:
  """The newest checkpoint directory in `path`: a workdir, its checkpoints
  directory, or a checkpoint itself; None if there is none."""
  if os.path.isdir(os.path.join(path, 'state')):
    return path
  directory = os.path.join(path, CHECKPOINTS_DIR)
  if not os.path.isdir(directory):
    directory = path
  if not os.path.isdir(directory):
    return None
  steps = [int(entry) for entry in os.listdir(directory) if entry.isdigit()
           and os.path.isdir(os.path.join(directory, entry, 'state'))]
  return os.path.join(directory, str(max(steps))) if steps else None


def load_trained(workdir: str):
  """(config, model, step) of the newest checkpoint in `workdir`, the model
  built from the config it was trained with."""
  step_dir = checkpoint_dir(workdir)
  if step_dir is None:
    raise ValueError(f'no checkpoint in {workdir!r}; pass the --workdir of a '
                     'run that saved one')
  weights = read_checkpoint(step_dir, {})
  config = trained_config(step_dir)
  arrays = weights.arrays
  stem = arrays.get('stem.kernel', arrays.get('patch_embed.kernel'))
  model = models.create_model(config, arrays['head.bias'].shape[0],
                              stem.shape[2],
                              dtype=mixed_precision.compute_dtype(config),
                              rngs=nnx.Rngs(config.seed))
  graphdef, *states = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
  fitted, _ = fit(weights, model_shapes(states), config)
  nnx.update(model, *[_replace(state, fitted) for state in states])
  del graphdef
  return config, model, int(os.path.basename(step_dir))


def class_names(workdir: str, config) -> list[str]:
  """The class names of the model in `workdir`'s newest checkpoint, index by
  index: those saved with it, or (a checkpoint that predates them) those of
  the data set it was trained on."""
  saved = checkpointing.saved_class_names(checkpoint_dir(workdir))
  return saved or datasets.label_names(config)


def saved_config(step_dir: str) -> dict:
  """The config saved with a checkpoint of this project, as a dict."""
  path = os.path.join(step_dir, 'config')
  if not os.path.isdir(path):
    raise ValueError(f'checkpoint {step_dir!r} has no saved config; pass a '
                     'checkpoint this trainer wrote')
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
    return reader.restore(path)


def trained_config(step_dir: str) -> ml_collections.ConfigDict:
  """The config saved with a checkpoint; keys it predates take their
  defaults."""
  return ml_collections.ConfigDict({**default.get_config().to_dict(),
                                    **saved_config(step_dir)})


def trained_arrays(model: nnx.Module) -> dict:
  """{name: float32 array} of a model's parameters and BatchNorm
  statistics, in the names every reader produces (stacked layout)."""
  return {name: np.asarray(variable.get_value(), np.float32)
          for name, variable in _named_variables(model).items()
          if isinstance(variable, (nnx.Param, nnx.BatchStat))}


# ------------------------------------------------------------- file access


def _read_torch_state_dict(path: str) -> dict:
  """{key: float32 array} of a PyTorch state dict in `.safetensors`, or in
  a pickle (`.pth`) read by PyTorch when it is installed."""
  if path.endswith('.safetensors'):
    return _read_safetensors(path)[1]
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f'reading {path!r} needs PyTorch (pip install torch); '
                     'or pass the .safetensors file of the same weights'
                     ) from None
  try:
    state_dict = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'cannot read init_from {path!r} with torch.load: '
                     f'{_first_line(e)}') from None
  if not isinstance(state_dict, dict) or not all(
      isinstance(value, torch.Tensor) for value in state_dict.values()):
    raise ValueError(f'init_from {path!r} is not a state dict of tensors; '
                     'save model.state_dict() alone')
  return {key: value.float().numpy() for key, value in state_dict.items()}


def _read_safetensors(path: str) -> tuple[dict, dict]:
  """(metadata, {key: float32 array}) of a `.safetensors` file."""
  import safetensors  # pylint: disable=g-import-not-at-top
  try:
    # The flax framework reads bfloat16, which numpy does not know.
    with safetensors.safe_open(path, framework='flax') as f:
      return (f.metadata() or {},
              {key: _float32(f.get_tensor(key)) for key in f.keys()})
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'cannot read init_from {path!r} as safetensors: '
                     f'{_first_line(e)}') from None


def _safetensors_header(path: str) -> tuple[dict, set]:
  import safetensors  # pylint: disable=g-import-not-at-top
  try:
    with safetensors.safe_open(path, framework='flax') as f:
      return f.metadata() or {}, set(f.keys())
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'cannot read init_from {path!r} as safetensors: '
                     f'{_first_line(e)}') from None


def _float32(value) -> np.ndarray:
  """float32 numpy; numpy's bfloat16-less `.npz` stores bfloat16 as 2-byte
  void (as big_vision writes it)."""
  value = np.asarray(value)
  if value.dtype.kind == 'V' and value.dtype.itemsize == 2:
    value = value.view(jax.numpy.bfloat16)
  return value.astype(np.float32)


def _flatten(tree: dict, prefix: str = '') -> dict:
  """{'a/b/c': leaf} of nested dicts."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f'{prefix}{key}/'))
    else:
      flat[f'{prefix}{key}'] = _float32(value)
  return flat


def _dotted(path_keys) -> str:
  """'stages.0.first.conv1.kernel' of a jax key path (without `.value`)."""
  keys = [str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))))
          for k in path_keys]
  return '.'.join(keys[:-1] if keys and keys[-1] == 'value' else keys)


def _conv_kernel(value: np.ndarray) -> np.ndarray:
  """PyTorch's (out, in, height, width) as Flax's (height, width, in,
  out)."""
  return value.transpose(2, 3, 1, 0)


def _kind(torch_name: str) -> str:
  return 'kernel' if torch_name == 'weight' else 'bias'


def _is_square(n: int) -> bool:
  return n > 0 and math.isqrt(n) ** 2 == n


def _first_line(error: Exception) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _summarize(names: list) -> str:
  """Names with the layer numbers of their last numbered part folded:
  'blocks.{0-11}.attn.qkv.weight'."""
  groups = {}
  for name in names:
    parts = re.split(r'([./_])', name)
    numbered = [i for i, part in enumerate(parts) if part.isdigit()]
    if not numbered:
      groups.setdefault((name,), set())
      continue
    i = numbered[-1]
    groups.setdefault((''.join(parts[:i]), ''.join(parts[i + 1:])),
                      set()).add(int(parts[i]))
  rendered = []
  for pattern, numbers in groups.items():
    if not numbers:
      rendered.append(pattern[0])
    elif len(numbers) == 1:
      rendered.append(f'{pattern[0]}{numbers.pop()}{pattern[1]}')
    else:
      rendered.append(f'{pattern[0]}{{{_ranges(sorted(numbers))}}}'
                      f'{pattern[1]}')
  return ', '.join(rendered)


def _ranges(numbers: list) -> str:
  """'0-3,5' of sorted integers."""
  runs = []
  for n in numbers:
    if runs and n == runs[-1][1] + 1:
      runs[-1][1] = n
    else:
      runs.append([n, n])
  return ','.join(f'{a}-{b}' if b > a else f'{a}' for a, b in runs)
