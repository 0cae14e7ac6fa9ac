"""The Flax ImageNet example's input, as a reference to time the trainer's by.

Written from reading google/flax `examples/imagenet/input_pipeline.py` and
`examples/imagenet/train.py`; each function names the one it mirrors. No
(seed, step) order, no resume, no exactly-once evaluation: training reads
its process's slice shuffled in a buffer, evaluation drops the remainder
and repeats. `benchmarks/input_pipeline.py --compare=flax_example` times it
beside `tfds_pipeline.TfdsDataset`.
"""

from flax import jax_utils
import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

# The example's constants: its centre crop keeps image_size of every
# image_size + CROP_PADDING pixels of the shorter side.
CROP_PADDING = 32
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def _bicubic(image, image_size: int):
  """The example's `_resize`: bicubic, to image_size square."""
  return tf.image.resize(image[None], (image_size, image_size),
                         method='bicubic')[0]


def decode_and_center_crop(image_bytes, image_size: int):
  """The example's `_decode_and_center_crop`: the central square of
  image_size / (image_size + 32) of the shorter side, decoded alone from
  the JPEG, then resized."""
  shape = tf.image.extract_jpeg_shape(image_bytes)
  side = tf.cast(image_size / (image_size + CROP_PADDING) *
                 tf.cast(tf.minimum(shape[0], shape[1]), tf.float32),
                 tf.int32)
  window = tf.stack([(shape[0] - side + 1) // 2, (shape[1] - side + 1) // 2,
                     side, side])
  return _bicubic(tf.io.decode_and_crop_jpeg(image_bytes, window, channels=3),
                  image_size)


def decode_and_random_crop(image_bytes, image_size: int):
  """The example's `_decode_and_random_crop` with its
  `distorted_bounding_box_crop`: a crop of 8-100% of the area, aspect
  3/4-4/3, 10 attempts, decoded alone; where the sampler gave up (the
  whole image came back), the centre crop instead."""
  shape = tf.image.extract_jpeg_shape(image_bytes)
  begin, size, _ = tf.image.sample_distorted_bounding_box(
      shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
      min_object_covered=0.1, aspect_ratio_range=(3 / 4, 4 / 3),
      area_range=(0.08, 1.0), max_attempts=10,
      use_image_if_no_bounding_boxes=True)
  window = tf.concat([begin[:2], size[:2]], 0)
  crop = tf.io.decode_and_crop_jpeg(image_bytes, window, channels=3)
  # As the example's `_at_least_x_are_equal(shape, crop's shape, 3)`.
  whole = tf.reduce_all(tf.equal(tf.shape(crop), shape))
  return tf.cond(whole, lambda: decode_and_center_crop(image_bytes, image_size),
                 lambda: _bicubic(crop, image_size))


def _normalize(image):
  """The example's `normalize_image`."""
  return (image - tf.constant(MEAN_RGB)) / tf.constant(STDDEV_RGB)


def preprocess_for_train(image_bytes, dtype, image_size: int):
  """The example's `preprocess_for_train`: crop, flip, normalise, cast."""
  image = tf.reshape(decode_and_random_crop(image_bytes, image_size),
                     (image_size, image_size, 3))
  image = _normalize(tf.image.random_flip_left_right(image))
  return tf.image.convert_image_dtype(image, dtype)


def preprocess_for_eval(image_bytes, dtype, image_size: int):
  """The example's `preprocess_for_eval`: centre crop, normalise, cast."""
  image = tf.reshape(decode_and_center_crop(image_bytes, image_size),
                     (image_size, image_size, 3))
  return tf.image.convert_image_dtype(_normalize(image), dtype)


def create_split(builder, batch_size: int, train: bool, dtype,
                 image_size: int, eval_split: str = 'validation'):
  """The example's `create_split`: this process's equal slice of the
  split, JPEGs undecoded; training repeats and shuffles 16 batches'
  worth (seed 0) before decoding; batches drop the remainder; evaluation
  repeats after batching; 10 batches prefetched."""
  name = 'train' if train else eval_split
  size = builder.info.splits[name].num_examples // jax.process_count()
  start = jax.process_index() * size
  examples = builder.as_dataset(
      split=f'{name}[{start}:{start + size}]',
      decoders={'image': tfds.decode.SkipDecoding()})
  options = tf.data.Options()
  options.threading.private_threadpool_size = 48
  examples = examples.with_options(options)
  if train:
    examples = examples.repeat().shuffle(16 * batch_size, seed=0)
  preprocess = preprocess_for_train if train else preprocess_for_eval
  batches = examples.map(
      lambda example: {'image': preprocess(example['image'], dtype,
                                           image_size),
                       'label': example['label']},
      num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size,
                                                 drop_remainder=True)
  if not train:
    batches = batches.repeat()
  return batches.prefetch(10)


def prepare_tf_data(batch: dict) -> dict:
  """The example train.py's `prepare_tf_data`: each tensor as NumPy without
  a copy, split into one part per local device."""
  devices = jax.local_device_count()

  def per_device(tensor):
    array = tensor._numpy()  # pylint: disable=protected-access
    return array.reshape((devices, -1) + array.shape[1:])
  return jax.tree.map(per_device, batch)


def create_input_iter(builder, batch_size: int, train: bool, dtype,
                      image_size: int):
  """The example train.py's `create_input_iter`: `create_split`'s batches,
  `prepare_tf_data`, two batches ahead on the devices."""
  tf_dtype = tf.dtypes.as_dtype(np.dtype(dtype))
  batches = create_split(builder, batch_size, train, tf_dtype, image_size)
  return jax_utils.prefetch_to_device(map(prepare_tf_data, batches), 2)

