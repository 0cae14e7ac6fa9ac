"""A workdir in a bucket: the whole checkpoint path on gs://, against a real
GCS JSON API served on 127.0.0.1 (tests/gcs_emulator.py).

The reference is the same run in a local workdir. TensorBoard event files
go to a local `events_dir` (TensorFlow cannot reach the emulator); the
event trimming on resume is tested on gs:// on its own, and so is the FLOPs
count that a compilation cache in a bucket keeps.
"""

import json
import logging
import os
import uuid

from etils import epath
import numpy as np
import PIL.Image
import pytest

import export
import predict

from runtime import checkpointing
from runtime import compilation_cache
from training import config_checks
from runtime import paths
from runtime import preemption
from training import evaluation
import train
from tests import gcs_emulator
from helpers import assert_same_state
from helpers import cache_directory
from helpers import counter
from helpers import events
from helpers import tiny_config

# Checkpoints at 2, 4, 6, 8; two kept.
BUCKET_RUN = dict(num_train_steps=8, log_every_steps=2,
                  checkpoint_every_steps=2, keep_checkpoints=2)


@pytest.fixture(scope='module')
def bucket():
  """gs://NAME of a fresh bucket on an emulator that runs for this module."""
  name = f'trainer-{uuid.uuid4().hex[:8]}'
  with gcs_emulator.running(name):
    yield f'gs://{name}'


def object_digests(directory: epath.Path) -> dict:
  """{path relative to `directory`: content} of every object below it."""
  return {os.path.relpath(os.fspath(f), os.fspath(directory)): f.read_bytes()
          for f in paths.files_under(directory)}


