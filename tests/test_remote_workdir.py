"""A workdir in a bucket: the whole checkpoint path on gs://, against a real
GCS JSON API served on 127.0.0.1 (tests/gcs_emulator.py).

The reference is the same run in a local workdir. Every command that reads
or writes a bucket (train, eval, predict, export, fine-tuning) also runs as
its own process, in the environment a user's shell gives it, since each
process chooses its file system for gs:// itself. TensorBoard event files
go to a local `events_dir` (TensorFlow cannot reach the emulator); the
event trimming on resume is tested on gs:// on its own, and so is the FLOPs
count that a compilation cache in a bucket keeps.
"""

import json
import logging
import os
import re
import subprocess
import sys

from etils import epath
import numpy as np
import PIL.Image
import pytest
import safetensors.numpy

import export
import predict

from runtime import checkpointing
from runtime import compilation_cache
from runtime import config_error
from runtime import paths
from runtime import preemption
from tests import processes
import eval_checkpoint
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
  checkpoints = paths.path(workdir) / 'checkpoints'
  # keep_checkpoints=2: the older two were deleted from the bucket.
  assert sorted(p.name for p in checkpoints.iterdir()) == ['6', '8']

  # A model of other shapes is refused before anything in the bucket
  # changes.
  before = object_digests(paths.path(workdir))
  with pytest.raises(config_error.ConfigError,
                     match=r'another model: width: 8 -> 16; use a new'):
    train.train_and_evaluate(tiny_config(**BUCKET_RUN, width=16), workdir,
                             events_dir=events_dir)
  assert object_digests(paths.path(workdir)) == before

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
  set_aside = paths.path(workdir) / checkpointing.CORRUPT_DIR / '8'
  assert object_digests(set_aside) == damaged
  # Every step once on TensorBoard, with the local run's values.
  assert (events(events_dir)['train_loss'] ==
          events(str(tmp_path / 'local'))['train_loss'])


# Each command's run in a bucket: trained once, checkpoint and evaluation
# at step 4.
COMMAND_RUN = dict(num_layers=2, width=8, batch_size=16, num_train_steps=4,
                   log_every_steps=2, eval_every_steps=4,
                   checkpoint_every_steps=4)


def run_command(command: list[str], environment: dict,
                timeout: float = 300) -> tuple[int, str, str]:
  """(exit code, stdout, stderr) of `command` run from the repository root
  as its own process."""
  done = subprocess.run(command, cwd=processes.REPO, env=environment,
                        capture_output=True, text=True, timeout=timeout,
                        check=False)
  return done.returncode, done.stdout, done.stderr


def succeeded(command: list[str], environment: dict) -> str:
  """The stdout of `command`, after asserting that it exited 0."""
  code, stdout, stderr = run_command(command, environment)
  assert code == 0, processes.failure_excerpt(stderr)
  return stdout


def digit_image(tmp_path) -> str:
  image = str(tmp_path / 'digit.png')
  PIL.Image.fromarray(np.kron(np.eye(8), np.ones((4, 4))).astype(
      np.uint8) * 255).save(image)
  return image


def last_scalars(events_dir: str, prefix: str) -> dict:
  """{tag: value} at the last step of every `prefix`* scalar in
  `events_dir`."""
  return {tag: pairs[-1] for tag, pairs in events(events_dir).items()
          if tag.startswith(prefix)}


