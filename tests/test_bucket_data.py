"""Data sets in a bucket: image folders (`folder:gs://...`) and a TFDS
`data_dir=gs://...`, against the GCS emulator of tests/gcs_emulator.py.

The reference for the folders is the same files on local disk: a run reads
them through tf.io there and through gcsfs in the bucket, and must train
and evaluate bit for bit alike. TFDS reads its records through TensorFlow's
own GCS client, which cannot be pointed at an emulator: what is tested is
that a run refuses such a data_dir in one line before it writes anything,
also when gcsfs (the rest of the run's client) reaches the bucket.
"""

import logging
import os
import shutil

import pytest

from data import folder_listing
from runtime import config_error
from runtime import paths
import train
from helpers import SIZE
from helpers import assert_same_state
from helpers import events
from helpers import tiny_config
from image_data import prepare_tiny_images
from image_data import write_folders


def upload(local_root: str, remote_root: str) -> None:
  """Every file below `local_root` to the same place below `remote_root`."""
  for directory, _, names in os.walk(local_root):
    for name in names:
      local = os.path.join(directory, name)
      remote = paths.path(remote_root) / os.path.relpath(local, local_root)
      with open(local, 'rb') as f:
        remote.write_bytes(f.read())


def folder_run(root: str):
  # One epoch is 3 steps of 8 of the 25 training files: the unreadable one
  # is met, and replaced.
  return tiny_config(dataset=f'folder:{root}', image_size=SIZE, batch_size=8,
                     num_train_steps=4, log_every_steps=1, eval_every_steps=4,
                     checkpoint_every_steps=4)


def test_folders_in_a_bucket_train_and_evaluate_as_on_local_disk(
    bucket, tmp_path, caplog):
  local_root = str(tmp_path / 'images')
  write_folders(local_root, corrupt=True)  # and files that are not images
  remote_root = f'{bucket}/images'
  upload(local_root, remote_root)

  reference = train.train_and_evaluate(folder_run(local_root),
                                       str(tmp_path / 'local'))
  with caplog.at_level(logging.WARNING):
    state = train.train_and_evaluate(folder_run(remote_root),
                                     str(tmp_path / 'remote'))

  assert_same_state(state, reference)
  local, remote = events(str(tmp_path / 'local')), events(
      str(tmp_path / 'remote'))
  for tag in ('train_loss', 'eval_loss', 'eval_accuracy', 'eval_examples',
              'data_skipped_files', 'data_skipped_images'):
    assert remote[tag] == local[tag], tag
  assert remote['data_skipped_images'][-1][1] == 1
  assert remote['data_skipped_files'][-1][1] == 2  # notes.txt, .DS_Store
  assert (f'Skipped unreadable image {remote_root}/train/cat/000a.jpg'
          in caplog.text)

  # The listing is the local one's, file for file, in the same order.
  listing = folder_listing.list_split(f'{remote_root}/train')
  local_listing = folder_listing.list_split(f'{local_root}/train')
  assert [os.path.relpath(f, remote_root) for f in listing.files] == [
      os.path.relpath(f, local_root) for f in local_listing.files]
  assert list(listing.labels) == list(local_listing.labels)


@pytest.mark.parametrize('make, message', [
    (lambda root: None, r"^a data set is missing: dataset folder:gs://\S+: "
     r"folder 'gs://[^']*/bad-[0-9]+' does not exist: put the images in its "
     r'train/<class>/ and val/<class>/ folders'),
    (lambda root: (paths.path(root) / 'train' / 'a' / 'x.png').write_bytes(
        b''), r'has none of the evaluation folders val/, validation/, test/'),
    (lambda root: (paths.path(root) / 'val' / 'x.JPEG').write_bytes(b'') or
     (paths.path(root) / 'train' / 'a' / 'x.png').write_bytes(b''),
     r"/val' has no class folders \(1 files directly in it\)"),
])
def test_bad_folders_in_a_bucket_are_refused_before_anything_is_written(
    bucket, tmp_path, make, message):
  root = f'{bucket}/bad-{len(message)}'
  make(root)
  workdir = tmp_path / 'workdir'
  with pytest.raises(config_error.ConfigError, match=message):
    train.train_and_evaluate(folder_run(root), str(workdir))
  assert not workdir.exists()


def test_a_tfds_data_dir_tensorflow_cannot_read_is_refused_in_one_line(
    bucket, tmp_path_factory):
  """The tiny TFDS data set, prepared, copied to the bucket: gcsfs reads its
  metadata there (the workdir is in the bucket too), TensorFlow's GCS
  client, which would read its records, cannot reach the emulator."""
  data_dir, _ = prepare_tiny_images(tmp_path_factory)
  remote_data_dir = f'{bucket}/tensorflow_datasets'
  upload(data_dir, remote_data_dir)
  shutil.rmtree(data_dir)
  workdir = f'{bucket}/tfds-run'
  config = tiny_config(dataset='tiny_images', data_dir=remote_data_dir,
                       image_size=SIZE, batch_size=8, num_train_steps=2)
  with pytest.raises(config_error.ConfigError) as raised:
    train.train_and_evaluate(config, workdir,
                             events_dir=str(tmp_path_factory.mktemp('ev')))
  message = str(raised.value)
  assert '\n' not in message
  assert message.startswith(
      f"data_dir {remote_data_dir} cannot be read through TensorFlow's GCS "
      'client, which reads TFDS data sets (')
  assert message.endswith('or copy the data set to a local disk and point '
                          'config.data_dir there')
  assert not paths.path(workdir).exists()
