"""Trains and evaluates a model: `python main.py --config=... --workdir=...`."""

import sys

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

import train

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Directory for checkpoints and TensorBoard '
                    'event files.')
config_flags.DEFINE_config_file(
    'config', None, 'Training config file.', lock_config=True)
flags.mark_flags_as_required(['config', 'workdir'])


def _quiet_orbax(record) -> bool:
  # Orbax logs every step of every save at INFO; keep its warnings only.
  return record.levelno >= logging.WARNING or '/orbax/' not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  logging.get_absl_handler().addFilter(_quiet_orbax)
  logging.info('JAX process %d of %d; local devices: %s',
               jax.process_index(), jax.process_count(), jax.local_devices())
  logging.info('All %d devices: %s', jax.device_count(), jax.devices())
  try:
    train.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  except (train.ConfigError, train.NonFiniteLossError) as e:
    sys.exit(f'Error: {e}')


if __name__ == '__main__':
  jax.config.config_with_absl()
  app.run(main)
