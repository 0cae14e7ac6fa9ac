"""big_vision's ViT `.npz` files, and those of the older vit_jax code."""

import re

import numpy as np

from weights import records


def read_big_vision(path: str, target: dict) -> records.Weights:
  """big_vision's ViT `.npz` (also the older vit_jax names), with flat
  `Transformer/encoderblock_{i}` or scanned `Transformer/encoderblock`."""
  del target
  try:
    with np.load(path, allow_pickle=False) as npz:
      flat = {key: records.float32(npz[key]) for key in npz.files}
  except (OSError, ValueError) as e:
    raise ValueError(f'cannot read init_from {path!r} as a big_vision .npz: '
                     f'{records.first_line(e)}') from None
  for prefix in ('params/', 'opt/target/'):  # checkpoints with optimizer
    if any(key.startswith(prefix) for key in flat):
      flat = {key[len(prefix):]: value for key, value in flat.items()
              if key.startswith(prefix)}
      break
  return _big_vision_vit(_linen_numbering(flat))


def _big_vision_vit(flat: dict) -> records.Weights:
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
      arrays[records.POSEMB] = value
    elif key == 'cls':
      arrays['cls'] = value
    elif (layer := key.rpartition('/')[0]) in top:
      arrays[f'{top[layer]}.{key.rpartition("/")[2]}'] = value
    else:
      unmatched.append(key)
  records.separate_class_token_position(arrays)
  return records.Weights(arrays, 'a big_vision ViT', 'vit', {
      'vit_gelu': 'tanh', 'vit_pool': 'cls' if 'cls' in arrays else 'gap',
      'vit_posemb': 'learn' if records.POSEMB in arrays else 'sincos2d',
      'vit_pre_logits': 'pre_logits.kernel' in arrays}, unmatched)


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
