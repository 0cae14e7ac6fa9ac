"""Restarts across launches of `main.py`: what a relaunch loads from JAX's
persistent compilation cache (the programs and the FLOPs count), what it
does with a damaged, unusable or stale one (another device count, another
jax), and the goodput a run killed and resumed twice reports."""

import glob
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest

from runtime import checkpointing
from runtime import compilation_cache
from runtime import goodput
import processes
from helpers import cache_directory
from helpers import counter
from helpers import events

RUN = dict(num_layers=2, width=8, batch_size=16, num_train_steps=12,
           log_every_steps=1, eval_every_steps=2, checkpoint_every_steps=2)
# main.py's last line: what the cache did in that launch.
REPORT = re.compile(r'Compilation cache (\S+): (\d+) programs loaded, '
                    r'(\d+) compiled')
STARTUP = re.compile(r'Started in ([\d.]+) s: imports [\d.]+ s, '
                     r'distributed [\d.]+ s, data [\d.]+ s, .*'
                     r'compile [\d.]+ s, first step [\d.]+ s\.')


# The report's end in a train run: its FLOPs count read back or counted.
FLOPS = re.compile(r'step_flops: (\d+) read back, (\d+) counted\.')


def command(workdir, cache_dir, python=sys.executable, **overrides):
  return processes.main_command(workdir, RUN | overrides,
                                f'--compilation_cache_dir={cache_dir}',
                                python=python)


def launch(workdir, cache_dir, devices=1, python=sys.executable,
           **overrides) -> tuple[int, int, str]:
  """One whole launch of RUN (with `overrides`) with `cache_dir` on
  `devices` CPU devices, run by `python`: (programs loaded, compiled, its
  log)."""
  [log] = processes.run([command(workdir, cache_dir, python, **overrides)],
                        [processes.cpu_environment(devices)])
  found = REPORT.search(log)
  assert found and found[1] == str(cache_dir), log[-3000:]
  return int(found[2]), int(found[3]), log


def flops_counts(log) -> tuple[int, int]:
  """(FLOPs counts read back from the cache, counted) by a launch."""
  found = FLOPS.search(log)
  assert found, log[-3000:]
  return int(found[1]), int(found[2])


def cache_warnings(log) -> list[str]:
  """The launch's warning lines about the compilation cache (absl's and
  Python's)."""
  return [line for line in log.splitlines()
          if re.match(r'W\d{4} |.*Warning:', line) and 'cache' in line.lower()]


def newest_checkpoint(workdir) -> int:
  """The step of the newest complete checkpoint (orbax renames a save's
  temporary directory to its step when it is complete); 0 if none."""
  directory = os.path.join(workdir, checkpointing.CHECKPOINTS_DIR)
  steps = [int(name) for name in os.listdir(directory) if name.isdigit()]
  return max(steps, default=0)


def read_record(workdir) -> dict:
  with open(os.path.join(workdir, goodput.RECORD_FILE)) as f:
    return json.loads(f.read())


def launch_and_kill(workdir, cache_dir, after_checkpoint: int):
  """Launches RUN and SIGKILLs it once a checkpoint newer than
  `after_checkpoint` is complete and a later step is recorded: steps that
  the next launch must do again. Returns (its start time, its log)."""
  started = time.time()
  with processes.Processes([command(workdir, cache_dir)],
                           [processes.cpu_environment(1)]) as run:
    deadline = time.monotonic() + 600
    while True:
      assert time.monotonic() < deadline and run.popens[0].poll() is None, (
          run.log(0)[-3000:])
      record_file = os.path.join(workdir, goodput.RECORD_FILE)
      if os.path.exists(record_file) and os.path.isdir(
          os.path.join(workdir, checkpointing.CHECKPOINTS_DIR)):
        newest = newest_checkpoint(workdir)
        pending = read_record(workdir)['pending_steps']
        if newest > after_checkpoint and pending and pending[-1][0] > newest:
          break
      time.sleep(0.005)
    run.popens[0].send_signal(signal.SIGKILL)
    run.wait(timeout=60)
    return started, run.log(0)


