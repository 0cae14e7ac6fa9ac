"""Real trainer processes for tests: `main.py` started as a user would,
each child tied to the test so that none outlives it."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A trainer's logged step: '[N] train_loss=..., 12.3 steps/s, 787 images/s,
# 0.0427 TFLOP/s/device, 0:01:05 left'.
LOGGED_STEP = re.compile(r'\[(\d+)\] .*train_loss=')


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def joined_run(log: str) -> tuple[int, int, int]:
  """(this process's index, the process count, the device count) that a
  trainer process logged when it joined its run."""
  found = re.search(r'process (\d+) of (\d+); its devices \[.*?\] of (\d+)\.',
                    log)
  assert found, log[-3000:]
  return tuple(int(group) for group in found.groups())


# How every test process compiles on XLA:CPU: the suite's programs are
# tiny and compiling them is most of its time. At optimisation level 0
# (the default is 2) they take about a fifth less CPU time, and with XLA's
# older fusion emitters (the newer ones, the default, generate code
# through MLIR) about two fifths less again; as one LLVM module each
# instead of parts compiled side by side (the suite's processes already
# keep both cores busy), about a quarter less again (docs/performance.md).
COMPILE_FLAGS = ('--xla_backend_optimization_level=0 '
                 '--xla_cpu_use_fusion_emitters=false '
                 '--xla_cpu_parallel_codegen_split_count=1')
# For the few runs whose steps, not compiles, take most of their time
# (hundreds of steps): level 0's programs run slower.
LONG_RUN_COMPILE_FLAGS = '--xla_backend_optimization_level=1'


def cpu_environment(devices: int, compile_flags: str = COMPILE_FLAGS,
                    **variables) -> dict:
  """This environment with `devices` simulated CPU devices, XLA's
  `compile_flags`, plus `variables`."""
  return {**os.environ, 'JAX_PLATFORMS': 'cpu',
          'XLA_FLAGS': (f'--xla_force_host_platform_device_count={devices} '
                        f'{compile_flags}'),
          **variables}


def one_device_environment(compile_flags: str = COMPILE_FLAGS) -> dict:
  """This environment with JAX's default of one CPU device, as a user's
  shell has it, and XLA's `compile_flags`."""
  return {**os.environ, 'XLA_FLAGS': compile_flags}


def main_command(workdir, overrides: dict, *flags: str,
                 python: str = sys.executable,
                 config: str = 'configs/default.py') -> list[str]:
  """`python3 main.py --config=CONFIG --workdir=...` with config overrides
  and further flags, run by the interpreter `python`."""
  return [python, 'main.py', f'--config={config}',
          f'--workdir={workdir}', *flags,
          *(f'--config.{k}={v}' for k, v in overrides.items())]


class Processes:
  """Started commands whose stderr is collected line by line as it comes.

  Used as a context manager: on leaving, every process still running is
  killed. Linux's setpriv also makes each die with the test process itself.
  A wait that passes its deadline fails with the Python stacks of every
  thread of the processes still running (main.py prints them on SIGUSR1),
  instead of hanging.
  """

  def __init__(self, commands: list[list[str]], environments: list[dict]):
    launcher = (['setpriv', '--pdeathsig', 'KILL', '--']
                if shutil.which('setpriv') else [])
    self.popens, self.lines, self._readers = [], [], []
    # Notified on each line read and at each stderr's end: a wait for a
    # line sleeps until there is one to look at.
    self._read = threading.Condition()
    self._ended = set()
    for index, (command, environment) in enumerate(zip(commands,
                                                        environments)):
      popen = subprocess.Popen([*launcher, *command], cwd=REPO,
                               env=environment, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
      lines = []
      reader = threading.Thread(target=self._read_lines,
                                args=(index, popen, lines), daemon=True)
      reader.start()
      self.popens.append(popen)
      self.lines.append(lines)
      self._readers.append(reader)

  def _read_lines(self, index: int, popen, lines: list) -> None:
    for line in iter(popen.stderr.readline, ''):
      with self._read:
        lines.append(line)
        self._read.notify_all()
    with self._read:
      self._ended.add(index)
      self._read.notify_all()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    for popen in self.popens:
      if popen.poll() is None:
        popen.kill()
      popen.wait()

  def wait_for_line(self, index: int, predicate, timeout: float,
                    first: int = 0) -> str:
    """The first stderr line of process `index` from line `first` on for
    which `predicate` holds, waiting for it at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    seen = first
    with self._read:
      while True:
        for line in self.lines[index][seen:]:
          if predicate(line):
            return line
        seen = len(self.lines[index])
        left = deadline - time.monotonic()
        if index in self._ended or left <= 0:
          break
        self._read.wait(left)
    raise AssertionError(f'process {index} logged no such line in '
                         f'{timeout:.0f} s; its log ends: '
                         f'{self.log(index)[-3000:]}{self.stacks()}')

  def run_slowly(self, index: int, seconds: float, share: float = 0.2,
                 period: float = 0.5) -> None:
    """Lets process `index` run on for `seconds`, but only a `share` of
    each `period` (SIGSTOP, then SIGCONT), as on a machine this busy: its
    timers (a library thread's sleep, say) run their course in wall time
    for a `share` of the CPU time."""
    popen = self.popens[index]
    end = time.monotonic() + seconds
    try:
      while time.monotonic() < end and popen.poll() is None:
        time.sleep(share * period)
        popen.send_signal(signal.SIGSTOP)
        time.sleep((1 - share) * period)
        popen.send_signal(signal.SIGCONT)
    finally:
      if popen.poll() is None:
        popen.send_signal(signal.SIGCONT)

  def wait(self, timeout: float) -> list[int]:
    """Every process's exit code, once all have ended; fails with their
    stacks if any is still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    try:
      codes = [p.wait(timeout=max(deadline - time.monotonic(), 0.1))
               for p in self.popens]
    except subprocess.TimeoutExpired:
      raise AssertionError(f'still running after {timeout:.0f} s:'
                           f'{self.stacks()}') from None
    for reader in self._readers:
      reader.join()
    return codes

  def stacks(self, settle: float = 3.0) -> str:
    """The stack of every thread of every process still running, as each
    prints them on SIGUSR1; '' when none is running."""
    running = [i for i, p in enumerate(self.popens) if p.poll() is None]
    before = {i: len(self.lines[i]) for i in running}
    for i in running:
      self.popens[i].send_signal(signal.SIGUSR1)
    time.sleep(settle)  # the report is written by each process itself
    return ''.join(f'\n--- process {i} (pid {self.popens[i].pid}), every '
                   f'thread:\n' + ''.join(self.lines[i][before[i]:])
                   for i in running)

  def log(self, index: int) -> str:
    return ''.join(self.lines[index])


def run(commands, environments, timeout: float = 600) -> list[str]:
  """Runs the commands together; their stderr texts, after asserting that
  each exited 0."""
  with Processes(commands, environments) as processes:
    codes = processes.wait(timeout)
    logs = [processes.log(i) for i in range(len(commands))]
  for code, log in zip(codes, logs):
    assert code == 0, failure_excerpt(log)
  return logs


def failure_excerpt(log: str) -> str:
  """The part of a failed process's log that says why: from Python's fatal
  error report (its list of extension modules at the end says nothing) or
  else the end."""
  fatal = log.find('Fatal Python error')
  return log[max(fatal - 1000, 0):fatal + 4000] if fatal >= 0 else log[-3000:]
