"""Throughput of the TFDS and image-folder pipelines on ImageNet-like JPEGs.

  python benchmarks/input_pipeline.py --num_images=1024 --batch_size=128
  python benchmarks/input_pipeline.py --config=configs/imagenet_vit.py
  python benchmarks/input_pipeline.py --num_images=640 --epochs=5

Writes `num_images` JPEGs of ImageNet's typical size (about 400x350 pixels,
about 110 KB: smooth random colour fields plus grain, quality 90) for each
split into class folders (`train/<class>/`, `validation/<class>/`, 10
classes), prepares the same files as a TFDS data set (TFRecords, like a
prepared imagenet2012), and times, with the preprocessing of `--config`,
end to end (reading, decoding the crop, resizing, flipping, RandAugment if
the config has it, normalising, batching, the transfer to the device):
`tfds_pipeline.TfdsDataset`, `folder_pipeline.ImageFolderDataset`, and,
as the reference, plain tf.data pipelines in the Flax ImageNet example's
manner over the same records and over the same files (interleaved read,
shuffle, decode and crop, batch, repeat; no (seed, step) order). Training
is timed over `epochs` epochs (epoch boundaries included). Prints a table
of images/s, images/s per CPU core and the ratio to the plain pipeline
(the best of `repeats` alternating runs).
"""

import os
import sys
import tempfile
import time

from absl import app
from absl import flags
import jax
from ml_collections import config_flags
import jax.numpy as jnp
import numpy as np
import PIL.Image
import tensorflow_datasets as tfds

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import folder_pipeline  # pylint: disable=g-import-not-at-top
from data import image_preprocessing
import input_pipeline
from data import tfds_pipeline
import tensorflow as tf

config_flags.DEFINE_config_file(
    'config', os.path.join(os.path.dirname(__file__), '..', 'configs',
                           'imagenet.py'),
    'The config whose preprocessing is timed.')

flags.DEFINE_integer('num_images', 1024, 'JPEGs per split.')
flags.DEFINE_integer('batch_size', 128, 'Global batch.')
flags.DEFINE_integer('repeats', 3, 'Timed runs of each pipeline; the best '
                     'counts.')
flags.DEFINE_float('epochs', 1, 'Training epochs timed (after one batch).')
flags.DEFINE_string('data_dir', '', 'Where to write the JPEGs and the TFDS '
                    'data set ("": a temporary directory).')
FLAGS = flags.FLAGS

SPLITS = ('train', 'validation')
NUM_CLASSES = 10


class ImagenetLikeJpegs(tfds.core.GeneratorBasedBuilder):
  """JPEG files `SPLIT/CLASS/INDEX.jpg` from `manual_dir`, 10 classes."""

  VERSION = tfds.core.Version('1.0.0')
  MANUAL_DOWNLOAD_INSTRUCTIONS = 'Written by benchmarks/input_pipeline.py.'

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(shape=(None, None, 3),
                                         encoding_format='jpeg'),
            'label': tfds.features.ClassLabel(num_classes=NUM_CLASSES),
        }),
        supervised_keys=('image', 'label'))

  def _split_generators(self, dl_manager):
    return {split: self._generate_examples(dl_manager.manual_dir / split)
            for split in SPLITS}

  def _generate_examples(self, directory):
    for class_dir in directory.iterdir():
      for path in class_dir.iterdir():
        yield int(path.stem), {'image': path, 'label': int(class_dir.name)}


def imagenet_like_jpeg(rng: np.random.Generator, path: str) -> int:
  """Writes one JPEG of about 400x350 pixels and 110 KB; returns its bytes."""
  height, width = rng.integers(300, 400), rng.integers(350, 450)
  coarse = rng.uniform(0, 255, (height // 5 + 2, width // 5 + 2, 3))
  smooth = np.asarray(PIL.Image.fromarray(coarse.astype(np.uint8)).resize(
      (width, height), PIL.Image.BICUBIC), np.float32)
  grain = rng.normal(0, 28, (height, width, 3))
  pixels = np.clip(smooth + grain, 0, 255).astype(np.uint8)
  PIL.Image.fromarray(pixels).save(path, quality=90)
  return os.path.getsize(path)


def prepare(data_dir: str, num_images: int) -> float:
  """Writes the JPEGs, prepares the TFDS data set; returns mean JPEG KB."""
  source = os.path.join(data_dir, 'jpegs')
  rng = np.random.default_rng(0)
  sizes = []
  for split in SPLITS:
    for index in range(num_images):
      directory = os.path.join(source, split, f'{index % NUM_CLASSES}')
      os.makedirs(directory, exist_ok=True)
      sizes.append(imagenet_like_jpeg(
          rng, os.path.join(directory, f'{index}.jpg')))
  ImagenetLikeJpegs(data_dir=data_dir).download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=source))
  return np.mean(sizes) / 1000


def images_per_second(batches, num_batches: int, batch_size: int) -> float:
  """Rate of `num_batches` batches after the first (pipeline warm-up)."""
  jax.block_until_ready(next(batches))
  start = time.perf_counter()
  for _ in range(num_batches):
    jax.block_until_ready(next(batches))
  return num_batches * batch_size / (time.perf_counter() - start)


