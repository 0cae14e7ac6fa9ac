"""Fitting read weights to a model: per-block names stacked as the model
holds them, then every name and shape checked, a ViT position embedding
resampled to the model's grid and a head of another class count started
from zeros. Every mismatch is one DoesNotFit (a ValueError) naming the fix.
"""

import math
import re

from flax import nnx
import jax
import numpy as np

from weights import records
import models

class DoesNotFit(ValueError):
  """Weights that do not fit the model. `fixes`: the config values the
  message names, which build a model they fit ({} when it names none)."""

  def __init__(self, message: str, fixes: dict):
    super().__init__(message)
    self.fixes = fixes


_FAMILY = {'resnet': 'ResNet', 'vit': 'ViT', 'convnext': 'ConvNeXt',
           'swin': 'Swin', 'regnet': 'RegNet'}


def model_shapes(model_or_states) -> dict:
  """{name: shape} of the parameters and BatchNorm statistics (what a file
  provides) of a model, or of its states."""
  return {name: tuple(variable.shape)
          for name, variable in named_variables(model_or_states).items()
          if isinstance(variable, (nnx.Param, nnx.BatchStat))}


def image_channels(shapes: dict) -> int:
  """The channels of the images a model of these parameter shapes
  ({name: shape}, as `model_shapes`) takes: its stem's or patch
  embedding's input channels."""
  return shapes.get('stem.kernel', shapes.get('patch_embed.kernel'))[2]


def named_variables(model_or_states) -> dict:
  states = (nnx.state(model_or_states)
            if isinstance(model_or_states, nnx.Module) else model_or_states)
  if not isinstance(states, (list, tuple)):
    states = [states]
  return {'.'.join(map(str, path)): variable
          for state in states for path, variable in nnx.to_flat_state(state)}


