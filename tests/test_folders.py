"""Image folders (`--config.dataset=folder:PATH`): real image files of
several formats written by the tests, read by the real pipeline."""

import importlib
import json
import os
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import pytest
import safetensors
import tensorflow as tf

from runtime import checkpointing
from runtime import config_error
from data import datasets
import export
from data import folder_listing
from data import folder_pipeline
from data import image_preprocessing
import input_pipeline
import predict
import train
from helpers import PREPROCESSING
from helpers import REPO
from helpers import SIZE
from helpers import assert_same_state
from helpers import batch_sharding
from helpers import copy_checkpoint
from helpers import events
from helpers import host_batches
from helpers import masked_examples
from helpers import read_scalars
from helpers import reference_eval_image
from helpers import tiny_config
from image_data import CLASSES
from image_data import SORTED_CLASSES
from image_data import save_image
from image_data import write_folders


@pytest.fixture
def folders(tmp_path):
  root = str(tmp_path / 'images')
  return root, write_folders(root, corrupt=True)


def test_labels_are_the_indices_of_the_sorted_class_folder_names(folders):
  root, written = folders
  dataset = folder_pipeline.ImageFolderDataset(root, PREPROCESSING)
  assert dataset.info.class_names == SORTED_CLASSES
  assert dataset.info.num_classes == 3
  # 24 written training images and the corrupt one; the text file skipped.
  assert dataset.info.num_train_examples == 25
  assert dataset.info.num_eval_examples == 9
  listing = folder_listing.list_split(os.path.join(root, 'train'))
  for path, label in zip(listing.files, listing.labels):
    assert SORTED_CLASSES[label] == os.path.basename(os.path.dirname(path))
  assert dataset.skipped() == {'data_skipped_files': 2,
                               'data_skipped_images': 0}


def test_every_format_evaluates_to_the_reference_crop_of_its_pixels(folders):
  root, written = folders
  dataset = folder_pipeline.ImageFolderDataset(root, PREPROCESSING)
  images, labels = masked_examples(dataset.eval_batches(
      4, batch_sharding(1), jnp.float32))
  paths = folder_listing.list_split(os.path.join(root, 'val')).files
  assert [os.path.basename(os.path.dirname(p)) for p in paths] == [
      SORTED_CLASSES[label] for label in labels]
  for image, path in zip(images, paths):
    reference = reference_eval_image(written[path])
    if path.endswith('.JPEG'):  # TensorFlow's and Pillow's libjpeg differ
      assert np.abs(image - reference).mean() < 0.05, path
    else:
      np.testing.assert_allclose(image, reference, atol=1e-5, err_msg=path)


