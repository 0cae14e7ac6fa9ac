"""TFDS training batches are a function of (seed, step) alone: whichever
processes load which rows, together they load the batches one process
loads. Real TFDS data (tiny_images, prepared from PNG files)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data import tfds_pipeline
from helpers import PREPROCESSING
from helpers import batch_sharding
from helpers import host_batches

STEPS = 5  # 19 examples, batch 8: two steps per epoch; five span three
SEED = 3


@pytest.mark.parametrize('max_shards, process_rows', [
    # Two processes of four devices; 4 shards (one per record file) of
    # two rows each.
    (16, [range(0, 4), range(4, 8)]),
    # Two processes whose rows are not adjacent (a mesh may order devices
    # so), sharing 2 shards of 4 rows.
    (2, [[0, 1, 4, 5], [2, 3, 6, 7]]),
])
def test_processes_together_load_the_batches_of_one_process(
    tiny_data_dir, monkeypatch, max_shards, process_rows):
  monkeypatch.setattr(tfds_pipeline, 'MAX_VIRTUAL_SHARDS', max_shards)
  dataset = tfds_pipeline.TfdsDataset('tiny_images', tiny_data_dir,
                                       PREPROCESSING)
  # One process of eight devices loads every row.
  whole = host_batches(dataset.train_batches(
      8, SEED, 0, batch_sharding(8), jnp.float32), STEPS)
  parts = []
  for rows in process_rows:
    batches = dataset.local_train_batches(8, SEED, 0, np.array(rows),
                                          jnp.float32)
    parts.append([next(batches) for _ in range(STEPS)])
  for step in range(STEPS):
    for key in ('image', 'label'):
      assembled = np.zeros_like(whole[step][key])
      for rows, batches in zip(process_rows, parts):
        assembled[list(rows)] = batches[step][key]
      np.testing.assert_array_equal(assembled, whole[step][key])
  # Labels name the examples: an epoch's batches hold distinct ones, and
  # the next epoch reshuffles.
  epochs = [np.concatenate([whole[s]['label'] for s in (2 * e, 2 * e + 1)])
            for e in (0, 1)]
  assert all(len(set(labels.tolist())) == 16 for labels in epochs)
  assert not np.array_equal(epochs[0], epochs[1])


def test_virtual_shards_divide_the_batch_and_start_files():
  assert [tfds_pipeline.virtual_shards(b, 1024)
          for b in (8, 12, 48, 1024, 7)] == [8, 4, 16, 16, 1]
  # At most one per record file: a small data set in one file is read once.
  assert [tfds_pipeline.virtual_shards(1024, files)
          for files in (1, 2, 3, 15, 16)] == [1, 2, 2, 8, 16]


def test_repeated_augments_give_each_example_k_copies_spread_over_processes(
    tiny_data_dir):
  dataset = tfds_pipeline.TfdsDataset('tiny_images', tiny_data_dir,
                                       PREPROCESSING)
  # Batch 6: 2 virtual shards of 3 positions, 3 steps an epoch; with 3
  # repeats each shard's epoch is 3 records x 3 copies.
  whole = host_batches(dataset.train_batches(
      6, SEED, 0, batch_sharding(6), jnp.float32, repeats=3), 4)
  epoch = np.concatenate([batch['label'] for batch in whole[:3]])
  labels, counts = np.unique(epoch, return_counts=True)
  assert len(labels) == 6 and set(counts) == {3}
  for batch in whole[:3]:
    for label in set(batch['label'].tolist()):
      copies = batch['image'][batch['label'] == label]
      # All three in the step, each augmented on its own, and on both
      # halves of the batch (two processes of three rows).
      assert len(copies) == 3
      assert len({copy.tobytes() for copy in copies}) == 3
      rows = np.flatnonzero(batch['label'] == label)
      assert rows.min() < 3 <= rows.max()
  # Two processes load what one loads; a resume reads on from its step.
  for rows in ([0, 1, 2], [3, 4, 5]):
    part = host_batches(dataset.local_train_batches(
        6, SEED, 0, np.array(rows), jnp.float32, repeats=3), 4)
    for step in range(4):
      for key in ('image', 'label'):
        np.testing.assert_array_equal(part[step][key], whole[step][key][rows])
  resumed = host_batches(dataset.train_batches(
      6, SEED, 2, batch_sharding(6), jnp.float32, repeats=3), 2)
  jax.tree.map(np.testing.assert_array_equal, resumed, whole[2:])
