"""Checks of `config.evals`, the named evaluators (evaluators/registry.py):
their settings before the run starts (`check_evaluators`, from
`config_checks.validate_config`), their data as each is opened.

Each mistake is a ValueError of one line that names the fix;
`config_checks.as_config_error` makes it a ConfigError.
"""

import os

import numpy as np

from runtime import paths

# The settings of each evaluator type of `config.evals` and their defaults
# (README). Few-shot: big_vision's `configs/common_fewshot.py` values.
EVALUATOR_SETTINGS = {
    'classification': dict(dataset='', split='', class_map='', labels='',
                           real_labels_file='', every_steps=0),
    'fewshot': dict(datasets={}, shots=(1, 5, 10, 25), l2_reg=2.0**10,
                    seed=0, every_steps=0),
}
# How a folder's class folders name the training classes: sorted order
# (''), the class index ('index': ImageNet-v2's release), the class name.
CLASS_MAPS = ('', 'index', 'name')
FOLDER = 'folder:'


def evaluator_settings(name: str, settings) -> dict:
  """Evaluator `name`'s settings with the defaults of its type filled in;
  ValueError naming the fix for an unknown type or setting."""
  settings = dict(settings)
  kind = settings.pop('type', None)
  if kind not in EVALUATOR_SETTINGS:
    raise ValueError(f'evals.{name}: unknown type {kind!r}; valid names: '
                     f'{", ".join(EVALUATOR_SETTINGS)}')
  defaults = EVALUATOR_SETTINGS[kind]
  unknown = sorted(set(settings) - set(defaults))
  if unknown:
    raise ValueError(f'evals.{name} ({kind}) has no setting {unknown[0]!r}; '
                     f'valid names: type, {", ".join(defaults)}')
  return {'type': kind, **defaults, **settings}


def check_evaluators(evals) -> None:
  """Raises ValueError, naming the fix, for `config.evals` settings no data
  set can use (the data-dependent checks follow when each is opened)."""
  for name, settings in evals.items():
    settings = evaluator_settings(name, settings)
    if not (isinstance(settings['every_steps'], int) and
            settings['every_steps'] >= 0):
      raise ValueError(f'evals.{name}.every_steps must be >= 0 (0: with the '
                       'main evaluation, every eval_every_steps)')
    if settings['type'] == 'classification':
      check_classification(name, settings)
    else:
      check_fewshot(name, settings)


def check_classification(name: str, settings: dict) -> None:
  dataset = settings['dataset']
  if not dataset:
    raise ValueError(f'evals.{name}.dataset is not set; name a TFDS data '
                     f'set, digits, or {FOLDER}PATH')
  if settings['class_map'] not in CLASS_MAPS:
    raise ValueError(f'evals.{name}.class_map {settings["class_map"]!r}: '
                     "valid names: '' (sorted folder order), index, name")
  if settings['class_map'] and not dataset.startswith(FOLDER):
    raise ValueError(f'evals.{name}.class_map is for image folders; set it '
                     f"to '' for {dataset!r}")
  if settings['labels'] not in ('', 'real'):
    raise ValueError(f'evals.{name}.labels {settings["labels"]!r}: valid '
                     "names: '' (the data set's labels), real")
  if settings['labels'] == 'real':
    if not dataset.startswith(FOLDER):
      raise ValueError(f"evals.{name}: labels='real' reads ImageNet's "
                       f'validation images by file name; set dataset to '
                       f'{FOLDER}PATH (see docs/data.md)')
    if not os.path.isfile(settings['real_labels_file']):
      raise ValueError(f'evals.{name}.real_labels_file '
                       f'{settings["real_labels_file"]!r} is not a file; '
                       'point it at real.json (see docs/data.md)')


