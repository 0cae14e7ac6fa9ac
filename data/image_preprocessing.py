"""Image preprocessing on tf.data: the training crop and the evaluation crop.

Shared by the TFDS data sets (`tfds_pipeline.py`), the image folders
(`folder_pipeline.py`) and single image files (`predict.py`), so that a
model sees the same pixels whichever way its images arrive.
`input_pipeline.Preprocessing` says how.

An image arrives in one of three encodings: `JPEG` (still-encoded JPEG
bytes: only the crop is decoded), `DECODED` (a uint8 tensor, as TFDS gives
PNG data sets) or `ANY` (the bytes of an image file of any format TensorFlow
decodes: JPEG, PNG, BMP, GIF (its first frame), WebP; JPEGs take the fused
path, the others are decoded whole). Encoded images are decoded with the
model's channels: grey, palette and RGBA images become RGB, colour images
grey for a one-channel model.
"""

import numpy as np
import tensorflow as tf

from input_pipeline import EVAL_CROP_FRACTION
from input_pipeline import Preprocessing
from input_pipeline import channel_normalization
from data import random_erasing
from data import randaugment

JPEG, DECODED, ANY = 'jpeg', 'decoded', 'any'


def train_image(image, seed, preprocessing: Preprocessing, encoding: str,
                channels: int):
  """Inception-style augmentation of one (maybe still encoded) image.

  A random crop of `crop_min_area` to all of the area with aspect ratio
  3/4-4/3 (decoded alone from a JPEG; after 10 failed draws, the evaluation
  crop), resized to `image_size` square with `resize_method`, flipped
  left-right with probability 1/2, RandAugment'ed if asked, normalised,
  then randomly erased if asked (`random_erasing`). `seed` ([2] int64)
  fixes every random choice.
  """
  crop_seed, flip_seed, augment_seed = tf.unstack(
      tf.random.experimental.stateless_split(seed, 3))

  def random_window(shape):
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=crop_seed, min_object_covered=0.0,
        aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(preprocessing.crop_min_area, 1.0), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    # After 10 failed attempts the sampler returns the whole image; take
    # the evaluation crop instead, as the Flax ImageNet example does.
    failed = tf.reduce_all(tf.equal(size[:2], shape[:2]))
    return tf.where(failed, _central_window(shape),
                    tf.concat([begin[:2], size[:2]], 0))

  image = _resize(_decode_and_crop(image, random_window, encoding, channels),
                  preprocessing.image_size, preprocessing.resize_method)
  if preprocessing.randaug_num_layers:
    # RandAugment's ops work on uint8 pixels, as the recipe's resize gives.
    image = tf.cast(tf.clip_by_value(image, 0.0, 255.0), tf.uint8)
  image = tf.image.stateless_random_flip_left_right(image, flip_seed)
  if preprocessing.randaug_num_layers:
    image = randaugment.randaugment(
        image, augment_seed, preprocessing.randaug_num_layers,
        preprocessing.randaug_magnitude, preprocessing.randaug_magnitude_std,
        preprocessing.randaug_apply_prob, preprocessing.randaug_ops)
  image = _normalize(image, preprocessing, channels)
  if preprocessing.random_erase_prob:
    # A seed of its own, folded in: the other choices stay as without it.
    image = random_erasing.random_erase(
        image, tf.random.experimental.stateless_fold_in(seed, 3),
        preprocessing.random_erase_prob)
  return image


def eval_image(image, preprocessing: Preprocessing, encoding: str,
               channels: int):
  """The shorter side resized to image_size * 256/224, the central square.

  Done the other way round, so that a JPEG decodes only what is kept: the
  central square of side EVAL_CROP_FRACTION x the shorter side, resized
  with `eval_resize_method`, normalised.
  """
  image = _resize(_decode_and_crop(image, _central_window, encoding, channels),
                  preprocessing.image_size, preprocessing.eval_resize_method)
  return _normalize(image, preprocessing, channels)