@pytest.mark.parametrize('num_devices,batch_size', [(1, 4), (8, 8)])
def test_eval_counts_every_image_once_on_any_device_count(
    folders, num_devices, batch_size):
  root, _ = folders
  dataset = folder_pipeline.ImageFolderDataset(root, PREPROCESSING)
  batches = list(dataset.eval_batches(batch_size, batch_sharding(num_devices),
                                      jnp.float32))
  assert len(batches) == -(-9 // batch_size)
  images, labels = masked_examples(batches)
  assert len(labels) == 9
  np.testing.assert_array_equal(labels, np.repeat([0, 1, 2], 3))
  # Every image once: no two rows alike.
  assert len({image.tobytes() for image in images}) == 9
  padding = ~np.concatenate([np.asarray(b['mask']) for b in batches])
  assert padding.sum() == len(batches) * batch_size - 9


def test_training_batches_are_a_function_of_seed_and_step_for_any_rows(
    folders):
  root, _ = folders
  dataset = folder_pipeline.ImageFolderDataset(root, PREPROCESSING)
  all_rows = np.arange(8)
  # 25 files, batch 8: 3 steps an epoch; 7 steps cross two epoch ends.
  uninterrupted = host_batches(dataset.local_train_batches(
      8, 5, 0, all_rows, np.float32), 7)
  resumed = host_batches(dataset.local_train_batches(
      8, 5, 4, all_rows, np.float32), 3)
  jax.tree.map(np.testing.assert_array_equal, resumed, uninterrupted[4:])
  # Two processes, each reading its own rows, read the same batches.
  halves = [host_batches(dataset.local_train_batches(
      8, 5, 0, rows, np.float32), 7) for rows in (all_rows[:4], all_rows[4:])]
  for step, batch in enumerate(uninterrupted):
    for key in batch:
      np.testing.assert_array_equal(
          np.concatenate([halves[0][step][key], halves[1][step][key]]),
          batch[key])
  # Each epoch reads distinct files, reshuffled and re-augmented.
  epoch = np.concatenate([b['image'] for b in uninterrupted[:3]])
  assert len({image.tobytes() for image in epoch}) == 24
  assert not np.array_equal(uninterrupted[0]['image'],
                            uninterrupted[3]['image'])


def test_an_unreadable_image_is_replaced_in_training_and_masked_in_eval(
    tmp_path):
  root = str(tmp_path / 'images')
  write_folders(root, per_class=(4, 2), extras=False)
  files = folder_listing.list_split(os.path.join(root, 'train')).files
  cats = [path for path in files if '/cat/' in path]
  bad_train, next_train = cats[1], cats[2]
  bad_eval = folder_listing.list_split(os.path.join(root, 'val')).files[-1]
  for path in (bad_train, bad_eval):
    with open(path, 'r+b') as f:
      f.truncate(20)
  dataset = folder_pipeline.ImageFolderDataset(root, PREPROCESSING)
  rows = np.arange(4)
  # Twelve files, batch 4: the epoch is 3 steps, every file once.
  epoch = host_batches(dataset.local_train_batches(4, 0, 0, rows,
                                                   np.float32), 3)
  assert all(len(b['label']) == 4 for b in epoch)
  images = np.concatenate([b['image'] for b in epoch])
  labels = np.concatenate([b['label'] for b in epoch])
  # The bad file's place holds the next readable file of the listing,
  # cropped and flipped with the bad file's random seed.
  position = list(input_pipeline.epoch_order(12, 0, 0)).index(
      files.index(bad_train))
  epoch_seed = np.random.SeedSequence([0, 0]).generate_state(1, np.uint32)[0]
  expected = image_preprocessing.train_image(
      tf.io.read_file(next_train), tf.constant([epoch_seed, position],
                                               tf.int64),
      PREPROCESSING, image_preprocessing.ANY, 3).numpy()
  np.testing.assert_array_equal(images[position], expected)
  assert labels[position] == SORTED_CLASSES.index('cat')
  assert dataset.skipped()['data_skipped_images'] == 1
  # The next epoch meets it again: still one unreadable image.
  host_batches(dataset.local_train_batches(4, 0, 3, rows, np.float32), 3)
  assert dataset.skipped()['data_skipped_images'] == 1

  images, labels = masked_examples(dataset.eval_batches(
      4, batch_sharding(1), jnp.float32))
  assert len(labels) == 5  # of 6: the unreadable one masked out
  np.testing.assert_array_equal(labels, [0, 0, 1, 1, 2])
  assert dataset.skipped()['data_skipped_images'] == 2


@pytest.mark.parametrize('make, message', [
    (lambda root: None, r"a data set is missing: dataset folder:.*missing: "
     r"folder '.*missing' does not exist: put the images in its "
     r'train/<class>/ and val/<class>/ folders, or set --config.dataset to '
     r'the folder:PATH where they are'),
    (lambda root: os.makedirs(os.path.join(root, 'val', 'a')),
     r"has no train/ folder \(it holds: val\); put the training images in "
     r'.*/train/<class>/'),
    (lambda root: os.makedirs(os.path.join(root, 'train', 'a')),
     r'has none of the evaluation folders val/, validation/, test/'),
    (lambda root: [os.makedirs(os.path.join(root, split)) for split in
                   ('train', 'val')],
     r"/train' has no class folders \(0 files directly in it\); move each "
     r'image into .*train/<class>/'),
    (lambda root: [os.makedirs(os.path.join(root, 'train', 'a')),
                   os.makedirs(os.path.join(root, 'val', 'a'))],
     r"class folder '.*/train/a' holds no images \(.jpg, .jpeg, .png, .bmp, "
     r'.gif, .webp\); add its images or remove it'),
    (lambda root: [write_folders(root, per_class=(1, 1), extras=False),
                   os.rename(os.path.join(root, 'val', 'cat'),
                             os.path.join(root, 'val', 'kitten'))],
     r"the class folders of '.*/train' and '.*/val' differ: only in the "
     r'first: cat; only in the second: kitten; give both splits the same '
     r'class folders'),
    (lambda root: write_folders(root, per_class=(2, 1), extras=False),
     r'batch_size 16 exceeds the 6 training examples; use a batch_size of at '
     r'most 6'),
])
def test_bad_folders_are_refused_before_anything_is_written(tmp_path, make,
                                                             message):
  root = str(tmp_path / 'missing')
  make(root)
  workdir = tmp_path / 'workdir'
  config = tiny_config(dataset=f'folder:{root}', image_size=SIZE)
  with pytest.raises(config_error.ConfigError, match=message):
    train.train_and_evaluate(config, str(workdir))
  assert not workdir.exists()


def test_a_flat_validation_folder_points_to_the_rearrangement(tmp_path):
  root = tmp_path / 'imagenet'
  write_folders(str(root), per_class=(1, 0), extras=False)
  for name in os.listdir(root / 'val'):
    os.rmdir(root / 'val' / name)
  (root / 'val' / 'ILSVRC2012_val_00000001.JPEG').write_bytes(b'')
  with pytest.raises(ValueError, match=r"val' has no class folders \(1 files "
                     r"directly in it\).*for ImageNet's flat val/, see "
                     r'docs/data.md'):
    folder_pipeline.ImageFolderDataset(str(root), PREPROCESSING)


def folder_config(root, **overrides):
  return tiny_config(**{'dataset': f'folder:{root}', 'image_size': SIZE,
                        'batch_size': 8, 'num_train_steps': 6,
                        'eval_every_steps': 3, 'checkpoint_every_steps': 3,
                        **overrides})


def test_training_evaluates_checkpoints_class_names_and_predict_names_them(
    tmp_path, folders):
  root, written = folders
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(folder_config(root), workdir)
  scalars = read_scalars(workdir)
  assert scalars['eval_examples'] == {3: 9.0, 6: 9.0}
  assert scalars['data_skipped_files'][6] == 2.0
  step_dir = os.path.join(workdir, 'checkpoints', '6')
  assert checkpointing.saved_class_names(step_dir) == list(SORTED_CLASSES)

  image = sorted(written)[-1]
  lines = predict.predict(workdir, [image])
  assert lines[0].split()[0] == image
  names = [entry.split(':')[0] for entry in lines[0].split()[1:]]
  assert sorted(names) == sorted(SORTED_CLASSES)
  probabilities = [float(entry.split(':')[1])
                   for entry in lines[0].split()[1:]]
  assert abs(sum(probabilities) - 1) < 1e-3

  # export.py keeps them.
  exported = str(tmp_path / 'model.safetensors')
  export.export(workdir, exported)
  with safetensors.safe_open(exported, 'np') as f:
    assert json.loads(f.metadata()['class_names']) == list(SORTED_CLASSES)

  # The data moved elsewhere resumes; other classes are refused by name.
  moved = str(tmp_path / 'moved')
  os.rename(root, moved)
  train.train_and_evaluate(folder_config(moved, num_train_steps=9), workdir)
  os.rename(os.path.join(moved, 'train', 'zebra'),
            os.path.join(moved, 'train', 'horse'))
  os.rename(os.path.join(moved, 'val', 'zebra'),
            os.path.join(moved, 'val', 'horse'))
  with pytest.raises(config_error.ConfigError, match=(
      'the checkpoint at step 9 was trained on other classes than this data '
      'set has \\(only in the checkpoint: zebra; only in the data set: '
      'horse\\)')):
    train.train_and_evaluate(folder_config(moved, num_train_steps=12),
                             workdir)


def test_predict_reads_any_image_as_a_digit_and_names_digits(tmp_path):
  workdir = str(tmp_path / 'digits')
  train.train_and_evaluate(tiny_config(num_train_steps=2), workdir)
  from sklearn import datasets as sklearn_datasets  # pylint: disable=g-import-not-at-top
  digits = sklearn_datasets.load_digits()
  paths = []
  # Training's normalisation: the statistics of its 1,437 training digits.
  train_digits = digits.images[np.random.default_rng(0).permutation(
      len(digits.images))[:-360]] / 16
  mean, std = train_digits.mean(), train_digits.std()
  for index in range(5):
    # Dark ink on white paper, 8x larger: as a user draws it.
    ink = np.kron(digits.images[index], np.ones((8, 8))) / 16 * 255
    paper = np.round(255 - ink).astype(np.uint8)
    path = str(tmp_path / f'digit{index}.png')
    PIL.Image.fromarray(paper).save(path)
    paths.append(path)
    # The file read back is the digit itself, normalised as in training
    # (to the rounding of its pixels to 0-255).
    with open(path, 'rb') as f:
      seen = datasets.digit_image(f.read())
    np.testing.assert_allclose(
        seen[..., 0], (digits.images[index] / 16 - mean) / std,
        atol=0.5 / 255 / std + 1e-5)
  lines = predict.predict(workdir, paths)
  for line in lines:
    names = [entry.split(':')[0] for entry in line.split()[1:]]
    assert len(names) == 5 and set(names) <= set('0123456789')


@pytest.mark.slow
@pytest.mark.parametrize('recipe, shrunk', [
    # (The ViT recipe's RandAugment and mixup are the TFDS pipeline's too:
    # trained on TFDS in tests/test_input_pipeline.py.)
    ('imagenet', dict(model='SmallResNet', num_layers=1, width=8,
                      scan_unroll=8)),
    ('finetune', dict(model='SmallResNet', num_layers=1, width=8,
                      scan_unroll=8, resnet_padding='same')),
])
def test_shrunk_imagenet_and_finetune_configs_train_on_folders(
    tmp_path, folders, recipe, shrunk):
  root, _ = folders
  config = importlib.import_module(f'configs.{recipe}').get_config()
  config.update(dataset=f'folder:{root}', image_size=SIZE, batch_size=8,
                num_train_steps=2, warmup_steps=1, log_every_steps=1,
                eval_every_steps=2, checkpoint_every_steps=2)
  config.update(shrunk)
  workdir = str(tmp_path / 'run')
  state = train.train_and_evaluate(config, workdir)
  assert int(state.step) == 2
  scalars = read_scalars(workdir)
  assert all(np.isfinite(v) for v in scalars['train_loss'].values())
  assert scalars['eval_examples'] == {2: 9.0}  # every image once
  assert scalars['data_skipped_images'][2] <= 1  # the corrupt one, if met


def test_a_run_on_folders_resumed_from_a_checkpoint_is_bit_identical(
    tmp_path, folders):
  """Resumed from the checkpoint at step 4, as after a kill there, the run
  reads the batches the uninterrupted one read. (Killing and resuming real
  processes: tests/test_reliability.py, on the digits.)"""
  root, _ = folders
  config = tiny_config(dataset=f'folder:{root}', image_size=SIZE,
                       num_layers=2, width=8, batch_size=8,
                       num_train_steps=12, log_every_steps=2,
                       eval_every_steps=4, checkpoint_every_steps=4,
                       # The per-example augmentations resume too.
                       randaug_num_layers=2, random_erase_prob=0.25,
                       repeated_augments=3)
  reference_dir, resumed_dir = str(tmp_path / 'ref'), tmp_path / 'resumed'
  reference = train.train_and_evaluate(config, reference_dir)
  copy_checkpoint(reference_dir, 4, resumed_dir)
  resumed = train.train_and_evaluate(config, str(resumed_dir))
  assert_same_state(resumed, reference)
  after_4 = lambda pairs: [(step, v) for step, v in pairs if step > 4]
  uninterrupted, resumed_events = events(reference_dir), events(resumed_dir)
  for tag in ('train_loss', 'eval_loss', 'eval_examples'):
    assert resumed_events[tag] == after_4(uninterrupted[tag]), tag


def test_the_docs_command_sorts_imagenets_flat_validation_folder(tmp_path):
  with open(os.path.join(REPO, 'docs', 'data.md')) as f:
    text = f.read()
  block = text[text.index('<!-- sort-imagenet-val -->'):]
  start = block.index('```sh\n') + len('```sh\n')
  command = block[start:block.index('\n```', start)]
  # The docs' python3 is the one with the project's packages: here, this one.
  assert command.startswith('python3 '), command
  command = shlex.quote(sys.executable) + command[len('python3'):]
  val = tmp_path / 'val'
  val.mkdir()
  names = [f'ILSVRC2012_val_{i:08d}.JPEG' for i in (1, 2, 50000)]
  for name in names:
    (val / name).write_bytes(b'')
  subprocess.run(['bash', '-c', command.replace('/data/imagenet/val',
                                                str(val))],
                 check=True, timeout=120)
  # The labels of images 1, 2 and 50,000 (ILSVRC2012's ground truth).
  assert sorted(str(p.relative_to(val)) for p in val.rglob('*.JPEG')) == [
      f'n01751748/{names[0]}', f'n02437616/{names[2]}',
      f'n09193705/{names[1]}']


def test_repeated_augments_read_each_file_k_times_each_copy_augmented(
    tmp_path):
  # Channel 0 of each file is one value of its own, which no crop, flip
  # or resize changes: it names the file; channel 1 shows the crop.
  root = str(tmp_path / 'images')
  for split, count in (('train', 12), ('val', 1)):
    for label, name in enumerate(CLASSES):
      os.makedirs(os.path.join(root, split, name))
      for i in range(count):
        pixels = np.zeros((20, 24, 3), np.uint8)
        pixels[..., 0] = 5 + 6 * (label * count + i)
        pixels[..., 1] = np.linspace(0, 250, 24).astype(np.uint8)
        save_image(os.path.join(root, split, name, f'{i:02d}.png'), pixels)
  dataset = folder_pipeline.ImageFolderDataset(root, PREPROCESSING)
  mean, std = input_pipeline.NORMALIZATIONS['imagenet']

  def files(batch):
    return np.rint(batch['image'][:, 0, 0, 0] * std[0] + mean[0]).astype(int)
  # 36 files, batch 12, 3 repeats: 3 steps an epoch of 12 files x 3.
  rows = np.arange(12)
  epoch = host_batches(dataset.local_train_batches(
      12, 1, 0, rows, np.float32, repeats=3), 4)
  named = np.concatenate([files(batch) for batch in epoch[:3]])
  values, counts = np.unique(named, return_counts=True)
  assert len(values) == 12 and set(counts) == {3}
  distinct_crops = 0
  for batch in epoch[:3]:
    for value in set(files(batch).tolist()):
      copies = np.flatnonzero(files(batch) == value)
      assert copies.min() < 6 <= copies.max()  # on both halves
      distinct_crops += len({batch['image'][row].tobytes() for row in copies})
  # Each copy has its own seed; in so small an image two copies' crops
  # (or their fallback, the central crop) and flips may still agree.
  assert distinct_crops >= 30
  halves = [host_batches(dataset.local_train_batches(
      12, 1, 0, part, np.float32, repeats=3), 4) for part in (rows[:6],
                                                              rows[6:])]
  resumed = host_batches(dataset.local_train_batches(
      12, 1, 2, rows, np.float32, repeats=3), 2)
  for step, batch in enumerate(epoch):
    for key in batch:
      np.testing.assert_array_equal(
          np.concatenate([halves[0][step][key], halves[1][step][key]]),
          batch[key])
      if step >= 2:
        np.testing.assert_array_equal(resumed[step - 2][key], batch[key])
