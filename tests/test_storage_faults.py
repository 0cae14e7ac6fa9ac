"""A bucket that stutters while a run restores: the launch retries, then
stops with one line, and nothing saved changes; only damage is set aside.

The workdir is in a bucket of the GCS emulator (tests/gcs_emulator.py);
the stuttering launch is `main.py` in its own process, its storage
clients pointed at a proxy in this process that answers HTTP 503 or
drops the connection for reads of checkpoint objects.
"""

import json
import logging
import os
import re
import signal

import gcsfs
import pytest

from runtime import paths
from runtime import storage_faults
import train
from tests import gcs_emulator
from tests import processes
from helpers import DETERMINISTIC_TAGS
from helpers import assert_same_state
from helpers import events
from helpers import restore_final
from helpers import tiny_config

# Checkpoints at 2, 4 and 6; the test removes the last, as if the run had
# been killed after step 4.
RUN = dict(num_layers=2, width=8, batch_size=16, num_train_steps=6,
           log_every_steps=2, eval_every_steps=4, checkpoint_every_steps=2)
# A link slow enough that reading a checkpoint of RUN takes over 20 s,
# and writing one (part of it is taken in at once by the sockets' buffers).
SLOW_LINK_BYTES_PER_SECOND = 4_000
SLOW_UPLOAD_BYTES_PER_SECOND = 1_500


def snapshot(workdir: str, events_dir) -> dict:
  """Every object of the workdir and every event file, by name."""
  root = paths.path(workdir)
  saved = {os.path.relpath(os.fspath(f), os.fspath(root)): f.read_bytes()
           for f in paths.files_under(root)}
  for name in os.listdir(events_dir):
    with open(os.path.join(events_dir, name), 'rb') as f:
      saved[f'events/{name}'] = f.read()
  return saved


def stuttering_launch(workdir, events_dir, proxy, **overrides):
  """`main.py` resuming `workdir`, its storage clients behind `proxy`."""
  command = processes.main_command(workdir, RUN | overrides,
                                   f'--events_dir={events_dir}')
  return processes.Processes([command],
                             [gcs_emulator.user_environment(proxy.url)])


def test_storage_errors_are_retried_then_stop_the_launch_and_the_next_resumes_bit_identically(
    bucket, tmp_path):
  """503s to every read of a checkpoint object (the first are the
  listing's): the launch reads again with backoff, saying so, and a
  SIGTERM meanwhile stops it in one line.
  Dropped connections to the array data (TensorStore's reads) for longer
  than restore_retry_seconds: one line naming the wait. Neither moves or
  deletes anything. With the bucket healthy, the same command resumes from
  the newest checkpoint and ends as an uninterrupted run does."""
  url = os.environ['STORAGE_EMULATOR_HOST']
  workdir, events_dir = f'{bucket}/stutter', str(tmp_path / 'events')
  # The uninterrupted run, the reference of the resumed one's end.
  uninterrupted = train.train_and_evaluate(tiny_config(**RUN), workdir,
                                           events_dir=events_dir)
  uninterrupted_losses = events(events_dir)['train_loss']
  paths.path(f'{workdir}/checkpoints/6').rmtree()
  before = snapshot(workdir, events_dir)

  with gcs_emulator.FaultyProxy(url) as proxy:
    proxy.failing, proxy.mode = '/checkpoints/', '503'
    with stuttering_launch(workdir, events_dir, proxy) as launch:
      retrying = launch.wait_for_line(
          0, lambda line: 'Storage error reading' in line, 180)
      launch.popens[0].send_signal(signal.SIGTERM)
      [code] = launch.wait(60)
      last = launch.log(0).strip().splitlines()[-1]
    assert re.search(rf'Storage error reading the checkpoints in {workdir}/'
                     r'checkpoints \(HttpError: Service Unavailable, 503\); '
                     r'reading it again in 1 s \(\d+ s left of '
                     r'restore_retry_seconds without progress\)', retrying), retrying
    assert code == 1
    assert last == (f'Error: SIGTERM received while reading the checkpoints '
                    f'in {workdir}/checkpoints; nothing was changed; run the '
                    'same command again')
    assert snapshot(workdir, events_dir) == before

    proxy.failing, proxy.mode = '/state/d/', 'drop'
    with stuttering_launch(workdir, events_dir, proxy,
                           restore_retry_seconds=5) as launch:
      [code] = launch.wait(120)
      last = launch.log(0).strip().splitlines()[-1]
    assert proxy.refused > 0
  assert code == 1
  assert re.fullmatch(
      rf'Error: checkpoint 4 in {workdir}/checkpoints could not be read: '
      r'stalled for \d+ s \(TimeoutError: no byte from storage for \d+ s\); '
      r'nothing was changed; run the same command again '
      r'\(restore_retry_seconds bounds a stall\)', last), last
  assert snapshot(workdir, events_dir) == before

  resumed = train.train_and_evaluate(tiny_config(**RUN), workdir,
                                     events_dir=events_dir)
  assert_same_state(resumed, uninterrupted)
  assert events(events_dir)['train_loss'] == uninterrupted_losses