def plain_batches(examples, preprocessing, batch_size: int, sharding, dtype,
                  encoding: str):
  """The Flax ImageNet example's training pipeline over `examples` ((encoded
  image, label) pairs, files already interleaved): repeat, shuffle, decode
  and crop, batch; then to the device as the trainer's pipelines are."""
  tf_dtype = tf.dtypes.as_dtype(np.dtype(dtype))

  def preprocess(index, example):
    image, label = example
    image = image_preprocessing.train_image(
        image, tf.stack([index, index]), preprocessing, encoding, 3)
    return {'image': tf.cast(image, tf_dtype), 'label': label}
  batches = examples.repeat().shuffle(16 * batch_size, seed=0).enumerate().map(
      preprocess, num_parallel_calls=tf.data.AUTOTUNE).batch(
          batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
  for batch in batches.as_numpy_iterator():
    yield input_pipeline.to_global(batch, sharding)


def main(_):
  data_dir = FLAGS.data_dir or tempfile.mkdtemp()
  kilobytes = prepare(data_dir, FLAGS.num_images)
  preprocessing = input_pipeline.Preprocessing.from_config(FLAGS.config)
  datasets = {
      'TFDS': tfds_pipeline.TfdsDataset('imagenet_like_jpegs', data_dir,
                                        preprocessing),
      'folders': folder_pipeline.ImageFolderDataset(
          os.path.join(data_dir, 'jpegs'), preprocessing),
  }
  builder = tfds.builder('imagenet_like_jpegs', data_dir=data_dir)
  files = folder_pipeline.list_split(os.path.join(data_dir, 'jpegs', 'train'))
  plain_sources = {
      # The Flax example's read: TFRecord files shuffled and interleaved.
      'TFDS': (lambda: builder.as_dataset(
          split='train', shuffle_files=True,
          decoders={'image': tfds.decode.SkipDecoding()}).map(
              lambda e: (e['image'], tf.cast(e['label'], tf.int32))),
               image_preprocessing.JPEG),
      'folders': (lambda: tf.data.Dataset.from_tensor_slices(
          (files.files, files.labels)).shuffle(len(files.files), seed=0).map(
              lambda path, label: (tf.io.read_file(path), label),
              num_parallel_calls=tf.data.AUTOTUNE),
                  image_preprocessing.ANY),
  }
  sharding = jax.sharding.NamedSharding(
      jax.make_mesh((jax.device_count(),), ('data',)),
      jax.sharding.PartitionSpec('data'))
  steps_per_epoch = FLAGS.num_images // FLAGS.batch_size
  train_steps = max(int(FLAGS.epochs * steps_per_epoch) - 1, 1)
  eval_steps = -(-FLAGS.num_images // FLAGS.batch_size) - 1
  dtype = jnp.bfloat16
  pipelines = {}
  for name, dataset in datasets.items():
    source, encoding = plain_sources[name]
    pipelines[f'{name}, plain tf.data', 'train'] = (
        lambda source=source, encoding=encoding: images_per_second(
            plain_batches(source(), preprocessing, FLAGS.batch_size, sharding,
                          dtype, encoding), train_steps, FLAGS.batch_size))
    pipelines[name, 'train'] = lambda dataset=dataset: images_per_second(
        dataset.train_batches(FLAGS.batch_size, 0, 0, sharding, dtype),
        train_steps, FLAGS.batch_size)
    pipelines[name, 'eval'] = lambda dataset=dataset: images_per_second(
        dataset.eval_batches(FLAGS.batch_size, sharding, dtype), eval_steps,
        FLAGS.batch_size)
  # Best of `repeats` alternating runs: the machine may be shared.
  rates = {key: 0.0 for key in pipelines}
  for _ in range(FLAGS.repeats):
    for key, measure in pipelines.items():
      rates[key] = max(rates[key], measure())
  # A restart at the last step of an epoch: skipped batches stay undecoded.
  resume_seconds = {}
  for name, dataset in datasets.items():
    start = time.perf_counter()
    jax.block_until_ready(next(dataset.train_batches(
        FLAGS.batch_size, 0, steps_per_epoch - 1, sharding, dtype)))
    resume_seconds[name] = time.perf_counter() - start

  cores = os.cpu_count()
  print(f'{cores} CPU cores, load average {os.getloadavg()[0]:.1f}; best of '
        f'{FLAGS.repeats}; '
        f'{FLAGS.num_images} JPEGs per split, mean {kilobytes:.0f} KB; '
        f'batch {FLAGS.batch_size}, {FLAGS.config.image_size} px, bfloat16; '
        f'training over {train_steps} steps ({FLAGS.epochs:g} epochs of '
        f'{steps_per_epoch}); {preprocessing}')
  print('| data | pipeline | images/s | images/s per core | / plain tf.data |')
  print('| --- | --- | ---: | ---: | ---: |')
  for (name, pipeline), rate in rates.items():
    plain = rates.get((f'{name}, plain tf.data', 'train'))
    ratio = f'{rate / plain:.2f}' if pipeline == 'train' and plain else ''
    print(f'| {name} | {pipeline} | {rate:.0f} | {rate / cores:.0f} | '
          f'{ratio} |')
  for name, seconds in resume_seconds.items():
    print(f'{name}: first batch of a run resumed at the last step of an '
          f'epoch (skipping {(steps_per_epoch - 1) * FLAGS.batch_size} '
          f'examples): {seconds:.2f} s')


if __name__ == '__main__':
  app.run(main)
