"""Throughput of the TFDS train and eval pipelines on ImageNet-like JPEGs.

  python benchmarks/input_pipeline.py --num_images=1024 --batch_size=128
  python benchmarks/input_pipeline.py --config=configs/imagenet_vit.py

Writes `num_images` JPEGs of ImageNet's typical size (about 400x350 pixels,
about 110 KB: smooth random colour fields plus grain, quality 90) for each split,
prepares them as a TFDS data set (TFRecords, like a prepared imagenet2012),
and times `tfds_pipeline.TfdsDataset` with the preprocessing of `--config`
end to end: reading, decoding the crop, resizing, flipping, RandAugment
(if the config has it), normalising, batching and the transfer to the
device. Prints a table of images/s and images/s per CPU core (the best of
`repeats` alternating runs).
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
import input_pipeline  # pylint: disable=g-import-not-at-top
import tfds_pipeline

config_flags.DEFINE_config_file(
    'config', os.path.join(os.path.dirname(__file__), '..', 'configs',
                           'imagenet.py'),
    'The config whose preprocessing is timed.')

flags.DEFINE_integer('num_images', 1024, 'JPEGs per split.')
flags.DEFINE_integer('batch_size', 128, 'Global batch.')
flags.DEFINE_integer('repeats', 3, 'Timed runs of each pipeline; the best '
                     'counts.')
flags.DEFINE_string('data_dir', '', 'Where to write the JPEGs and the TFDS '
                    'data set ("": a temporary directory).')
FLAGS = flags.FLAGS

SPLITS = ('train', 'validation')


class ImagenetLikeJpegs(tfds.core.GeneratorBasedBuilder):
  """JPEG files `SPLIT/INDEX.jpg` from `manual_dir`, 1000 classes."""

  VERSION = tfds.core.Version('1.0.0')
  MANUAL_DOWNLOAD_INSTRUCTIONS = 'Written by benchmarks/input_pipeline.py.'

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            'image': tfds.features.Image(shape=(None, None, 3),
                                         encoding_format='jpeg'),
            'label': tfds.features.ClassLabel(num_classes=1000),
        }),
        supervised_keys=('image', 'label'))

  def _split_generators(self, dl_manager):
    return {split: self._generate_examples(dl_manager.manual_dir / split)
            for split in SPLITS}

  def _generate_examples(self, directory):
    for path in directory.iterdir():
      index = int(path.stem)
      yield index, {'image': path, 'label': index % 1000}


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
    os.makedirs(os.path.join(source, split), exist_ok=True)
    for index in range(num_images):
      sizes.append(imagenet_like_jpeg(
          rng, os.path.join(source, split, f'{index}.jpg')))
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


def main(_):
  data_dir = FLAGS.data_dir or tempfile.mkdtemp()
  kilobytes = prepare(data_dir, FLAGS.num_images)
  dataset = tfds_pipeline.TfdsDataset(
      'imagenet_like_jpegs', data_dir,
      input_pipeline.Preprocessing.from_config(FLAGS.config))
  sharding = jax.sharding.NamedSharding(
      jax.make_mesh((jax.device_count(),), ('data',)),
      jax.sharding.PartitionSpec('data'))
  steps_per_epoch = FLAGS.num_images // FLAGS.batch_size
  dtype = jnp.bfloat16
  # Within one epoch: each epoch starts a fresh pipeline (timed below).
  # Best of `repeats` alternating runs: the machine may be shared.
  pipelines = {
      'train': lambda: images_per_second(
          dataset.train_batches(FLAGS.batch_size, 0, 0, sharding, dtype),
          steps_per_epoch - 1, FLAGS.batch_size),
      'eval': lambda: images_per_second(
          dataset.eval_batches(FLAGS.batch_size, sharding, dtype),
          -(-FLAGS.num_images // FLAGS.batch_size) - 1, FLAGS.batch_size),
  }
  rates = {name: 0.0 for name in pipelines}
  for _ in range(FLAGS.repeats):
    for name, measure in pipelines.items():
      rates[name] = max(rates[name], measure())
  # Starting an epoch's pipeline, here at its last step: a resumed run
  # skips the epoch's first batches undecoded.
  start = time.perf_counter()
  jax.block_until_ready(next(dataset.train_batches(
      FLAGS.batch_size, 0, steps_per_epoch - 1, sharding, dtype)))
  resume_seconds = time.perf_counter() - start

  cores = os.cpu_count()
  print(f'{cores} CPU cores, load average {os.getloadavg()[0]:.1f}; best of '
        f'{FLAGS.repeats}; '
        f'{FLAGS.num_images} JPEGs per split, mean {kilobytes:.0f} KB; '
        f'batch {FLAGS.batch_size}, {FLAGS.config.image_size} px, bfloat16; '
        f'{input_pipeline.Preprocessing.from_config(FLAGS.config)}')
  print('| pipeline | images/s | images/s per core |')
  print('| --- | ---: | ---: |')
  for name, rate in rates.items():
    print(f'| {name} | {rate:.0f} | {rate / cores:.0f} |')
  print(f'First batch of a pipeline started at the last step of an epoch '
        f'(skipping {(steps_per_epoch - 1) * FLAGS.batch_size} examples): '
        f'{resume_seconds:.2f} s')


if __name__ == '__main__':
  app.run(main)