def check_fewshot(name: str, settings: dict) -> None:
  if not settings['datasets']:
    raise ValueError(f'evals.{name}.datasets is empty; map names to TFDS '
                     f'data sets or {FOLDER}PATH, e.g. {{"pets": '
                     '"oxford_iiit_pet"}')
  for key, spec in settings['datasets'].items():
    fewshot_splits(name, key, spec)
  shots = settings['shots']
  if not shots or any(not isinstance(k, int) or k < 1 for k in shots):
    raise ValueError(f'evals.{name}.shots {tuple(shots)} must be whole '
                     'numbers >= 1, e.g. (1, 5, 10, 25)')
  if not settings['l2_reg'] > 0:
    raise ValueError(f'evals.{name}.l2_reg must be > 0 (big_vision: 1024)')


def fewshot_splits(name: str, key: str, spec) -> tuple[str, str, str]:
  """(data set, training split, test split) of few-shot data set `key`: a
  name (splits train and test) or such a triple."""
  if key == 'mean':
    raise ValueError(f'evals.{name}.datasets: the name mean is the tags\' '
                     'mean over data sets; call the data set otherwise')
  if isinstance(spec, str):
    spec = (spec, 'train', 'test')
  if len(spec) != 3 or not all(isinstance(s, str) and s for s in spec):
    raise ValueError(f'evals.{name}.datasets.{key} {spec!r}: give a data '
                     'set name, or (name, training split, test split)')
  return tuple(spec)


def check_class_map(name: str, class_map: str, folders: list[str],
                    class_names: tuple) -> None:
  """Raises ValueError unless `class_map` maps every class folder to one of
  the model's classes (`class_names`, index by index)."""
  count = len(class_names)
  if class_map == 'index':
    bad = [f for f in folders if not (f.isdigit() and int(f) < count)]
    fix = f'folders named 0 to {count - 1} (the training class indices)'
  elif class_map == 'name':
    bad = [f for f in folders if f not in class_names]
    fix = ('folders named as the training classes (e.g. '
           f'{", ".join(class_names[:2])})')
  else:
    bad = [] if len(folders) == count else folders[count:] or ['(too few)']
    fix = f'{count} class folders (the training classes, in sorted order)'
  if bad:
    raise ValueError(f'evals.{name}: class_map {class_map!r} needs {fix}; '
                     f'these do not fit: {", ".join(bad[:5])}. Set class_map '
                     "to index, name or '' as the folders are named")


def check_real_labels(name: str, path: str, label_sets: list,
                      num_images: int, num_classes: int) -> None:
  """Raises ValueError unless `label_sets` (real.json) has one list of
  class indices per image of the split."""
  if len(label_sets) != num_images:
    raise ValueError(f'evals.{name}: {path} has {len(label_sets)} label sets '
                     f'for the {num_images} images of the split; use the '
                     'real.json of this validation set (50,000 for ImageNet)')
  if not all(isinstance(labels, list) and
             all(isinstance(l, int) and 0 <= l < num_classes for l in labels)
             for labels in label_sets):
    raise ValueError(f'evals.{name}: {path} holds entries that are not lists '
                     f'of class indices below {num_classes}; use real.json')


def check_shots(name: str, key: str, shots, labels, num_classes: int) -> None:
  """Raises ValueError when a class of few-shot data set `key`'s training
  split has fewer examples than the largest shot count."""
  counts = np.bincount(labels, minlength=num_classes)
  if max(shots) > counts.min():
    raise ValueError(
        f'evals.{name}: {max(shots)} shots, but class {int(counts.argmin())} '
        f'of {key} has {int(counts.min())} training examples; use shots of '
        f'at most {int(counts.min())} or a larger training split')


def check_image_shapes(name: str, shapes: dict, model_shape: tuple) -> None:
  """Raises ValueError unless every few-shot split's images ({split:
  shape}) have the shape the model was built for."""
  for split, shape in shapes.items():
    if tuple(shape) != tuple(model_shape):
      raise ValueError(f'evals.{name}: {split} has images of shape {shape}, '
                       f'the model takes {model_shape}; use data sets of '
                       'its channels (the image size is the run\'s)')
