"""The data sets: scikit-learn's digits in memory, synthetic batches, TFDS
data sets (`tfds_pipeline.py`; what TFDS knows of them before a read:
`tfds_catalog.py`) and image folders (`folder_pipeline.py`), each an
`input_pipeline.Dataset`.

`create_dataset` opens the one an `input_pipeline.DataSource` names;
`missing_data` says whether a data set is where a run reads it, without
opening it;
`label_names` and `eval_image_file` say how each names its classes and
reads one image file.
"""

import contextlib
import functools
import gzip
import importlib.util
import io
import itertools
import os
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from data import folder_listing
from input_pipeline import DataSource
from input_pipeline import DatasetInfo
from input_pipeline import Preprocessing
from input_pipeline import process_rows
from input_pipeline import to_global
from input_pipeline import train_indices
from runtime import paths

DIGITS = 'digits'
FAKE = 'fake'
# The digits 0 to 4 alone (5 classes): a small target for fine-tuning a
# model trained on all ten.
DIGITS_0TO4 = 'digits_0to4'
DATASET_NAMES = (DIGITS, FAKE, DIGITS_0TO4)
# The data sets whose images have one size, which no preprocessing changes.
FIXED_IMAGE_SIZES = {DIGITS: 8, DIGITS_0TO4: 8}
# `folder:PATH`: image folders PATH/train/<class>/, PATH/val/<class>/.
FOLDER_PREFIX = 'folder:'

# scikit-learn's 1,797 8x8 digits; this many, drawn once with a fixed seed,
# are held out for evaluation.
_DIGITS_EVAL_EXAMPLES = 360


class ArrayDataset:
  """A data set held in memory: images (N, H, W, C) and labels (N,)."""

  def __init__(self, train_images, train_labels, eval_images, eval_labels,
               num_classes):
    self.train_images, self.train_labels = train_images, train_labels
    self.eval_images, self.eval_labels = eval_images, eval_labels
    self.info = DatasetInfo(num_classes, train_images.shape[1:],
                            len(train_labels), len(eval_labels),
                            numbered_classes(num_classes))

  def skipped(self) -> dict:
    return {}  # nothing read from files

  def eval_split_labels(self) -> np.ndarray:
    """The labels of the split `eval_batches` reads, in its order."""
    return self.eval_labels

  def train_batches(self, batch_size: int, seed: int, start_step: int,
                    sharding, dtype, repeats: int = 1) -> Iterator[dict]:
    """Global training batches from step `start_step` on, forever (no
    augmentation: an example's `repeats` copies are alike)."""
    rows = process_rows(batch_size, sharding)
    step = start_step
    while True:
      index = train_indices(len(self.train_labels), batch_size, seed,
                            step, repeats)[rows]
      yield to_global({'image': self.train_images[index].astype(dtype),
                        'label': self.train_labels[index]}, sharding)
      step += 1

  def eval_batches(self, batch_size: int, sharding, dtype) -> Iterator[dict]:
    """The held-out split exactly once; the last batch padded and masked."""
    # Not CLU's pad_dataset: that pads tf.data pipelines, and these arrays
    # are served without TensorFlow.
    num = len(self.eval_labels)
    rows = process_rows(batch_size, sharding)
    for start in range(0, num, batch_size):
      index = np.arange(start, start + batch_size)
      mask = index < num
      index = np.where(mask, index, 0)[rows]
      yield to_global({'image': self.eval_images[index].astype(dtype),
                        'label': self.eval_labels[index],
                        'index': index.astype(np.int32),
                        'mask': mask[rows]}, sharding)


class FakeDataset:
  """One synthetic batch made on device, repeated: measures the model alone.

  ImageNet-shaped (1000 classes, RGB, `image_size`); its evaluation
  is `steps_per_eval` batches (one if the whole split is asked for).
  """

  def __init__(self, image_size: int, steps_per_eval: int):
    self.info = DatasetInfo(1000, (image_size, image_size, 3), 1_281_167,
                            50_000, numbered_classes(1000))
    self._eval_steps = max(steps_per_eval, 1)

  def skipped(self) -> dict:
    return {}  # nothing read from files

  def _batch(self, batch_size, sharding, dtype, with_mask=False):
    shape = (batch_size, *self.info.image_shape)
    num_classes = self.info.num_classes

    def make(key):
      batch = {'image': jax.random.normal(key, shape, dtype),
               'label': jax.random.randint(key, (batch_size,), 0,
                                           num_classes)}
      if with_mask:
        batch['mask'] = jnp.ones((batch_size,), bool)
        batch['index'] = jnp.arange(batch_size)
      return batch
    return jax.jit(make, out_shardings=sharding)(jax.random.key(0))

  def train_batches(self, batch_size, seed, start_step, sharding, dtype,
                    repeats=1):
    del seed, start_step, repeats  # every step sees the same batch
    return itertools.repeat(self._batch(batch_size, sharding, dtype))

  def eval_batches(self, batch_size, sharding, dtype):
    batch = self._batch(batch_size, sharding, dtype, with_mask=True)
    return itertools.repeat(batch, self._eval_steps)


