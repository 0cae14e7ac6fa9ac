"""What a restart costs with JAX's persistent compilation cache.

  python3 benchmarks/restarts.py --config=configs/default.py --num_train_steps=6

Launches `main.py` (one process, one CPU device unless --devices) three
ways, each from a fresh temporary directory of its own, and prints a table:
a cold launch (an empty cache), a second run of the same config (another
workdir, the cache the cold launch filled) and a resume after a SIGKILL (the
second run's workdir killed after its first checkpoint, then launched
again), and the same three with `--compilation_cache_dir=''` (no cache).
Columns: the launch's startup (main.py's line at its first step: from
its first line to the first step's result) and its phases of a tenth of a
second or more, the train step's `compile_seconds`, programs loaded and
compiled (main.py's last line), and the whole launch's wall time, the
interpreter's start and exit included.
"""

import os
import re
import signal
import sys
import tempfile
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from runtime import console  # pylint: disable=g-import-not-at-top
from tests import processes  # pylint: disable=g-import-not-at-top

flags.DEFINE_string('config', 'configs/default.py', 'Config file.')
flags.DEFINE_integer('num_train_steps', 6, 'Steps of each run.')
flags.DEFINE_integer('devices', 1, 'Simulated CPU devices.')
flags.DEFINE_list('overrides', [], 'More config overrides, KEY=VALUE.')
FLAGS = flags.FLAGS

STARTUP = re.compile(r'Started in ([\d.]+) s: (.*)\.$', re.MULTILINE)
COMPILE_SECONDS = re.compile(r'\[\d+\] compile_seconds=([\d.]+)')
REPORT = re.compile(r'Compilation cache \S+: (\d+) programs loaded, (\d+) '
                    r'compiled')


def command(workdir: str, cache_dir: str) -> list[str]:
  overrides = dict(num_train_steps=FLAGS.num_train_steps, log_every_steps=1,
                   eval_every_steps=FLAGS.num_train_steps,
                   checkpoint_every_steps=max(FLAGS.num_train_steps // 2, 1))
  overrides.update(o.split('=', 1) for o in FLAGS.overrides)
  return [sys.executable, 'main.py', f'--config={FLAGS.config}',
          f'--workdir={workdir}', f'--compilation_cache_dir={cache_dir}',
          *(f'--config.{k}={v}' for k, v in overrides.items())]


def launch(workdir: str, cache_dir: str, kill_after_checkpoint=False):
  """(startup seconds, its main phases, compile_seconds, loaded, compiled,
  wall seconds) of one launch; killed after its first checkpoint when
  asked (then only the first three are measured)."""
  started = time.monotonic()
  with processes.Processes([command(workdir, cache_dir)],
                           [processes.cpu_environment(FLAGS.devices)]) as run:
    run.wait_for_line(0, processes.LOGGED_STEP.search, timeout=600)
    if kill_after_checkpoint:
      checkpoints = os.path.join(workdir, 'checkpoints')
      while not (os.path.isdir(checkpoints) and any(
          name.isdigit() for name in os.listdir(checkpoints))):
        time.sleep(0.01)
      run.popens[0].send_signal(signal.SIGKILL)
    codes = run.wait(timeout=600)
    log = run.log(0)
  wall = time.monotonic() - started
  compile_seconds = float(COMPILE_SECONDS.search(log)[1])
  startup = STARTUP.search(log)
  phases = ', '.join(
      phase for phase in startup[2].split(', ')
      if float(phase.rsplit(' ', 2)[1]) >= 0.1)
  if kill_after_checkpoint:
    return float(startup[1]), phases, compile_seconds, None, None, None
  assert codes == [0], processes.failure_excerpt(log)
  report = REPORT.search(log)
  loaded, compiled = (int(report[1]), int(report[2])) if report else (0, 0)
  return float(startup[1]), phases, compile_seconds, loaded, compiled, wall


def main(_):
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  root = tempfile.mkdtemp(prefix='restarts-')
  print(f'{FLAGS.config}, {FLAGS.num_train_steps} steps, {FLAGS.devices} '
        f'CPU device(s), {os.cpu_count()} CPU cores; each launch a new '
        'process')
  print('| cache | launch | startup s | its phases, s | compile_seconds | '
        'programs loaded | compiled | wall s |')
  print('| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |')
  for label, cache_dir in (('on', os.path.join(root, 'cache')), ('off', '')):
    rows = {}
    rows['cold'] = launch(os.path.join(root, label, 'cold'), cache_dir)
    second = os.path.join(root, label, 'second')
    rows['second run'] = launch(second, cache_dir)
    killed = os.path.join(root, label, 'killed')
    launch(killed, cache_dir, kill_after_checkpoint=True)
    rows['resume after SIGKILL'] = launch(killed, cache_dir)
    for name, (startup, phases, compile_s, loaded, compiled,
               wall) in rows.items():
      print(f'| {label} | {name} | {startup:.1f} | {phases} | '
            f'{compile_s:.2f} | {loaded} | {compiled} | {wall:.1f} |')


if __name__ == '__main__':
  app.run(main)
