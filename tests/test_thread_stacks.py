"""runtime/thread_stacks.py: SIGUSR1 prints every thread's stack, and keeps
doing so while threads come and go, without ending the process."""

import os
import signal
import sys
import time

import processes


# Threads that keep starting short-lived threads (as tf.data and orbax do)
# while the main thread waits; each SIGUSR1 prints every stack.
THREAD_CHURN_SCRIPT = """
import signal, sys, threading
from runtime import thread_stacks

def numbers(n):
  yield from range(n)

def short_lived():
  try:
    raise ValueError(sum(numbers(20)))
  except ValueError:
    pass

def start_threads_forever():
  while True:
    thread = threading.Thread(target=short_lived)
    thread.start()
    thread.join()

def wait_forever():
  threading.Event().wait()

thread_stacks.print_on_signal(signal.SIGUSR1)
for _ in range(4):
  threading.Thread(target=start_threads_forever, daemon=True).start()
print('ready', file=sys.stderr, flush=True)
wait_forever()
"""


def cpu_seconds(pid: int) -> float:
  """The CPU time (user and system) that process `pid` has used so far."""
  with open(f'/proc/{pid}/stat') as f:
    fields = f.read().rsplit(')', 1)[1].split()  # past the command's name
  return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def test_stacks_on_sigusr1_print_every_thread_while_threads_come_and_go():
  # Printing from inside the signal handler (faulthandler.register) crashed
  # this process within about 50 signals.
  dumps = 300
  with processes.Processes([[sys.executable, '-c', THREAD_CHURN_SCRIPT]],
                           [os.environ]) as run:
    run.wait_for_line(0, lambda line: line == 'ready\n', timeout=60)
    pid = run.popens[0].pid
    printed, read = 0, 0  # dumps printed, lines of the log read
    for dump in range(1, dumps + 1):
      run.popens[0].send_signal(signal.SIGUSR1)
      signalled = time.monotonic(), cpu_seconds(pid)
      # The main thread's stack ends each dump (the oldest thread, printed
      # last), and its outermost frame, the script's own, ends that: the
      # main thread may be anywhere in the script, not yet waiting, at the
      # first signal. Only new lines are read: rereading the whole log
      # every millisecond would take a core from the process under test.
      while printed < dump:
        code = run.popens[0].poll()
        assert code is None, (f'the process ended (exit code {code}) at '
                              f'dump {dump}: {run.log(0)[-3000:]}')
        # A dump takes milliseconds. The deadline counts the seconds the
        # process ran (its churning threads run all the time), which a
        # loaded machine stretches, not its wait for a core.
        waited = (time.monotonic() - signalled[0],
                  cpu_seconds(pid) - signalled[1])
        assert waited[1] < 30 and waited[0] < 600, (
            f'dump {dump} of {dumps} not complete {waited[0]:.0f} s after '
            f'its SIGUSR1 ({waited[1]:.0f} s of CPU time), the process '
            f'still running: {run.log(0)[-3000:]}')
        time.sleep(0.001)
        lines = run.lines[0][read:]
        read += len(lines)
        printed += sum('in <module>' in line for line in lines)
    assert run.popens[0].poll() is None  # printing never stopped it
    log = run.log(0)
  assert log.count('in start_threads_forever') == dumps * 4