def test_a_slow_link_that_keeps_delivering_is_waited_for_and_the_run_resumes_bit_identically(
    bucket, tmp_path):
  """Every answer of the bucket delivered whole but throttled, so that the
  resume's reads take several times restore_retry_seconds: bytes keep
  arriving, so the launch reads on, says how far it is, and ends as an
  uninterrupted run does. Then its uploads throttled: the run's last save
  takes over 20 s, and the run says how far it is while it waits."""
  url = os.environ['STORAGE_EMULATOR_HOST']
  workdir, events_dir = f'{bucket}/slow', str(tmp_path / 'events')
  uninterrupted = train.train_and_evaluate(tiny_config(**RUN), workdir,
                                           events_dir=events_dir)
  paths.path(f'{workdir}/checkpoints/6').rmtree()

  with gcs_emulator.FaultyProxy(url) as proxy:
    proxy.rate = SLOW_LINK_BYTES_PER_SECOND
    with stuttering_launch(workdir, events_dir, proxy,
                           restore_retry_seconds=2) as launch:
      launch.wait_for_line(0, lambda line: 'Restored checkpoint' in line, 300)
      proxy.rate, proxy.upload_rate = None, SLOW_UPLOAD_BYTES_PER_SECOND
      [code] = launch.wait(300)
      log = launch.log(0)
  assert code == 0, processes.failure_excerpt(log)
  restore_seconds = float(re.search(r'Started in .* restore ([\d.]+) s',
                                    log)[1])
  assert restore_seconds > 5 * 2, log
  assert re.search(rf'Reading checkpoint 4 in {workdir}/checkpoints: '
                   r'[\d.]+ kB of [\d.]+ kB in 2\d s \([\d.]+ kB/s\), '
                   r'about \d+ s left\.', log), log
  assert re.search(rf'Writing the checkpoint to {workdir}/checkpoints: '
                   r'[\d.]+ kB of [\d.]+ kB in 2\d s \([\d.]+ kB/s\)', log), (
                       log)
  assert 'Storage error' not in log, log
  assert_same_state(restore_final(workdir, tiny_config(**RUN)),
                    uninterrupted)


def test_a_fresh_start_moves_the_old_history_aside_and_no_resume_cuts_it(
    tmp_path, caplog):
  """A workdir whose checkpoints are gone (set aside, or never written)
  starts at step 0 and moves the summaries written before into a run of
  their own; the new run's resume then cuts only its own files."""
  workdir = str(tmp_path)
  config = tiny_config()  # checkpoints at 4 and 8
  train.train_and_evaluate(config, workdir)
  earlier = events(workdir)
  os.rename(tmp_path / 'checkpoints', tmp_path / 'corrupt_checkpoints')
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(config, workdir)
  assert (f'No checkpoint to resume from in {workdir}/checkpoints: starting '
          f'at step 0; moved the 1 event files of the run before to '
          f'{workdir}/earlier_runs/1 and kept the damaged checkpoints in '
          f'{workdir}/corrupt_checkpoints.') in caplog.text
  fresh = events(workdir)
  paths.path(f'{workdir}/checkpoints/8').rmtree()
  train.train_and_evaluate(config, workdir)  # resumes from step 4
  assert events(str(tmp_path / 'earlier_runs' / '1')) == earlier
  assert {tag: events(workdir)[tag] for tag in DETERMINISTIC_TAGS} == {
      tag: fresh[tag] for tag in DETERMINISTIC_TAGS}


@pytest.mark.parametrize('error, kind', [
    (gcsfs.retry.HttpError({'code': 503, 'message': 'Unavailable'}),
     storage_faults.OUTAGE),
    (gcsfs.retry.HttpError({'code': 429, 'message': 'Too many requests'}),
     storage_faults.OUTAGE),
    (gcsfs.retry.HttpError({'code': 401, 'message': 'Invalid Credentials'}),
     storage_faults.OUTAGE),
    (gcsfs.retry.HttpError({'code': 404, 'message': 'No such object'}),
     storage_faults.DAMAGE),
    (MemoryError(), storage_faults.OUTAGE),
    (ConnectionResetError(104, 'Connection reset by peer'),
     storage_faults.OUTAGE),
    (FileNotFoundError('checkpoints/4/state/_METADATA'),
     storage_faults.DAMAGE),
    (RuntimeError('anything else'), storage_faults.OUTAGE),
])
def test_errors_are_told_apart_by_what_they_prove(error, kind):
  assert storage_faults.classify(error) == kind


