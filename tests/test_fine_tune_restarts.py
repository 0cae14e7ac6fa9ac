"""A fine-tune whose checkpoints cannot be restored starts from its
init_from weights again, as it did at first, never from random ones:
whether its only checkpoint proves damaged (set aside) or was never
finished (a first save to a bucket cut before orbax's commit marker).
Its init_from weights in a bucket are read as a restore reads: through an
outage, and damage ends the launch in one line."""

import logging
import os

from data import datasets
from runtime import paths
import train
from tests import gcs_emulator
from tests import processes
from helpers import assert_same_state
from helpers import restore_final
from helpers import tiny_config
from helpers import write_checkpoint

# Checkpoints at 4 and 8; the tests keep only the first, damaged.
RUN = dict(num_train_steps=8, checkpoint_every_steps=4)
# tiny_config(**RUN) as a command's overrides.
COMMAND_RUN = dict(num_layers=2, width=8, batch_size=16, log_every_steps=2,
                   eval_every_steps=4, **RUN)


def fine_tune_config(tmp_path):
  """RUN from the weights of another run (noisy, so that they differ from
  a fresh model's)."""
  source = str(tmp_path / 'source')
  write_checkpoint(source, tiny_config(), datasets.load_digits().info,
                   noise=0.1)
  return tiny_config(init_from=source, **RUN)


def truncate_arrays(step_dir) -> None:
  """Cuts every array file of the checkpoint in `step_dir` in half, as a
  save to a bucket cut midway leaves them (orbax writes there in place)."""
  for file in paths.files_under(paths.path(step_dir) / 'state'):
    if '/d/' in os.fspath(file):
      data = file.read_bytes()
      file.write_bytes(data[:len(data) // 2])


def test_a_fine_tune_whose_only_checkpoint_is_damaged_starts_from_its_weights_again(
    tmp_path, caplog):
  config = fine_tune_config(tmp_path)
  workdir = str(tmp_path / 'run')
  uninterrupted = train.train_and_evaluate(config, workdir)
  paths.path(f'{workdir}/checkpoints/8').rmtree()
  truncate_arrays(f'{workdir}/checkpoints/4')

  with caplog.at_level(logging.WARNING):
    restarted = train.train_and_evaluate(config, workdir)
  assert 'Checkpoint at step 4 is unreadable' in caplog.text
  assert (f'starting at step 0 from the weights of {config.init_from}; '
          in caplog.text), caplog.text
  assert_same_state(restarted, uninterrupted)


def test_a_fine_tune_whose_first_save_to_a_bucket_was_cut_starts_from_its_weights_again(
    bucket, tmp_path):
  config = fine_tune_config(tmp_path)
  workdir, events_dir = f'{bucket}/cut', str(tmp_path / 'events')
  uninterrupted = train.train_and_evaluate(config, workdir,
                                           events_dir=events_dir)
  paths.path(f'{workdir}/checkpoints/8').rmtree()
  first_save = paths.path(f'{workdir}/checkpoints/4')
  (first_save / 'commit_success.txt').unlink()
  truncate_arrays(first_save)

  restarted = train.train_and_evaluate(config, workdir,
                                       events_dir=events_dir)
  assert_same_state(restarted, uninterrupted)


def test_a_fine_tune_reads_its_bucket_weights_through_an_outage(bucket,
                                                               tmp_path):
  """init_from a workdir in a bucket whose checkpoint's objects answer 503:
  the fine-tune (`main.py`, its own process) reads them again, saying so,
  and once the bucket answers ends as the fine-tune that read them at
  once. The same checkpoint damaged (its arrays cut short) ends the launch
  in one line, exit code 1, nothing trained."""
  source = f'{bucket}/source'
  write_checkpoint(source, tiny_config(), datasets.load_digits().info,
                   noise=0.1)
  config = tiny_config(init_from=source, **RUN)
  at_once = train.train_and_evaluate(config, str(tmp_path / 'at_once'))
  workdir = str(tmp_path / 'run')
  command = processes.main_command(workdir,
                                   COMMAND_RUN | {'init_from': source})
  with gcs_emulator.FaultyProxy(os.environ['STORAGE_EMULATOR_HOST']) as proxy:
    proxy.failing = 'source/checkpoints/0/state/'
    environment = gcs_emulator.user_environment(proxy.url)
    with processes.Processes([command], [environment]) as launch:
      retrying = launch.wait_for_line(
          0, lambda line: 'Storage error reading' in line, 180)
      proxy.failing = ''
      [code] = launch.wait(300)
    assert code == 0, launch.log(0)[-3000:]
    assert f'checkpoint {source}/checkpoints/0' in retrying, retrying
    assert_same_state(restore_final(workdir, config), at_once)

    truncate_arrays(f'{source}/checkpoints/0')
    damaged = str(tmp_path / 'damaged')
    with processes.Processes([processes.main_command(
        damaged, COMMAND_RUN | {'init_from': source})],
                             [environment]) as launch:
      [code] = launch.wait(300)
  assert code == 1
  assert launch.log(0).strip().splitlines()[-1].startswith(
      f'Error: the metadata of checkpoint {source}/checkpoints/0 is damaged '
      '('), (
          launch.log(0)[-3000:])
  assert not paths.path(f'{damaged}/checkpoints').exists()
