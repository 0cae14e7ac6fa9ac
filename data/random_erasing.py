"""Random erasing (Zhong et al., 2017) as timm's `RandomErasing` does it in
DeiT's recipe: mode 'pixel', one box.

With probability `probability`, a box of 2% to 1/3 of the image's area and
aspect ratio 0.3 to 3.3 (log-uniform) is filled with normal noise, one
value per pixel and channel, on the normalised image. Ten attempts are
drawn at once and the first that fits inside the image is taken; if none
fits, the image is left alone (as timm does). Stateless, seeded per
example, like every other training augmentation here.
"""

import math

import tensorflow as tf

MIN_AREA, MAX_AREA = 0.02, 1 / 3
MIN_ASPECT = 0.3  # and 1 / MIN_ASPECT at most
ATTEMPTS = 10


def random_erase(image, seed, probability: float):
  """`image` (height, width, channels float, normalised) with one box of
  pixels replaced by N(0, 1) noise with probability `probability`."""
  apply_seed, area_seed, aspect_seed, top_seed, left_seed, noise_seed = (
      tf.unstack(tf.random.experimental.stateless_split(seed, 6)))
  height, width = tf.shape(image)[0], tf.shape(image)[1]
  area = tf.cast(height * width, tf.float32) * tf.random.stateless_uniform(
      [ATTEMPTS], area_seed, MIN_AREA, MAX_AREA)
  aspect = tf.exp(tf.random.stateless_uniform(
      [ATTEMPTS], aspect_seed, math.log(MIN_ASPECT), -math.log(MIN_ASPECT)))
  box_h = tf.cast(tf.round(tf.sqrt(area * aspect)), tf.int32)
  box_w = tf.cast(tf.round(tf.sqrt(area / aspect)), tf.int32)
  fits = (box_h < height) & (box_w < width)
  first = tf.argmax(tf.cast(fits, tf.int32))
  box_h, box_w = box_h[first], box_w[first]
  top = tf.random.stateless_uniform([], top_seed, 0, height - box_h + 1,
                                    dtype=tf.int32)
  left = tf.random.stateless_uniform([], left_seed, 0, width - box_w + 1,
                                     dtype=tf.int32)
  rows = tf.range(height)[:, None]
  cols = tf.range(width)[None, :]
  box = ((rows >= top) & (rows < top + box_h) & (cols >= left) &
         (cols < left + box_w))
  erase = tf.reduce_any(fits) & (
      tf.random.stateless_uniform([], apply_seed) < probability)
  noise = tf.random.stateless_normal(tf.shape(image), noise_seed,
                                     dtype=image.dtype)
  return tf.where(erase & box[:, :, None], noise, image)