def scanned_layout(arrays: dict, family: str = 'resnet') -> dict:
  """Per-block names stacked as the model holds them, on a leading layer
  axis: a ResNet's (and a RegNet's) `stages.S.blocks.0` -> `stages.S.first`
  and `stages.S.blocks.1..` -> `stages.S.rest.layers`, a ConvNeXt's
  `stages.S.blocks.*` -> `stages.S.blocks.layers` (every block is in the
  stack), `encoder.blocks.*` -> `encoder.layers`."""
  laid_out, stacks = {}, {}
  for name, value in arrays.items():
    m = re.fullmatch(r'(stages\.\d+)\.blocks\.(\d+)\.(.+)', name)
    e = re.fullmatch(r'encoder\.blocks\.(\d+)\.(.+)', name)
    if m and family == 'swin':
      block = 'second' if int(m[2]) % 2 else 'first'
      stacks.setdefault(f'{m[1]}.blocks.layers.{block}.{m[3]}', {})[
          int(m[2]) // 2] = value
    elif m and family == 'convnext':
      stacks.setdefault(f'{m[1]}.blocks.layers.{m[3]}', {})[int(m[2])] = value
    elif m and m[2] == '0':
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


def unstacked_layout(arrays: dict) -> dict:
  """The inverse of `scanned_layout`: a model's stacked arrays as one entry
  per block (`stages.S.blocks.M.*`, `encoder.blocks.M.*`), as readers
  return them and published files hold them."""
  unstacked = {}
  for name, value in arrays.items():
    m = re.fullmatch(r'(stages\.\d+)\.(first|rest\.layers|blocks\.layers)'
                     r'\.(.+)', name)
    e = re.fullmatch(r'encoder\.layers\.(.+)', name)
    if m and m[2] == 'first':
      unstacked[f'{m[1]}.blocks.0.{m[3]}'] = value
    elif m and m[2] == 'rest.layers':
      for i, layer in enumerate(value):
        unstacked[f'{m[1]}.blocks.{i + 1}.{m[3]}'] = layer
    elif m and m[3].startswith(('first.', 'second.')):  # a Swin's pairs
      block, rest = m[3].split('.', 1)
      for i, layer in enumerate(value):
        unstacked[f'{m[1]}.blocks.{2 * i + (block == "second")}.{rest}'] = (
            layer)
    elif m:
      for i, layer in enumerate(value):
        unstacked[f'{m[1]}.blocks.{i}.{m[3]}'] = layer
    elif e:
      for i, layer in enumerate(value):
        unstacked[f'encoder.blocks.{i}.{e[1]}'] = layer
    else:
      unstacked[name] = value
  return unstacked


def fit(weights: records.Weights, target: dict, settings: dict,
        new_head: bool = True,
        fixed_depth: bool = False) -> tuple[dict, list]:
  """The arrays of `weights` for the model of `settings`
  (`models.settings`) of `target` shapes {name: shape}, and notes for the
  log. Raises ValueError, naming the fix, when they do not fit; also when
  the head does not and `new_head` is False. With `fixed_depth` the model's depth and width are not the
  caller's to set (a teacher's: its file's, or its model's standard ones),
  so a fix names only the model.

  A short pipeline, each step on the arrays the previous one left: the
  file's model family and conventions checked, blocks stacked, the position
  embedding resampled, the head kept or started anew, then every name and
  shape checked.
  """
  fix = lambda: _fix(weights, settings, fixed_depth)
  _check_family(weights, target, settings, fix)
  _check_conventions(weights, target, settings, fix)
  arrays = scanned_layout(weights.arrays, weights.family)
  notes = [_fit_posemb(arrays, target),
           _fit_relative_position_tables(arrays, target),
           _fit_head(arrays, target, weights, new_head)]
  _check_names(arrays, target, weights, settings, fix)
  _check_shapes(arrays, target, weights, settings, fix)
  return {name: np.asarray(value, np.float32)
          for name, value in arrays.items()}, notes


def _check_family(weights: records.Weights, target: dict, settings,
                  fix) -> None:
  """Refuses a model of another family, naming the model and every config
  value the file needs at once."""
  family = records.family_of(target)
  if weights.family != family:
    conventions = _convention_mismatches(weights, settings)[1]
    needed, fixes = fix()
    if conventions:
      needed += (f' {_flags(conventions)}' if fixes
                 else f'; and {_flags(conventions)}')
    raise DoesNotFit(
        f'init_from is {weights.source}, but '
        f'--config.model={settings["model"]} '
        f'is a {_FAMILY[family]}; {needed}', {**fixes, **conventions})


def _check_conventions(weights: records.Weights, target: dict, settings,
                       fix) -> None:
  """Refuses config values the weights do not compute with (padding, GELU,
  pooling, ...): they change no shape, so nothing else would notice. Every
  one in one line, with the model and depth when they do not fit either."""
  del fix  # the model's fix is part of this one's, when needed
  found, fixes, model_has = _convention_mismatches(weights, settings)
  if not found:
    return
  matching = _matching_model(weights, settings)
  depth = target.get('encoder.layers.ln1.scale', (0,))[0]
  if matching and matching[0] != settings['model'] or (
      matching and depth and matching[1] != depth):
    fixes = {**_model_values(*matching), **fixes}
  raise DoesNotFit(
      f'init_from is {weights.source} with {", ".join(found)}; set '
      f'{_flags(fixes)} (the model has {", ".join(model_has)})', fixes)


def _convention_mismatches(weights: records.Weights, settings
                           ) -> tuple[list, dict, list]:
  """(what the file computes with, the config values that set it, the
  model's values) of each config value the weights do not compute with."""
  found, fixes, model_has = [], {}, []
  for key, value in weights.conventions.items():
    if key in settings and settings[key] != value:
      found.append(f'{key}={value!r}')
      fixes[key] = value
      model_has.append(repr(settings[key]))
  for key, values in weights.choices.items():
    if key in settings and settings[key] not in values:
      found.append(f'{key} {" or ".join(map(repr, values))}')
      fixes[key] = values[0]
      model_has.append(repr(settings[key]))
  return found, fixes, model_has


def _fit_posemb(arrays: dict, target: dict) -> str:
  """Resamples (bicubic) a position embedding on a square grid to the
  model's grid, in place; a note, '' when nothing changed. Other shapes are
  left to the shape check."""
  posemb, shape = arrays.get(records.POSEMB), target.get(records.POSEMB)
  if posemb is None or shape is None or posemb.shape == shape:
    return ''
  old, new = posemb.shape[1], shape[1]
  if not (records.is_square(old) and records.is_square(new) and
          posemb.shape[2] == shape[2]):
    return ''
  arrays[records.POSEMB] = resample_posemb(posemb, math.isqrt(new))
  return (f'position embedding resampled from a {math.isqrt(old)}x'
          f'{math.isqrt(old)} to a {math.isqrt(new)}x{math.isqrt(new)} grid')


def _fit_relative_position_tables(arrays: dict, target: dict) -> str:
  """Resizes a Swin's relative position bias tables of another window to
  the model's window, in place; a note, '' when nothing changed. Other
  shapes are left to the shape check."""
  resized = set()
  for name, shape in target.items():
    table = arrays.get(name)
    if (not name.endswith('relative_position_bias_table') or table is None
        or table.shape == shape or table.shape[:-2] != shape[:-2]
        or table.shape[-1] != shape[-1]):
      continue
    old, new = table.shape[-2], shape[-2]
    if not (records.is_square(old) and records.is_square(new)):
      continue
    arrays[name] = resize_relative_position_table(table, math.isqrt(new))
    resized.add((math.isqrt(old) + 1) // 2)
    window = (math.isqrt(new) + 1) // 2
  if not resized:
    return ''
  return (f'relative position bias tables resized from window '
          f'{", ".join(map(str, sorted(resized)))} to {window}')


def resize_relative_position_table(table: np.ndarray, size: int
                                   ) -> np.ndarray:
  """(..., n*n, heads) tables of relative positions -(n-1)/2 .. (n-1)/2 on
  each axis -> (..., size*size, heads), as BEiT and timm's
  `resize_rel_pos_bias_table` resize them: the old offsets spread over the
  new range along a geometric progression (so the small offsets keep
  their spacing), then linear interpolation at the new integer offsets,
  the nearest edge beyond them."""
  n = math.isqrt(table.shape[-2])
  weights = _offset_interpolation(n, size)
  grid = table.reshape(*table.shape[:-2], n, n, table.shape[-1])
  resized = np.einsum('yi,xj,...ijh->...yxh', weights, weights, grid)
  return resized.reshape(*table.shape[:-2], size * size,
                         table.shape[-1]).astype(np.float32)


def _offset_interpolation(old: int, new: int) -> np.ndarray:
  """(new, old) linear interpolation weights from `old` offsets placed
  along BEiT's geometric progression to `new` integer offsets."""
  half = old // 2
  low, high = 1.01, 1.5  # the ratio, found by bisection
  while high - low > 1e-6:
    ratio = (low + high) / 2
    if (1 - ratio ** half) / (1 - ratio) > new // 2:
      high = ratio
    else:
      low = ratio
  steps = np.cumsum([1.0] + [ratio ** (i + 1) for i in range(half - 1)])
  offsets = np.concatenate([-steps[::-1], [0.0], steps])
  targets = np.arange(-(new // 2), new // 2 + 0.1)
  return np.stack([np.interp(targets, offsets, unit)
                   for unit in np.eye(old)], axis=1)


def _fit_head(arrays: dict, target: dict, weights: records.Weights,
              new_head: bool) -> str:
  """Starts a head that does not fit the model from zeros, in place, with
  `new_head`; refuses it without. A note, '' when the head fits."""
  head = [name for name in target if name.startswith(records.HEAD)]
  if all(name in arrays and arrays[name].shape == target[name]
         for name in head):
    return ''
  found = arrays.get('head.bias')
  if weights.head_is:
    classes = (f"the file's head is {weights.head_is} "
               f'({found.shape[0]} wide), no classifier; the model has '
               f'{target["head.bias"][0]} classes')
  else:
    classes = (f'the file has {found.shape[0] if found is not None else "no"}'
               f' classes, the model {target["head.bias"][0]}')
  if not new_head:
    if found is not None and found.shape[0] == target['head.bias'][0]:
      return ''  # the classes fit: other widths are the shape check's
    raise ValueError(f'init_from ({weights.source}) does not fit the data '
                     f'set: {classes}; evaluate on the data set it was '
                     'trained on (--config.dataset)')
  # Zeros, as transfer recipes start a new head (BiT, ViT): the first
  # logits are all equal instead of random projections of pretrained
  # features.
  for name in head:
    arrays[name] = np.zeros(target[name], np.float32)
  return f'head re-initialised to zeros: {classes}'


def _check_names(arrays: dict, target: dict, weights: records.Weights,
                 settings, fix) -> None:
  missing = [name for name in target if name not in arrays
             and not name.startswith(records.ADDED_LAYERS)]
  unexpected = weights.unmatched + [name for name in arrays
                                    if name not in target]
  if missing or unexpected:
    needed, fixes = fix()
    raise DoesNotFit(
        f'init_from ({weights.source}) does not fit --config.model='
        f'{settings["model"]}: '
        + '; '.join(f'{what} {_summarize(names)}' for what, names in (
            ('missing in the file:', missing),
            ('not in the model:', unexpected)) if names)
        + f'; {needed}', fixes)


def _check_shapes(arrays: dict, target: dict, weights: records.Weights,
                  settings, fix) -> None:
  wrong = [f'{name} {arrays[name].shape} (model {target[name]})'
           for name in sorted(arrays) if arrays[name].shape != target[name]]
  if wrong:
    needed, fixes = fix()
    raise DoesNotFit(
        f'init_from ({weights.source}) has other shapes than --config.model='
        f'{settings["model"]}: {", ".join(wrong)}; {needed}', fixes)


def resample_posemb(posemb: np.ndarray, grid: int) -> np.ndarray:
  """(1, n*n, width) on an n x n grid -> (1, grid*grid, width), bicubic."""
  n, width = math.isqrt(posemb.shape[1]), posemb.shape[2]
  resized = jax.image.resize(posemb.reshape(n, n, width),
                             (grid, grid, width), method='bicubic')
  return np.asarray(resized, np.float32).reshape(1, grid * grid, width)


def _fix(weights: records.Weights, settings,
         fixed_depth: bool) -> tuple[str, dict]:
  """(what to do, the config values it names) to build the file's model;
  with `fixed_depth` (see `fit`), naming only the model."""
  if fixed_depth:
    return _fixed_depth_fix(weights, settings)
  found = (weights.suggestion or
           _model_values(*(_matching_model(weights, settings) or ('', 0))))
  if found:
    return f'its model needs {_flags(found)}', found
  return ('choose the --config.model (and num_layers) the file was trained '
          'as', {})


def _fixed_depth_fix(weights: records.Weights, settings) -> tuple[str, dict]:
  """The fix naming only the model: this project's files record it (their
  depth and width follow), a published file's model must fit at its
  standard depth."""
  recorded = weights.conventions.get('model')
  found = ((recorded, 0) if recorded else
           _matching_model(weights, settings, standard_depth=True))
  if found:
    fixes = _model_values(found[0], 0)
    return f'its model needs {_flags(fixes)}', fixes
  other_depth = _matching_model(weights, settings)
  if other_depth:
    name, depth = other_depth
    return (f'the file holds a {name} of {depth} layers, and this model is '
            f'built at its standard depth; pass a file of {name} (or of '
            'another model) at its standard depth', {})
  return ('choose the --config.model the file was trained as, of a file at '
          "that model's standard depth", {})


def _model_values(name: str, depth: int) -> dict:
  """{'model': name, 'num_layers': depth} ({} without a name; the model's
  own depth, num_layers 0, left out)."""
  if not name:
    return {}
  return {'model': name, **({'num_layers': depth} if depth else {})}


def _flags(values: dict) -> str:
  """'--config.KEY=VALUE ...' of `values`."""
  return ' '.join(f'--config.{key}={value}' for key, value in values.items())


def _matching_model(weights: records.Weights, settings,
                    standard_depth: bool = False) -> tuple[str, int] | None:
  """(name, num_layers) of the first model whose names and shapes, head
  and position embedding aside, the file's arrays fit: at the file's
  depth, or with `standard_depth` at the model's own (num_layers 0)."""
  try:
    arrays = scanned_layout(weights.arrays, weights.family)
  except ValueError:
    return None
  stem = arrays.get('stem.kernel', arrays.get('patch_embed.kernel'))
  if stem is None:
    return None
  depth = arrays.get('encoder.layers.ln1.scale', np.zeros((0,))).shape[0]
  if standard_depth:
    depth = 0
  comparable = lambda shapes: {n: _without_heads(n, s)
                               for n, s in shapes.items()
                               if not n.startswith(records.HEAD)
                               and n != records.POSEMB}
  found = comparable({n: a.shape for n, a in arrays.items()})
  for name in models.MODEL_NAMES:
    if models.family(name) != weights.family:
      continue
    candidate = {**settings, **weights.conventions, 'model': name,
                 'num_layers': depth}
    try:
      shapes = model_shapes(nnx.eval_shape(lambda c=candidate: (
          models.create_model(c['model'], 2, stem.shape[2],
                              rngs=nnx.Rngs(0), **models.options(c)))))
    except (ValueError, AttributeError):
      continue
    if comparable(shapes) == found:
      return name, depth
  return None


def _without_heads(name: str, shape: tuple) -> tuple:
  """An attention array's shape with (heads, head_dim) as one axis: a
  file's fused heads were split by the model's head count."""
  if '.attention.' not in name:
    return shape
  if name.endswith('out.kernel'):  # (..., heads, head_dim, width)
    return (*shape[:-3], shape[-3] * shape[-2], shape[-1])
  return (*shape[:-2], shape[-2] * shape[-1])


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
