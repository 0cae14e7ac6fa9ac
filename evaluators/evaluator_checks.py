"""Checks of `config.evals`, the named evaluators (evaluators/registry.py):
their settings before the run starts (`check_evaluators`, from
`config_values.validate_config`), their data as each is opened.

Each mistake is a ValueError of one line that names the fix;
`config_error.as_config_error` makes it a ConfigError.
"""

import numpy as np

from evaluators import evaluator_types

# How a folder's class folders name the training classes: sorted order
# (''), the class index ('index': ImageNet-v2's release), the class name.
CLASS_MAPS = ('', 'index', 'name')
FOLDER = 'folder:'


def evaluator_settings(name: str, settings) -> dict:
  """Evaluator `name`'s settings with the defaults of its type filled in;
  ValueError naming the fix for an unknown type or setting."""
  settings = dict(settings)
  kind = settings.pop('type', None)
  if kind not in evaluator_types.SETTINGS:
    raise ValueError(f'evals.{name}: unknown type {kind!r}; valid names: '
                     f'{", ".join(evaluator_types.SETTINGS)}')
  defaults = evaluator_types.SETTINGS[kind]
  unknown = sorted(set(settings) - set(defaults))
  if unknown:
    raise ValueError(f'evals.{name} ({kind}) has no setting {unknown[0]!r}; '
                     f'valid names: type, {", ".join(defaults)}')
  return {'type': kind, **defaults, **settings}


def check_evaluators(evals) -> None:
  """Raises ValueError, naming the fix, for `config.evals` settings no data
  set can use (the data-dependent checks follow when each is opened)."""
  filled = {}
  for name, settings in evals.items():
    settings = filled[name] = evaluator_settings(name, settings)
    if not (isinstance(settings['every_steps'], int) and
            settings['every_steps'] >= 0):
      raise ValueError(f'evals.{name}.every_steps must be >= 0 (0: with the '
                       'main evaluation, every eval_every_steps)')
    if settings['type'] == 'classification':
      check_classification(name, settings)
    elif settings['type'] == 'fewshot':
      check_fewshot(name, settings)
    else:
      check_knn(name, settings)
  check_tags(filled)


# The metrics behind the TensorBoard tags (evaluators/common.prefix names
# them eval_[ema_][NAME_]METRIC, fewshot_[ema_]KEY_<k>shot and
# knn_[ema_]KEY_top1): of the main
# evaluation and classification evaluators, of ReaL labels, and the main
# evaluation's with a teacher. A moving average's tags leave out the
# examples (the same ones) and the teacher's accuracy (the same teacher).
CLASSIFICATION_METRICS = ('loss', 'accuracy', 'top5_accuracy', 'examples')
REAL_METRICS = ('accuracy', 'top5_accuracy', 'examples')
TEACHER_METRICS = ('teacher_accuracy', 'teacher_agreement')
KNN_METRICS = ('top1', 'top5')
# Who writes a tag, and the name to change so that it does not (None: no
# name changes that tag).
MAIN_EVALUATION = ('the main evaluation', None)


def metric_tags(prefix: str, metrics: tuple) -> list[str]:
  """`prefix`ed tags of `metrics`, then those of the moving average."""
  moving = prefix.replace('eval_', 'eval_ema_', 1)
  return ([prefix + metric for metric in metrics] +
          [moving + metric for metric in metrics
           if metric not in ('examples', 'teacher_accuracy')])


def evaluator_tags(name: str, settings: dict) -> list[tuple[str, tuple]]:
  """(tag, (who writes it, the name that changes it)) of each TensorBoard
  tag evaluator `name` of `settings` (filled in) writes."""
  if settings['type'] == 'classification':
    writer = (f'evals.{name}', f'evals.{name}')
    metrics = (REAL_METRICS if settings['labels'] == 'real'
               else CLASSIFICATION_METRICS)
    return [(tag, writer) for tag in metric_tags(f'eval_{name}_', metrics)]
  if settings['type'] == 'knn':
    return [(f'knn_{ema}{key}_{metric}', data_set_writer(name, key))
            for key in settings['datasets'] for ema in ('', 'ema_')
            for metric in KNN_METRICS]
  seeds = range(settings['seed'], settings['seed'] + settings['num_seeds'])
  tags = []
  for key in [*settings['datasets'], 'mean']:
    writer = ((f'evals.{name}', None) if key == 'mean' else
              data_set_writer(name, key))
    for ema in ('', 'ema_'):
      for k in settings['shots']:
        tags.append((f'fewshot_{ema}{key}_{k}shot', writer))
        if key != 'mean' and len(seeds) > 1:
          tags += [(f'fewshot_{ema}{key}_{k}shot_seed{seed}', writer)
                   for seed in seeds]
  return tags


