"""`kill -USR1 PID` prints the Python stack of every thread of a running
trainer to stderr, and the run goes on: what a run that seems stuck waits for.

A watcher thread prints them with faulthandler, holding the GIL, so no other
thread starts, ends or changes its frames while they are read.
(`faulthandler.register` prints from inside the signal handler instead,
without the GIL; a thread that ends meanwhile frees what is being read, and
with tf.data's and orbax's threads coming and going that crashed the
process now and then.)
"""

import faulthandler
import os
import signal
import sys
import threading


def print_on_signal(signum: int = signal.SIGUSR1) -> None:
  """From now on, signal `signum` prints every thread's stack to stderr.

  Call from the main thread, once per process.
  """
  read_end, write_end = os.pipe()
  os.set_blocking(write_end, False)
  # Python's C-level handler writes each signal's number to the wakeup fd
  # as soon as it arrives, whichever thread takes it and whatever the main
  # thread is blocked in. The Python-level handler only runs once the main
  # thread is back in the interpreter, which a stuck one never is.
  signal.signal(signum, lambda *_: None)
  signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
  threading.Thread(target=_print_when_signalled, args=(read_end, signum),
                   name='thread-stacks', daemon=True).start()


def _print_when_signalled(read_end: int, signum: int) -> None:
  while True:
    # Other signals with a Python handler (SIGINT, SIGTERM) are written
    # here too; they are not for this thread.
    if signum in os.read(read_end, 64):
      sys.stderr.flush()
      # A C function that keeps the GIL: every other thread is paused in
      # between two bytecodes or in C code that released it.
      faulthandler.dump_traceback(sys.stderr, all_threads=True)