class ShapesDataset:
  """A data set of shapes alone: its batches are `jax.ShapeDtypeStruct`s
  placed as the run's batches, all that compiling a run's programs needs
  of its data (`--mode=compile`); `eval_extras` are more int32 keys of an
  evaluation batch (a teacher's `teacher_top1`)."""

  def __init__(self, info: DatasetInfo, eval_extras: tuple = ()):
    self.info = info
    self._eval_extras = eval_extras

  def skipped(self) -> dict:
    return {}

  def _batch(self, batch_size, sharding, dtype, keys) -> dict:
    shapes = {'image': ((batch_size, *self.info.image_shape), dtype),
              'label': ((batch_size,), jnp.int32),
              'index': ((batch_size,), jnp.int32),
              'mask': ((batch_size,), jnp.bool_)}
    shapes.update({key: ((batch_size,), jnp.int32)
                   for key in self._eval_extras})
    return {key: jax.ShapeDtypeStruct(*shapes[key], sharding=sharding)
            for key in keys}

  def train_batches(self, batch_size, seed, start_step, sharding, dtype,
                    repeats=1):
    del seed, start_step, repeats  # shapes alone
    return itertools.repeat(self._batch(batch_size, sharding, dtype,
                                        ('image', 'label')))

  def eval_batches(self, batch_size, sharding, dtype):
    return iter([self._batch(batch_size, sharding, dtype,
                             ('image', 'label', 'index', 'mask',
                              *self._eval_extras))])


def described(source: DataSource) -> DatasetInfo:
  """What `source.dataset` is without reading an example: its classes and
  the model's input shape (no example counts), for compiling alone; a
  TFDS data set need not be prepared, image folders need their train/
  class folders."""
  size = source.preprocessing.image_size
  if source.dataset in DATASET_NAMES:
    return create_dataset(source).info  # in memory, or made up
  if source.dataset.startswith(FOLDER_PREFIX):
    train, _ = folder_listing.split_directories(folder_root(source.dataset))
    names = tuple(name for name in paths.subdirectories(train)
                  if not name.startswith('.'))
    return DatasetInfo(len(names), (size, size, 3), 0, 0, names)
  from data import tfds_catalog  # pylint: disable=g-import-not-at-top
  with _tfds_name(source.dataset):
    return tfds_catalog.described(source.dataset,
                                  tfds_data_dir(source.data_dir), size)


def create_dataset(source: DataSource):
  """The data set `source.dataset` names: digits (all ten or 0-4), fake,
  image folders (`folder:PATH`) or a TFDS name."""
  if source.dataset == DIGITS:
    return load_digits()
  if source.dataset == DIGITS_0TO4:
    return load_digits(num_classes=5)
  if source.dataset == FAKE:
    return FakeDataset(source.preprocessing.image_size,
                       source.steps_per_eval)
  # TensorFlow only when image files are read: the models and the compiled
  # steps run without it (e.g. benchmarks on an accelerator host).
  if source.dataset.startswith(FOLDER_PREFIX):
    from data import folder_pipeline  # pylint: disable=g-import-not-at-top
    return folder_pipeline.ImageFolderDataset(
        folder_root(source.dataset), source.preprocessing)
  from data import tfds_pipeline  # pylint: disable=g-import-not-at-top
  with _tfds_name(source.dataset):
    return tfds_pipeline.TfdsDataset(
        source.dataset, tfds_data_dir(source.data_dir), source.preprocessing,
        train_split=source.train_split, eval_split=source.eval_split)


def open_split(dataset: str, split: str, preprocessing: Preprocessing,
               data_dir: str = ''):
  """Split `split` of `dataset` (digits, a TFDS name) as an evaluation
  data set: `eval_batches` read it once, `eval_split_labels()` are its
  labels by position (a training split's too, for the few-shot probes). '' is the held-out split: digits' own, TFDS's 'validation'
  (else 'test'). Image folders: see `folder_split`."""
  if dataset in (DIGITS, DIGITS_0TO4):
    if split not in ('', 'train', 'test', 'validation'):
      raise ValueError(f'split {split!r} of {dataset}: use train or test')
    digits = load_digits(num_classes=5 if dataset == DIGITS_0TO4 else 10)
    if split == 'train':
      return ArrayDataset(digits.train_images, digits.train_labels,
                          digits.train_images, digits.train_labels,
                          digits.info.num_classes)
    return digits
  if dataset == FAKE or dataset.startswith(FOLDER_PREFIX):
    raise ValueError(f'dataset {dataset!r} has no split to open here')
  from data import tfds_pipeline  # pylint: disable=g-import-not-at-top
  with _tfds_name(dataset):
    return tfds_pipeline.TfdsDataset(
        dataset, tfds_data_dir(data_dir),
        preprocessing, train_split=split or 'train', eval_split=split)


