"""Trains and evaluates a model: `python main.py --config=... --workdir=...`."""

import time

# The launch's startup counts from here: the imports below are part of it.
LAUNCH_TIME = time.time()

# First: while the modules below import, Python's collector pauses and
# their libraries' optional imports are left out (runtime/lean_imports.py).
from runtime import lean_imports  # pylint: disable=g-bad-import-order
lean_imports.before_imports()

import atexit
import gc
import signal
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from configs import finetune
import eval_checkpoint
from checks import command_line
from runtime import config_error
from checks import memory_budget
from training import nonfinite
from training import reporting
from runtime import accelerators
from runtime import checkpoint_reads
from runtime import compilation_cache
from runtime import console
from runtime import distributed
from runtime import goodput
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
flags.DEFINE_enum('mode', 'train', ['train', 'eval', 'compile'],
                  'train: train and evaluate, resuming from the latest '
                  'checkpoint; eval: evaluate the latest checkpoint (or '
                  'config.init_from) over the whole eval split, writing no '
                  'checkpoint, with the config it was trained with '
                  '(overrides change only what is evaluated: dataset, evals, '
                  'batch_size, ...); compile: compile the programs of a run '
                  'on --topology and print the memory each needs per chip '
                  '(nothing is run, read or written; no --workdir needed).')
flags.DEFINE_string('topology', None, 'With --mode=compile: the accelerator '
                    'to compile for, a TPU slice (v5e:2x2, v5e:4x4, v4:2x2x2, '
                    'v5p:2x2x1, v6e:2x4, or as Cloud TPU names it: '
                    'v5litepod-4, v5e-8, v6e-4, v4-8 and v5p-8 counting '
                    'TensorCores) or GPUs (h100, h100:8 = one host of 8, '
                    'a100:2x8 = 2 hosts of 8; also h200, l4).')
flags.DEFINE_integer('num_slices', 1, 'With --mode=compile: TPU slices of '
                     '--topology joined by the data-centre network '
                     '(config.mesh.dcn_data spans them).', lower_bound=1)
flags.DEFINE_bool('largest_batch', False, 'With --mode=compile: also find '
                  'the largest batch per chip that fits (a few more '
                  'compiles, each a line on stderr as it ends).')
flags.DEFINE_bool('ema', False, 'With --mode=eval: evaluate the moving '
                  'average of the weights (a run with ema_decay > 0), as '
                  'eval_ema_*.')
flags.DEFINE_string('coordinator_address', None, 'host:port of process 0, '
                    'for a multi-process run (auto-detected on Cloud TPU and '
                    'under SLURM or Open MPI).')
flags.DEFINE_integer('num_processes', None, 'Processes in the run.')
flags.DEFINE_integer('process_id', None, 'This process, 0..num_processes-1.')
flags.DEFINE_integer('heartbeat_timeout_seconds', 100, 'A multi-process run '
                     'aborts when one of its processes has not been heard '
                     'from for this long (it died or hangs); the default is '
                     "JAX's.", lower_bound=1)
flags.DEFINE_string('compilation_cache_dir', None, "JAX's persistent "
                    'compilation cache: every compiled program kept for '
                    "relaunches, resumes and other runs ('' = none; "
                    'default: JAX_COMPILATION_CACHE_DIR, else '
                    f'{compilation_cache.DEFAULT_DIR}).')
flags.mark_flags_as_required(['config'])


def initialize_distributed() -> None:
  """Joins the multi-process run the flags or the cluster describe
  (`runtime/distributed.py`); anywhere else the run stays one process."""
  # Orbax synchronises processes with device collectives by default
  # (`sync_global_devices`), issued from the main thread while the train
  # step's collectives may still run. Device collectives must reach every
  # process in one order, so orbax waits at the coordination service's
  # barriers instead, as its background threads already do.
  FLAGS.experimental_orbax_use_distributed_barrier = True
  try:
    distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes,
                           FLAGS.process_id, FLAGS.heartbeat_timeout_seconds)
  except distributed.DetectionError as e:
    sys.exit(f'Error: {e}')


