"""Image folders: `ROOT/train/<class>/*` and `ROOT/val/<class>/*` via tf.data.

The layout torchvision's `ImageFolder` reads, listed by `folder_listing.py`:
one folder per class, the classes numbered in sorted order of their folder
names (so a model trained here and one trained with `ImageFolder` agree on
label indices); files in nested folders count for their class. Images are
JPEG, PNG, BMP, GIF or WebP (by extension; other files are skipped and
counted), cropped and normalised by `image_preprocessing.py` as the TFDS
data sets are. An `input_pipeline.Dataset`.

Training batches are a function of (seed, step) alone: epoch e is a
permutation of the files seeded by (seed, e), global batch s its s-th slice,
each example's crop, flip and RandAugment seeded by (seed, e, its position
in the epoch). A process reads and decodes only its rows, so the batches do
not depend on the number of processes, and a resumed run starts at its step
without reading what it skips. One tf.data pipeline runs across epochs, so
decoding never stops at an epoch boundary.

An image that cannot be read or decoded is skipped: in training the next
readable file of the listing takes its place (with that file's label), in
evaluation its row is masked out; each is logged by name and counted on the
dashboard (`data_skipped_images`). Finding it costs nothing on the way:
tf.data drops the failed example, and the batches are re-cut around it.

ROOT may be in a bucket (gs://...): it is listed and its files read through
`runtime/paths.py` (gcsfs), as a workdir there is, each class folder in one
listing of its prefix, the files fetched REMOTE_READS at a time.
"""

import os
from typing import Callable, Iterator

from absl import logging
import numpy as np
import tensorflow as tf

from data import folder_listing
from data import image_preprocessing
from runtime import paths
from input_pipeline import DatasetInfo
from input_pipeline import Preprocessing
from input_pipeline import epoch_order
from input_pipeline import global_batches
from input_pipeline import LocalRowsDataset
from input_pipeline import sequence_positions
from input_pipeline import steps_per_epoch

# tf.data's tuning model off: its thread sleeps between rounds for a
# period that doubles up to a minute, and an iterator's teardown could wait
# out that sleep (5 to 40 s after a run's last step, measured). Without it
# AUTOTUNE's parallelism is the host's cores: as fast, measured on 2.
_WITHOUT_TUNING_MODEL = tf.data.Options()
_WITHOUT_TUNING_MODEL.autotune.enabled = False
# Readable files tried, in listing order, in place of an unreadable one.
SUBSTITUTE_TRIES = 16
# Files of a bucket fetched at once: each waits tens of milliseconds for
# its first byte, so the reads overlap, in threads of their own.
REMOTE_READS = 64