def folder_split(dataset: str, split: str):
  """The listing of `folder:PATH`'s split: the class folders of
  PATH/SPLIT, or of PATH itself when `split` is ''."""
  if absent := missing_folders(dataset, (split,)):
    raise ValueError(f'dataset {dataset!r}: {absent}')
  root = os.path.expanduser(dataset[len(FOLDER_PREFIX):])
  return folder_listing.list_split(os.path.join(root, split) if split
                                   else root)


def missing_data(key: str, dataset: str, data_dir: str,
                 folders: tuple | None = None) -> str | None:
  """None when data set `dataset` (config key `key`) is where the run
  reads it, else one clause without ';' naming the key and how to prepare
  it: a TFDS data set prepared in `data_dir` ('': $TFDS_DATA_DIR, else
  TFDS's default), image folders with the split folders `folders` (None:
  train/ and an evaluation folder, the rule of every image folder data
  set), nothing for the digits and fake data."""
  if dataset in DATASET_NAMES:
    return None
  if dataset.startswith(FOLDER_PREFIX):
    absent = missing_folders(dataset, folders)
    return absent and (f'{key} {dataset}: {absent}, or set --config.{key} '
                       f'to the {FOLDER_PREFIX}PATH where they are')
  from data import tfds_catalog  # pylint: disable=g-import-not-at-top
  with _tfds_name(dataset):
    absent = tfds_catalog.missing(dataset, tfds_data_dir(data_dir))
  return absent and f'{key} {dataset} is {absent}'


def missing_folders(dataset: str, folders: tuple | None) -> str | None:
  """None when `folder:PATH` has the split folders `folders` (a split ''
  is PATH itself; None: train/ and an evaluation folder), else what is
  missing and how to lay it out."""
  root = os.path.expanduser(dataset[len(FOLDER_PREFIX):])
  if folders is None:
    try:
      folder_listing.split_directories(root)
    except ValueError as e:
      return str(e)
    return None
  for split in folders:
    directory = os.path.join(root, split) if split else root
    if not paths.path(directory).is_dir():
      return (f'folder {directory!r} does not exist: put the images there, '
              f'one folder per class ({os.path.join(directory, "<class>")}/)')
  return None


def folder_split_names(dataset: str) -> tuple[str, str]:
  """The (training, evaluation) folder names of `folder:PATH` by the rule
  of every image folder data set (`folder_listing.split_directories`:
  train/ and the first of val/, validation/, test/)."""
  root = os.path.expanduser(dataset[len(FOLDER_PREFIX):])
  return tuple(os.path.basename(directory) for directory in
               folder_listing.split_directories(root))


def folder_root(dataset: str) -> str:
  """PATH of `dataset` = 'folder:PATH' (~ expanded)."""
  root = dataset[len(FOLDER_PREFIX):]
  if not root:
    raise ValueError(f"dataset {dataset!r} names no folder; pass "
                     f"--config.dataset={FOLDER_PREFIX}PATH")
  return os.path.expanduser(root)


def numbered_classes(num_classes: int) -> tuple:
  """'0', '1', ...: the class names of data sets whose classes are
  numbers (the digits themselves, for the digits)."""
  return tuple(str(i) for i in range(num_classes))


def label_names(dataset: str, data_dir: str) -> list[str]:
  """The class names of `dataset` (TFDS's in `data_dir`), index by index,
  read from the data set (checkpoints keep their own:
  `checkpointing.class_names`)."""
  if dataset == DIGITS:
    return list(numbered_classes(10))
  if dataset == DIGITS_0TO4:
    return list(numbered_classes(5))
  if dataset == FAKE:
    return list(numbered_classes(1000))
  if dataset.startswith(FOLDER_PREFIX):
    train_dir, _ = folder_listing.split_directories(folder_root(dataset))
    return folder_listing.list_split(train_dir).classes
  from data import tfds_catalog  # pylint: disable=g-import-not-at-top
  with _tfds_name(dataset):
    return tfds_catalog.label_names(dataset, tfds_data_dir(data_dir))


def tfds_data_dir(data_dir: str):
  """Where TFDS data sets are read: `data_dir`, else $TFDS_DATA_DIR, else
  (None) TFDS's default."""
  return data_dir or os.environ.get('TFDS_DATA_DIR') or None