def data_set_writer(name: str, key: str) -> tuple[str, str]:
  """Who writes the tags of data set `key` of evaluator `name`, and the
  name that changes them."""
  return (f'evals.{name} (data set {key})', f'evals.{name}.datasets.{key}')


def check_tags(evals: dict) -> None:
  """Raises ValueError unless every TensorBoard tag has one writer among
  the main evaluation and `evals` (each evaluator's settings, filled in):
  a tag written twice would mix two curves in one."""
  writers = {tag: MAIN_EVALUATION for tag in
             metric_tags('eval_', CLASSIFICATION_METRICS + TEACHER_METRICS)}
  for name, settings in evals.items():
    for tag, writer in evaluator_tags(name, settings):
      first = writers.setdefault(tag, writer)
      if first == writer:
        continue
      renames = [w[1] for w in (first, writer) if w[1]]
      fix = ('rename ' + ' or '.join(renames) if renames else
             "list both evaluators' data sets in one of them, or give them "
             'different shots')
      raise ValueError(f'{first[0]} and {writer[0]} both write the '
                       f'TensorBoard tag {tag}; {fix}')


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


def check_data_sets(name: str, settings: dict) -> None:
  """The `datasets` of a few-shot or k-NN evaluator."""
  if not settings['datasets']:
    raise ValueError(f'evals.{name}.datasets is empty; map names to TFDS '
                     f'data sets or {FOLDER}PATH, e.g. {{"pets": '
                     '"oxford_iiit_pet"}')
  for key, spec in settings['datasets'].items():
    fewshot_splits(name, key, spec)


def check_fewshot(name: str, settings: dict) -> None:
  check_data_sets(name, settings)
  if not (isinstance(settings['num_seeds'], int) and
          settings['num_seeds'] >= 1):
    raise ValueError(f'evals.{name}.num_seeds must be a whole number >= 1 '
                     '(big_vision: 3)')
  shots = settings['shots']
  if not shots or any(not isinstance(k, int) or k < 1 for k in shots):
    raise ValueError(f'evals.{name}.shots {tuple(shots)} must be whole '
                     'numbers >= 1, e.g. (1, 5, 10, 25)')
  if not settings['l2_reg'] > 0:
    raise ValueError(f'evals.{name}.l2_reg must be > 0 (big_vision: 1024)')


def check_knn(name: str, settings: dict) -> None:
  check_data_sets(name, settings)
  if not (isinstance(settings['k'], int) and settings['k'] >= 1):
    raise ValueError(f'evals.{name}.k must be a whole number >= 1 (DINO: '
                     '20)')
  if not settings['temperature'] > 0:
    raise ValueError(f'evals.{name}.temperature must be > 0 (DINO: 0.07)')


def fewshot_splits(name: str, key: str, spec) -> tuple[str, str, str]:
  """(data set, training split, test split) of data set `key` of a
  few-shot or k-NN evaluator: a
  name (splits train and test; image folders: see
  `eval_splits.data_set_splits`) or such a triple."""
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


def training_class_counts(name: str, key: str, labels,
                          num_classes: int) -> np.ndarray:
  """The training examples of each class of few-shot data set `key`;
  ValueError for a class with none (no probe could ever predict it: the
  split leaves it out)."""
  counts = np.bincount(labels, minlength=num_classes)
  empty = np.flatnonzero(counts == 0)
  if empty.size:
    raise ValueError(
        f'evals.{name}: class {int(empty[0])} of {key} has no training '
        f'example ({empty.size} of its {num_classes} classes have none); use '
        'a training split that holds every class')
  return counts


def check_image_shapes(name: str, shapes: dict, model_shape: tuple) -> None:
  """Raises ValueError unless every few-shot split's images ({split:
  shape}) have the shape the model was built for."""
  for split, shape in shapes.items():
    if tuple(shape) != tuple(model_shape):
      raise ValueError(f'evals.{name}: {split} has images of shape {shape}, '
                       f'the model takes {model_shape}; use data sets of '
                       'its channels (the image size is the run\'s)')
