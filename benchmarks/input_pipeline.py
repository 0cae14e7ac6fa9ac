"""Throughput of the TFDS and image-folder pipelines on ImageNet-like JPEGs.

  python benchmarks/input_pipeline.py --num_images=1024 --batch_size=128
  python benchmarks/input_pipeline.py --config=configs/imagenet_vit.py
  python benchmarks/input_pipeline.py --num_images=640 --epochs=5
  python benchmarks/input_pipeline.py --compare=flax_example --num_images=1000

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

`--compare=flax_example --flax_example_dir=PATH` instead writes the JPEGs
as ILSVRC2012 tar files (`ILSVRC2012_img_train.tar` of one tar per class,
10 classes, and `ILSVRC2012_img_val.tar`), prepares imagenet2012 from them
with TFDS's own builder, and times `tfds_pipeline.TfdsDataset` as train.py
and evaluators/classification.py consume it (`input_pipeline.prefetch`,
one `eval_batches` per evaluation) beside the Flax ImageNet example's own
input, imported from PATH (its `examples/imagenet` folder: `git clone
https://github.com/google/flax`): its train.py's `create_input_iter`
(`input_pipeline.create_split`, `prepare_tf_data`,
`jax_utils.prefetch_to_device(it, 2)`) with its default config's values,
for training (`epochs` epochs) and evaluation (`eval_passes` passes over
the split), in each precision of `dtypes` (the example's `dtype`:
tf.float32, or tf.bfloat16), in alternating order, `rounds` times; one
table of each one's median images/s (evaluation: examples counted,
padding excluded), their ratio, each round's ratio, and the medians of
images per CPU-second of the process.
"""

import gc
import itertools
import os
import statistics
import sys
import tarfile
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
from data import folder_listing
from data import folder_pipeline  # pylint: disable=g-import-not-at-top
from data import image_preprocessing
import input_pipeline
from data import tfds_pipeline
from runtime import console
import flax_example
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
flags.DEFINE_enum('compare', '', ['', 'flax_example'], '"flax_example": '
                  'time the TFDS pipeline beside the Flax ImageNet example\'s '
                  'on imagenet2012 (see the module docstring).')
flags.DEFINE_integer('rounds', 5, 'With --compare: alternating rounds; the '
                     'median counts.')
flags.DEFINE_integer('eval_batch_size', 64, 'With --compare: global '
                     'evaluation batch.')
flags.DEFINE_integer('eval_passes', 2, 'With --compare: evaluations timed.')
flags.DEFINE_string('flax_example_dir', '', 'With --compare: the Flax '
                    'ImageNet example whose own input is timed, e.g. '
                    'flax/examples/imagenet of `git clone '
                    'https://github.com/google/flax`.')
flags.DEFINE_multi_enum('dtypes', ['float32', 'bfloat16'],
                        ['float32', 'bfloat16'], 'With --compare: the '
                        'precisions of the images timed.')
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
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  if FLAGS.compare:
    compare_with_flax_example()
    return
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
  files = folder_listing.list_split(os.path.join(data_dir, 'jpegs', 'train'))
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



IMAGENET = 'imagenet2012:5.*.*'