def test_every_command_run_as_its_own_process_reads_and_writes_a_bucket(
    bucket, tmp_path):
  """Train into gs://, then eval, predict, export (to a file and to gs://)
  and fine-tune from the bucket workdir and from the exported file, each a
  process of its own as a user's shell starts it: each gives what the same
  run trained into a local workdir gives."""
  environment = gcs_emulator.user_environment(
      os.environ['STORAGE_EMULATOR_HOST'])
  python = sys.executable
  local, remote = str(tmp_path / 'local'), f'{bucket}/commands'
  reference = tiny_config(**COMMAND_RUN)
  train.train_and_evaluate(reference, local)
  expected_eval = eval_checkpoint.evaluate_checkpoint(reference, local)

  def main_py(workdir, events_dir, *flags, **overrides):
    return processes.main_command(workdir, COMMAND_RUN | overrides,
                                  f'--events_dir={events_dir}', *flags,
                                  python=python)

  succeeded(main_py(remote, tmp_path / 'train_events'), environment)
  assert checkpointing.checkpoint_dir(remote).endswith('/checkpoints/4')

  succeeded(main_py(remote, tmp_path / 'eval_events', '--mode=eval'),
            environment)
  assert last_scalars(str(tmp_path / 'eval_events'), 'eval_') == {
      name: (4, value) for name, value in expected_eval.items()}

  image = digit_image(tmp_path)
  assert succeeded([python, 'predict.py', f'--workdir={remote}', image],
                   environment).splitlines() == predict.predict(local, [image])

  expected = export.export(local, str(tmp_path / 'local.safetensors'))
  exported_file = str(tmp_path / 'remote.safetensors')
  exported_object = f'{bucket}/exported/remote.safetensors'
  for output in (exported_file, exported_object):
    succeeded([python, 'export.py', f'--workdir={remote}',
               f'--output={output}'], environment)
  copied = str(tmp_path / 'from_bucket.safetensors')
  paths.path(exported_object).copy(epath.Path(copied))
  for written in (exported_file, copied):
    arrays = safetensors.numpy.load_file(written)
    assert arrays.keys() == expected.keys()
    for name in expected:
      np.testing.assert_array_equal(arrays[name], expected[name], name)

  # Fine-tuning from the bucket workdir and from the exported object: the
  # same weights, so the same run.
  finetuned = {}
  for name, init_from in (('workdir', remote), ('export', exported_object)):
    events_dir = str(tmp_path / f'finetune_{name}')
    succeeded(main_py(str(tmp_path / f'finetune_{name}_workdir'), events_dir,
                      init_from=init_from, num_train_steps=2,
                      eval_every_steps=2, checkpoint_every_steps=2),
              environment)
    finetuned[name] = events(events_dir)
  assert finetuned['workdir']['train_loss'] == finetuned['export'][
      'train_loss']
  assert finetuned['workdir']['eval_accuracy'] == finetuned['export'][
      'eval_accuracy']


def error_line(code: int, stderr: str) -> str:
  """The one line a failed command ends with, after asserting that it
  failed."""
  assert code != 0, stderr[-3000:]
  return stderr.strip().splitlines()[-1]


def test_commands_name_a_missing_or_unreachable_bucket_and_keep_the_workdir(
    bucket, tmp_path):
  """A bucket that does not exist, or an endpoint that does not answer,
  is said as such in one line, and nothing saved in a bucket changes; a
  reachable empty workdir still says it holds no checkpoint."""
  environment = gcs_emulator.user_environment(
      os.environ['STORAGE_EMULATOR_HOST'])
  saved = paths.path(f'{bucket}/saved/object')
  saved.write_bytes(b'kept')
  python = sys.executable

  line = error_line(*run_command(processes.main_command(
      'gs://no-such-bucket/run', COMMAND_RUN, '--mode=eval',
      f'--events_dir={tmp_path / "events"}', python=python), environment)[::2])
  assert line == ('Error: bucket gs://no-such-bucket does not exist; create '
                  'it (`gcloud storage buckets create gs://no-such-bucket`) '
                  'or check the path')

  line = error_line(*run_command(processes.main_command(
      tmp_path / 'workdir', COMMAND_RUN | {
          'init_from': 'gs://no-such-bucket/model.safetensors'},
      python=python), environment)[::2])
  assert line.startswith('Error: bucket gs://no-such-bucket does not exist')

  unreachable = f'http://127.0.0.1:{processes.free_port()}'
  line = error_line(*run_command(
      [python, 'predict.py', f'--workdir={bucket}/saved', digit_image(tmp_path)],
      gcs_emulator.user_environment(unreachable))[::2])
  assert re.fullmatch(
      rf'Error: bucket {bucket} cannot be reached: no answer from '
      rf'{unreachable}/storage/v1/ in {paths.REACH_SECONDS} s \(Cannot '
      r'connect to host .*\); check the network \(and STORAGE_EMULATOR_HOST '
      r'if you use an emulator\)', line), line

  line = error_line(*run_command(
      [python, 'predict.py', f'--workdir={bucket}/empty',
       digit_image(tmp_path)], environment)[::2])
  assert line == (f"Error: no checkpoint in '{bucket}/empty'; pass the "
                  '--workdir of a run that saved one')
  assert object_digests(paths.path(f'{bucket}/saved')) == {'object': b'kept'}
  assert not (tmp_path / 'workdir').exists()