@pytest.fixture(scope='module')
def killed_and_resumed_twice(tmp_path_factory):
  """RUN launched with an empty cache and killed, resumed and killed, then
  resumed to its end: (workdir, cache, programs the first launch compiled,
  the launches' logs, lost seconds and a floor of the idle seconds as the
  killed launches' records give them, each launch's first step)."""
  tmp_path = tmp_path_factory.mktemp('restarts')
  workdir, cache = tmp_path / 'run', tmp_path / 'cache'
  expected_lost, idle_floor, first_steps, logs = 0.0, 0.0, [1], []
  checkpoint = 0
  for _ in range(2):
    started, log = launch_and_kill(workdir, cache, checkpoint)
    logs.append(log)
    # What the killed launch recorded last: its steps after the checkpoint
    # the next launch resumes from are lost.
    record, checkpoint = read_record(workdir), newest_checkpoint(workdir)
    expected_lost += sum(seconds for step, seconds in record['pending_steps']
                         if step > checkpoint)
    first_steps.append(checkpoint + 1)
    time.sleep(1.0)  # idle: no launch
    idle_floor += time.time() - record['updated']
    if len(logs) == 1:
      # The cold launch compiled every program into the cache.
      programs = len(cache_entries(cache))
      assert programs >= 4
  loaded, compiled, log = launch(workdir, cache)
  logs.append(log)
  assert f'Restored checkpoint at step {checkpoint}' in log
  return dict(workdir=workdir, cache=cache, programs=programs, logs=logs,
              loaded=loaded, compiled=compiled, expected_lost=expected_lost,
              idle_floor=idle_floor, first_steps=first_steps)


@pytest.mark.xdist_group('restarts')
def test_a_resume_after_a_kill_loads_every_program_from_the_cache(
    killed_and_resumed_twice):
  run = killed_and_resumed_twice
  assert (run['loaded'], run['compiled']) == (run['programs'], 0)


@pytest.mark.xdist_group('restarts')
def test_goodput_and_badput_of_a_run_killed_and_resumed_twice_add_up(
    killed_and_resumed_twice):
  run = killed_and_resumed_twice
  workdir, expected_lost, idle_floor = (
      run['workdir'], run['expected_lost'], run['idle_floor'])
  record = read_record(workdir)
  assert record['launches'] == 3 and record['pending_steps'] == []
  assert record['seconds']['lost_steps'] == pytest.approx(expected_lost,
                                                          abs=1e-9)
  assert expected_lost > 0
  # The idle time spans each gap from a launch's last record to the next
  # launch's first line (Python's own start up to it included).
  assert idle_floor <= record['seconds']['idle'] <= idle_floor + 10
  # Every second since the first launch counted once: on TensorBoard, the
  # last step's goodput and badput add up to 1.
  scalars = events(workdir)
  last = {tag: pairs[-1] for tag, pairs in scalars.items()
          if tag == 'goodput' or tag.startswith('badput/')}
  assert sorted(last) == sorted(
      ['goodput', *(f'badput/{cause}' for cause in goodput.BADPUT)])
  assert {step for step, _ in last.values()} == {RUN['num_train_steps']}
  assert sum(value for _, value in last.values()) == pytest.approx(1, abs=1e-5)
  assert last['badput/lost_steps'][1] > 0 and last['badput/idle'][1] > 0
  assert 0 < last['goodput'][1] < 1
  assert re.search(r'Goodput [\d.]+% of [\d.]+ s since the run\'s first '
                   r'launch \(3 launches\); badput: startup [\d.]+%, '
                   r'compile [\d.]+%, checkpoint [\d.]+%, evaluation '
                   r'[\d.]+%, lost steps [\d.]+%, idle [\d.]+%, teardown '
                   r'[\d.]+%, other '
                   r'[\d.]+%\.', run['logs'][-1])
  # Each launch's startup: one console line by phase, and on TensorBoard.
  for launch_log in run['logs']:
    assert len(STARTUP.findall(launch_log)) == 1, launch_log[-3000:]
  assert [step for step, _ in scalars['startup_seconds']] == run['first_steps']
  assert all(seconds > 0 for _, seconds in scalars['startup_seconds'])