def prepare_imagenet2012(data_dir: str, num_images: int) -> float:
  """imagenet2012 in `data_dir`, prepared by TFDS's builder from written
  ILSVRC2012 tar files of `num_images` JPEGs per split (10 classes);
  returns the mean JPEG KB. Kept when `data_dir` holds it already."""
  builder = tfds.builder(IMAGENET, data_dir=data_dir)
  manual_dir = os.path.join(data_dir, 'ilsvrc2012')
  if builder.is_prepared():
    return np.mean([os.path.getsize(os.path.join(manual_dir, name))
                    for name in os.listdir(manual_dir)
                    if name.endswith('.JPEG')]) / 1000
  os.makedirs(manual_dir, exist_ok=True)
  synsets = builder.info.features['label'].names[:NUM_CLASSES]
  rng = np.random.default_rng(0)
  sizes = []

  def jpeg(name):
    path = os.path.join(manual_dir, name)
    sizes.append(imagenet_like_jpeg(rng, path))
    return path
  with tarfile.open(os.path.join(manual_dir, 'ILSVRC2012_img_train.tar'),
                    'w') as train:
    for index, synset in enumerate(synsets):
      synset_path = os.path.join(manual_dir, f'{synset}.tar')
      with tarfile.open(synset_path, 'w') as synset_tar:
        for image in range(index, num_images, NUM_CLASSES):
          synset_tar.add(jpeg(f'{synset}_{image}.JPEG'),
                         arcname=f'{synset}_{image}.JPEG')
      train.add(synset_path, arcname=f'{synset}.tar')
  with tarfile.open(os.path.join(manual_dir, 'ILSVRC2012_img_val.tar'),
                    'w') as val:
    for image in range(1, num_images + 1):
      name = f'ILSVRC2012_val_{image:08d}.JPEG'
      val.add(jpeg(name), arcname=name)
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
  return np.mean(sizes) / 1000


def examples_per_second(batches, num_batches: int) -> tuple[float, float]:
  """Examples per second and per CPU-second (of all the process's threads)
  of `num_batches` batches after the first (pipeline warm-up), counting
  each batch's examples (its unmasked rows where it has a mask); then
  closes `batches`, so that its threads stop before the next run."""
  batches = iter(batches)
  try:
    jax.block_until_ready(next(batches))
    start, cpu_start = time.perf_counter(), time.process_time()
    examples = 0
    for batch in itertools.islice(batches, num_batches):
      jax.block_until_ready(batch)
      examples += (int(np.sum(batch['mask'])) if 'mask' in batch
                   else batch['label'].size)
    return (examples / (time.perf_counter() - start),
            examples / (time.process_time() - cpu_start))
  finally:
    if hasattr(batches, 'close'):
      batches.close()
    del batches
    gc.collect()


def project_eval_passes(dataset, batch_size: int, sharding, dtype,
                        passes: int):
  """`passes` evaluations of `dataset`, as evaluators/classification.py makes
  them."""
  for _ in range(passes):
    yield from input_pipeline.prefetch(
        dataset.eval_batches(batch_size, sharding, dtype))


