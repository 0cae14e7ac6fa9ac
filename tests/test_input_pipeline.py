"""TFDS input: preprocessing, determinism and resume, exactly-once eval.

imagenet2012 is mocked by TFDS itself (`MockPolicy.USE_CODE`: the builder's
own features, random JPEG images and labels, no files). The `data_dir` route
and per-process parts use a real data set that the tests prepare with TFDS
from PNG files they write.
"""

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import imagenet
import input_pipeline
import train
from tests.test_train import read_scalars

IMAGENET = 'imagenet2012:5.*.*'
NUM_EXAMPLES = 21  # per split of the mocked imagenet2012: odd on purpose
SIZE = 16
MEAN = np.array(input_pipeline.IMAGENET_MEAN_RGB, np.float32)
STDDEV = np.array(input_pipeline.IMAGENET_STDDEV_RGB, np.float32)


@pytest.fixture
def mock_imagenet():
  with tfds.testing.mock_data(num_examples=NUM_EXAMPLES,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    yield


def batch_sharding(num_devices):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), ('data',))
  return NamedSharding(mesh, P('data'))


def split_examples(split, data_dir=None, name=IMAGENET):
  """(encoded or decoded images, labels) of `split`, read by TFDS directly."""
  builder = tfds.builder(name, data_dir=data_dir)
  jpeg = builder.info.features['image'].encoding_format == 'jpeg'
  decoders = {'image': tfds.decode.SkipDecoding()} if jpeg else None
  examples = list(builder.as_dataset(split=split, decoders=decoders)
                  .as_numpy_iterator())
  return ([e['image'] for e in examples],
          np.array([e['label'] for e in examples]))


def reference_eval_image(pixels: np.ndarray) -> np.ndarray:
  """Central square of 224/256 of the shorter side, bilinear, normalised."""
  height, width = pixels.shape[:2]
  side = int(224 / 256 * min(height, width))
  top, left = (height - side + 1) // 2, (width - side + 1) // 2
  crop = pixels[top:top + side, left:left + side].astype(np.float32)
  resized = tf.image.resize(crop, (SIZE, SIZE), method='bilinear').numpy()
  return (resized - MEAN) / STDDEV


def masked_examples(batches):
  """Host copies of the unmasked images and labels of eval batches."""
  images, labels = [], []
  for batch in batches:
    mask = np.asarray(batch['mask'])
    images.append(np.asarray(batch['image'], np.float32)[mask])
    labels.append(np.asarray(batch['label'])[mask])
  return np.concatenate(images), np.concatenate(labels)


def test_imagenet_batches_have_shapes_dtypes_ranges_and_labels(mock_imagenet):
  dataset = input_pipeline.TfdsDataset(IMAGENET, None, SIZE)
  assert dataset.info == input_pipeline.DatasetInfo(
      1000, (SIZE, SIZE, 3), NUM_EXAMPLES, NUM_EXAMPLES)
  jpegs, labels = split_examples('validation')

  # Evaluation: float32, the reference crop of every example, in order.
  batches = list(dataset.eval_batches(8, batch_sharding(8), jnp.float32))
  assert [b['image'].dtype for b in batches] == [jnp.float32] * 3
  assert all(b['image'].shape == (8, SIZE, SIZE, 3) for b in batches)
  images, eval_labels = masked_examples(batches)
  np.testing.assert_array_equal(eval_labels, labels)
  reference = np.stack([reference_eval_image(tf.io.decode_jpeg(jpeg).numpy())
                        for jpeg in jpegs])
  # libjpeg's fused decode of a crop upsamples the colour of the crop's
  # last column without its right neighbour, so that column differs from a
  # full decode; everywhere else the two agree to rounding.
  error = np.abs(images - reference) * STDDEV
  assert np.quantile(error, 0.8) < 0.01, np.quantile(error, 0.8)
  assert error.mean() < 2.0, error.mean()  # a crop off by one pixel: ~30

  # Training: bfloat16 normalised pixels of [0, 255]; one epoch (two
  # batches of 8) takes 16 distinct examples of the split.
  train_iter = dataset.train_batches(8, 0, 0, batch_sharding(8), jnp.bfloat16)
  epoch = [next(train_iter) for _ in range(2)]
  assert all(b['image'].dtype == jnp.bfloat16 for b in epoch)
  assert all(b['label'].dtype == jnp.int32 for b in epoch)
  pixels = np.concatenate([np.asarray(b['image'], np.float32)
                           for b in epoch]) * STDDEV + MEAN
  assert pixels.shape == (16, SIZE, SIZE, 3)
  assert -1.0 <= pixels.min() and pixels.max() <= 256.0  # bfloat16 rounding
  assert pixels.std() > 10  # real image content, not padding
  epoch_labels = collections.Counter(
      np.concatenate([np.asarray(b['label']) for b in epoch]).tolist())
  assert sum(epoch_labels.values()) == 16
  assert not epoch_labels - collections.Counter(labels.tolist())


def host_batches(iterator, count):
  return [jax.tree.map(lambda x: np.asarray(x, np.float32), next(iterator))
          for _ in range(count)]


def test_train_batches_are_a_function_of_seed_and_step(mock_imagenet):
  dataset = input_pipeline.TfdsDataset(IMAGENET, None, SIZE)
  sharding = batch_sharding(8)
  # 21 examples, batch 8: two steps per epoch; steps 0-5 span three epochs.
  uninterrupted = host_batches(
      dataset.train_batches(8, 7, 0, sharding, jnp.float32), 6)
  # A restart from the checkpoint of step 3 (mid-epoch) reads steps 3-5.
  resumed = host_batches(dataset.train_batches(8, 7, 3, sharding, jnp.float32),
                         3)
  jax.tree.map(np.testing.assert_array_equal, resumed, uninterrupted[3:])
  # Epochs reshuffle and re-augment; another seed reads other batches.
  assert not np.array_equal(uninterrupted[0]['image'],
                            uninterrupted[2]['image'])
  other_seed = host_batches(
      dataset.train_batches(8, 8, 0, sharding, jnp.float32), 1)
  assert not np.array_equal(other_seed[0]['image'], uninterrupted[0]['image'])


@pytest.mark.parametrize('num_devices,batch_size', [(1, 4), (8, 8)])
def test_eval_covers_the_split_exactly_once(mock_imagenet, num_devices,
                                            batch_size):
  dataset = input_pipeline.TfdsDataset(IMAGENET, None, SIZE)
  batches = list(dataset.eval_batches(batch_size, batch_sharding(num_devices),
                                      jnp.float32))
  assert len(batches) == -(-NUM_EXAMPLES // batch_size)
  assert all(b['image'].sharding == batch_sharding(num_devices)
             for b in batches)
  _, labels = masked_examples(batches)
  np.testing.assert_array_equal(labels, split_examples('validation')[1])
  # Padding rows are masked out and hold zero images.
  last = batches[-1]
  padding = ~np.asarray(last['mask'])
  assert padding.sum() == len(batches) * batch_size - NUM_EXAMPLES
  assert not np.asarray(last['image'])[padding].any()
