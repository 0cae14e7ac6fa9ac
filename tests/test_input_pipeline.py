"""TFDS input: preprocessing, determinism and resume, exactly-once eval.

imagenet2012 is prepared by TFDS's own builder from ILSVRC2012 tar files
that the tests write (real JPEGs, a few per split). The `data_dir` route
and per-process parts use a data set that the tests prepare with TFDS from
PNG files they write. mnist is mocked by TFDS itself
(`MockPolicy.USE_CODE`).
"""

import collections
import contextlib
import dataclasses
import functools
import os
import re
import tarfile

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.testing import test_utils as tfds_test_utils

from runtime import config_error
from configs import deit_s16
from configs import finetune
from configs import imagenet
from configs import imagenet_vit
from data import datasets
import input_pipeline
from data import tfds_pipeline
import train
from helpers import MEAN
from helpers import PREPROCESSING
from helpers import SIZE
from helpers import STDDEV
from helpers import batch_sharding
from helpers import host_batches
from helpers import masked_examples
from helpers import read_scalars
from helpers import reference_eval_image
from image_data import prepare_tiny_images

IMAGENET = 'imagenet2012:5.*.*'
NUM_EXAMPLES = 45  # per split of the prepared imagenet2012: odd on purpose
IMAGENET_CLASSES = ('n01440764', 'n01443537', 'n01484850')  # its first three


class _NoFileSystemMock:
  """Stands in for TFDS's MockFs, which TFDS enters around every mocked
  `as_dataset` call only to make the builder's data directory exist.

  MockFs patches the file functions of the whole process: a checkpoint
  that the training loop writes while the input pipeline's thread calls
  `as_dataset` would land in MockFs' temporary directory, and two
  overlapping calls restore each other's patches, leaving one behind for
  every later test. `mocked_tfds` answers the existence check instead.
  """

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    return False

  def add_file(self, path, content=None):
    del path, content


@contextlib.contextmanager
def mocked_tfds(monkeypatch, num_examples):
  """TFDS's own mock of every data set (`MockPolicy.USE_CODE`), safe to
  read from several threads."""
  # TFDS's data directory in this mode; a builder's own is NAME/VERSION.
  builder_dir = re.compile(r'/tmp/non-existing/tfds/data_dir/[^/]+/[0-9.]+')
  path_class = type(epath.Path('/'))
  real_exists = path_class.exists
  monkeypatch.setattr(path_class, 'exists', lambda self: bool(
      builder_dir.fullmatch(os.fspath(self))) or real_exists(self))
  monkeypatch.setattr(tfds_test_utils, 'MockFs', _NoFileSystemMock)
  with tfds.testing.mock_data(num_examples=num_examples,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    yield


def write_ilsvrc2012_tars(directory, rng):
  """ILSVRC2012_img_train.tar (a tar of one tar of JPEGs per class) and
  ILSVRC2012_img_val.tar (flat, ILSVRC2012_val_00000001.JPEG, ...): the
  layout of the published files, NUM_EXAMPLES JPEGs of a few sizes each."""

  def add_jpeg(archive, name):
    shape = (rng.integers(20, 48), rng.integers(20, 48), 3)
    path = directory / name
    PIL.Image.fromarray(rng.integers(0, 256, shape, np.uint8)).save(
        path, format='JPEG')
    archive.add(path, arcname=name)
    path.unlink()

  with tarfile.open(directory / 'ILSVRC2012_img_train.tar', 'w') as train:
    for index, synset in enumerate(IMAGENET_CLASSES):
      with tarfile.open(directory / f'{synset}.tar', 'w') as synset_tar:
        for image in range(index, NUM_EXAMPLES, len(IMAGENET_CLASSES)):
          add_jpeg(synset_tar, f'{synset}_{image}.JPEG')
      train.add(directory / f'{synset}.tar', arcname=f'{synset}.tar')
  with tarfile.open(directory / 'ILSVRC2012_img_val.tar', 'w') as val:
    for image in range(1, NUM_EXAMPLES + 1):
      add_jpeg(val, f'ILSVRC2012_val_{image:08d}.JPEG')


@pytest.fixture(scope='module')
def imagenet_data_dir(tmp_path_factory):
  """A data dir holding imagenet2012, prepared by TFDS's imagenet2012
  builder from written ILSVRC2012 tar files."""
  manual_dir = tmp_path_factory.mktemp('ilsvrc2012')
  write_ilsvrc2012_tars(manual_dir, np.random.default_rng(0))
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  # Four record files per split, so that batches of 8 come from four
  # virtual shards.
  tfds.builder(IMAGENET, data_dir=data_dir).download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=manual_dir,
                                                   num_shards=4))
  return data_dir