@contextlib.contextmanager
def _tfds_name(name: str):
  """A name TFDS does not know, as the error that lists every valid one."""
  from data import tfds_catalog  # pylint: disable=g-import-not-at-top
  try:
    yield
  except tfds_catalog.UnknownDatasetError as e:
    raise ValueError(f'unknown dataset {name!r}; valid names: '
                     f'{", ".join(DATASET_NAMES)}, {FOLDER_PREFIX}PATH (image '
                     f'folders), or {e}') from None


def eval_image_file(source: DataSource, path: str, channels: int,
                    dtype) -> np.ndarray:
  """The image file at `path` (any format and size) as the model trained on
  `source` sees it in evaluation, in `dtype` (the compute dtype): the
  evaluation preprocessing of the image data sets, or, for the digits, an
  8x8 digit on their scale."""
  if not os.path.isfile(path):
    raise ValueError(f'image {path!r} not found')
  with open(path, 'rb') as f:
    data = f.read()
  try:
    if source.dataset in (DIGITS, DIGITS_0TO4):
      return digit_image(data).astype(dtype)
    from data import image_preprocessing  # pylint: disable=g-import-not-at-top
    return image_preprocessing.eval_image_file(
        data, source.preprocessing, channels, dtype)
  except ValueError as e:
    raise ValueError(f'image {path!r}: {e}') from None


def digit_image(data: bytes) -> np.ndarray:
  """An image file's bytes as one of scikit-learn's digits (8, 8, 1),
  normalised as `load_digits` does.

  The digits are light ink (16) on a dark ground (0), the digit filling
  the square. So: grey, inverted if the border is light (dark ink on
  paper), padded with its ground to a square, area-averaged to 8x8, scaled
  to 0-16. Draw the digit filling the image, as the digits do.
  """
  import PIL.Image  # pylint: disable=g-import-not-at-top
  try:
    image = PIL.Image.open(io.BytesIO(data))
    grey = np.asarray(image.convert('L'), np.float32) / 255.0
  except (OSError, SyntaxError, ValueError) as e:
    raise ValueError(f'not an image Pillow decodes ({e})') from None
  border = np.concatenate([grey[0], grey[-1], grey[:, 0], grey[:, -1]])
  ink = 1.0 - grey if border.mean() > 0.5 else grey
  height, width = ink.shape
  side = max(height, width)
  square = np.zeros((side, side), np.float32)
  square[(side - height) // 2:(side - height) // 2 + height,
         (side - width) // 2:(side - width) // 2 + width] = ink
  digit = np.asarray(PIL.Image.fromarray(square).resize(
      (8, 8), PIL.Image.Resampling.BOX), np.float32) * 16.0
  mean, std = _digits_normalization()
  return ((digit[..., None] / 16.0 - mean) / std).astype(np.float32)


def _digits_split(num_labels: int):
  """(training, held-out) indices of the digits: the same for every caller."""
  order = np.random.default_rng(0).permutation(num_labels)
  return order[:-_DIGITS_EVAL_EXAMPLES], order[-_DIGITS_EVAL_EXAMPLES:]


@functools.cache
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
  """(images 0-16 as (1797, 8, 8) float64, labels) of the digits file that
  scikit-learn ships, read as its `load_digits` reads it. Found without
  importing scikit-learn, whose import (SciPy's statistics with it) would
  cost every launch about two seconds."""
  spec = importlib.util.find_spec('sklearn')
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError("the 'digits' data set ships with "
                              'scikit-learn: pip install -r requirements.txt')
  path = os.path.join(spec.submodule_search_locations[0], 'datasets', 'data',
                      'digits.csv.gz')
  with gzip.open(path, 'rt', encoding='utf-8') as f:
    rows = np.loadtxt(f, delimiter=',')
  return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(np.int32)


@functools.cache
def _digits_normalization() -> tuple[float, float]:
  """(mean, standard deviation) of the training digits' pixels on 0-1."""
  images = _digits_arrays()[0].astype(np.float32) / 16.0
  train, _ = _digits_split(len(images))
  return images[train].mean(), images[train].std()


def load_digits(num_classes: int = 10) -> ArrayDataset:
  """scikit-learn's bundled digits, normalised, with a fixed held-out split;
  the digits below `num_classes` only, normalised and split as in the
  whole set (so each image has the same pixels in both)."""
  digit_images, labels = _digits_arrays()
  images = digit_images.astype(np.float32)[..., None] / 16.0
  train, held_out = _digits_split(len(labels))
  mean, std = _digits_normalization()
  images = (images - mean) / std
  train = train[labels[train] < num_classes]
  held_out = held_out[labels[held_out] < num_classes]
  return ArrayDataset(images[train], labels[train], images[held_out],
                      labels[held_out], num_classes=num_classes)