def test_a_bucket_that_does_not_answer_a_write_is_said_to_be_down_not_unwritable(
    bucket, tmp_path):
  """The workdir's write check answered 503 (after gcsfs's own retries):
  one line that the bucket did not answer and to run the command again,
  not that the workdir is not writable; nothing is written."""
  with gcs_emulator.FaultyProxy(os.environ['STORAGE_EMULATOR_HOST']) as proxy:
    proxy.failing_uploads = True
    line = error_line(*run_command(processes.main_command(
        f'{bucket}/down', COMMAND_RUN, python=sys.executable),
        gcs_emulator.user_environment(proxy.url))[::2])
    assert proxy.refused > 0
  assert re.fullmatch(
      rf"Error: bucket '{bucket.removeprefix('gs://')}' did not answer a "
      rf"write to workdir '{bucket}/down' \(HttpError: .*503.*\); nothing "
      r'was changed; run the same command again once it answers', line), line
  assert not paths.path(f'{bucket}/down').exists()


def test_event_trimming_on_resume_rewrites_event_files_in_a_bucket(
    bucket, tmp_path):
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  writer = metric_writers.create_default_writer(str(tmp_path))
  for step in (0, 2, 4):
    writer.write_scalars(step, {'train_loss': float(step)})
  writer.close()
  [local_file] = os.listdir(tmp_path)
  remote = paths.path(f'{bucket}/events')
  (remote / local_file).write_bytes((tmp_path / local_file).read_bytes())

  preemption.drop_events_after(os.fspath(remote), 2)
  (tmp_path / local_file).write_bytes((remote / local_file).read_bytes())
  assert events(str(tmp_path))['train_loss'] == [(0, 0.0), (2, 2.0)]
  assert [p.name for p in remote.iterdir()] == [local_file]  # nothing else


@pytest.mark.parametrize('workdir, message', [
    ('gs://no-such-bucket/run',
     r'bucket gs://no-such-bucket does not exist; create it'),
    ('s3://bucket/run', r's3:// is not supported; use a local directory or '
     r'a gs://BUCKET/DIR path'),
])
def test_unusable_remote_workdirs_are_refused_naming_the_fix(
    bucket, tmp_path, workdir, message):
  del bucket  # the emulator answers for gs://; no-such-bucket is not on it
  with pytest.raises(config_error.ConfigError, match=message) as error:
    train.train_and_evaluate(tiny_config(), workdir,
                             events_dir=str(tmp_path / 'events'))
  assert '\n' not in str(error.value)
  assert os.listdir(tmp_path) == []


def test_moving_a_tree_in_a_bucket_copies_it_whole_then_deletes_the_source(
    bucket):
  source = paths.path(f'{bucket}/move/source')
  contents = {'commit_success.txt': b'', 'a/b.bin': np.arange(9).tobytes(),
              'c.json': b'{}'}
  for name, data in contents.items():
    (source / name).write_bytes(data)
  destination = paths.path(f'{bucket}/move/elsewhere/destination')
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
    kept = paths.path(
        f'{bucket}/jax_cache/{compilation_cache.FLOPS_DIR}/{key}.json')
    kept.write_bytes(b'not a count')
    assert compilation_cache.kept_flops(key, count) == 5e9
  assert len(calls) == 2  # the second call read the count back
  assert json.loads(kept.read_text()) == {'flops': 5e9}
