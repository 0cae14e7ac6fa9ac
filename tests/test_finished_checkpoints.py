"""Every command reads only finished checkpoints, and storage that fails or
a damaged checkpoint ends it in one line, with nothing changed.

Each command runs as its own process, as a user's shell starts it, against
a workdir in a bucket of the GCS emulator (tests/gcs_emulator.py) whose
newest step is a save under way: its arrays written, orbax's commit marker
not yet; or whose newest finished step is damaged.
"""

import asyncio
import gc
import os
import re
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest

from runtime import event_loops
from runtime import paths
import train
from tests import gcs_emulator
from tests import processes
from helpers import events
from helpers import LOG_LINE
from helpers import tiny_config

# Checkpoints at 2 and 4.
RUN = dict(num_layers=2, width=8, batch_size=16, num_train_steps=4,
           log_every_steps=2, eval_every_steps=2, checkpoint_every_steps=2)


def cut_arrays(step_dir) -> None:
  """Cuts every array file of the checkpoint in `step_dir` in half."""
  for file in paths.files_under(paths.path(step_dir) / 'state'):
    if '/d/' in os.fspath(file):
      data = file.read_bytes()
      file.write_bytes(data[:len(data) // 2])


@pytest.fixture(scope='module')
def saving(bucket, tmp_path_factory):
  """A workdir in the bucket whose step 4 is being saved: uncommitted,
  its arrays half written."""
  workdir = f'{bucket}/saving'
  train.train_and_evaluate(tiny_config(**RUN), workdir,
                           events_dir=str(tmp_path_factory.mktemp('events')))
  (paths.path(f'{workdir}/checkpoints/4') / 'commit_success.txt').unlink()
  cut_arrays(f'{workdir}/checkpoints/4')
  return workdir


def run(command: list[str], proxy_url: str | None = None
        ) -> tuple[int, str]:
  """(exit code, stderr) of `command`, its own process, its storage
  clients pointed at the emulator or at `proxy_url`."""
  done = subprocess.run(
      command, cwd=processes.REPO, capture_output=True, text=True,
      timeout=300, check=False, env=gcs_emulator.user_environment(
          proxy_url or os.environ['STORAGE_EMULATOR_HOST']))
  return done.returncode, done.stderr


def last_line(stderr: str) -> str:
  return stderr.strip().splitlines()[-1]


def digit_image(tmp_path) -> str:
  image = str(tmp_path / 'digit.png')
  PIL.Image.fromarray(np.kron(np.eye(8), np.ones((4, 4))).astype(
      np.uint8) * 255).save(image)
  return image


def test_eval_predict_and_export_read_the_newest_finished_checkpoint(
    saving, tmp_path):
  python = sys.executable
  events_dir = str(tmp_path / 'eval')
  code, stderr = run(processes.main_command(
      saving, RUN, '--mode=eval', f'--events_dir={events_dir}',
      python=python))
  assert code == 0, processes.failure_excerpt(stderr)
  assert [step for step, _ in events(events_dir)['eval_accuracy']] == [2]
  code, stderr = run([python, 'predict.py', f'--workdir={saving}',
                      digit_image(tmp_path)])
  assert code == 0, processes.failure_excerpt(stderr)
  code, stderr = run([python, 'export.py', f'--workdir={saving}',
                      f'--output={tmp_path / "model.safetensors"}'])
  assert code == 0, processes.failure_excerpt(stderr)


def test_a_checkpoint_named_while_being_saved_is_refused_in_one_line(
    saving, tmp_path):
  code, stderr = run([sys.executable, 'export.py',
                      f'--workdir={saving}/checkpoints/4',
                      f'--output={tmp_path / "model.safetensors"}'])
  assert code == 1
  assert last_line(stderr) == (
      f'Error: checkpoint {saving}/checkpoints/4 is not finished (a save '
      'under way or cut short); pass its workdir, or a finished checkpoint')


@pytest.mark.parametrize('command', ['eval', 'predict.py', 'export.py'])
def test_an_outage_ends_each_command_in_one_line_within_the_bound(
    saving, command, tmp_path):
  """Every read of the checkpoints answered 503: `--mode=eval`,
  predict.py and export.py read again until restore_retry_seconds (3 s
  here) pass without progress, then stop in one line."""
  bound = {'restore_retry_seconds': 3}
  arguments = {
      'eval': processes.main_command(
          saving, RUN | bound, '--mode=eval',
          f'--events_dir={tmp_path / "eval"}', python=sys.executable),
      'predict.py': [sys.executable, 'predict.py', f'--workdir={saving}',
                     '--restore_retry_seconds=3', digit_image(tmp_path)],
      'export.py': [sys.executable, 'export.py', f'--workdir={saving}',
                    '--restore_retry_seconds=3',
                    f'--output={tmp_path / "model.safetensors"}'],
  }[command]
  with gcs_emulator.FaultyProxy(os.environ['STORAGE_EMULATOR_HOST']) as proxy:
    proxy.failing, proxy.mode = '/checkpoints/', '503'
    code, stderr = run(arguments, proxy.url)
  assert code == 1, stderr[-3000:]
  assert re.fullmatch(
      rf'Error: the checkpoints in {saving} could not be read: stalled for '
      r'\d+ s \(.+\); nothing was changed; run the same command again '
      r'\(restore_retry_seconds bounds a stall\)', last_line(stderr)), (
          stderr[-3000:])
  assert not (tmp_path / 'model.safetensors').exists()


@pytest.fixture(scope='module')
def damaged_index(bucket, tmp_path_factory):
  """A workdir in the bucket whose newest finished checkpoint's index of
  its arrays (OCDBT's manifest, read for the arrays' metadata) is cut
  short."""
  workdir = f'{bucket}/damaged_index'
  train.train_and_evaluate(tiny_config(**RUN), workdir,
                           events_dir=str(tmp_path_factory.mktemp('events')))
  manifest = paths.path(f'{workdir}/checkpoints/4/state/manifest.ocdbt')
  manifest.write_bytes(manifest.read_bytes()[:20])
  return workdir


@pytest.mark.parametrize('command', ['predict.py', 'export.py'])
def test_damaged_metadata_ends_predict_and_export_in_one_line(
    damaged_index, command, tmp_path):
  """The metadata read opens every array at once; the opens still in
  flight when the first fails end after it, some runs after the error
  line (hence three runs)."""
  arguments = ([digit_image(tmp_path)] if command == 'predict.py' else
               [f'--output={tmp_path / "model.safetensors"}'])
  for _ in range(3):
    code, stderr = run([sys.executable, command,
                        f'--workdir={damaged_index}', *arguments])
    lines = [line for line in stderr.splitlines()
             if not LOG_LINE.fullmatch(line)]
    assert code == 1, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(
        f'Error: the metadata of checkpoint {damaged_index}/checkpoints/4 '
        'is damaged (ValueError: DATA_LOSS: '), stderr[-3000:]


def test_a_read_that_fails_as_its_loop_stops_is_taken_before_it_closes():
  """A read that fails in the loop's last turn is done, but the callback
  by which its `gather` takes the error is still queued when orbax closes
  the loop: closing runs it, so asyncio has nothing to log after the
  command's error line."""
  loop = event_loops.FinishingLoop()
  logged, taken = [], []
  loop.set_exception_handler(lambda _, context: logged.append(context))

  async def read_all():
    read = asyncio.ensure_future(fails_late())
    read.add_done_callback(lambda done: taken.append(done.exception()))

  async def fails_late():
    raise ValueError('DATA_LOSS')

  loop.run_until_complete(read_all())
  loop.close()
  gc.collect()
  assert [str(error) for error in taken] == ['DATA_LOSS']
  assert logged == []