def cache_entries(cache_dir) -> list[str]:
  return [os.path.join(cache_dir, name) for name in os.listdir(cache_dir)
          if name.endswith('-cache')]


@pytest.mark.xdist_group('restarts')
def test_damaged_cache_entries_are_compiled_again_with_one_warning(
    killed_and_resumed_twice, tmp_path):
  cache, compiled = (killed_and_resumed_twice['cache'],
                     killed_and_resumed_twice['programs'])
  entries = cache_entries(cache)
  assert len(entries) == compiled
  # Entries cut short or overwritten with garbage: compiled again, one
  # warning line for all of them.
  for index, path in enumerate(entries):
    with open(path, 'r+b') as f:
      if index % 2:
        f.truncate(os.path.getsize(path) // 2)
      else:
        f.write(b'not a compiled program' * 8)
  loaded, compiled_again, log = launch(tmp_path / 'damaged', cache)
  assert (loaded, compiled_again) == (0, compiled)
  assert log.count('holds an unreadable entry') == 1, log[-3000:]
  # The one warning line, found as `cache_warnings` finds any.
  assert len(cache_warnings(log)) == 1, log[-3000:]
  assert log.count('Error reading persistent compilation cache entry') == 1
  assert f'({len(entries)} unreadable entries)' in log
  assert 'Remove the directory to rebuild the cache.' in log


@pytest.mark.xdist_group('restarts')
def test_relaunches_read_step_flops_back_and_a_wider_model_counts_its_own(
    killed_and_resumed_twice, tmp_path):
  run = killed_and_resumed_twice
  # The cold launch kept one count; the last resume read it back instead of
  # lowering the step again, unrolled (the killed launches end before
  # main.py's report), and every launch logged the same step_flops.
  assert flops_counts(run['logs'][-1]) == (1, 0)
  flops = [value for _, value in events(run['workdir'])['step_flops']]
  assert len(flops) == 3 and len(set(flops)) == 1 and flops[0] > 0
  cache = shutil.copytree(run['cache'], tmp_path / 'cache')
  assert len(os.listdir(cache / compilation_cache.FLOPS_DIR)) == 1
  # Another width is another program: a count of its own, kept beside.
  _, _, log = launch(tmp_path / 'wide', cache, width=16, num_train_steps=2)
  assert flops_counts(log) == (0, 1)
  [(_, wide)] = events(tmp_path / 'wide')['step_flops']
  assert wide > 2 * flops[0]
  assert len(os.listdir(cache / compilation_cache.FLOPS_DIR)) == 2


@pytest.mark.xdist_group('restarts')
def test_another_device_count_compiles_every_program_again_without_warning(
    killed_and_resumed_twice, tmp_path):
  """The cache of RUN on one device, RUN relaunched on two."""
  run = killed_and_resumed_twice
  cache = shutil.copytree(run['cache'], tmp_path / 'cache')
  workdir = tmp_path / 'two_devices'
  loaded, compiled, log = launch(workdir, cache, devices=2)
  assert processes.joined_run(log)[2] == 2
  # JAX leaves the device-count flag out of its key, but the programs'
  # shardings and device assignment differ: no entry matches. (Two devices
  # run more programs than one: small ones that one device needs not.)
  assert loaded == 0 and compiled >= run['programs']
  assert cache_warnings(log) == []
  assert flops_counts(log) == (0, 1)
  assert events(workdir)['train_loss'][-1][0] == RUN['num_train_steps']


# Another jax release that requirements.txt's flax accepts (jax >= 0.10.0).
OTHER_JAX = '0.10.1'


def test_another_jax_version_compiles_every_program_again_without_warning(
    tmp_path):
  """A short run with jax and jaxlib OTHER_JAX (a virtual environment over
  this interpreter's packages) fills a cache; this interpreter's jax then
  loads none of it."""
  run = dict(num_train_steps=2)
  cache, venv = tmp_path / 'cache', tmp_path / 'venv'
  try:
    subprocess.run([sys.executable, '-m', 'venv', venv], check=True)
    python = str(venv / 'bin' / 'python')
    # This interpreter's packages behind the new environment's own (a .pth
    # file's paths follow the environment's site-packages): unlike
    # --system-site-packages, this holds when this interpreter is itself a
    # virtual environment's, whose packages are not the base's.
    [site_packages] = glob.glob(str(venv / 'lib' / 'python*' /
                                    'site-packages'))
    with open(os.path.join(site_packages, 'outer_packages.pth'), 'w') as f:
      f.write('\n'.join(p for p in sys.path if p.endswith('site-packages')))
    install = subprocess.run(
        [python, '-m', 'pip', 'install', '--quiet', '--root-user-action=ignore',
         '--disable-pip-version-check', f'jax=={OTHER_JAX}',
         f'jaxlib=={OTHER_JAX}'], capture_output=True, text=True, check=False)
    assert install.returncode == 0, install.stdout + install.stderr
    *from_empty_cache, log = launch(tmp_path / 'other', cache,
                                    python=python, **run)
    assert f'JAX {OTHER_JAX} on cpu' in log, log[-3000:]
  finally:
    shutil.rmtree(venv, ignore_errors=True)  # some 300 MB
  *from_other_cache, log = launch(tmp_path / 'this', cache, **run)
  assert f'JAX {jax.__version__} on cpu' in log
  # This jax loads from the other's cache what the other loaded from an
  # empty one: only its own programs compiled earlier in the launch (two
  # functions that lower to one program), none of the other jax's; and it
  # compiles as many.
  assert from_other_cache == from_empty_cache
  assert from_empty_cache[0] > 0
  assert cache_warnings(log) == []
  # The FLOPs count's key holds the jax version too.
  assert flops_counts(log) == (0, 1)


def test_a_damaged_flops_count_is_counted_again_and_replaced(tmp_path,
                                                             caplog):
  count, calls = counter(5e9)
  key = 'a' * 64
  with cache_directory(str(tmp_path)):
    assert compilation_cache.kept_flops(key, count) == 5e9
    assert compilation_cache.kept_flops(key, count) == 5e9
    assert len(calls) == 1  # the second one read the first one's count
    kept = tmp_path / compilation_cache.FLOPS_DIR / f'{key}.json'
    damaged = [b'', b'{"flops": 5e', b'\xff\xfe garbage', b'[5e9]',
               b'{"flops": "5e9"}', b'{"flops": NaN}', b'{"count": 5e9}']
    for content in damaged:
      kept.write_bytes(content)
      assert compilation_cache.kept_flops(key, count) == 5e9
      assert json.loads(kept.read_text()) == {'flops': 5e9}
  assert len(calls) == 1 + len(damaged)
  warnings = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING]
  assert len(warnings) == len(damaged)
  assert all(f'{kept} holds no FLOPs count' in w for w in warnings)


def test_without_a_cache_directory_the_flops_are_counted_every_time():
  count, calls = counter(5e9)
  with cache_directory(None):
    for _ in range(2):
      assert compilation_cache.kept_flops('a' * 64, count) == 5e9
  assert len(calls) == 2


def test_an_unusable_cache_directory_is_one_warning_line_and_no_cache(
    tmp_path, caplog):
  not_a_directory = tmp_path / 'file'
  not_a_directory.write_text('')
  cache = not_a_directory / 'cache'
  suites_cache = jax.config.jax_compilation_cache_dir
  try:
    compilation_cache.enable(str(cache))
    assert jax.config.jax_compilation_cache_dir is None
  finally:
    jax.config.update('jax_compilation_cache_dir', suites_cache)
  [warning] = [r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING]
  assert warning.startswith(f'Compilation cache {cache} is not usable (')
  assert warning.endswith(
      "compiling every program. Pass --compilation_cache_dir=DIR (writable) "
      "or '' for none.")
  assert compilation_cache.report() == ''
