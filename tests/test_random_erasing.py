"""Random erasing against timm's rule, drawn in NumPy: how often, which
boxes, what noise; and its place in the training preprocessing."""

import math

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

from data import image_preprocessing
from data import random_erasing
import input_pipeline

HEIGHT, WIDTH = 32, 40


@tf.function(autograph=False)
def _erase_many(seeds, probability):
  image = tf.fill([HEIGHT, WIDTH, 3], 7.0)  # noise is never exactly 7
  return tf.map_fn(lambda seed: random_erasing.random_erase(
      image, seed, probability), seeds, fn_output_signature=tf.float32)


def erased(count: int, probability: float):
  seeds = tf.stack([tf.fill([count], 11), tf.range(count)], 1)
  return _erase_many(tf.cast(seeds, tf.int64),
                     tf.constant(probability)).numpy() != 7.0


def timm_boxes(count: int, rng) -> np.ndarray:
  """(height, width) of timm's `RandomErasing._erase` box (one box, ten
  attempts, the first that fits), in NumPy."""
  boxes = []
  for _ in range(count):
    for _ in range(10):
      area = rng.uniform(0.02, 1 / 3) * HEIGHT * WIDTH
      aspect = math.exp(rng.uniform(math.log(0.3), math.log(1 / 0.3)))
      h = int(round(math.sqrt(area * aspect)))
      w = int(round(math.sqrt(area / aspect)))
      if w < WIDTH and h < HEIGHT:
        boxes.append((h, w))
        break
  return np.array(boxes)


def test_one_box_of_timms_sizes_becomes_noise():
  masks = erased(2000, 1.0)[..., 0]
  heights = masks.any(axis=2).sum(axis=1)
  widths = masks.any(axis=1).sum(axis=1)
  # One filled rectangle per image.
  np.testing.assert_array_equal(masks.sum(axis=(1, 2)), heights * widths)
  reference = timm_boxes(20_000, np.random.default_rng(0))
  for ours, theirs in ((heights, reference[:, 0]), (widths, reference[:, 1]),
                       (heights * widths, reference.prod(axis=1))):
    assert scipy.stats.ks_2samp(ours, theirs)[0] < 0.05


def test_the_noise_is_standard_normal_per_pixel_and_channel():
  seeds = tf.constant([[5, s] for s in range(200)], tf.int64)
  images = _erase_many(seeds, tf.constant(1.0)).numpy()
  noise = images[images != 7.0]
  assert scipy.stats.kstest(noise, 'norm')[0] < 0.02
  # Channels draw their own values.
  box = images[..., 0] != 7.0
  assert not np.allclose(images[..., 0][box], images[..., 1][box])


@pytest.mark.parametrize('probability', [0.0, 0.25])
def test_the_share_of_erased_images_is_the_probability(probability):
  share = erased(2000, probability).any(axis=(1, 2, 3)).mean()
  assert share == pytest.approx(probability, abs=0.03)


def test_training_preprocessing_erases_after_normalising_and_keeps_the_rest():
  pixels = np.random.default_rng(1).integers(0, 256, (48, 56, 3), np.uint8)
  seed = tf.constant([3, 9], tf.int64)

  def train_image(probability):
    return image_preprocessing.train_image(
        tf.constant(pixels), seed, input_pipeline.Preprocessing(
            image_size=32, random_erase_prob=probability),
        image_preprocessing.DECODED, 3).numpy()
  plain, erased_image = train_image(0.0), train_image(1.0)
  changed = (plain != erased_image).any(axis=-1)
  # The crop and flip are the same; one box differs, the rest is equal.
  assert 0.02 * 32 * 32 * 0.8 <= changed.sum() <= 32 * 32 / 3 * 1.2
  np.testing.assert_array_equal(plain[~changed], erased_image[~changed])
  np.testing.assert_array_equal(train_image(1.0), erased_image)