class ImageFolderDataset(LocalRowsDataset):
  """Image folders under `root` (see the module's docstring)."""

  def __init__(self, root: str, preprocessing: Preprocessing):
    train_dir, eval_dir = folder_listing.split_directories(root)
    train = folder_listing.list_split(train_dir)
    held_out = folder_listing.list_split(eval_dir)
    folder_listing.check_same_classes(train, held_out)
    self._use(train, held_out, preprocessing, len(train.classes))
    logging.info('Image folders: %d training images in %s, %d evaluation '
                 'images in %s, %d classes.', self.info.num_train_examples,
                 self._train.directory, self.info.num_eval_examples,
                 self._eval.directory, self.info.num_classes)

  def _use(self, train: folder_listing.Listing,
           held_out: folder_listing.Listing, preprocessing: Preprocessing,
           num_classes: int) -> None:
    """Serves `train` and `held_out`, labels in [0, num_classes)."""
    # tf.data runs on the host only; keep TensorFlow off the accelerators.
    tf.config.set_visible_devices([], 'GPU')
    self._train, self._eval = train, held_out
    for listing in dict.fromkeys((self._train, self._eval)):
      if listing.skipped:
        logging.warning('Skipped %d files that are not images in %s (%s).',
                        sum(listing.skipped.values()), listing.directory,
                        ', '.join(f'{ext}: {n}' for ext, n in
                                  listing.skipped.most_common(5)))
    self._preprocessing = preprocessing
    self._skipped_images = set()  # paths of unreadable images
    size = preprocessing.image_size
    self.info = DatasetInfo(num_classes, (size, size, 3),
                            len(self._train.files), len(self._eval.files),
                            tuple(self._train.classes))

  def skipped(self) -> dict:
    """Files skipped: not images (in the listing), unreadable images (met
    so far, each counted once)."""
    return {'data_skipped_files': sum(self._train.skipped.values()) +
                                  sum(self._eval.skipped.values()),
            'data_skipped_images': len(self._skipped_images)}

  def eval_split_labels(self) -> np.ndarray:
    """The labels of the split `eval_batches` reads, file by file."""
    return self._eval.labels

  # ------------------------------------------------------------- training

  def local_train_batches(self, batch_size: int, seed: int, start_step: int,
                          rows: np.ndarray, dtype,
                          repeats: int = 1) -> Iterator[dict]:
    """Rows `rows` of the global training batches from step `start_step`
    on, forever, as NumPy arrays; each file `repeats` times in the epoch's
    sequence, each copy cropped, flipped and augmented on its own."""
    slots = _TrainSlots(len(self._train.files), batch_size, seed, rows,
                        repeats)

    def epochs():  # Python once per epoch, never per image
      epoch, step = divmod(start_step, slots.epoch_steps)
      while True:
        yield slots.of_steps(range(epoch * slots.epoch_steps + step,
                                   (epoch + 1) * slots.epoch_steps))
        epoch, step = epoch + 1, 0

    load = self._loader(self._train, dtype, train=True)
    examples = tf.data.Dataset.from_generator(epochs, output_signature={
        key: tf.TensorSpec([None, *spec.shape], spec.dtype)
        for key, spec in _SLOT_SIGNATURE.items() if key != 'mask'}).unbatch()

    def substitute(step, missing_rows):
      """The next readable files after the unreadable ones of `step`."""
      slot = slots.of_steps([step])
      replacements = [self._substitute(load, slot, row)
                      for row in missing_rows]
      return {key: np.stack([r[key] for r in replacements])
              for key in replacements[0]}
    yield from _whole_batches(
        self._batches(self._fetched(examples, self._train), load, len(rows)),
        start_step, len(rows), substitute)

  def _substitute(self, load, slot: dict, row: int) -> dict:
    """`load` of the first readable file after the one in `row` of `slot`
    (tried eagerly, in listing order), with `row`'s random seed."""
    files = self._train.files
    mine = {key: value[row] for key, value in slot.items()}
    for offset in range(1, SUBSTITUTE_TRIES + 1):
      candidate = dict(mine, index=(mine['index'] + offset) % len(files))
      try:
        example = load(candidate)
      except tf.errors.OpError:
        continue
      self._log_skipped(files[mine['index']], 'training with '
                        f'{files[candidate["index"]]} in its place')
      return {key: np.asarray(value) for key, value in example.items()}
    raise ValueError(f'{files[mine["index"]]!r} and the {SUBSTITUTE_TRIES} '
                     'files after it cannot be read as images; check the '
                     f'folder {os.path.dirname(files[mine["index"]])!r} '
                     '(a damaged disk or copy?)')

  # ----------------------------------------------------------- evaluation

  def eval_batches(self, batch_size: int, sharding, dtype) -> Iterator[dict]:
    """The evaluation split exactly once; the last batch padded and masked
    (as are unreadable images)."""
    return global_batches(lambda rows: self.local_eval_batches(
        batch_size, rows, dtype), batch_size, sharding)

  def local_eval_batches(self, batch_size: int, rows: np.ndarray,
                         dtype) -> Iterator[dict]:
    """Rows `rows` of every global evaluation batch, as NumPy arrays:
    global batch k holds examples k * batch_size, ..., the ones past the
    end padded with masked-out copies of the first."""
    num = len(self._eval.files)
    num_batches = -(-num // batch_size)
    index = np.arange(num_batches)[:, None] * batch_size + rows[None, :]
    slots = {'index': np.where(index < num, index, 0).ravel(),
             'mask': (index < num).ravel(),
             'batch': np.repeat(np.arange(num_batches), len(rows)),
             'row': np.tile(np.arange(len(rows)), num_batches),
             'seed': np.zeros((index.size, 2), np.int64)}
    load = self._loader(self._eval, dtype, train=False)
    examples = tf.data.Dataset.from_tensor_slices(
        {key: value.astype(_SLOT_SIGNATURE[key].dtype.as_numpy_dtype)
         for key, value in slots.items()})
    shape = (*self.info.image_shape[:2], 3)

    def masked_out(batch_number, missing_rows):
      for row in missing_rows:
        position = batch_number * len(rows) + row
        if slots['mask'][position]:
          self._log_skipped(self._eval.files[slots['index'][position]],
                            'left out of the evaluation')
      return {'image': np.zeros((len(missing_rows), *shape), dtype),
              'label': np.zeros(len(missing_rows), np.int32),
              'index': np.zeros(len(missing_rows), np.int32),
              'mask': np.zeros(len(missing_rows), bool)}
    yield from _whole_batches(
        self._batches(self._fetched(examples, self._eval), load, len(rows)),
        0, len(rows), masked_out, last=num_batches - 1)

  # -------------------------------------------------------------- shared

  def _loader(self, listing: folder_listing.Listing, dtype,
              train: bool) -> Callable:
    """slot -> {'image', 'label', 'batch', 'row', 'mask'?}: one example,
    of the file's bytes in the slot (`_fetched`), else read here."""
    read = _reader(listing.files)
    labels = tf.constant(listing.labels)
    tf_dtype = tf.dtypes.as_dtype(np.dtype(dtype))
    preprocessing = self._preprocessing

    def load(slot):
      data = slot['data'] if 'data' in slot else read(slot['index'])
      if train:
        image = image_preprocessing.train_image(
            data, slot['seed'], preprocessing, image_preprocessing.ANY, 3)
      else:
        image = image_preprocessing.eval_image(
            data, preprocessing, image_preprocessing.ANY, 3)
      example = {'image': tf.cast(image, tf_dtype),
                 'label': tf.gather(labels, slot['index']),
                 'batch': slot['batch'], 'row': slot['row']}
      if 'mask' in slot:  # evaluation: the position in the listing too
        example['mask'] = slot['mask']
        example['index'] = tf.cast(slot['index'], tf.int32)
      return example
    return load

  def _fetched(self, examples, listing: folder_listing.Listing):
    """`examples` (slots), each with its file's bytes ('data') when the
    files are in a bucket: fetched REMOTE_READS at a time, in order."""
    if not paths.is_remote(listing.directory):
      return examples  # `load` reads the file: a local read is quick
    read = _reader(listing.files)
    options = tf.data.Options()
    # A fetch holds its thread while it waits; tf.data's own threads are
    # as many as the cores.
    options.threading.private_threadpool_size = REMOTE_READS
    return examples.map(lambda slot: dict(slot, data=read(slot['index'])),
                        num_parallel_calls=REMOTE_READS).with_options(options)

  def _batches(self, examples, load, local_batch: int) -> Iterator[dict]:
    """Decoded examples in batches of `local_batch`, unreadable ones left
    out (so a batch may hold rows of the next)."""
    batches = examples.map(
        load, num_parallel_calls=tf.data.AUTOTUNE).ignore_errors().batch(
            local_batch).prefetch(tf.data.AUTOTUNE)
    return batches.with_options(_WITHOUT_TUNING_MODEL).as_numpy_iterator()

  def _log_skipped(self, path: str, what: str) -> None:
    """Counts an unreadable image, and logs it the first time."""
    if path in self._skipped_images:
      return
    self._skipped_images.add(path)
    try:
      image_preprocessing.eval_image_file(paths.read_bytes(path),
                                          self._preprocessing, 3, np.float32)
      why = 'its crop could not be decoded'
    except Exception as e:  # pylint: disable=broad-except
      # Besides OSError and ValueError, gcsfs's own HTTP errors.
      why = str(e) or type(e).__name__
    logging.warning('Skipped unreadable image %s (%s); %s. %d unreadable '
                    'images so far.', path, why, what,
                    len(self._skipped_images))


class FolderSplit(ImageFolderDataset):
  """One split's listing alone, for evaluation (`eval_batches`) by a model
  of `num_classes` classes: the listing's labels are the model's (see
  `folder_listing.relabeled`)."""

  def __init__(self, listing: folder_listing.Listing,
               preprocessing: Preprocessing, num_classes: int):
    self._use(listing, listing, preprocessing, num_classes)
    logging.info('An evaluator reads %d images of %d class folders in %s.',
                 len(listing.files), len(listing.classes), listing.directory)

  def files(self) -> list[str]:
    """The split's image paths, by position."""
    return self._eval.files


def _reader(files: list[str]) -> Callable:
  """index -> the bytes of files[index], a string tensor: through
  TensorFlow's file system for local files, gcsfs for a bucket's (which the
  rest of the trainer reaches gs:// through)."""
  if not paths.is_remote(files[0]):
    names = tf.constant(files)
    return lambda index: tf.io.read_file(tf.gather(names, index))

  def fetch(index):
    return paths.read_bytes(files[int(index)])
  return lambda index: tf.ensure_shape(
      tf.py_function(fetch, [index], tf.string), [])


_SLOT_SIGNATURE = {
    'index': tf.TensorSpec([], tf.int64),  # into the split's files
    'seed': tf.TensorSpec([2], tf.int64),  # the example's random ops
    'batch': tf.TensorSpec([], tf.int64),  # step, or evaluation batch
    'row': tf.TensorSpec([], tf.int64),  # in this process's batch
    'mask': tf.TensorSpec([], tf.bool),  # evaluation only
}


class _TrainSlots:
  """Which file, with which seed, fills each of this process's rows of a
  training step."""

  def __init__(self, num_files: int, batch_size: int, seed: int,
               rows: np.ndarray, repeats: int):
    self.epoch_steps = steps_per_epoch(num_files, batch_size)
    self._num_files, self._batch_size = num_files, batch_size
    self._seed, self._repeats = seed, repeats
    self._positions = sequence_positions(batch_size, repeats)[rows]
    self._rows = rows

  def of_steps(self, steps) -> dict:
    """{key of _SLOT_SIGNATURE: array} for `steps` (within one epoch), in
    step, then row order."""
    steps = np.asarray(steps, np.int64)
    epoch = int(steps[0]) // self.epoch_steps
    order = epoch_order(self._num_files, self._seed, epoch)
    # The position in the epoch's sequence seeds the random ops: each copy
    # of a file its own.
    position = ((steps[:, None] % self.epoch_steps) * self._batch_size +
                self._positions[None, :]).ravel()
    epoch_seed = int(np.random.SeedSequence(
        [self._seed, epoch]).generate_state(1, np.uint32)[0])
    return {'index': order[position // self._repeats],
            'seed': np.stack([np.full_like(position, epoch_seed), position],
                             axis=1),
            'batch': np.repeat(steps, len(self._rows)),
            'row': np.tile(np.arange(len(self._rows)), len(steps))}


def _whole_batches(batches: Iterator[dict], first: int, local_batch: int,
                   fill: Callable, last: int | None = None) -> Iterator[dict]:
  """Batches numbered `first`, ... (to `last`, when given) of `local_batch`
  rows each, cut from `batches`, in which rows of unreadable images are
  missing; `fill(number, missing rows)` makes those rows."""
  pending = None
  number = first

  def complete(rows_of_number: dict) -> dict:
    present = rows_of_number['row']
    missing = np.setdiff1d(np.arange(local_batch), present)
    if len(missing):
      made = fill(number, missing)
      rows_of_number = {key: np.concatenate([value, made[key]])
                        for key, value in rows_of_number.items()
                        if key in made}
      order = np.argsort(np.concatenate([present, missing]), kind='stable')
      rows_of_number = {key: value[order]
                        for key, value in rows_of_number.items()}
    return {key: value for key, value in rows_of_number.items()
            if key not in ('batch', 'row')}

  for batch in batches:
    if pending is None and len(batch['row']) == local_batch and (
        batch['batch'][-1] == number):  # nothing missing: as it came
      yield complete(batch)
      number += 1
      continue
    pending = batch if pending is None else {
        key: np.concatenate([pending[key], batch[key]]) for key in batch}
    # A batch is whole once all its rows are there or a later one began.
    while len(pending['batch']) and (
        pending['batch'][-1] > number or
        np.count_nonzero(pending['batch'] == number) == local_batch):
      mine = pending['batch'] == number
      yield complete({key: value[mine] for key, value in pending.items()})
      pending = {key: value[~mine] for key, value in pending.items()}
      number += 1
    if not len(pending['batch']):
      pending = None
  while last is not None and number <= last:  # the end, missing rows
    mine = (pending['batch'] == number if pending is not None
            else np.zeros(0, bool))
    yield complete({key: value[mine] for key, value in pending.items()}
                   if pending is not None else
                   {'row': np.zeros(0, np.int64)})
    number += 1
