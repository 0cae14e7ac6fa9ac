"""Trains and evaluates a model: `python main.py --config=... --workdir=...`."""

import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

import config_checks
import evaluation
import preemption
import train

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Directory for checkpoints and TensorBoard '
                    'event files.')
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
flags.mark_flags_as_required(['config', 'workdir'])


def _quiet_orbax(record) -> bool:
  # Orbax logs every step of every save at INFO; keep its warnings only.
  return record.levelno >= logging.WARNING or '/orbax/' not in record.pathname


def initialize_distributed() -> None:
  """Joins the multi-process run the flags or the cluster describe.

  With no flag given, `jax.distributed.initialize()` detects Cloud TPU,
  SLURM and Open MPI; anywhere else (a plain single machine) it finds no
  coordinator and the run stays one process.
  """
  # CPU devices of different processes talk through gloo; GPUs and TPUs
  # have their own collectives and ignore this.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  explicit = dict(coordinator_address=FLAGS.coordinator_address,
                  num_processes=FLAGS.num_processes,
                  process_id=FLAGS.process_id)
  if any(value is not None for value in explicit.values()):
    jax.distributed.initialize(**explicit)
    return
  try:
    jax.distributed.initialize()
  except ValueError as e:  # no cluster detected: one process
    logging.info('Single process (%s).', e)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  logging.get_absl_handler().addFilter(_quiet_orbax)
  initialize_distributed()
  logging.info('JAX process %d of %d; local devices: %s',
               jax.process_index(), jax.process_count(), jax.local_devices())
  logging.info('All %d devices: %s', jax.device_count(), jax.devices())
  try:
    if FLAGS.mode == 'eval':
      evaluation.evaluate_checkpoint(FLAGS.config, FLAGS.workdir)
      return
    # SIGTERM and SIGINT: finish the step, save a checkpoint, exit 0.
    with preemption.StopRequest() as stop_request:
      train.train_and_evaluate(FLAGS.config, FLAGS.workdir, stop_request)
  except (train.ConfigError, train.NonFiniteError) as e:
    sys.exit(f'Error: {e}')


if __name__ == '__main__':
  jax.config.config_with_absl()
  app.run(main, flags_parser=config_checks.parse_flags)