def main(argv):
  lean_imports.freeze_imports()
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  if FLAGS.ema and FLAGS.mode != 'eval':
    raise app.UsageError('--ema is for --mode=eval; training evaluates the '
                         'moving average at every evaluation already.')
  if FLAGS.mode == 'compile':
    sys.exit(compile_for_topology())
  if FLAGS.workdir is None:
    raise app.UsageError('--workdir is required: the directory of the run\'s '
                         'checkpoints and TensorBoard event files.')
  timeline = goodput.Timeline(start=LAUNCH_TIME)
  # First of the exit handlers (the last registered): the interpreter's
  # final collection then skips the objects of TensorFlow, JAX and the run,
  # which go with the process anyway (2 s after every run on 2 cores).
  atexit.register(gc.freeze)
  console.quiet(FLAGS.verbosity)
  # `kill -USR1 PID` prints the Python stack of every thread to stderr and
  # the run goes on: what a run that seems stuck is waiting for.
  thread_stacks.print_on_signal(signal.SIGUSR1)
  reporting.start_importing_writers()  # while the accelerator opens
  compilation_cache.enable(
      compilation_cache.default_directory()
      if FLAGS.compilation_cache_dir is None else FLAGS.compilation_cache_dir)
  timeline.switch('distributed')
  initialize_distributed()
  logging.info('JAX %s on %s: process %d of %d; its devices %s of %d.',
               jax.__version__, jax.default_backend(), jax.process_index(),
               jax.process_count(), jax.local_devices(), jax.device_count())
  # Called first by an exit that skips Python's own
  # (`console.exit_at_once`): process 0 serves the coordination service,
  # so it leaves only once every process has come to the shutdown's
  # barrier.
  shutdown = (jax.distributed.shutdown if jax.process_count() > 1
              else lambda: None)
  try:
    # Every checkpoint and weights read of the command is retried until
    # this long passes without progress.
    with checkpoint_reads.stall_bound(FLAGS.config.restore_retry_seconds):
      train_or_evaluate(timeline)
  except (config_error.ConfigError, nonfinite.NonFiniteError) as e:
    preset = finetune.preset_fitting(getattr(e, 'fixes', {}), FLAGS.config)
    message = f'Error: {e}{preset}'
    if train.train_step_compiling() or reporting.writers_importing_unused():
      # Met before the run used its train step (a minute's compile for
      # ResNet-50 on a CPU) or made its writer (TensorFlow's import, seconds),
      # so before anything was written.
      console.exit_at_once(message, shutdown)
    sys.exit(message)
  except checkpoint_reads.RestoreError as e:
    # Every process stops here alike.
    console.exit_at_once(f'Error: {e}', shutdown)
  if cache_report := compilation_cache.report():
    logging.info(cache_report)


def train_or_evaluate(timeline) -> None:
  """--mode=train (SIGTERM and SIGINT: finish the step, save a checkpoint,
  exit 0) or --mode=eval."""
  if FLAGS.mode == 'eval':
    # The checkpoint's config, changed only where this command sets what
    # is evaluated.
    overridden = {key.split('.')[0] for key in
                  config_flags.get_override_values(FLAGS['config'])}
    eval_checkpoint.evaluate_checkpoint(
        FLAGS.config, FLAGS.workdir, events_dir=FLAGS.events_dir,
        ema=FLAGS.ema, overridden=overridden)
    return
  with preemption.StopRequest() as stop_request:
    train.train_and_evaluate(FLAGS.config, FLAGS.workdir, stop_request,
                             events_dir=FLAGS.events_dir, timeline=timeline)


def compile_for_topology() -> int:
  """--mode=compile: the run's programs compiled for --topology, reported;
  the exit code (1: the step does not fit)."""
  if FLAGS.topology is None:
    raise app.UsageError('--mode=compile needs --topology, e.g. '
                         '--topology=v5e:2x2 or --topology=h100:8')
  console.quiet(FLAGS.verbosity)
  # Compile-only devices: this machine's own accelerator, if any, stays
  # free for the runs using it.
  jax.config.update('jax_platforms', 'cpu')
  try:
    return memory_budget.report(
        FLAGS.config, accelerators.topology(FLAGS.topology, FLAGS.num_slices),
        train.compile_for_topology, FLAGS.largest_batch)
  except (config_error.ConfigError, accelerators.TopologyError) as e:
    return f'Error: {e}'


if __name__ == '__main__':
  jax.config.config_with_absl()
  app.run(main, flags_parser=command_line.parse_flags)
