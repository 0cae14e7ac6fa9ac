"""Checkpoints of the Flax ImageNet example's Linen ResNet."""

import re

from weights import records


def read_flax_imagenet(path: str, target: dict) -> records.Weights:
  """A checkpoint of the Flax ImageNet example (Linen ResNet; msgpack file
  or orbax directory `checkpoint_N`, or the workdir holding them)."""
  del target
  from flax.training import checkpoints  # pylint: disable=g-import-not-at-top
  try:
    restored = checkpoints.restore_checkpoint(path, target=None)
  except Exception as e:  # pylint: disable=broad-except
    # msgpack, orbax and the file system each raise their own types.
    raise ValueError(f'cannot read init_from {path!r} as a Flax ImageNet '
                     f'checkpoint: {records.first_line(e)}') from None
  if not isinstance(restored, dict) or 'params' not in restored:
    raise ValueError(f'init_from {path!r} holds no Flax ImageNet checkpoint '
                     '(no params); pass a checkpoint_N or the workdir with '
                     'them')
  return _flax_resnet(records.flatten(restored['params']),
                      records.flatten(restored.get('batch_stats') or {}))


def _flax_resnet(params: dict, batch_stats: dict) -> records.Weights:
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
  return records.Weights(arrays, 'a Flax ImageNet example ResNet',
                         'resnet', {'resnet_padding': 'same'}, unmatched)


def _flax_resnet_layer(name: str, inside_block: bool) -> str | None:
  """This project's name of a Linen ResNet layer, or None."""
  if not inside_block:
    return {'conv_init': 'stem', 'bn_init': 'stem_bn',
            'Dense_0': 'head'}.get(name)
  m = re.fullmatch(r'(Conv|BatchNorm)_(\d)', name)
  if m:  # Linen counts from 0, the blocks here from 1
    return f'{"conv" if m[1] == "Conv" else "bn"}{int(m[2]) + 1}'
  return {'conv_proj': 'proj', 'norm_proj': 'proj_bn'}.get(name)
