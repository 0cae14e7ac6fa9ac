"""The data sets: scikit-learn's digits in memory, synthetic batches, and
TFDS data sets (`tfds_pipeline.py`), each an `input_pipeline.Dataset`.

`create_dataset` maps `config.dataset` to one of them.
"""

import contextlib
import itertools
import os
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from input_pipeline import DatasetInfo
from input_pipeline import Preprocessing
from input_pipeline import process_rows
from input_pipeline import steps_per_epoch
from input_pipeline import to_global

DIGITS = 'digits'
FAKE = 'fake'
# The digits 0 to 4 alone (5 classes): a small target for fine-tuning a
# model trained on all ten.
DIGITS_0TO4 = 'digits_0to4'
DATASET_NAMES = (DIGITS, FAKE, DIGITS_0TO4)

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
                            len(train_labels), len(eval_labels))

  def train_batches(self, batch_size: int, seed: int, start_step: int,
                    sharding, dtype) -> Iterator[dict]:
    """Global training batches from step `start_step` on, forever."""
    rows = process_rows(batch_size, sharding)
    step = start_step
    while True:
      index = train_indices(len(self.train_labels), batch_size, seed,
                            step)[rows]
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
                        'mask': mask[rows]}, sharding)


class FakeDataset:
  """One synthetic batch made on device, repeated: measures the model alone.

  ImageNet-shaped (1000 classes, RGB, `config.image_size`); its evaluation
  is `steps_per_eval` batches (one if the whole split is asked for).
  """

  def __init__(self, image_size: int, steps_per_eval: int):
    self.info = DatasetInfo(1000, (image_size, image_size, 3), 1_281_167,
                            50_000)
    self._eval_steps = max(steps_per_eval, 1)

  def _batch(self, batch_size, sharding, dtype, with_mask=False):
    shape = (batch_size, *self.info.image_shape)
    num_classes = self.info.num_classes

    def make(key):
      batch = {'image': jax.random.normal(key, shape, dtype),
               'label': jax.random.randint(key, (batch_size,), 0,
                                           num_classes)}
      if with_mask:
        batch['mask'] = jnp.ones((batch_size,), bool)
      return batch
    return jax.jit(make, out_shardings=sharding)(jax.random.key(0))

  def train_batches(self, batch_size, seed, start_step, sharding, dtype):
    del seed, start_step  # every step sees the same batch
    return itertools.repeat(self._batch(batch_size, sharding, dtype))

  def eval_batches(self, batch_size, sharding, dtype):
    batch = self._batch(batch_size, sharding, dtype, with_mask=True)
    return itertools.repeat(batch, self._eval_steps)


def create_dataset(config):
  """The data set named by `config.dataset`: digits (all ten or 0-4), fake,
  or a TFDS name."""
  if config.dataset == DIGITS:
    return load_digits()
  if config.dataset == DIGITS_0TO4:
    return load_digits(num_classes=5)
  if config.dataset == FAKE:
    return FakeDataset(config.image_size, config.steps_per_eval)
  # TensorFlow only when a TFDS data set is asked for: the models and the
  # compiled steps run without it (e.g. benchmarks on an accelerator host).
  import tfds_pipeline  # pylint: disable=g-import-not-at-top
  with _tfds_name(config.dataset, tfds_pipeline):
    return tfds_pipeline.TfdsDataset(
        config.dataset, _tfds_data_dir(config),
        Preprocessing.from_config(config), train_split=config.train_split,
        eval_split=config.eval_split)


def label_names(config) -> list[str]:
  """The class names of `config.dataset`, index by index (TFDS data sets
  only: the others have no image files to classify)."""
  if config.dataset in DATASET_NAMES:
    raise ValueError(f'dataset {config.dataset!r} has no image files or label '
                     'names to predict with; train on a TFDS data set')
  import tfds_pipeline  # pylint: disable=g-import-not-at-top
  with _tfds_name(config.dataset, tfds_pipeline):
    return tfds_pipeline.label_names(config.dataset, _tfds_data_dir(config))


def _tfds_data_dir(config):
  return config.data_dir or os.environ.get('TFDS_DATA_DIR') or None


@contextlib.contextmanager
def _tfds_name(name: str, tfds_pipeline):
  """A name TFDS does not know, as the error that lists every valid one."""
  try:
    yield
  except tfds_pipeline.UnknownDatasetError as e:
    raise ValueError(f'unknown dataset {name!r}; valid names: '
                     f'{", ".join(DATASET_NAMES)}, or {e}') from None


def eval_image_file(config, path: str, channels: int, dtype) -> np.ndarray:
  """The image file at `path` (JPEG or PNG, any size) preprocessed as the
  evaluation pipeline of `config.dataset` preprocesses its images, in
  `dtype` (the compute dtype)."""
  if not os.path.isfile(path):
    raise ValueError(f'image {path!r} not found')
  import tfds_pipeline  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as f:
    data = f.read()
  try:
    return tfds_pipeline.eval_image_file(
        data, Preprocessing.from_config(config), channels, dtype)
  except ValueError as e:
    raise ValueError(f'image {path!r}: {e}') from None


def load_digits(num_classes: int = 10) -> ArrayDataset:
  """scikit-learn's bundled digits, normalised, with a fixed held-out split;
  the digits below `num_classes` only, normalised and split as in the
  whole set (so each image has the same pixels in both)."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  digits = datasets.load_digits()
  images = digits.images.astype(np.float32)[..., None] / 16.0
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(labels))
  train, held_out = order[:-_DIGITS_EVAL_EXAMPLES], order[-_DIGITS_EVAL_EXAMPLES:]
  mean, std = images[train].mean(), images[train].std()
  images = (images - mean) / std
  train = train[labels[train] < num_classes]
  held_out = held_out[labels[held_out] < num_classes]
  return ArrayDataset(images[train], labels[train], images[held_out],
                      labels[held_out], num_classes=num_classes)



def train_indices(num_examples: int, batch_size: int, seed: int,
                  step: int) -> np.ndarray:
  """Example indices of the global training batch at `step` (0-based).

  Each epoch is a fresh permutation seeded by (seed, epoch); the remainder
  that does not fill a batch is dropped, as in the Flax ImageNet example.
  """
  epoch, position = divmod(step, steps_per_epoch(num_examples, batch_size))
  order = np.random.default_rng([seed, epoch]).permutation(num_examples)
  return order[position * batch_size:(position + 1) * batch_size]