@pytest.mark.parametrize('status, kind', [
    ('400', storage_faults.OUTAGE), ('411', storage_faults.OUTAGE),
    ('302', storage_faults.OUTAGE), ('413', storage_faults.OUTAGE),
    ('416', storage_faults.DAMAGE)])
def test_an_http_status_behind_a_tensorstore_error_is_told_by_the_status(
    bucket, monkeypatch, status, kind):
  """TensorStore's own errors for a read the bucket answers with `status`
  (through the proxy): a redirect or a refused request is reported as
  FAILED_PRECONDITION or INVALID_ARGUMENT, and proves nothing damaged."""
  error = tensorstore_error(bucket, monkeypatch, f'status_{status}/', status)
  assert storage_faults.classify(error) == kind, error


@pytest.mark.parametrize('status', ['404', '412'])
def test_a_missing_object_is_damage_only_when_the_buckets_listing_agrees(
    bucket, monkeypatch, status):
  """TensorStore reports a 404 and a 412 (a proxy's or a conditional
  read's answer) alike, as a missing object: NOT_FOUND, no status. That
  is damage when the bucket's listing agrees the object is gone, and
  proves nothing while the object is there."""
  error = tensorstore_error(bucket, monkeypatch, f'missing_{status}/', status)
  assert str(error).startswith('NOT_FOUND'), error
  assert storage_faults.classify(error) == storage_faults.OUTAGE, error
  paths.path(f'{bucket}/missing_{status}/.zarray').unlink()
  error = tensorstore_error(bucket, monkeypatch, f'missing_{status}/', status,
                            create=False)
  assert storage_faults.classify(error) == storage_faults.DAMAGE, error


def tensorstore_error(bucket, monkeypatch, path, status, create=True):
  """TensorStore's error reading a zarr array at `path` in `bucket`
  (written first, when `create`) through the proxy answering `status` to
  reads of it."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  spec = {'driver': 'zarr', 'kvstore': {
      'driver': 'gcs', 'bucket': bucket.removeprefix('gs://'), 'path': path}}
  if create:
    ts.open(spec, create=True, dtype=ts.float32, shape=[64]).result().write(
        1.0).result()
  with gcs_emulator.FaultyProxy(os.environ['STORAGE_EMULATOR_HOST']) as proxy:
    proxy.failing, proxy.mode = path, status
    monkeypatch.setenv('TENSORSTORE_GCS_HTTP_URL', proxy.url)
    with pytest.raises(Exception) as answered:
      ts.open(spec, context=ts.Context()).result().read().result()
  return answered.value


def test_tensorstore_and_json_damage_is_damage_and_wrapped_outages_are_not(
    tmp_path):
  """Real errors of the readers: TensorStore reading a truncated file,
  JSON that does not parse; an outage raised while handling damage (a
  retry that failed) is still an outage."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  spec = {'driver': 'zarr', 'kvstore': f'file://{tmp_path}/array'}
  ts.open(spec, create=True, dtype=ts.float32, shape=[64]).result().write(
      range(64)).result()
  chunk = tmp_path / 'array' / '0'
  chunk.write_bytes(chunk.read_bytes()[:10])
  with pytest.raises(Exception) as truncated:
    ts.open(spec).result().read().result()
  assert storage_faults.classify(truncated.value) == storage_faults.DAMAGE
  with pytest.raises(json.JSONDecodeError) as undecodable:
    json.loads('{"step": ')
  assert storage_faults.classify(undecodable.value) == storage_faults.DAMAGE
  try:
    try:
      raise undecodable.value
    except ValueError as e:
      raise TimeoutError('reading it again timed out') from e
  except TimeoutError as wrapped:
    assert storage_faults.classify(wrapped) == storage_faults.OUTAGE


def test_restore_retry_seconds_must_not_be_negative(tmp_path):
  from runtime import config_error  # pylint: disable=g-import-not-at-top
  with pytest.raises(config_error.ConfigError,
                     match=r'^restore_retry_seconds must be >= 0'):
    train.train_and_evaluate(tiny_config(restore_retry_seconds=-1),
                             str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()
