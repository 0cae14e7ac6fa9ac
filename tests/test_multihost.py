"""Multi-process runs as users launch them, stopped, killed and moved.

Real `main.py` processes on this machine (CPU devices, gloo collectives),
launched with the commands of docs/multihost.md. The reference is one
uninterrupted two-process run started SLURM-style: two tasks, no flags,
the SLURM variables that `srun` sets and JAX's cluster detection reads.
"""

import glob
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import uuid

from absl import flags
import numpy as np
import pytest

from checks import command_line
from configs import default
import eval_checkpoint
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from runtime import paths
import train
import processes
from tests import gcs_emulator
from helpers import DETERMINISTIC_TAGS
from helpers import assert_same_state
from helpers import assert_trees_close
from helpers import assert_within_rounding
from helpers import copy_checkpoint
from helpers import events
from helpers import read_scalars
from helpers import restore_final

DOC = os.path.join(processes.REPO, 'docs', 'multihost.md')
NUM_STEPS = 24
CHECKPOINT_EVERY = 12
# SGD: Adam turns rounding noise on parameters with zero gradient into
# learning-rate-sized steps.
RUN = dict(num_layers=2, width=8, batch_size=16, optimizer='sgd',
           warmup_epochs=0.0, num_train_steps=NUM_STEPS, log_every_steps=1,
           eval_every_steps=NUM_STEPS, checkpoint_every_steps=CHECKPOINT_EVERY)
# Seconds after which the survivors of a run give up on a dead process.
HEARTBEAT_TIMEOUT = 10
# What tells the docs' launch commands apart: a TPU slice, several TPU
# slices, SLURM, local.
TPU, MULTISLICE, SLURM, LOCAL = (
    'gcloud compute tpus tpu-vm ssh', 'gcloud compute tpus queued-resources',
    'srun', '--coordinator_address=127.0.0.1')


def run_config():
  """configs/default.py with RUN's overrides."""
  config = default.get_config()
  config.update(RUN)
  return config


def doc_block(marker: str) -> str:
  """The shell block of docs/multihost.md that contains `marker`."""
  with open(DOC) as f:
    blocks = re.findall(r'```sh\n(.*?)```', f.read(), re.S)
  [block] = [b for b in blocks if marker in b]
  return block


def doc_words(marker: str) -> list[str]:
  """The words of the docs' shell block that contains `marker`,
  continuation lines joined."""
  return shlex.split(doc_block(marker).replace('\\\n', ' '))


def local_launch(workdir, port: int, process_id: int, *extra_flags):
  """The docs' command for one of several local CPU processes, with this
  test's workdir, port and config overrides: (environment, command)."""
  words = doc_words(LOCAL)
  words = words[words.index('do') + 1:words.index('&')]
  variable, value = words[0].split('=', 1)
  assert variable == 'XLA_FLAGS' and words[1:3] == ['python3', 'main.py']
  command = [sys.executable, 'main.py'] + [
      word.replace('/tmp/two_processes', str(workdir))
      .replace('12345', str(port)).replace('$i', str(process_id))
      for word in words[3:]] + list(extra_flags) + [
          f'--config.{k}={v}' for k, v in RUN.items()]
  return processes.cpu_environment(
      4, XLA_FLAGS=f'{value} {processes.COMPILE_FLAGS}'), command


def local_processes(workdir, port: int) -> processes.Processes:
  launches = [local_launch(workdir, port, i,
                           f'--heartbeat_timeout_seconds={HEARTBEAT_TIMEOUT}')
              for i in range(2)]
  return processes.Processes([c for _, c in launches],
                             [e for e, _ in launches])


def slurm_port() -> int:
  """A free port that JAX's SLURM detection derives from a job id: it takes
  SLURM_JOB_ID % 4096 in the range 61440-65535."""
  for port in random.sample(range(61440, 65536), 200):
    with socket.socket() as s:
      try:
        s.bind(('127.0.0.1', port))
      except OSError:
        continue
      return port
  raise RuntimeError('no free port in 61440-65535')


def slurm_launch(workdir, devices: int, port: int, task: int):
  """The docs' SLURM command as `srun` runs it in one task of two on this
  node: (environment, command)."""
  words = doc_words(SLURM)
  program = words[words.index('python3'):]
  # No multi-host flag: everything comes from SLURM's variables.
  assert [w.split('=')[0] for w in program[2:]] == ['--config', '--workdir']
  environment = processes.cpu_environment(
      devices, SLURM_JOB_ID=str(port - 61440), SLURM_STEP_NODELIST='localhost',
      SLURM_NTASKS='2', SLURM_PROCID=str(task), SLURM_LOCALID=str(task))
  return environment, processes.main_command(workdir, RUN)