# The example's modules, named as some of the project's are.
def compare_with_flax_example():
  """Prints one table: the TFDS pipeline and the Flax example's, training
  and evaluation in each precision, median images/s of alternating rounds,
  and the ratio."""
  if not FLAGS.flax_example_dir:
    raise app.UsageError('--compare=flax_example needs --flax_example_dir: '
                         'examples/imagenet of `git clone '
                         'https://github.com/google/flax`')
  example, example_config = flax_example.load(FLAGS.flax_example_dir)
  data_dir = FLAGS.data_dir or tempfile.mkdtemp()
  kilobytes = prepare_imagenet2012(data_dir, FLAGS.num_images)
  preprocessing = input_pipeline.Preprocessing.from_config(FLAGS.config)
  dataset = tfds_pipeline.TfdsDataset(IMAGENET, data_dir, preprocessing)
  builder = tfds.builder(IMAGENET, data_dir=data_dir)
  sharding = jax.sharding.NamedSharding(
      jax.make_mesh((jax.device_count(),), ('data',)),
      jax.sharding.PartitionSpec('data'))
  size = preprocessing.image_size
  batch, eval_batch = FLAGS.batch_size, FLAGS.eval_batch_size
  steps_per_epoch = dataset.info.num_train_examples // batch
  train_steps = max(int(FLAGS.epochs * steps_per_epoch) - 1, 1)
  project_eval_steps = -(-dataset.info.num_eval_examples // eval_batch)
  example_eval_steps = dataset.info.num_eval_examples // eval_batch

  def example_batches(batch_size, train, dtype):
    # As the example's train.py makes its iterators.
    return example.create_input_iter(
        builder, batch_size, size, tf.dtypes.as_dtype(dtype), train=train,
        cache=example_config.cache,
        shuffle_buffer_size=(example_config.shuffle_buffer_size if train
                             else None), prefetch=example_config.prefetch)
  runs = {}
  for dtype in FLAGS.dtypes:
    jnp_dtype = jnp.dtype(dtype)
    runs[dtype, 'train', 'project'] = lambda d=jnp_dtype: examples_per_second(
        input_pipeline.prefetch(dataset.train_batches(
            batch, 0, 0, sharding, d)), train_steps)
    runs[dtype, 'train', 'example'] = lambda d=dtype: examples_per_second(
        example_batches(batch, True, d), train_steps)
    # A data set of its own each round, as the example's pipeline is new
    # each round: no batches decoded ahead during the other runs.
    runs[dtype, 'eval', 'project'] = lambda d=jnp_dtype: examples_per_second(
        project_eval_passes(
            tfds_pipeline.TfdsDataset(IMAGENET, data_dir, preprocessing),
            eval_batch, sharding, d, FLAGS.eval_passes),
        FLAGS.eval_passes * project_eval_steps - 1)
    runs[dtype, 'eval', 'example'] = lambda d=dtype: examples_per_second(
        example_batches(eval_batch, False, d),
        FLAGS.eval_passes * example_eval_steps - 1)
  rates = {key: [] for key in runs}
  for round_index in range(FLAGS.rounds):
    # A, B, A, B: which one goes first alternates too.
    order = (('project', 'example') if round_index % 2 == 0
             else ('example', 'project'))
    for dtype in FLAGS.dtypes:
      for split in ('train', 'eval'):
        for pipeline in order:
          rates[dtype, split, pipeline].append(
              runs[dtype, split, pipeline]())
  print(f'{os.cpu_count()} CPU cores, {jax.device_count()} '
        f'{jax.devices()[0].platform} device(s), load average '
        f'{os.getloadavg()[0]:.1f}; median of {FLAGS.rounds} alternating '
        f'rounds; imagenet2012 of {FLAGS.num_images} JPEGs per split, mean '
        f'{kilobytes:.0f} KB; {size} px; train: batch {batch}, '
        f'{train_steps} steps timed ({FLAGS.epochs:g} epochs of '
        f'{steps_per_epoch}); eval: batch {eval_batch}, {FLAGS.eval_passes} '
        f'passes; {preprocessing}')
  print_comparison(rates)


def print_comparison(rates: dict) -> None:
  """The table of `rates` {(dtype, split, pipeline): each round's (images/s,
  images per CPU-second)}."""
  # Images per CPU-second: what the pipelines cost, less sensitive than
  # images/s to what else runs on a shared machine. Each round's ratio
  # compares runs a few seconds apart.
  print('| precision | input | project images/s | example images/s | '
        'project / example | median of rounds\' ratios | each round\'s '
        'project / example | project images per CPU-s | example images per '
        'CPU-s | project / example (CPU) |')
  print('| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |')
  for dtype in FLAGS.dtypes:
    for split in ('train', 'eval'):
      ours, theirs = (
          [statistics.median(rate[k] for rate in rates[dtype, split, p])
           for k in (0, 1)] for p in ('project', 'example'))
      ratios = [a[0] / b[0] for a, b in zip(rates[dtype, split, 'project'],
                                            rates[dtype, split, 'example'])]
      print(f'| {dtype} | {split} | {ours[0]:.0f} | {theirs[0]:.0f} | '
            f'{ours[0] / theirs[0]:.2f} | {statistics.median(ratios):.2f} | '
            f'{" ".join(f"{r:.2f}" for r in ratios)} | {ours[1]:.0f} | '
            f'{theirs[1]:.0f} | {ours[1] / theirs[1]:.2f} |')


if __name__ == '__main__':
  app.run(main)
