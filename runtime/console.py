"""What the commands (main.py, predict.py, export.py) print: their own
lines and every library's warnings, not the libraries' INFO lines; and
how they end at once on an error that threads still at work would hold
(a read that could not be done, a train step still compiling)."""

import logging as python_logging
import os
import sys

from absl import logging

from runtime import storage_faults

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shown_on_console(record: python_logging.LogRecord) -> bool:
  """Warnings and errors from everywhere; INFO lines only from the
  project's own modules and from CLU (the metric lines and the progress
  line). Other libraries' INFO lines are dropped: orbax alone logs dozens
  per checkpoint save, JAX its backend probing.

  Every library's Python logs reach absl's one handler, most through the
  single `absl` logger, so the source file tells them apart.
  """
  if record.levelno >= python_logging.WARNING:  # Python's level, not absl's
    return not is_storage_retry_trace(record)
  path = os.path.abspath(record.pathname)
  if f'{os.sep}clu{os.sep}' in path:
    return not is_tensorboard_only(record)
  return is_project_file(path)


def is_storage_retry_trace(record: python_logging.LogRecord) -> bool:
  """A traceback of a storage outage that a library logs on its way up
  (gcsfs giving up a request, orbax's thread that raised it): the trainer
  reports the error itself, in one line, and reads again or stops."""
  if record.name.startswith('gcsfs'):
    return 'out of retries' in str(record.msg)
  return bool(record.exc_info and record.exc_info[1] is not None and
              f'{os.sep}orbax{os.sep}' in record.pathname and
              storage_faults.classify(record.exc_info[1]) ==
              storage_faults.OUTAGE)


def is_tensorboard_only(record: python_logging.LogRecord) -> bool:
  """CLU's logging writer's line of every histogram bin, of the whole
  config, or of every scalar of a logged step (goodput, badput by cause,
  throughput, skipped files...): TensorBoard shows them (HISTOGRAMS,
  HPARAMS, SCALARS), and on the console they bury the rest. A logged step
  has a short line of its own (`reporting.StepConsole`)."""
  message = record.getMessage()
  return (message.startswith('[Hyperparameters]') or
          'Histogram for' in message or 'steps_per_second=' in message)


def is_project_file(path: str) -> bool:
  """A module of this project: under its folder, and not an installed
  package (a virtual environment inside the checkout is not the project)."""
  return (path.startswith(PROJECT_DIR + os.sep) and
          f'{os.sep}site-packages{os.sep}' not in path)


def quiet(verbosity: int) -> None:
  """Keeps the console to the command's own lines (see `shown_on_console`),
  unless --verbosity asks for debug logs (-v 1): then everything shows."""
  if verbosity >= 1:
    return
  logging.get_absl_handler().addFilter(shown_on_console)
  # TensorFlow prints a notice that its oneDNN kernels are on to stderr at
  # import, past every log level. Here it runs only the input pipeline and
  # the event-file writer, none of the ops those kernels serve
  # (convolutions, matrix products); off, they print nothing.
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')


def exit_at_once(message: str, before_exit=lambda: None):
  """Ends the command with `message` on stderr and exit code 1, after
  `before_exit()`, not waiting for the threads that would hold the exit:
  reads still under way in the storage clients' threads (they give up
  after minutes), a train step still compiling (XLA cannot stop a
  compile). Only for errors met while nothing is being written."""
  sys.stdout.flush()
  print(message, file=sys.stderr, flush=True)
  logging.flush()
  before_exit()
  os._exit(1)