@pytest.fixture(scope='module')
def slurm_run(tmp_path_factory):
  """The reference: two SLURM-style tasks of four CPU devices, no flags,
  uninterrupted. Its workdir."""
  workdir = tmp_path_factory.mktemp('slurm')
  port = slurm_port()
  launches = [slurm_launch(workdir, 4, port, task) for task in range(2)]
  logs = processes.run([c for _, c in launches], [e for e, _ in launches])
  for task, log in enumerate(logs):  # one run of eight devices
    assert processes.joined_run(log) == (task, 2, 8)
  # Each process loads its own rows of every global batch.
  assert sorted(re.search(r'process \d loads rows ([\d,-]+) of', log)[1]
                for log in logs) == ['0-7', '8-15']
  return workdir


def stop_together(workdir, port: int, index: int, signum,
                  after_step: int) -> int:
  """Launches the two processes, sends `signum` to process `index` once a
  step past `after_step` is logged, and asserts that both stop after the
  same step, with a checkpoint there, and exit 0. Returns that step."""
  with local_processes(workdir, port) as run:
    run.wait_for_line(0, lambda line: (
        (m := processes.LOGGED_STEP.search(line)) and int(m[1]) > after_step),
                      300)
    run.popens[index].send_signal(signum)
    codes = run.wait(timeout=300)
    logs = [run.log(i) for i in range(2)]
  assert codes == [0, 0], logs[index][-3000:]
  name = signal.Signals(signum).name
  stopped = [re.findall(rf'Stopped by {name} after step (\d+)', log)
             for log in logs]
  assert stopped[0] == stopped[1] and len(stopped[0]) == 1, stopped
  step = int(stopped[0][0])
  assert step > after_step
  assert step in checkpointing.create_manager(workdir, 3).all_steps()
  return step


def tree_digest(root) -> dict:
  """{path relative to `root`: content} of every file below it, local or
  gs://."""
  root = paths.path(root)
  return {os.path.relpath(os.fspath(f), os.fspath(root)): f.read_bytes()
          for f in paths.files_under(root)}