def test_bucket_workdir_saves_keeps_restores_and_sets_aside_like_local(
    bucket, tmp_path, caplog):
  config = tiny_config(**BUCKET_RUN)
  reference = train.train_and_evaluate(config, str(tmp_path / 'local'))
  workdir = f'{bucket}/run'
  events_dir = str(tmp_path / 'events')

  state = train.train_and_evaluate(config, workdir, events_dir=events_dir)
  assert_same_state(state, reference)
  checkpoints = epath.Path(workdir) / 'checkpoints'
  # keep_checkpoints=2: the older two were deleted from the bucket.
  assert sorted(p.name for p in checkpoints.iterdir()) == ['6', '8']

  # A model of other shapes is refused before anything in the bucket
  # changes.
  before = object_digests(epath.Path(workdir))
  with pytest.raises(config_checks.ConfigError,
                     match=r'another model: width: 8 -> 16; use a new'):
    train.train_and_evaluate(tiny_config(**BUCKET_RUN, width=16), workdir,
                             events_dir=events_dir)
  assert object_digests(epath.Path(workdir)) == before

  # Damage the newest checkpoint: truncate its largest data object.
  data = max(paths.files_under(checkpoints / '8' / 'state' / 'd'),
             key=lambda f: len(f.read_bytes()))
  data.write_bytes(data.read_bytes()[:len(data.read_bytes()) // 2])
  damaged = object_digests(checkpoints / '8')
  with caplog.at_level(logging.WARNING):
    resumed = train.train_and_evaluate(config, workdir, events_dir=events_dir)
  assert 'Checkpoint at step 8 is unreadable' in caplog.text
  # Resumed from step 6 in the bucket, retrained to the same state.
  assert_same_state(resumed, reference)
  assert sorted(p.name for p in checkpoints.iterdir()) == ['6', '8']
  # The damaged checkpoint is kept, object for object, out of the way.
  set_aside = epath.Path(workdir) / checkpointing.CORRUPT_DIR / '8'
  assert object_digests(set_aside) == damaged
  # Every step once on TensorBoard, with the local run's values.
  assert (events(events_dir)['train_loss'] ==
          events(str(tmp_path / 'local'))['train_loss'])


def test_eval_predict_export_and_finetune_read_a_bucket_workdir_as_a_local_one(
    bucket, tmp_path):
  """Each command that reads a trained run gives, from gs://, exactly what
  it gives from the same run trained into a local workdir."""
  config = tiny_config(num_train_steps=4, eval_every_steps=4,
                       checkpoint_every_steps=4)
  local, remote = str(tmp_path / 'local'), f'{bucket}/trained'
  events_dir = str(tmp_path / 'events')
  train.train_and_evaluate(config, local)
  train.train_and_evaluate(config, remote, events_dir=events_dir)

  assert (evaluation.evaluate_checkpoint(config, remote,
                                         events_dir=events_dir) ==
          evaluation.evaluate_checkpoint(config, local))
  assert events(events_dir)['eval_examples'][-1] == (4, 360.0)

  image = str(tmp_path / 'digit.png')
  PIL.Image.fromarray(np.kron(np.eye(8), np.ones((4, 4))).astype(
      np.uint8) * 255).save(image)
  assert predict.predict(remote, [image]) == predict.predict(local, [image])

  exported = export.export(remote, str(tmp_path / 'remote.safetensors'))
  expected = export.export(local, str(tmp_path / 'local.safetensors'))
  assert exported.keys() == expected.keys()
  for name in expected:
    np.testing.assert_array_equal(exported[name], expected[name], name)

  finetune = dict(num_train_steps=2, eval_every_steps=2,
                  checkpoint_every_steps=2)
  from_remote = train.train_and_evaluate(
      tiny_config(init_from=remote, **finetune), str(tmp_path / 'ft_remote'))
  from_local = train.train_and_evaluate(
      tiny_config(init_from=local, **finetune), str(tmp_path / 'ft_local'))
  assert_same_state(from_remote, from_local)


def test_event_trimming_on_resume_rewrites_event_files_in_a_bucket(
    bucket, tmp_path):
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  writer = metric_writers.create_default_writer(str(tmp_path))
  for step in (0, 2, 4):
    writer.write_scalars(step, {'train_loss': float(step)})
  writer.close()
  [local_file] = os.listdir(tmp_path)
  remote = epath.Path(f'{bucket}/events')
  (remote / local_file).write_bytes((tmp_path / local_file).read_bytes())

  preemption.drop_events_after(os.fspath(remote), 2)
  (tmp_path / local_file).write_bytes((remote / local_file).read_bytes())
  assert events(str(tmp_path))['train_loss'] == [(0, 0.0), (2, 2.0)]
  assert [p.name for p in remote.iterdir()] == [local_file]  # nothing else


@pytest.mark.parametrize('workdir, message', [
    ('gs://no-such-bucket/run',
     "is not writable .*; check that bucket 'no-such-bucket' exists"),
    ('s3://bucket/run', r's3:// is not supported; use a local directory or '
     r'a gs://BUCKET/DIR path'),
])
def test_unusable_remote_workdirs_are_refused_naming_the_fix(
    bucket, tmp_path, workdir, message):
  del bucket  # the emulator answers for gs://; no-such-bucket is not on it
  with pytest.raises(config_checks.ConfigError, match=message) as error:
    train.train_and_evaluate(tiny_config(), workdir,
                             events_dir=str(tmp_path / 'events'))
  assert '\n' not in str(error.value)
  assert os.listdir(tmp_path) == []


def test_moving_a_tree_in_a_bucket_copies_it_whole_then_deletes_the_source(
    bucket):
  source = epath.Path(f'{bucket}/move/source')
  contents = {'commit_success.txt': b'', 'a/b.bin': np.arange(9).tobytes(),
              'c.json': b'{}'}
  for name, data in contents.items():
    (source / name).write_bytes(data)
  destination = epath.Path(f'{bucket}/move/elsewhere/destination')
  paths.move_tree(source, destination, delete_first='commit_success.txt')
  assert object_digests(destination) == contents
  assert not source.exists()
  # An existing destination is never overwritten.
  (source / 'x').write_bytes(b'x')
  with pytest.raises(FileExistsError):
    paths.move_tree(source, destination)
  assert object_digests(destination) == contents
  assert object_digests(source) == {'x': b'x'}


def test_a_compilation_cache_in_a_bucket_keeps_the_flops_count(bucket):
  count, calls = counter(5e9)
  key = 'b' * 64
  with cache_directory(f'{bucket}/jax_cache'):
    for _ in range(2):
      assert compilation_cache.kept_flops(key, count) == 5e9
    kept = epath.Path(
        f'{bucket}/jax_cache/{compilation_cache.FLOPS_DIR}/{key}.json')
    kept.write_bytes(b'not a count')
    assert compilation_cache.kept_flops(key, count) == 5e9
  assert len(calls) == 2  # the second call read the count back
  assert json.loads(kept.read_text()) == {'flops': 5e9}
