"""The data a classification evaluator reads: a split of a TFDS data set or
of the digits, or image folders whose class folders name the training
classes in sorted order, by index or by name (`class_map`)."""

import numpy as np

from data import datasets
from data import folder_listing
from training import evaluator_checks


def classification_data(name: str, settings: dict, context):
  """The evaluation data set of classification evaluator `name`, its
  labels the model's: for image folders under `settings['class_map']`, or
  ReaL's evaluator's own (`labels='real'`: the folders' files are read by
  name, their class folders play no part)."""
  dataset, split = settings['dataset'], settings['split']
  num_classes = len(context.class_names)
  if dataset.startswith(datasets.FOLDER_PREFIX):
    from data import folder_pipeline  # pylint: disable=g-import-not-at-top
    listing = datasets.folder_split(dataset, split)
    if settings['labels'] != 'real':
      evaluator_checks.check_class_map(name, settings['class_map'],
                                    listing.classes, context.class_names)
      listing = folder_listing.relabeled(listing, model_labels(
          listing, settings['class_map'], context.class_names))
    return folder_pipeline.FolderSplit(listing, context.preprocessing,
                                       num_classes)
  data = datasets.open_split(dataset, split, context.preprocessing,
                             context.data_dir)
  if data.info.num_classes != num_classes:
    raise ValueError(f'evals.{name}: {dataset} has {data.info.num_classes} '
                     f'classes, the model {num_classes}; evaluate on a data '
                     'set of the training classes')
  return data


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
