"""What the trainer needs of a data set, and what every data set shares.

A data set (`Dataset`) describes itself (`DatasetInfo`) and yields global
batches as `jax.Array`s sharded over the mesh: training batches from any
step on, a pure function of (seed, step), so a run resumed at step N reads
exactly the batches an uninterrupted run reads; evaluation batches covering
the held-out split exactly once, padding masked out. Each process builds
only its own rows of a batch (`process_rows`) and `to_global` assembles the
global array. `data/datasets.py` makes the data sets of a `DataSource`;
its `Preprocessing` says how an image data set turns images into model
inputs.
"""

import collections
import dataclasses
import time
from typing import Callable, Iterator, Protocol

from absl import logging
import jax
import numpy as np


# An input pipeline that takes longer to stop says so (`stop`).
SLOW_STOP_SECONDS = 1.0
# tf.image.resize methods a config may name.
RESIZE_METHODS = ('bilinear', 'bicubic', 'area', 'lanczos3', 'lanczos5',
                  'gaussian', 'mitchellcubic', 'nearest')
# Pixel normalisations: per-channel (mean, standard deviation) of the 0-255
# values; 'minus_one_to_one' maps [0, 255] to [-1, 1].
NORMALIZATIONS = {
    'imagenet': ((0.485 * 255, 0.456 * 255, 0.406 * 255),
                 (0.229 * 255, 0.224 * 255, 0.225 * 255)),
    'minus_one_to_one': ((127.5,) * 3, (127.5,) * 3),
}
# Evaluation resizes the shorter side to image_size * 256 / 224, then crops
# the central image_size square: the crop is this fraction of the side.
EVAL_CROP_FRACTION = 224 / 256
# RandAugment's op sets (data/randaugment.py's OP_SETS): big_vision's, and
# timm's `inc1`.
RANDAUG_OP_SETS = ('big_vision', 'timm_increasing')


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """How a TFDS data set turns images into model inputs (see README)."""
  image_size: int
  crop_min_area: float = 0.1
  resize_method: str = 'bicubic'
  eval_resize_method: str = 'bicubic'
  normalization: str = 'imagenet'
  randaug_num_layers: int = 0
  randaug_magnitude: float = 10.0
  randaug_magnitude_std: float = 0.0
  randaug_apply_prob: float = 1.0
  randaug_ops: str = 'big_vision'
  random_erase_prob: float = 0.0

  def __post_init__(self):
    for key in ('resize_method', 'eval_resize_method'):
      if getattr(self, key) not in RESIZE_METHODS:
        raise ValueError(f'unknown {key} {getattr(self, key)!r}; valid names: '
                         f'{", ".join(RESIZE_METHODS)}')
    if self.normalization not in NORMALIZATIONS:
      raise ValueError(f'unknown normalization {self.normalization!r}; valid '
                       f'names: {", ".join(NORMALIZATIONS)}')
    if self.randaug_ops not in RANDAUG_OP_SETS:
      raise ValueError(f'unknown randaug_ops {self.randaug_ops!r}; valid '
                       f'names: {", ".join(RANDAUG_OP_SETS)}')
    if self.randaug_magnitude_std < 0:
      raise ValueError(f'randaug_magnitude_std {self.randaug_magnitude_std} '
                       'must be >= 0 (0: every op at randaug_magnitude)')
    if not 0 <= self.randaug_apply_prob <= 1:
      raise ValueError(f'randaug_apply_prob {self.randaug_apply_prob} must be '
                       'in [0, 1] (1: every chosen op applied)')
    if not 0 <= self.random_erase_prob <= 1:
      raise ValueError(f'random_erase_prob {self.random_erase_prob} must be '
                       'in [0, 1] (0: off)')
    if not 0 < self.crop_min_area <= 1:
      raise ValueError(f'crop_min_area {self.crop_min_area} must be in (0, 1] '
                       '(the smallest training crop, as a fraction of the '
                       'image)')

  @classmethod
  def from_config(cls, config) -> 'Preprocessing':
    return cls(**{field.name: config[field.name]
                  for field in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class DataSource:
  """Which data set a run reads and how (`data/datasets.py` opens it):
  `digits`, `digits_0to4`, `fake`, `folder:PATH` or a TFDS name; TFDS's
  directory and splits; the evaluation batches (-1: the split once)."""
  dataset: str
  preprocessing: Preprocessing
  data_dir: str
  train_split: str
  eval_split: str
  steps_per_eval: int

  @classmethod
  def from_config(cls, config) -> 'DataSource':
    return cls(config.dataset, Preprocessing.from_config(config),
               config.data_dir, config.train_split, config.eval_split,
               config.steps_per_eval)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  num_classes: int
  image_shape: tuple  # (height, width, channels)
  num_train_examples: int
  num_eval_examples: int
  class_names: tuple = ()  # index by index; () when the data set has none


class Dataset(Protocol):
  """A data set the trainer can train and evaluate on."""

  info: DatasetInfo

  def train_batches(self, batch_size: int, seed: int, start_step: int,
                    sharding, dtype, repeats: int = 1) -> Iterator[dict]:
    """Global batches {'image', 'label'} of steps `start_step`, ...,
    forever; each example `repeats` times (`sequence_positions`)."""

  def eval_batches(self, batch_size: int, sharding,
                   dtype) -> Iterator[dict]:
    """Global batches {'image', 'label', 'index', 'mask'} covering the
    held-out split once; `index` is each example's position in the split
    (in the data set's own order, the same on any number of processes),
    `mask` is False on padding."""

  def skipped(self) -> dict[str, int]:
    """Files skipped so far, by reason, for the dashboard: its `data_*`
    tags ({} for data sets that read no files of their own)."""


def channel_normalization(normalization: str, channels: int
                          ) -> tuple[np.ndarray, np.ndarray]:
  """(mean, standard deviation) of the 0-255 pixels per channel of
  `normalization` (NORMALIZATIONS): their averages over the channels on
  images of other than 3 channels."""
  mean, stddev = map(np.array, NORMALIZATIONS[normalization])
  if channels != 3:
    mean, stddev = mean.mean(keepdims=True), stddev.mean(keepdims=True)
  return mean, stddev


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
  """Whole global batches in an epoch of `num_examples` (the remainder is
  dropped, as in the Flax ImageNet example)."""
  if batch_size > num_examples:
    raise ValueError(f'batch_size {batch_size} exceeds the {num_examples} '
                     'training examples; use a batch_size of at most '
                     f'{num_examples}')
  return num_examples // batch_size


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """The order of the training examples in `epoch`: a permutation seeded by
  (seed, epoch)."""
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


def sequence_positions(batch_size: int, repeats: int) -> np.ndarray:
  """Which position of its step's stretch of the epoch's sequence each row
  of a global batch holds, when every example of the sequence appears
  `repeats` times in a row (DeiT's repeated augmentation): row r holds
  position [r] of the returned array. An example's copies, consecutive
  positions, land about batch_size / repeats rows apart, so on other
  devices and, with several processes, other processes, as DeiT's sampler
  deals them to other ranks. The identity when `repeats` is 1."""
  per_copy = -(-batch_size // repeats)
  positions = np.arange(per_copy * repeats).reshape(per_copy, repeats).T
  return positions[positions < batch_size]


def train_indices(num_examples: int, batch_size: int, seed: int,
                  step: int, repeats: int = 1) -> np.ndarray:
  """Example indices of the global training batch at `step` (0-based) of a
  data set read in `epoch_order`, each example `repeats` times in the
  epoch's sequence (`sequence_positions`); the remainder of an epoch that
  does not fill a batch is dropped, as in the Flax ImageNet example."""
  epoch, step_in_epoch = divmod(step,
                                steps_per_epoch(num_examples, batch_size))
  order = epoch_order(num_examples, seed, epoch)
  position = step_in_epoch * batch_size + sequence_positions(batch_size,
                                                             repeats)
  return order[position // repeats]


def process_rows(global_batch_size: int, sharding) -> np.ndarray:
  """The rows of every global batch that this process loads, in the order
  `jax.make_array_from_process_local_data` places them on its devices.

  Read from `sharding` rather than assumed to be the `process_index`-th
  block, which the device order of a mesh does not promise.
  """
  index_map = sharding.addressable_devices_indices_map((global_batch_size,))
  starts = sorted({index[0].indices(global_batch_size)[:2]
                   for index in index_map.values()})
  return np.concatenate([np.arange(start, stop) for start, stop in starts])


def describe_rows(rows: np.ndarray) -> str:
  """Row indices as ranges for the log, e.g. '0-7,16-23'."""
  breaks = np.flatnonzero(np.diff(rows) != 1) + 1
  return ','.join(f'{run[0]}-{run[-1]}' for run in np.split(rows, breaks))


def to_global(local_batch: dict, sharding) -> dict:
  """The global batch of which `local_batch` holds this process's rows."""
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, x),
      local_batch)


def global_batches(local_batches: Callable[[np.ndarray], Iterator[dict]],
                   batch_size: int, sharding) -> Iterator[dict]:
  """Global batches made of `local_batches(rows)`, the batches' rows that
  this process loads (`process_rows`), as NumPy arrays."""
  batches = local_batches(process_rows(batch_size, sharding))
  try:
    for batch in batches:
      yield to_global(batch, sharding)
  finally:
    close(batches)


class LocalRowsDataset:
  """A data set whose training batches are made by rows: each process makes
  the rows it loads (`local_train_batches`), which are assembled here."""

  def train_batches(self, batch_size: int, seed: int, start_step: int,
                    sharding, dtype, repeats: int = 1) -> Iterator[dict]:
    """Global training batches from step `start_step` on, forever."""
    return global_batches(lambda rows: self.local_train_batches(
        batch_size, seed, start_step, rows, dtype, repeats), batch_size,
                          sharding)

  def local_train_batches(self, batch_size: int, seed: int, start_step: int,
                          rows: np.ndarray, dtype,
                          repeats: int = 1) -> Iterator[dict]:
    """Rows `rows` (ascending) of the global training batches from step
    `start_step` on, forever, as NumPy arrays; each example `repeats`
    times in the epoch's sequence (`sequence_positions`)."""
    raise NotImplementedError


def prefetch(iterator: Iterator, size: int = 2) -> Iterator:
  """Keeps `size` batches in flight so host work overlaps device steps;
  closing it closes `iterator`."""
  queue = collections.deque()
  try:
    for item in iterator:
      queue.append(item)
      if len(queue) > size:
        yield queue.popleft()
  finally:
    close(iterator)
  while queue:
    yield queue.popleft()


def close(iterator: Iterator) -> None:
  """Stops `iterator` now, and the iterators it reads, where it can be
  stopped (a generator; `itertools.repeat` has nothing to stop).

  A tf.data pipeline over a Python generator (the image folders') left
  to the interpreter's exit is torn down while Python shuts down: its
  producer can no longer run Python, TensorFlow prints "Error occurred when
  finalizing GeneratorDataset iterator: FAILED_PRECONDITION", and the exit
  may wait on it. Closed here, it stops while Python runs.
  """
  stop = getattr(iterator, 'close', None)
  if stop is not None:
    stop()


def stop(iterator: Iterator, what: str) -> None:
  """`close(iterator)` (`what`, e.g. 'the training batches'), logged when
  it has to wait (tf.data's threads finish the work they hold first)."""
  started = time.monotonic()
  close(iterator)
  seconds = time.monotonic() - started
  if seconds > SLOW_STOP_SECONDS:
    logging.info('Stopping the input pipeline of %s took %.1f s, waiting '
                 "for tf.data's threads to finish the work in flight.", what,
                 seconds)