def split_examples(split, data_dir=None, name=IMAGENET):
  """(encoded or decoded images, labels) of `split`, read by TFDS directly."""
  builder = tfds.builder(name, data_dir=data_dir)
  jpeg = builder.info.features['image'].encoding_format == 'jpeg'
  decoders = {'image': tfds.decode.SkipDecoding()} if jpeg else None
  examples = list(builder.as_dataset(split=split, decoders=decoders)
                  .as_numpy_iterator())
  return ([e['image'] for e in examples],
          np.array([e['label'] for e in examples]))


def test_imagenet_batches_have_shapes_dtypes_ranges_and_labels(
    imagenet_data_dir):
  # Bilinear training crops stay within [0, 255] (bicubic overshoots).
  dataset = tfds_pipeline.TfdsDataset(
      IMAGENET, imagenet_data_dir, dataclasses.replace(
          PREPROCESSING, resize_method='bilinear'))
  assert dataset.info == input_pipeline.DatasetInfo(
      1000, (SIZE, SIZE, 3), NUM_EXAMPLES, NUM_EXAMPLES,
      tuple(tfds.builder(IMAGENET).info.features['label'].names))
  assert dataset.info.class_names[:3] == IMAGENET_CLASSES
  jpegs, labels = split_examples('validation', imagenet_data_dir)

  # Evaluation: float32, the reference crop of every example, in order.
  batches = list(dataset.eval_batches(8, batch_sharding(8), jnp.float32))
  assert [b['image'].dtype for b in batches] == [jnp.float32] * 6
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

  # Training: bfloat16 normalised pixels of [0, 255]; one epoch is five
  # batches of 8 examples of the split (distinct examples per epoch are
  # tested with labels that name examples, in test_data_order.py).
  train_iter = dataset.train_batches(8, 0, 0, batch_sharding(8), jnp.bfloat16)
  epoch = [next(train_iter) for _ in range(5)]
  assert all(b['image'].dtype == jnp.bfloat16 for b in epoch)
  assert all(b['label'].dtype == jnp.int32 for b in epoch)
  pixels = np.concatenate([np.asarray(b['image'], np.float32)
                           for b in epoch]) * STDDEV + MEAN
  assert pixels.shape == (40, SIZE, SIZE, 3)
  assert -1.0 <= pixels.min() and pixels.max() <= 256.0  # bfloat16 rounding
  assert pixels.std() > 10  # real image content, not padding
  epoch_labels = collections.Counter(
      np.concatenate([np.asarray(b['label']) for b in epoch]).tolist())
  assert sum(epoch_labels.values()) == 40
  assert set(epoch_labels) == {0, 1, 2}


def test_train_batches_are_a_function_of_seed_and_step(imagenet_data_dir):
  dataset = tfds_pipeline.TfdsDataset(IMAGENET, imagenet_data_dir,
                                       PREPROCESSING)
  sharding = batch_sharding(8)
  # 45 examples, batch 8: five steps per epoch; steps 0-14 span three.
  uninterrupted = host_batches(
      dataset.train_batches(8, 7, 0, sharding, jnp.float32), 15)
  # A restart from the checkpoint of step 7 (mid-epoch 1) reads steps 7-14.
  resumed = host_batches(dataset.train_batches(8, 7, 7, sharding, jnp.float32),
                         8)
  jax.tree.map(np.testing.assert_array_equal, resumed, uninterrupted[7:])
  # Epochs reshuffle and re-augment; another seed reads other batches.
  assert not np.array_equal(uninterrupted[0]['image'],
                            uninterrupted[5]['image'])
  other_seed = host_batches(
      dataset.train_batches(8, 8, 0, sharding, jnp.float32), 1)
  assert not np.array_equal(other_seed[0]['image'], uninterrupted[0]['image'])


