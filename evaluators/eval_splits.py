"""The splits the evaluators read, each opened as an evaluation data set
(`eval_batches` read it once, `eval_split_labels()` are its labels): a
split of a TFDS data set or of the digits, or image folders; for a
classification evaluator, image folders whose class folders name the
training classes in sorted order, by index or by name (`class_map`)."""

import numpy as np

from data import datasets
from data import folder_listing
from evaluators import evaluator_checks


def open_split(dataset: str, split: str, context, *, relabel=None,
               num_classes: int | None = None):
  """Split `split` of `dataset` (a TFDS name, digits, or `folder:PATH`,
  whose SPLIT folder holds the class folders) as an evaluation data set.
  Image folders are labelled by their class folders in sorted order, or by
  `relabel(listing)` (one label per file) for a model of `num_classes`
  classes (default: the folders')."""
  if not dataset.startswith(datasets.FOLDER_PREFIX):
    return datasets.open_split(dataset, split, context.preprocessing,
                               context.data_dir)
  from data import folder_pipeline  # pylint: disable=g-import-not-at-top
  listing = datasets.folder_split(dataset, split)
  if relabel is not None:
    listing = folder_listing.relabeled(listing, relabel(listing))
  return folder_pipeline.FolderSplit(listing, context.preprocessing,
                                     num_classes or len(listing.classes))


def classification_split(name: str, settings: dict, context):
  """The evaluation data set of classification evaluator `name`, its
  labels the model's: for image folders under `settings['class_map']`, or
  ReaL's evaluator's own (`labels='real'`: the folders' files are read by
  name, their class folders play no part)."""
  dataset, split = settings['dataset'], settings['split']
  num_classes = len(context.class_names)

  def relabel(listing):
    evaluator_checks.check_class_map(name, settings['class_map'],
                                     listing.classes, context.class_names)
    return model_labels(listing, settings['class_map'], context.class_names)
  data = open_split(dataset, split, context, num_classes=num_classes,
                    relabel=None if settings['labels'] == 'real' else relabel)
  if data.info.num_classes != num_classes:
    raise ValueError(f'evals.{name}: {dataset} has {data.info.num_classes} '
                     f'classes, the model {num_classes}; evaluate on a data '
                     'set of the training classes')
  return data


def data_set_splits(name: str, key: str, spec) -> tuple[str, str, str]:
  """(data set, training split, test split) of data set `key` of a
  few-shot or k-NN evaluator (`evaluator_checks.fewshot_splits`); image
  folders given alone split as every image folder data set does
  (`datasets.folder_split_names`)."""
  if isinstance(spec, str) and spec.startswith(datasets.FOLDER_PREFIX):
    spec = (spec, *datasets.folder_split_names(spec))
  return evaluator_checks.fewshot_splits(name, key, spec)


def train_and_test_splits(name: str, data_sets: dict, context) -> dict:
  """{key: (training split, test split, classes)} of evaluator `name`'s
  `datasets` setting (few-shot, k-NN), opened; refuses images of another
  shape than the model's."""
  splits = {}
  for key, spec in data_sets.items():
    dataset, train_split, test_split = data_set_splits(name, key, spec)
    train = open_split(dataset, train_split, context)
    splits[key] = (train, open_split(dataset, test_split, context),
                   train.info.num_classes)
  evaluator_checks.check_image_shapes(
      name, {f'{key} {role}': split.info.image_shape
             for key, (train, test, _) in splits.items()
             for role, split in (('train', train), ('test', test))},
      context.image_shape)
  return splits


def model_labels(listing, class_map: str, class_names: tuple) -> np.ndarray:
  """The model's label of each file of `listing` under `class_map`: its
  class folder's position in sorted order (''), its name as a number
  ('index'), or the index of its name among `class_names` ('name')."""
  if class_map == 'index':
    of_folder = [int(folder) for folder in listing.classes]
  elif class_map == 'name':
    of_folder = [class_names.index(folder) for folder in listing.classes]
  else:
    return listing.labels
  return np.asarray(of_folder, np.int32)[listing.labels]
