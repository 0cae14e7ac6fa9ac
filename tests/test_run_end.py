"""A run's end as a user sees it: after Ctrl-C (or the last step, or a
bad config's error line) the process exits at once, its teardown counted
by name in the goodput line."""

import signal
import time

import pytest

import processes
from image_data import write_folders

# tf.data's tuning thread sleeps between rounds for a period that doubles:
# about 41 s long once a pipeline has run 41 s. A teardown then used to
# wait out what was left of it (5 to 40 s), most often right after an
# evaluation; a run stopped sooner never waited. The run goes on that long
# at a fifth of its CPU time (`Processes.run_slowly`): the tuning thread's
# sleeps count wall time.
PIPELINE_SECONDS = 45
EXIT_SECONDS = 2.0
# TensorFlow's import takes a launch about 3 s of CPU on this kind of
# machine; a refusal exits in milliseconds after its line (0.06 to 0.12 s
# with three busy processes beside it).
REFUSED_EXIT_SECONDS = 1.0


def test_a_folder_run_exits_within_two_seconds_of_its_last_step_line(
    tmp_path):
  """From the last step's line (its evaluation and checkpoint follow) to
  the process's exit, without TensorFlow's FAILED_PRECONDITION about the
  generator of the folders' pipeline."""
  root = tmp_path / 'images'
  write_folders(root, extras=False)
  steps = 30
  command = processes.main_command(
      tmp_path / 'run', dict(dataset=f'folder:{root}', batch_size=8,
                             num_train_steps=steps, log_every_steps=10))
  with processes.Processes([command],
                           [processes.one_device_environment()]) as run:
    run.wait_for_line(0, lambda line: f'[{steps}] ' in line and
                      'train_loss=' in line, 300)
    last_step = time.monotonic()
    assert run.wait(60) == [0], run.log(0)[-3000:]
    exit_seconds = time.monotonic() - last_step
  assert exit_seconds <= EXIT_SECONDS, run.log(0)[-3000:]
  assert 'FAILED_PRECONDITION' not in run.log(0)


@pytest.mark.slow
def test_ctrl_c_late_in_a_folder_run_exits_within_two_seconds_of_its_save(
    tmp_path):
  """Ctrl-C 45 s into a run on image folders, right after an evaluation:
  from the 'Stopped by SIGINT ... checkpoint saved' line to the process's
  exit, at most 2 s."""
  root = tmp_path / 'images'
  write_folders(root, extras=False)
  command = processes.main_command(
      tmp_path / 'run', dict(dataset=f'folder:{root}', batch_size=8,
                             num_train_steps=10**6, log_every_steps=50,
                             eval_every_steps=50,
                             checkpoint_every_steps=10**6))
  with processes.Processes([command],
                           [processes.one_device_environment()]) as run:
    run.wait_for_line(0, processes.LOGGED_STEP.search, 300)
    run.run_slowly(0, PIPELINE_SECONDS)
    run.wait_for_line(0, lambda line: 'eval_accuracy=' in line, 120,
                      first=len(run.lines[0]))
    run.popens[0].send_signal(signal.SIGINT)
    run.wait_for_line(0, lambda line: 'Stopped by SIGINT' in line, 120)
    saved = time.monotonic()
    assert run.wait(60) == [0], run.log(0)[-3000:]
    exit_seconds = time.monotonic() - saved
    log = run.log(0)
  assert exit_seconds <= EXIT_SECONDS, log[-3000:]
  assert 'Stopping the input pipeline' not in log
  goodput, = [line for line in log.splitlines() if 'Goodput ' in line]
  assert ', teardown ' in goodput, goodput


def test_a_launch_refused_for_its_config_exits_at_once_after_its_error(
    tmp_path):
  """A bad config is met while TensorFlow still imports for the run's
  writer (seconds, on a thread of its own): the launch does not wait for
  the import it will not use, and has written nothing."""
  workdir = tmp_path / 'run'
  command = processes.main_command(workdir, dict(num_train_steps=-5))
  with processes.Processes([command],
                           [processes.one_device_environment()]) as run:
    error = run.wait_for_line(0, lambda line: line.startswith('Error: '), 300)
    refused = time.monotonic()
    assert run.wait(60) == [1], run.log(0)[-3000:]
    exit_seconds = time.monotonic() - refused
  assert 'num_train_steps > 0' in error
  assert exit_seconds <= REFUSED_EXIT_SECONDS, run.log(0)[-3000:]
  assert not workdir.exists()
