"""Faults injected into a two-process run: does it always come back?

  python3 benchmarks/chaos.py --faults=50 --seed=0

Runs `main.py` as two processes of four CPU devices each (the local launch
of docs/multihost.md, `configs/default.py` with a small model, a checkpoint
every 5 steps, an evaluation every 7) and injects `--faults` faults, each at
a step drawn from `--seed`: SIGKILL of process 0 or 1, SIGTERM of process 0
or 1, or SIGTERM of both; each either at a plain step, during a checkpoint
write (fired when the save's temporary directory appears) or during an
evaluation (fired when an evaluation step has logged its training metrics,
so that the evaluation is running). After each fault:

- SIGKILL: the other process must exit within the heartbeat timeout plus
  `--exit_bound_seconds` (JAX's coordination service aborts it);
- SIGTERM: both processes must stop at the same step, with a checkpoint
  there, and exit 0 within `--exit_bound_seconds`;

then the same two commands are relaunched, and each launch must log a
training step within `--start_bound_seconds`. A missed bound is a hang:
the stacks of every thread of the processes still running are written to
`WORKDIR/logs` (with every launch's logs) and the processes are killed.
After the last fault the run is left to finish, and its final parameters
and BatchNorm statistics are compared bit for bit with an uninterrupted
run of the same two processes.

Prints a table: faults injected and survived (stopped as promised, then
resumed past the step where the fault hit), hangs, and the time lost per
fault (from the fault until the relaunched run logs the step it had reached).
Exit code 0 only with every fault survived, no hang and no difference.
"""

import collections
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from runtime import checkpointing  # pylint: disable=g-import-not-at-top
from runtime import console
from runtime import goodput
from tests import processes
from weights import project_files

flags.DEFINE_integer('faults', 50, 'Faults to inject.')
flags.DEFINE_integer('seed', 0, 'Seeds the faults, their steps and phases.')
flags.DEFINE_integer('num_train_steps', 0, 'Steps of the run (0: enough '
                     'for the faults, 7 per fault plus 20).')
flags.DEFINE_integer('heartbeat_timeout_seconds', 10, 'Passed to main.py.')
flags.DEFINE_integer('exit_bound_seconds', 60, 'Seconds, beyond the '
                     'heartbeat timeout after a SIGKILL, within which the '
                     'processes must exit after a fault.')
flags.DEFINE_integer('start_bound_seconds', 180, 'Seconds within which a '
                     'launch must log its first training step.')
flags.DEFINE_string('workdir', None, 'Where the runs go (default: a new '
                    'temporary directory).')
flags.DEFINE_string('compilation_cache_dir', None, "Passed to main.py ('': "
                    "none; default: main.py's).")
flags.DEFINE_string('reference_workdir', None, 'A finished uninterrupted run '
                    'of the same model, optimizer and steps on two processes '
                    'of four devices, to compare with instead of running one '
                    '(its checkpoint and evaluation steps may differ).')

RUN = dict(num_layers=2, width=8, batch_size=16, optimizer='sgd',
           warmup_epochs=0.0, log_every_steps=1, checkpoint_every_steps=5,
           eval_every_steps=7, steps_per_eval=-1)
KINDS = ('SIGKILL 0', 'SIGKILL 1', 'SIGTERM 0', 'SIGTERM 1', 'SIGTERM both')
PHASES = ('step', 'checkpoint write', 'evaluation')
STOPPED = re.compile(r'Stopped by SIGTERM after step (\d+)')


def run_overrides(num_steps: int) -> dict:
  return dict(RUN, num_train_steps=num_steps)


def launch(workdir, port: int, num_steps: int) -> processes.Processes:
  """The two processes of the run, as docs/multihost.md launches them."""
  commands = [processes.main_command(
      workdir, run_overrides(num_steps), f'--coordinator_address=127.0.0.1:'
      f'{port}', '--num_processes=2', f'--process_id={i}',
      f'--heartbeat_timeout_seconds={FLAGS.heartbeat_timeout_seconds}',
      *([] if FLAGS.compilation_cache_dir is None else
        [f'--compilation_cache_dir={FLAGS.compilation_cache_dir}']))
              for i in range(2)]
  return processes.Processes(commands, [processes.cpu_environment(4)] * 2)


def last_logged_step(run: processes.Processes) -> int:
  steps = [int(m[1]) for line in list(run.lines[0])
           if (m := processes.LOGGED_STEP.search(line))]
  return max(steps, default=0)


def wait_until(condition, timeout: float, poll: float = 0.01) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      return True
    time.sleep(poll)
  return False


