"""Trains and evaluates a model: `python main.py --config=... --workdir=...`."""

import logging as python_logging
import os
import signal
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from training import config_checks
from training import evaluation
from training import nonfinite
from runtime import preemption
from runtime import thread_stacks
import train

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Directory for checkpoints and TensorBoard '
                    'event files.')
flags.DEFINE_string('events_dir', None, 'Directory for the TensorBoard event '
                    'files, if not the workdir (e.g. a local directory for a '
                    'run whose workdir is in a bucket).')
config_flags.DEFINE_config_file(
    'config', None, 'Training config file.', lock_config=True)
flags.DEFINE_enum('mode', 'train', ['train', 'eval'], 'train: train and '
                  'evaluate, resuming from the latest checkpoint; eval: '
                  'evaluate the latest checkpoint (or config.init_from) over '
                  'the whole eval split, writing no checkpoint.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0, '
                    'for a multi-process run (auto-detected on Cloud TPU and '
                    'under SLURM or Open MPI).')
flags.DEFINE_integer('num_processes', None, 'Processes in the run.')
flags.DEFINE_integer('process_id', None, 'This process, 0..num_processes-1.')
flags.DEFINE_integer('heartbeat_timeout_seconds', 100, 'A multi-process run '
                     'aborts when one of its processes has not been heard '
                     'from for this long (it died or hangs); the default is '
                     "JAX's.", lower_bound=1)
flags.mark_flags_as_required(['config', 'workdir'])


PROJECT_DIR = os.path.dirname(os.path.abspath(__file__))


def shown_on_console(record: python_logging.LogRecord) -> bool:
  """Warnings and errors from everywhere; INFO lines only from the
  project's own modules and from CLU (the metric lines and the progress
  line). Other libraries' INFO lines are dropped: orbax alone logs dozens
  per checkpoint save, JAX its backend probing.

  Every library's Python logs reach absl's one handler, most through the
  single `absl` logger, so the source file tells them apart.
  """
  if record.levelno >= python_logging.WARNING:  # Python's level, not absl's
    return True
  path = os.path.abspath(record.pathname)
  if f'{os.sep}clu{os.sep}' in path:
    return not is_bulk_summary(record)
  return is_project_file(path)


def is_bulk_summary(record: python_logging.LogRecord) -> bool:
  """CLU's logging writer's line of every histogram bin or of the whole
  config: TensorBoard shows both (HISTOGRAMS, HPARAMS), and on the console
  they bury the metrics."""
  return isinstance(record.msg, str) and (
      record.msg.startswith('[Hyperparameters]') or
      'Histogram for' in record.msg)


def is_project_file(path: str) -> bool:
  """A module of this project: under its folder, and not an installed
  package (a virtual environment inside the checkout is not the project)."""
  return (path.startswith(PROJECT_DIR + os.sep) and
          f'{os.sep}site-packages{os.sep}' not in path)


def quiet_console() -> None:
  """Keeps the console to the run's own lines (see `shown_on_console`),
  unless --verbosity asks for debug logs (-v 1): then everything shows."""
  if FLAGS.verbosity >= 1:
    return
  logging.get_absl_handler().addFilter(shown_on_console)
  # TensorFlow prints a notice that its oneDNN kernels are on to stderr at
  # import, past every log level. Here it runs only the input pipeline and
  # the event-file writer, none of the ops those kernels serve
  # (convolutions, matrix products); off, they print nothing.
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')


def initialize_distributed() -> None:
  """Joins the multi-process run the flags or the cluster describe.

  With no flag given, `jax.distributed.initialize()` detects Cloud TPU,
  SLURM and Open MPI; anywhere else (a plain single machine) it finds no
  coordinator and the run stays one process.
  """
  # CPU devices of different processes talk through gloo; GPUs and TPUs
  # have their own collectives and ignore this.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # Orbax synchronises processes with device collectives by default
  # (`sync_global_devices`), issued from the main thread while the train
  # step's collectives may still run. Device collectives must reach every
  # process in one order, so orbax waits at the coordination service's
  # barriers instead, as its background threads already do.
  FLAGS.experimental_orbax_use_distributed_barrier = True
  explicit = dict(coordinator_address=FLAGS.coordinator_address,
                  num_processes=FLAGS.num_processes,
                  process_id=FLAGS.process_id)
  timeout = dict(heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_seconds)
  if any(value is not None for value in explicit.values()):
    jax.distributed.initialize(**explicit, **timeout)
    return
  try:
    jax.distributed.initialize(**timeout)
  except ValueError as e:  # no cluster detected: one process
    logging.debug('No cluster detected (%s); one process.', e)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  quiet_console()
  # `kill -USR1 PID` prints the Python stack of every thread to stderr and
  # the run goes on: what a run that seems stuck is waiting for.
  thread_stacks.print_on_signal(signal.SIGUSR1)
  initialize_distributed()
  logging.info('JAX %s on %s: process %d of %d; its devices %s of %d.',
               jax.__version__, jax.default_backend(), jax.process_index(),
               jax.process_count(), jax.local_devices(), jax.device_count())
  try:
    if FLAGS.mode == 'eval':
      evaluation.evaluate_checkpoint(FLAGS.config, FLAGS.workdir,
                                     events_dir=FLAGS.events_dir)
      return
    # SIGTERM and SIGINT: finish the step, save a checkpoint, exit 0.
    with preemption.StopRequest() as stop_request:
      train.train_and_evaluate(FLAGS.config, FLAGS.workdir, stop_request,
                               events_dir=FLAGS.events_dir)
  except (config_checks.ConfigError, nonfinite.NonFiniteError) as e:
    sys.exit(f'Error: {e}')


if __name__ == '__main__':
  jax.config.config_with_absl()
  app.run(main, flags_parser=config_checks.parse_flags)