@pytest.mark.parametrize('num_devices,batch_size', [(1, 4), (8, 8)])
def test_eval_covers_the_split_exactly_once(imagenet_data_dir, num_devices,
                                            batch_size):
  dataset = tfds_pipeline.TfdsDataset(IMAGENET, imagenet_data_dir,
                                       PREPROCESSING)
  batches = list(dataset.eval_batches(batch_size, batch_sharding(num_devices),
                                      jnp.float32))
  assert len(batches) == -(-NUM_EXAMPLES // batch_size)
  assert all(b['image'].sharding == batch_sharding(num_devices)
             for b in batches)
  _, labels = masked_examples(batches)
  np.testing.assert_array_equal(
      labels, split_examples('validation', imagenet_data_dir)[1])
  # Padding rows are masked out and hold zero images.
  last = batches[-1]
  padding = ~np.asarray(last['mask'])
  assert padding.sum() == len(batches) * batch_size - NUM_EXAMPLES
  assert not np.asarray(last['image'])[padding].any()


def test_grey_images_are_normalised_by_the_average_channel_statistics(
    monkeypatch):
  """mnist (one channel, PNG), mocked by TFDS: ImageNet's mean and standard
  deviation averaged over the three channels."""
  with mocked_tfds(monkeypatch, 5):
    dataset = tfds_pipeline.TfdsDataset('mnist', None, PREPROCESSING)
    images, labels = masked_examples(
        dataset.eval_batches(4, batch_sharding(1), jnp.float32))
    pixels, expected_labels = split_examples('test', name='mnist')
  assert dataset.info.image_shape == (SIZE, SIZE, 1)
  np.testing.assert_array_equal(labels, expected_labels)
  grey_mean, grey_stddev = np.float32(MEAN.mean()), np.float32(STDDEV.mean())
  np.testing.assert_allclose(
      images, np.stack([reference_eval_image(p, mean=grey_mean,
                                             stddev=grey_stddev)
                        for p in pixels]), atol=1e-5)
  assert images.std() > 0.1  # distinct random images, not constant ones


def tiny_images_config(data_dir, **overrides):
  """The ImageNet config on `tiny_images` in `data_dir`, at SIZE."""
  config = imagenet.get_config()
  config.update(dataset='tiny_images', data_dir=data_dir, image_size=SIZE,
                eval_split='')  # its held-out split is 'test'
  config.update(overrides)
  return config


def open_tiny_images(data_dir, **overrides):
  """The data set of `tiny_images_config`."""
  return datasets.create_dataset(input_pipeline.DataSource.from_config(
      tiny_images_config(data_dir, **overrides)))


def test_data_dir_route_reads_a_data_set_prepared_by_tfds(tiny_data_dir):
  dataset = open_tiny_images(tiny_data_dir)
  assert dataset.info == input_pipeline.DatasetInfo(
      19, (SIZE, SIZE, 3), 19, 7, tuple(str(i) for i in range(19)))
  pngs, labels = split_examples('test', tiny_data_dir, 'tiny_images')
  images, eval_labels = masked_examples(
      dataset.eval_batches(4, batch_sharding(1), jnp.float32))
  np.testing.assert_array_equal(eval_labels, labels)
  # PNGs decode whole, then crop: exactly the reference.
  np.testing.assert_allclose(
      images, np.stack([reference_eval_image(p) for p in pngs]), atol=1e-5)
  # An epoch of 19 examples at batch 8: two batches of distinct examples.
  epoch = host_batches(
      dataset.train_batches(8, 0, 0, batch_sharding(8), jnp.float32), 2)
  epoch_labels = np.concatenate([b['label'] for b in epoch])
  assert len(set(epoch_labels.tolist())) == 16


@pytest.mark.parametrize('method, normalization', [
    ('area', 'minus_one_to_one'), ('bilinear', 'imagenet')])
def test_eval_resizes_and_normalises_as_configured(tiny_data_dir, method,
                                                   normalization):
  dataset = open_tiny_images(
      tiny_data_dir, eval_resize_method=method, normalization=normalization)
  pngs, _ = split_examples('test', tiny_data_dir, 'tiny_images')
  images, _ = masked_examples(
      dataset.eval_batches(4, batch_sharding(1), jnp.float32))
  mean, stddev = input_pipeline.NORMALIZATIONS[normalization]
  reference = np.stack([reference_eval_image(p, method, np.array(mean),
                                             np.array(stddev)) for p in pngs])
  np.testing.assert_allclose(images, reference, atol=1e-5)
  # The method matters: the default (bicubic) gives other pixels.
  bicubic = np.stack([reference_eval_image(p, 'bicubic', np.array(mean),
                                           np.array(stddev)) for p in pngs])
  assert np.abs(images - bicubic).max() > 0.05


def test_randaugment_training_batches_are_a_function_of_seed_and_step(
    tiny_data_dir):
  plain = open_tiny_images(
      tiny_data_dir, normalization='minus_one_to_one')
  augmented = open_tiny_images(
      tiny_data_dir, normalization='minus_one_to_one', randaug_num_layers=2,
      randaug_magnitude=10)
  sharding = batch_sharding(8)
  # 19 examples, batch 8: two steps per epoch, so steps 0-3 span 2 epochs.
  uninterrupted = host_batches(
      augmented.train_batches(8, 3, 0, sharding, jnp.float32), 4)
  resumed = host_batches(
      augmented.train_batches(8, 3, 1, sharding, jnp.float32), 3)
  jax.tree.map(np.testing.assert_array_equal, resumed, uninterrupted[1:])
  unaugmented = host_batches(
      plain.train_batches(8, 3, 0, sharding, jnp.float32), 1)
  # Same examples and crops, other pixels.
  np.testing.assert_array_equal(unaugmented[0]['label'],
                                uninterrupted[0]['label'])
  assert np.abs(unaugmented[0]['image'] - uninterrupted[0]['image']).mean(
  ) > 0.05
  # RandAugment works on uint8 pixels: every value is one of 256 levels.
  levels = uninterrupted[0]['image'] * 127.5 + 127.5
  np.testing.assert_allclose(levels, np.round(levels), atol=1e-3)


def test_every_evaluation_covers_the_split_once_after_one_left_early(
    imagenet_data_dir):
  """The evaluation pipeline serves every evaluation: after one read to its
  end and one left after two batches, each evaluation still yields the
  batches of a newly built data set, every example once."""
  sharding = batch_sharding(1)
  fresh = masked_examples(tfds_pipeline.TfdsDataset(
      IMAGENET, imagenet_data_dir, PREPROCESSING).eval_batches(
          4, sharding, jnp.float32))
  dataset = tfds_pipeline.TfdsDataset(IMAGENET, imagenet_data_dir,
                                       PREPROCESSING)
  evaluations = [list(dataset.eval_batches(4, sharding, jnp.float32))]
  left_early = dataset.eval_batches(4, sharding, jnp.float32)
  next(left_early), next(left_early)
  evaluations += [list(dataset.eval_batches(4, sharding, jnp.float32))
                  for _ in range(2)]
  for batches in evaluations:
    assert len(batches) == -(-NUM_EXAMPLES // 4)
    images, labels = masked_examples(batches)
    np.testing.assert_array_equal(
        labels, split_examples('validation', imagenet_data_dir)[1])
    np.testing.assert_array_equal(images, fresh[0])


def test_each_process_evaluates_a_disjoint_part(tiny_data_dir):
  """Three processes' parts of the test split: disjoint, together
  everything. (Training batches: test_data_order.py.)"""
  eval_labels = []
  for process in range(3):
    dataset = tfds_pipeline.TfdsDataset('tiny_images', tiny_data_dir,
                                         PREPROCESSING,
                                         process_index=process,
                                         process_count=3)
    # Global batch 6: 2 rows per process. Each process's part of the 7 test
    # examples (3, 2, 2) is padded to as many batches as the largest needs.
    batches = list(dataset.eval_batches(6, batch_sharding(1), jnp.float32))
    assert len(batches) == 2
    eval_labels.append(masked_examples(batches)[1])
  np.testing.assert_array_equal(np.sort(np.concatenate(eval_labels)),
                                np.arange(7))


def test_a_data_set_not_prepared_is_one_error_with_the_command(tmp_path):
  empty = str(tmp_path)
  with pytest.raises(config_error.ConfigError) as error:
    train.train_and_evaluate(tiny_images_config(empty), str(tmp_path / 'workdir'))
  message = str(error.value)
  assert '\n' not in message
  assert f'not prepared in {empty}' in message
  assert (f'`tfds build tiny_images --data_dir={empty} '
          '--manual_dir=MANUAL_DIR`') in message
  assert '(see docs/data.md)' in message  # where the tfds build steps are
  assert not os.path.exists(tmp_path / 'workdir')  # nothing written

  with pytest.raises(ValueError, match=(
      'put ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar .* run '
      f'`tfds build imagenet2012 --data_dir={empty} --manual_dir=MANUAL_DIR`')):
    open_tiny_images(empty, dataset=IMAGENET)
  with pytest.raises(ValueError, match="unknown dataset 'imagenet2013'; "
                     'valid names: digits, fake, digits_0to4, folder:PATH '
                     r'\(image folders\), or a TFDS'):
    open_tiny_images(empty, dataset='imagenet2013')


def test_a_data_set_of_array_record_files_is_refused_with_the_command(
    tmp_path_factory, tmp_path):
  data_dir, _ = prepare_tiny_images(tmp_path_factory, 'array_record')
  with pytest.raises(config_error.ConfigError, match=(
      'tiny_images is prepared as array_record files; the trainer reads '
      'TFRecord files: prepare it again with `tfds build tiny_images '
      '--file_format=tfrecord`')):
    train.train_and_evaluate(tiny_images_config(data_dir), str(tmp_path))
  assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize('recipe, shrunk, grad_accum_steps', [
    (imagenet.get_config, dict(model='SmallResNet', num_layers=1, width=8,
                               image_size=SIZE, scan_unroll=8), 1),
    # RandAugment, mixup, AdamW, pre-logits: the whole ViT recipe, and
    # accumulation (its arithmetic: tests/test_grad_accum.py).
    (imagenet_vit.get_config, dict(model='ViT_Ti16', num_layers=1,
                                   image_size=32), 4),
    # DeiT's: stochastic depth, CutMix, erasing, repeats, the moving average.
    (deit_s16.get_config, dict(model='ViT_Ti16', num_layers=2, image_size=32,
                               min_learning_rate=1e-6), 1),
    # MAE's linear probe: a frozen network, the feature BatchNorm, LARS.
    (functools.partial(finetune.get_config, 'vit_b16_mae,linear_probe'),
     dict(model='ViT_Ti16', num_layers=2, image_size=32), 1),
], ids=['imagenet', 'imagenet_vit', 'deit_s16', 'mae_linear_probe'])
def test_shrunk_imagenet_configs_train_evaluate_and_checkpoint(
    imagenet_data_dir, tmp_path, recipe, shrunk, grad_accum_steps):
  config = recipe()
  # The config with a small model and images, and two steps; micro-batches
  # of one example per device.
  config.update(data_dir=imagenet_data_dir, batch_size=8 * grad_accum_steps,
                grad_accum_steps=grad_accum_steps, num_train_steps=2,
                log_every_steps=1, eval_every_steps=2,
                checkpoint_every_steps=2, **shrunk)
  workdir = str(tmp_path)
  state = train.train_and_evaluate(config, workdir)
  assert int(state.step) == 2
  assert os.listdir(os.path.join(workdir, 'checkpoints')) == ['2']
  scalars = read_scalars(workdir)
  assert sorted(scalars['train_loss']) == [1, 2]
  assert all(np.isfinite(v) for v in scalars['train_loss'].values())
  # Every example once; the last eval batch is partial.
  assert scalars['eval_examples'] == {2: NUM_EXAMPLES}
  assert 0 <= scalars['eval_accuracy'][2] <= scalars['eval_top5_accuracy'][
      2] <= 1


def test_repeated_sequence_positions_spread_copies_over_the_batch():
  # Batch 8, 3 copies: examples' copies at positions 3i, 3i+1, 3i+2 of
  # the sequence, rows a third of the batch apart.
  positions = input_pipeline.sequence_positions(8, 3)
  np.testing.assert_array_equal(positions, [0, 3, 6, 1, 4, 7, 2, 5])
  np.testing.assert_array_equal(input_pipeline.sequence_positions(8, 1),
                                np.arange(8))
  order = input_pipeline.epoch_order(40, 0, 0)
  # 40 examples, 5 steps an epoch: the first 40 / 3 of the order, 3 times.
  epoch = np.concatenate([input_pipeline.train_indices(40, 8, 0, step, 3)
                          for step in range(5)])
  values, counts = np.unique(epoch, return_counts=True)
  np.testing.assert_array_equal(np.sort(values), np.sort(order[:14]))
  assert counts.sum() == 40 and counts.max() == 3
  np.testing.assert_array_equal(
      input_pipeline.train_indices(40, 8, 0, 1, 3),
      order[(8 + positions) // 3])
  np.testing.assert_array_equal(input_pipeline.train_indices(40, 8, 0, 6),
                                input_pipeline.epoch_order(40, 0, 1)[8:16])