def next_multiple(step: int, every: int) -> int:
  return -(-step // every) * every


class Chaos:
  """The faulted run and what each fault cost."""

  def __init__(self, workdir: str, num_steps: int, rng: random.Random):
    self.workdir, self.num_steps, self.rng = workdir, num_steps, rng
    self.port = processes.free_port()
    self.lost = collections.defaultdict(list)  # kind -> seconds lost
    self.injected = collections.Counter()  # (kind, phase) -> count
    self.survived = self.hangs = 0
    self.in_phase = collections.Counter()  # phase -> fired inside it
    self.notes = []
    self.launches = 0
    self.logs = os.path.join(os.path.dirname(workdir), 'logs')
    os.makedirs(self.logs, exist_ok=True)

  def end(self, run: processes.Processes) -> None:
    """Kills what is left of a launch and keeps its logs in WORKDIR/logs."""
    run.__exit__()
    self.launches += 1
    for index in range(2):
      with open(os.path.join(self.logs, f'launch-{self.launches}.process-'
                             f'{index}.log'), 'w') as f:
        f.write(run.log(index))

  def hang(self, run: processes.Processes, what: str,
           stacks: str | None = None) -> None:
    """Books a missed bound, with the stacks of the processes left."""
    self.hangs += 1
    path = os.path.join(self.logs, f'hang-{self.hangs}.txt')
    with open(path, 'w') as f:
      f.write(what + (run.stacks() if stacks is None else stacks))
    self.notes.append(f'hang: {what} (stacks in {path})')

  def start(self, fault) -> processes.Processes | None:
    """Launches the run. After a `fault` (kind, the step it hit, its
    time), books the time lost once the run logs a step past that one."""
    run = launch(self.workdir, self.port, self.num_steps)
    started = wait_until(lambda: last_logged_step(run) > 0 or any(
        p.poll() is not None for p in run.popens),
                         FLAGS.start_bound_seconds, poll=0.05)
    if not started:
      self.hang(run, f'launch logged no step in {FLAGS.start_bound_seconds}'
                ' s')
      self.end(run)
      return None
    if fault is not None:
      kind, reached, fault_time = fault
      if wait_until(lambda: last_logged_step(run) >= min(
          reached + 1, self.num_steps), FLAGS.start_bound_seconds, 0.05):
        self.lost[kind].append(time.monotonic() - fault_time)
        self.survived += 1
      else:
        self.notes.append(f'{kind}: the relaunch did not pass step '
                          f'{reached}')
    return run

  def target(self, after: int, phase: str) -> int:
    """A step shortly after `after`, at a checkpoint or evaluation step if
    the fault is meant to hit one."""
    step = after + self.rng.randint(1, 5)
    if phase == 'checkpoint write':
      step = next_multiple(step, RUN['checkpoint_every_steps'])
    elif phase == 'evaluation':
      step = next_multiple(step, RUN['eval_every_steps'])
    return step

  def fire(self, run: processes.Processes, step: int, phase: str,
           kind: str) -> bool | None:
    """Waits for `step` (its `phase`) and sends `kind`'s signals; whether
    the fault hit inside the phase, None if the run never got there."""
    if phase == 'checkpoint write':
      checkpoints = os.path.join(self.workdir, 'checkpoints')
      seen = []

      def saving_or_saved():
        names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
        seen[:] = [n for n in names if n.split('.')[0] == str(step)]
        return bool(seen)
      if not wait_until(saving_or_saved, FLAGS.start_bound_seconds, 0.002):
        return None
      inside = any('tmp' in name for name in seen)
    else:
      if not wait_until(lambda: last_logged_step(run) >= step,
                        FLAGS.start_bound_seconds, 0.005):
        return None
      inside = phase == 'step' or not any(
          re.search(rf'\[{step}\] .*eval_loss=', line)
          for line in list(run.lines[0]))
    signum = signal.SIGKILL if kind.startswith('SIGKILL') else signal.SIGTERM
    targets = [0, 1] if kind.endswith('both') else [int(kind[-1])]
    for index in targets:
      run.popens[index].send_signal(signum)
    return inside

  def outcome(self, run: processes.Processes, kind: str) -> bool:
    """Whether the processes ended as promised after `kind`, in time."""
    bound = FLAGS.exit_bound_seconds
    if kind.startswith('SIGKILL'):
      bound += FLAGS.heartbeat_timeout_seconds
    try:
      codes = run.wait(bound)
    except AssertionError as stuck:
      self.hang(run, f'{kind}: ', stacks=str(stuck))
      return False
    logs = [run.log(i) for i in range(2)]
    if kind.startswith('SIGKILL'):
      killed = int(kind[-1])
      ok = codes[killed] == -signal.SIGKILL and codes[1 - killed] != 0
    else:
      stops = [STOPPED.findall(log) for log in logs]
      ok = codes == [0, 0] and stops[0] == stops[1] and len(stops[0]) == 1
      ok = ok and os.path.isdir(
          os.path.join(self.workdir, 'checkpoints', stops[0][0]))
    if not ok:
      self.notes.append(f'{kind}: exit codes {codes}; process logs end: ' +
                        ' | '.join(log[-500:] for log in logs))
    return ok

  def run(self, faults: int) -> tuple[float, list[int]]:
    """Injects the faults, then lets the run finish; the wall time and
    the final launch's exit codes."""
    start = time.monotonic()
    fault = None
    for _ in range(faults):
      run = self.start(fault)
      fault = None
      if run is None:
        continue
      kind = self.rng.choice(KINDS)
      phase = self.rng.choice(PHASES)
      step = self.target(last_logged_step(run), phase)
      if step >= self.num_steps:
        self.notes.append('ran out of steps after '
                          f'{sum(self.injected.values())} faults')
        self.end(run)
        break
      inside = self.fire(run, step, phase, kind)
      if inside is None:
        self.hang(run, f'step {step} not reached in '
                  f'{FLAGS.start_bound_seconds} s')
        self.end(run)
        continue
      self.in_phase[phase] += inside
      fault_time = time.monotonic()
      self.injected[kind, phase] += 1
      reached = last_logged_step(run)
      if self.outcome(run, kind):
        fault = (kind, reached, fault_time)
      self.end(run)
    final = self.start(fault)
    if final is None:
      return time.monotonic() - start, []
    try:
      codes = final.wait(FLAGS.start_bound_seconds + self.num_steps)
    except AssertionError as stuck:
      self.hang(final, 'the last launch did not finish: ', stacks=str(stuck))
      codes = []
    self.end(final)
    return time.monotonic() - start, codes


def final_weights(workdir: str) -> tuple[str, dict]:
  """The newest checkpoint's step and its parameters and BatchNorm
  statistics, as NumPy arrays."""
  return (os.path.basename(checkpointing.checkpoint_dir(workdir)),
          project_files.read_checkpoint(workdir, {}).arrays)


def main(_):
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  workdir = FLAGS.workdir or tempfile.mkdtemp(prefix='chaos-')
  num_steps = FLAGS.num_train_steps or 7 * FLAGS.faults + 20
  reference_dir = FLAGS.reference_workdir or os.path.join(workdir,
                                                         'uninterrupted')
  began = time.monotonic()
  if not FLAGS.reference_workdir:
    reference = launch(reference_dir, processes.free_port(), num_steps)
    assert reference.wait(FLAGS.start_bound_seconds + num_steps) == [0, 0], (
        reference.log(0)[-3000:])
    reference.__exit__()
  reference_seconds = time.monotonic() - began

  chaos = Chaos(os.path.join(workdir, 'faulted'), num_steps,
                random.Random(FLAGS.seed))
  seconds, codes = chaos.run(FLAGS.faults)
  same = codes == [0, 0]
  if same:
    (step, arrays), (reference_step, reference_arrays) = (
        final_weights(chaos.workdir), final_weights(reference_dir))
    same = (step == reference_step and arrays.keys() == reference_arrays.keys()
            and all(np.array_equal(arrays[name], reference_arrays[name])
                    for name in arrays))

  injected = sum(chaos.injected.values())
  lost = [s for seconds_lost in chaos.lost.values() for s in seconds_lost]
  print(f'{num_steps} steps, 2 processes x 4 CPU devices, '
        f'{os.cpu_count()} CPU cores; heartbeat timeout '
        f'{FLAGS.heartbeat_timeout_seconds} s; bounds: exit within '
        f'{FLAGS.exit_bound_seconds} s of a SIGTERM (heartbeat timeout + '
        f'{FLAGS.exit_bound_seconds} s of a SIGKILL), first step within '
        f'{FLAGS.start_bound_seconds} s of a launch; seed {FLAGS.seed}')
  print(f'uninterrupted run {reference_dir} ' + (
      'given' if FLAGS.reference_workdir else f'{reference_seconds:.0f} s') +
        f'; faulted run {seconds:.0f} s')
  print('| faults injected | survived | hangs | final parameters |')
  print('| ---: | ---: | ---: | --- |')
  print(f'| {injected} | {chaos.survived} | {chaos.hangs} | '
        f'{"bit-identical" if same else "DIFFERENT"} |')
  print()
  print('| fault | count | at a step | in a checkpoint write | in an '
        'evaluation | time lost, median s | max s |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: |')
  for kind in KINDS:
    count = sum(chaos.injected[kind, p] for p in PHASES)
    if count:
      times = chaos.lost[kind] or [float('nan')]
      print(f'| {kind} | {count} | ' + ' | '.join(
          str(chaos.injected[kind, p]) for p in PHASES) +
            f' | {statistics.median(times):.1f} | {max(times):.1f} |')
  if lost:
    print(f'Time lost per fault: median {statistics.median(lost):.1f} s, '
          f'mean {statistics.mean(lost):.1f} s, max {max(lost):.1f} s.')
  if same:
    print(f'Faulted run: {goodput.describe_record(chaos.workdir)}')
  print('Fired inside the phase: ' + ', '.join(
      f'{chaos.in_phase[p]} of {sum(chaos.injected[k, p] for k in KINDS)} '
      f'{p}s' for p in PHASES) + '.')
  for note in chaos.notes:
    print(note)
  if not (chaos.survived == injected == FLAGS.faults and chaos.hangs == 0
          and same):
    sys.exit(1)


FLAGS = flags.FLAGS

if __name__ == '__main__':
  app.run(main)