def damage(checkpoint) -> dict:
  """Truncates the largest array file of `checkpoint` (a step's directory)
  to half; returns the directory's `tree_digest` after."""
  data = max(glob.glob(str(checkpoint / 'state' / 'd' / '*')),
             key=os.path.getsize)
  with open(data, 'r+b') as f:
    f.truncate(os.path.getsize(data) // 2)
  return tree_digest(checkpoint)


@pytest.mark.slow
@pytest.mark.xdist_group('slurm_run')
def test_an_interrupted_run_and_a_damaged_checkpoint_resume_with_the_same_commands_bit_exact(
    slurm_run, tmp_path):
  workdir, port = tmp_path / 'run', processes.free_port()
  # SIGINT (Ctrl-C) to process 1 only, past the first periodic checkpoint:
  # the processes share it through the coordination service, finish the
  # same step, save one checkpoint together and exit 0. (SIGTERM, a
  # preemption notice, which JAX's runtime shares: the chaos test below.)
  interrupted_step = stop_together(workdir, port, 1, signal.SIGINT,
                                   after_step=CHECKPOINT_EVERY)
  assert interrupted_step < NUM_STEPS
  previous, newest = checkpointing.create_manager(workdir, 3).all_steps()
  assert (previous, newest) == (CHECKPOINT_EVERY, interrupted_step)

  # The newest checkpoint truncated: both processes find it damaged,
  # process 0 moves it aside once and both resume from the one before.
  damaged = damage(workdir / 'checkpoints' / str(newest))
  # The same commands again: the run ends as the uninterrupted one did,
  # bit for bit, and TensorBoard shows every step once, with its values.
  # (A SIGKILL of one process of two: the chaos test below.)
  with local_processes(workdir, port) as run:
    assert run.wait(timeout=600) == [0, 0], run.log(0)[-3000:]
    logs = [run.log(i) for i in range(2)]
  for log in logs:
    assert f'Checkpoint at step {newest} is unreadable' in log
    assert f'Restored checkpoint at step {previous}' in log
  assert tree_digest(workdir / checkpointing.CORRUPT_DIR /
                     str(newest)) == damaged
  assert_same_state(restore_final(workdir, run_config()),
                    restore_final(slurm_run, run_config()))
  reference_events, resumed_events = events(slurm_run), events(workdir)
  for tag in DETERMINISTIC_TAGS:
    assert resumed_events[tag] == reference_events[tag], tag


@pytest.mark.slow
@pytest.mark.xdist_group('slurm_run')
def test_two_processes_compute_what_one_process_of_eight_devices_computes(
    slurm_run, tmp_path):
  """The same loss at every step (1e-5) and, restored in this one process
  of eight devices onto its own shardings, the checkpoint the two processes
  wrote together holds its parameters, statistics and optimizer state."""
  reference = train.train_and_evaluate(run_config(), str(tmp_path))
  losses, reference_losses = (
      read_scalars(str(workdir))['train_loss']
      for workdir in (slurm_run, tmp_path))
  assert sorted(losses) == list(range(1, NUM_STEPS + 1))
  np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                             [reference_losses[s] for s in sorted(losses)],
                             rtol=1e-5)
  manager = checkpointing.create_manager(slurm_run, keep=3)
  restored = checkpointing.restore_latest(
      manager, reference, compatibility.as_json(run_config())).state
  manager.close()
  assert int(restored.step) == NUM_STEPS
  assert_trees_close(
      (restored.params, restored.model_state, restored.opt_state),
      (reference.params, reference.model_state, reference.opt_state),
      rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group('slurm_run')
def test_two_processes_resume_on_one_process_of_two_devices_within_rounding(
    slurm_run, tmp_path):
  resumed, alone = tmp_path / 'resumed', tmp_path / 'alone'
  copy_checkpoint(slurm_run, CHECKPOINT_EVERY, resumed)
  # One process of two devices: resumed from the two processes' checkpoint,
  # and from scratch (the rounding floor of the device count).
  logs = processes.run(
      [processes.main_command(resumed, RUN),
       processes.main_command(alone, RUN)],
      [processes.cpu_environment(2)] * 2)
  assert f'Restored checkpoint at step {CHECKPOINT_EVERY}' in logs[0]
  assert processes.joined_run(logs[0]) == (0, 1, 2)
  assert_within_rounding(restore_final(resumed, run_config()),
                         restore_final(slurm_run, run_config()),
                         restore_final(alone, run_config()))


@pytest.mark.slow
@pytest.mark.xdist_group('slurm_run')
def test_seeded_faults_never_hang_a_two_process_run_and_it_ends_bit_identical(
    slurm_run, tmp_path):
  # benchmarks/chaos.py, short: a SIGTERM of process 0 during a checkpoint
  # write, then a SIGKILL of process 1 during an evaluation; every exit and
  # relaunch within its bound. (A SIGTERM at a plain step: the test above.)
  # The uninterrupted run to end bit-identical to: the SLURM-launched one.
  result = subprocess.run(
      [sys.executable, 'benchmarks/chaos.py', '--faults=2', '--seed=13',
       f'--num_train_steps={NUM_STEPS}', f'--reference_workdir={slurm_run}',
       f'--heartbeat_timeout_seconds={HEARTBEAT_TIMEOUT}',
       f'--workdir={tmp_path}'], cwd=processes.REPO, capture_output=True,
      text=True, timeout=1800)
  assert result.returncode == 0, (
      result.stdout + processes.failure_excerpt(result.stderr))
  assert '| 2 | 2 | 0 | bit-identical |' in result.stdout, result.stdout
  # The survivor of the SIGKILL (the second launch) aborted through JAX's
  # coordination service.
  with open(tmp_path / 'logs' / 'launch-2.process-0.log') as f:
    assert 'unhealthy (stopped sending heartbeats)' in f.read()
  # The last launch: process 0 loads every program from the cache that the
  # two processes share and compiles none. Process 1 compiles them all:
  # JAX writes entries from process 0 only, and on XLA:CPU its cache key
  # (the devices' topology fingerprint) differs from process to process.
  reports = []
  for index in range(2):
    with open(tmp_path / 'logs' / f'launch-3.process-{index}.log') as f:
      [report] = re.findall(r'Compilation cache \S+: (\d+) programs '
                            r'loaded, (\d+) compiled', f.read())
      reports.append(tuple(map(int, report)))
  programs = reports[0][0]
  assert programs > 0 and reports == [(programs, 0), (0, programs)], reports


# A config file of the run with a copy of its validation set and a few-shot
# probe beside the main evaluation.
EVALS_CONFIG = """
import ml_collections
from configs import default
from evaluators import classification


def get_config():
  config = default.get_config()
  config.evals.copy = ml_collections.ConfigDict(
      dict(type='classification', dataset='digits'))
  config.evals.probe = ml_collections.ConfigDict(
      dict(type='fewshot', datasets={'digits': 'digits'}, shots=(1, 10)))
  return config
"""


@pytest.mark.slow
@pytest.mark.xdist_group('slurm_run')
def test_two_processes_stop_together_when_the_bucket_stutters_and_nothing_moves(
    slurm_run, tmp_path):
  """Connections to the arrays' data dropped past restore_retry_seconds:
  both processes stop with the same one line and the bucket is as it
  was."""
  name = f'two-{uuid.uuid4().hex[:8]}'
  with gcs_emulator.running(name) as url:
    workdir = f'gs://{name}/run'
    for file in paths.files_under(paths.path(slurm_run) / 'checkpoints'):
      relative = os.path.relpath(os.fspath(file), os.fspath(slurm_run))
      (paths.path(workdir) / relative).write_bytes(file.read_bytes())
    before = tree_digest(workdir)
    with gcs_emulator.FaultyProxy(url) as proxy:
      proxy.failing, proxy.mode = '/state/d/', 'drop'
      port = processes.free_port()
      launches = [local_launch(workdir, port, i,
                               '--config.restore_retry_seconds=20',
                               f'--events_dir={tmp_path / "events"}')
                  for i in range(2)]
      with processes.Processes(
          [c for _, c in launches],
          [{k: v for k, v in e.items() if k != 'EPATH_USE_TF'} |
           gcs_emulator.environment(proxy.url) for e, _ in launches]) as run:
        codes = run.wait(timeout=300)
        lasts = [run.log(i).strip().splitlines()[-1] for i in range(2)]
      assert codes == [1, 1], lasts
      assert proxy.refused > 0
    assert lasts[0] == lasts[1]
    assert re.fullmatch(
        rf'Error: checkpoint {NUM_STEPS} in {workdir}/checkpoints could not '
        r'be read: stalled for \d+ s \(TimeoutError: no byte from storage '
        r'for \d+ s\); nothing was changed; run the same command again '
        r'\(restore_retry_seconds bounds a stall\)', lasts[0]), lasts[0]
    assert tree_digest(workdir) == before


@pytest.mark.slow
@pytest.mark.xdist_group('slurm_run')
def test_two_processes_run_every_evaluator_once_over_its_data(slurm_run,
                                                              tmp_path):
  """--mode=eval of the two processes' checkpoint on two processes: each
  evaluator counts every example once, and gives what one process of
  eight devices gives."""
  config_file = tmp_path / 'evals_config.py'
  config_file.write_text(EVALS_CONFIG)
  port, events_dir = processes.free_port(), tmp_path / 'events'
  commands = [[sys.executable, 'main.py', f'--config={config_file}',
               f'--workdir={slurm_run}', f'--events_dir={events_dir}',
               '--mode=eval', f'--coordinator_address=127.0.0.1:{port}',
               '--num_processes=2', f'--process_id={i}'] +
              [f'--config.{k}={v}' for k, v in RUN.items()]
              for i in range(2)]
  logs = processes.run(commands, [processes.cpu_environment(4)] * 2)
  assert processes.joined_run(logs[1]) == (1, 2, 8)
  two = {tag: values[NUM_STEPS]
         for tag, values in read_scalars(str(events_dir)).items()}
  assert two['eval_copy_examples'] == two['eval_examples'] == 360
  for metric in ('accuracy', 'top5_accuracy', 'loss'):
    assert two[f'eval_copy_{metric}'] == two[f'eval_{metric}']
  config = command_line.load_config_file(str(config_file))
  config.update(RUN)
  one = eval_checkpoint.evaluate_checkpoint(config, str(slurm_run),
                                           events_dir=str(tmp_path / 'one'))
  assert one.keys() == two.keys()
  for tag in one:  # few-shot: one test digit of 360 may tip over
    assert two[tag] == pytest.approx(
        one[tag], rel=1e-5, abs=1.01 / 360 if 'fewshot' in tag else 0), tag


def test_launch_commands_agree_in_readme_and_docs_and_use_existing_flags():
  import main  # pylint: disable=g-import-not-at-top  (defines the flags)
  del main
  # The README shows the same commands (multislice and local processes:
  # docs/multihost.md only).
  spaced = lambda text: ' '.join(text.replace('\\\n', ' ').split())
  with open(os.path.join(processes.REPO, 'README.md')) as f:
    readme = spaced(f.read())
  for marker in (TPU, SLURM):
    assert spaced(doc_block(marker)) in readme, marker
  commands = []
  for marker in (TPU, MULTISLICE):  # what each worker runs
    [remote] = [w.split('=', 1)[1] for w in doc_words(marker)
                if w.startswith('--command=')]
    program = shlex.split(remote.split('&&', 1)[1])
    assert program[:2] == ['python3', 'main.py'], program
    commands.append(program)
  slurm = doc_words(SLURM)
  commands.append(slurm[slurm.index('python3'):])
  for command in commands:
    config_path = [w for w in command if w.startswith('--config=')]
    file_config = command_line.load_config_file(
        os.path.join(processes.REPO, config_path[0].split('=', 1)[1]))
    for word in command[2:]:
      name = word[2:].split('=', 1)[0]
      if name.startswith('config.'):
        value = file_config
        for key in name.split('.')[1:]:
          value = value[key]  # a KeyError names a key that does not exist
      else:
        assert name in flags.FLAGS, f'main.py has no flag --{name}'
