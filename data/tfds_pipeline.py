"""TFDS image classification data sets (ImageNet): tf.data pipelines.

Which examples make each batch, in which order, on which process; the
pixels are `image_preprocessing.py`'s. An `input_pipeline.Dataset`. Imported
only when a TFDS data set is used.
"""

import functools
import math
import os
from typing import Iterator

import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from data import image_preprocessing
from data import tfds_catalog
from input_pipeline import DatasetInfo
from input_pipeline import LocalRowsDataset
from input_pipeline import Preprocessing
from input_pipeline import sequence_positions
from input_pipeline import steps_per_epoch
from input_pipeline import to_global

# Training examples shuffled together, in local batches (the Flax example's).
SHUFFLE_BATCHES = 16
# Batches of training records read ahead of decoding.
RECORDS_AHEAD_BATCHES = 4
# The training split is cut into up to gcd(batch_size, MAX_VIRTUAL_SHARDS)
# parts (`virtual_shards`), one per block of rows of the global batch. Up to
# that many processes read disjoint parts; beyond it, processes share parts
# (each reads a whole part and decodes only its rows).
MAX_VIRTUAL_SHARDS = 16


class TfdsDataset(LocalRowsDataset):
  """A TFDS image classification data set (e.g. imagenet2012), via tf.data.

  Training cuts the split into virtual shards, one per block of rows of
  the global batch (`local_train_batches`), and reshuffles each shard every
  epoch with one seed made of (seed, epoch, shard): the order of its files,
  a shuffle buffer, and each example's crop and flip (stateless, from that
  seed and the example's position in the shard's epoch). So the global
  batches do not depend on the number of processes. One tf.data pipeline
  serves every epoch (the epoch is a tensor in it), so decoding runs on
  across epoch boundaries. Evaluation reads each process's own disjoint
  part of the split (`tfds.even_splits`), one repeated pipeline serving
  every evaluation (`eval_batches`); its sums do not depend on the
  order. A run resumed at step N starts in its epoch and
  skips the first N mod steps_per_epoch batches before decoding them, so
  it reads exactly the batches an uninterrupted run reads from step N+1 on;
  the step is the whole input state. The last partial batch of an epoch is
  dropped, as in the Flax ImageNet example.
  """

  def __init__(self, name: str, data_dir, preprocessing: Preprocessing,
               train_split: str = 'train', eval_split: str = '',
               process_index: int | None = None,
               process_count: int | None = None):
    # tf.data runs on the host only; keep TensorFlow off the accelerators.
    tf.config.set_visible_devices([], 'GPU')
    self._builder = tfds_catalog.dataset_builder(name, data_dir)
    features = self._builder.info.features
    if self._builder.info.supervised_keys is None:
      raise ValueError(f'dataset {name!r} has no (image, label) supervised '
                       'keys; use an image classification data set')
    self._image_key, self._label_key = self._builder.info.supervised_keys
    # TFDS reads only TFRecord files as tf.data (`as_dataset`).
    file_format = self._builder.info.file_format
    if file_format not in (None, tfds.core.FileFormat.TFRECORD):
      raise ValueError(
          f'{name} is prepared as {file_format.value} files; the trainer '
          f'reads TFRecord files: prepare it again with `tfds build {name} '
          '--file_format=tfrecord`')
    image_feature = features[self._image_key]
    # JPEG data sets decode only the crop (fused decode and crop).
    jpeg = image_feature.encoding_format == 'jpeg'
    self._encoding = (image_preprocessing.JPEG if jpeg
                      else image_preprocessing.DECODED)
    self._decoders = ({self._image_key: tfds.decode.SkipDecoding()}
                      if jpeg else None)
    self._channels = image_feature.shape[-1]
    if preprocessing.randaug_num_layers and self._channels != 3:
      raise ValueError(f'RandAugment needs RGB images; {name} has '
                       f'{self._channels} channel(s): set '
                       '--config.randaug_num_layers=0')
    self._preprocessing = preprocessing
    # {(local batch, dtype name): the evaluation pipeline's iterator, at
    # the start of an evaluation}: see `eval_batches`.
    self._eval_iterators = {}
    self._process_index = (jax.process_index() if process_index is None
                           else process_index)
    self._process_count = (jax.process_count() if process_count is None
                           else process_count)
    self._train_split = train_split
    self._eval_split = eval_split or next(
        (split for split in ('validation', 'test')
         if split in self._builder.info.splits), 'validation')
    size = preprocessing.image_size
    self.info = DatasetInfo(
        features[self._label_key].num_classes, (size, size, self._channels),
        self._split_size(self._train_split),
        self._split_size(self._eval_split),
        tuple(features[self._label_key].names))

  def skipped(self) -> dict:
    return {}  # TFDS checked every image when it prepared the data set

  def _as_dataset(self, split):
    """TFDS's examples of `split` in its order; JPEG images still encoded
    (`_image_and_label` takes the pair out)."""
    try:
      examples = self._builder.as_dataset(
          split=split, decoders=self._decoders,
          # No in-memory caching of small splits: every split reads its
          # files, as ImageNet's must.
          read_config=tfds.ReadConfig(try_autocache=False))
    except AssertionError:  # how TFDS says that the data set is not prepared
      raise ValueError(
          tfds_catalog.not_prepared_message(self._builder)) from None
    except ValueError as e:  # a split TFDS cannot parse or does not have
      raise ValueError(
          f'split {split!r} of {self._builder.name}: {str(e).splitlines()[0]}'
          f' Set --config.train_split / --config.eval_split to one of '
          f'{", ".join(self._builder.info.splits)} or a slice of one, e.g. '
          'train[:99%]') from None
    return examples

  def eval_split_labels(self) -> np.ndarray:
    """The labels of the split `eval_batches` reads, in its order (one
    pass over its records, no image decoded)."""
    examples = self._builder.as_dataset(
        split=self._eval_split,
        decoders={self._image_key: tfds.decode.SkipDecoding()},
        read_config=tfds.ReadConfig(try_autocache=False))
    labels = examples.map(lambda example: example[self._label_key])
    return np.fromiter(labels.as_numpy_iterator(), np.int32)

  def _image_and_label(self, example):
    return (example[self._image_key],
            tf.cast(example[self._label_key], tf.int32))

  def _split_size(self, split: str) -> int:
    size = int(self._as_dataset(split).cardinality())
    if size < 0:
      raise ValueError(f'TFDS does not know the size of split {split!r} of '
                       f'{self._builder.name}; prepare it again')
    return size

  def _process_part(self, split: str):
    """This process's disjoint, nearly equal part of `split` (evaluation)."""
    # TFDS's own split, which CLU's deterministic_data now defers to.
    return tfds.even_splits(split, n=self._process_count)[self._process_index]

  def local_train_batches(self, batch_size: int, seed: int, start_step: int,
                          rows: np.ndarray, dtype,
                          repeats: int = 1) -> Iterator[dict]:
    """Rows `rows` (ascending) of the global training batches from step
    `start_step` on, forever, as NumPy arrays.

    The global batches are a function of (seed, step, batch_size) alone:
    the split is cut into `virtual_shards` parts, and row block k of every
    batch's sequence positions (`sequence_positions`) comes from part k,
    read in an order seeded by (seed, epoch, k), each record `repeats`
    times in a row. A process reads only the parts its rows come from, so
    the batches do not depend on how many processes share them.
    """
    # Not CLU's create_dataset: it resumes from a saved iterator state;
    # here the step alone fixes the input, without decoding skipped images.
    epoch_steps = steps_per_epoch(self.info.num_train_examples, batch_size)
    first_epoch, first_step = divmod(start_step, epoch_steps)
    # Plain Python building a graph: nothing for autograph to convert.
    num_shards = self._virtual_shards(batch_size)
    block = batch_size // num_shards
    # The pipeline yields the sequence positions of this process's rows in
    # ascending order; `rows` take them in theirs.
    positions = sequence_positions(batch_size, repeats)[rows]
    ascending = np.sort(positions)
    epoch_records = tf.autograph.experimental.do_not_convert(functools.partial(
        self._epoch_records, seed, self._train_files(num_shards), block,
        repeats, _rows_by_shard(ascending, block), epoch_steps, first_epoch,
        first_step))
    # One pipeline for all epochs, so that decoding runs on across epoch
    # boundaries; the records of a few batches ahead hide the start of the
    # next epoch (its files opened, its shuffle buffers filled).
    records = tf.data.Dataset.range(
        first_epoch, np.iinfo(np.int64).max).flat_map(epoch_records).prefetch(
            RECORDS_AHEAD_BATCHES * len(rows))
    batches = self._train_batches(records, len(rows), dtype)
    if not np.array_equal(positions, ascending):
      order = tf.constant(np.searchsorted(ascending, positions))
      batches = batches.map(lambda batch: {
          key: tf.gather(value, order) for key, value in batch.items()})
    return batches.prefetch(tf.data.AUTOTUNE).as_numpy_iterator()

  def _epoch_records(self, seed: int, files: tuple, block: int, repeats: int,
                     shard_rows: dict, steps_per_epoch: int, first_epoch: int,
                     first_step: int, epoch):
    """(example seed, serialized record) of this process's sequence
    positions of `epoch`'s batches, in batch and position order: those of
    the blocks (of `block` positions) of the virtual shards in `shard_rows`
    ({virtual shard: offsets of this process's positions in its block}),
    read from `files` (as `_train_files` gives them), each record `repeats`
    times; in `first_epoch`, from step `first_step` on. `epoch` is a
    tensor: one graph serves every epoch."""
    skipped = tf.where(epoch == first_epoch, np.int64(first_step * block),
                       np.int64(0))

    def shard_examples(index, shard):
      """(index, shard seed, position in the shard's epoch, serialized
      record) of virtual shard `shard`, `index` in `shard_rows`."""
      shard_key = tf.random.experimental.stateless_fold_in(
          tf.stack([tf.constant(seed, tf.int64), epoch]), shard)
      shard_seed = tf.random.stateless_uniform(
          [], shard_key, minval=None, maxval=None, dtype=tf.int64)
      records = self._train_part(files, shard, shard_key).shuffle(
          SHUFFLE_BATCHES * block, seed=shard_seed)
      if repeats > 1:
        records = records.map(
            lambda record: tf.fill([repeats], record)).unbatch()
      # Position p of the shard's epoch is position p % block of its block
      # in the batch at step p // block; it seeds the random ops, so each
      # copy of a record is augmented on its own.
      return records.take(steps_per_epoch * block).enumerate().skip(
          skipped).map(lambda position, record: (
              index, shard_seed, position, record))
    # Block by block: each shard gives its block of a batch's rows. The
    # shards hold the same number of steps, so they end with the epoch.
    # Sequential (no num_parallel_calls), hence always in this order.
    shards = tf.data.Dataset.from_tensor_slices(
        (np.arange(len(shard_rows)), np.array(list(shard_rows), np.int64)))
    records = shards.interleave(shard_examples, cycle_length=len(shard_rows),
                                block_length=block)
    # This process's rows, with their augmentation seeds. Skipped and
    # other processes' rows are never parsed: that comes after.
    wanted = tf.constant([[offset in offsets for offset in range(block)]
                          for offsets in shard_rows.values()])
    return records.filter(
        lambda index, shard_seed, position, record: wanted[
            index, position % block]).map(
                lambda index, shard_seed, position, record: (
                    tf.stack([shard_seed, position]), record))

  def _virtual_shards(self, batch_size: int) -> int:
    return virtual_shards(batch_size, len(
        self._builder.info.splits[self._train_split].file_instructions))

  def _train_files(self, num_shards: int) -> tuple[np.ndarray, ...]:
    """The record files of each of `num_shards` virtual shards of the
    training split: (paths, records to skip, records to take), [shard,
    file] arrays padded to the most files, and each shard's count."""
    parts = [self._builder.info.splits[part].file_instructions
             for part in tfds.even_splits(self._train_split, n=num_shards)]
    width = max(len(instructions) for instructions in parts)

    def table(value, padding):
      return np.array([[value(i) for i in instructions] +
                       [padding] * (width - len(instructions))
                       for instructions in parts])
    return (table(lambda i: os.fspath(i.filename), ''),
            table(lambda i: i.skip, 0).astype(np.int64),
            table(lambda i: i.take, 0).astype(np.int64),
            np.array([len(instructions) for instructions in parts]))

  def _train_part(self, files: tuple, shard, shard_key):
    """Serialized records of virtual shard `shard` of the training split
    (`files` as `_train_files` gives them), its record files in an
    order drawn from `shard_key`, read as TFDS reads them (16 files
    interleaved, 16 records at a time)."""
    paths, skips, takes, counts = (tf.constant(table) for table in files)
    order = tf.random.experimental.stateless_shuffle(
        tf.range(counts[shard]), seed=shard_key)
    shard_files = tf.data.Dataset.from_tensor_slices(tuple(
        tf.gather(table[shard], order) for table in (paths, skips, takes)))
    return shard_files.interleave(
        lambda path, skip, take: tf.data.TFRecordDataset(path).skip(
            skip).take(take),
        cycle_length=16, block_length=16, num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True)

  def _train_batches(self, records, local_batch: int, dtype):
    """Batches of `local_batch` training examples made of `records`
    ((example seed, serialized record))."""
    tf_dtype = tf.dtypes.as_dtype(np.dtype(dtype))
    features = self._builder.info.features

    def preprocess(example_seed, record):
      image, label = self._image_and_label(features.deserialize_example(
          record, decoders=self._decoders))
      image = image_preprocessing.train_image(
          image, example_seed, self._preprocessing, self._encoding,
          self._channels)
      return {'image': tf.cast(image, tf_dtype), 'label': label}
    return records.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE).batch(
        local_batch, drop_remainder=True)

  def eval_batches(self, batch_size: int, sharding, dtype) -> Iterator[dict]:
    """The evaluation split exactly once; the last batches padded and masked.

    Every process yields as many batches as the process with the largest
    part needs, its own part padded with masked-out zero images. One
    tf.data pipeline per (batch size, dtype) serves every evaluation: it
    repeats the padded part, and an evaluation read to its end leaves it
    at the start of the next one, whose first batches decode ahead (as in
    the Flax ImageNet example, whose evaluation input repeats), rather
    than each evaluation building, starting and warming up a pipeline of
    its own. An evaluation left before its end drops its pipeline, so the
    next one starts a new pipeline at the start of the part.
    """
    local_batch = batch_size // self._process_count
    largest_part = -(-self.info.num_eval_examples // self._process_count)
    num_batches = -(-largest_part // local_batch)
    key = (local_batch, np.dtype(dtype).name)
    # Taken, so that another evaluation meanwhile starts a pipeline of its
    # own; put back only at the end of this one.
    batches = self._eval_iterators.pop(key, None)
    if batches is None:
      batches = self._eval_pipeline(
          local_batch, num_batches, dtype).as_numpy_iterator()
    for _ in range(num_batches):
      yield to_global(next(batches), sharding)
    self._eval_iterators[key] = batches

  def _eval_pipeline(self, local_batch: int, num_batches: int, dtype):
    """This process's part of the evaluation split in batches of
    `local_batch`, padded with masked-out zero images to `num_batches`
    batches, repeated."""
    tf_dtype = tf.dtypes.as_dtype(np.dtype(dtype))

    # The pair and the mask come with the pixels: one parallel map per
    # example (a map to the pair, or CLU's `pad_dataset`, adds another).
    # The position in the split: the parts before this process's, then
    # the position in its part.
    first = sum(int(self._as_dataset(part).cardinality()) for part in
                tfds.even_splits(self._eval_split, n=self._process_count)[
                    :self._process_index])

    def preprocess(position, example):
      image, label = self._image_and_label(example)
      image = image_preprocessing.eval_image(
          image, self._preprocessing, self._encoding, self._channels)
      return {'image': tf.cast(image, tf_dtype), 'label': label,
              'index': tf.cast(position + first, tf.int32),
              'mask': tf.constant(True)}
    examples = self._as_dataset(self._process_part(self._eval_split))
    padding = num_batches * local_batch - int(examples.cardinality())
    filler = {'image': tf.zeros(self.info.image_shape, tf_dtype),
              'label': tf.constant(0, tf.int32),
              'index': tf.constant(0, tf.int32), 'mask': tf.constant(False)}
    examples = examples.enumerate().map(
        preprocess, num_parallel_calls=tf.data.AUTOTUNE).concatenate(
            tf.data.Dataset.from_tensors(filler).repeat(padding))
    # Whole batches of the padded part, so that every repetition's batches
    # are the first's.
    return examples.batch(local_batch).repeat().prefetch(tf.data.AUTOTUNE)


def virtual_shards(batch_size: int, num_files: int) -> int:
  """How many parts of a training split of `num_files` record files feed
  the rows of a global batch of `batch_size`: one block of batch_size /
  that many rows each. The most that divide gcd(batch_size,
  MAX_VIRTUAL_SHARDS) and are at most `num_files`: a part that starts
  inside a file reads that file from its start, so a small data set in one
  file is read once per epoch, not once per part."""
  most = math.gcd(batch_size, MAX_VIRTUAL_SHARDS)
  return max(count for count in range(1, min(most, num_files) + 1)
             if most % count == 0)


def _rows_by_shard(rows: np.ndarray, block: int) -> dict:
  """{virtual shard: offsets of `rows` within that shard's block of
  `block` rows}."""
  shards = {}
  for row in rows:
    shards.setdefault(int(row) // block, []).append(int(row) % block)
  return shards