def eval_image_file(data: bytes, preprocessing: Preprocessing, channels: int,
                    dtype) -> np.ndarray:
  """`eval_image` of an image file's bytes (any format of `ANY`), cast to
  `dtype` by TensorFlow, as the evaluation pipelines make it."""
  try:
    image = eval_image(tf.constant(data), preprocessing, ANY, channels)
    return tf.cast(image, tf.dtypes.as_dtype(np.dtype(dtype))).numpy()
  except tf.errors.InvalidArgumentError as e:
    raise ValueError(undecodable(e)) from None


def undecodable(error: tf.errors.OpError) -> str:
  """Why TensorFlow's decoders refused an image file: `error_reason`."""
  return ('not an image TensorFlow decodes (JPEG, PNG, BMP, GIF, WebP): '
          f'{error_reason(error)}')


def decodes(data: bytes) -> bool:
  """Whether TensorFlow decodes the image file `data` (a format of `ANY`)."""
  try:
    tf.io.decode_image(data, channels=3, expand_animations=False)
  except tf.errors.InvalidArgumentError:
    return False
  return True


def error_reason(error: tf.errors.OpError) -> str:
  """TensorFlow's message, less the op's name before and after it (eager)
  or the node's lines around it (a graph), at most 200 characters."""
  lines = [line for line in error.message.splitlines() if line.strip()
           and not line.lstrip().startswith(('[[', 'Graph execution error',
                                             'Detected at node', '<stack'))]
  reason = (lines or [''])[-1].split('}}')[-1].split('[Op:')[0].strip()
  return reason[:200]


def _resize(image, image_size: int, method: str):
  return tf.image.resize(image, (image_size, image_size), method=method)


def _central_window(shape):
  """[top, left, height, width] of the central evaluation square."""
  height, width = shape[0], shape[1]
  side = tf.cast(EVAL_CROP_FRACTION *
                 tf.cast(tf.minimum(height, width), tf.float32), tf.int32)
  return tf.stack([(height - side + 1) // 2, (width - side + 1) // 2, side,
                   side])


def _decode_and_crop(image, window_of_shape, encoding: str, channels: int):
  """The window `window_of_shape(image's [height, width, ...])` of `image`,
  decoded, with `channels` channels."""
  def fused_jpeg():
    window = window_of_shape(tf.image.extract_jpeg_shape(image))
    return tf.image.decode_and_crop_jpeg(image, window, channels=channels)

  def crop(pixels):
    window = window_of_shape(tf.shape(pixels))
    return tf.image.crop_to_bounding_box(pixels, window[0], window[1],
                                         window[2], window[3])
  if encoding == JPEG:
    return fused_jpeg()
  if encoding == DECODED:
    return crop(image)
  return tf.cond(tf.io.is_jpeg(image), fused_jpeg, lambda: crop(_to_channels(
      tf.io.decode_image(image, channels=3, expand_animations=False),
      channels)))


def _to_channels(rgb, channels: int):
  """RGB pixels as `channels` (1: grey, ITU-R 601 luma; 3: as they are)."""
  if channels == 1:
    return tf.cast(tf.round(tf.image.rgb_to_grayscale(
        tf.cast(rgb, tf.float32))), tf.uint8)
  return rgb


def _normalize(image, preprocessing: Preprocessing, channels: int):
  """(pixels - mean) / standard deviation of `preprocessing.normalization`
  (their averages over the channels on grey images) of an image of
  image_size square."""
  # By constants of the image's shape: a broadcast over the last axis of 3
  # took TensorFlow 1 ms of CPU per 224 px image, a third of its
  # preprocessing; elementwise, 0.3 ms (the same values).
  shape = (preprocessing.image_size, preprocessing.image_size, channels)
  scale, offset = (np.broadcast_to(value, shape) for value in
                   normalization_scale_and_offset(
                       channels, preprocessing.normalization))
  return tf.cast(image, tf.float32) * scale + offset


def normalization_scale_and_offset(channels: int, normalization: str
                                   ) -> tuple[np.ndarray, np.ndarray]:
  """(1 / stddev, -mean / stddev) of `normalization` in float32, per
  channel (their averages over the channels on grey images): pixels x
  scale + offset normalises them."""
  mean, stddev = channel_normalization(normalization, channels)
  # A multiplication for the division made a 224 px evaluation image 8-10%
  # cheaper to preprocess (the same value to float32 rounding).
  return (1 / stddev).astype(np.float32), (-mean / stddev).astype(np.float32)
