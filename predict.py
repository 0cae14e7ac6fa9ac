"""Classifies images: `python predict.py --workdir=DIR IMAGE...`.

Prints one line per image: its path, then the five most probable classes as
`name:probability` (the class names saved with the checkpoint, spaces as
underscores: an image folder's class folder names; imagenet2012's WordNet
synset ids such as n01440764; the digits' '0' to '9'). Each image, JPEG,
PNG, BMP, GIF or WebP of any size, goes through exactly the evaluation
preprocessing of the data set the model in DIR's newest checkpoint was
trained on (for the digits: made an 8x8 digit, see
`datasets.digit_image`); the model runs on batches of them.
"""

import sys

from absl import app
from absl import flags
from flax import nnx
import jax
import numpy as np

from configs import default
from data import datasets
from runtime import console
from runtime import mixed_precision
from training import run_state
from weights import fitting
from weights import pretrained

FLAGS = flags.FLAGS


TOP_K = 5


def predict(workdir: str, paths: list[str], batch_size: int = 32,
            ema: bool = False) -> list:
  """One line per image of `paths`: the path, then the top-5 classes, by
  the newest checkpoint's weights or (`ema`) their moving average."""
  if batch_size < 1:
    raise ValueError(f'--batch_size={batch_size} must be positive')
  config, run = run_state.load_trained(workdir, default.get_config(),
                                       ema=ema)
  model = run.model()
  names = [name.replace(' ', '_')
           for name in pretrained.class_names(workdir, config)]
  shapes = fitting.model_shapes(model)
  channels = shapes.get('stem.kernel', shapes.get('patch_embed.kernel'))[2]
  dtype = mixed_precision.compute_dtype(config)
  images = np.stack([datasets.eval_image_file(config, path, channels,
                                                    dtype)
                     for path in paths])
  graphdef, state = nnx.split(model)
  probabilities = jax.jit(lambda state, x: jax.nn.softmax(
      nnx.merge(graphdef, state)(x, train=False)))
  lines = []
  for start in range(0, len(paths), batch_size):
    batch = images[start:start + batch_size]
    # Padded to a whole batch: one compiled shape for every batch.
    padded = np.concatenate([batch, np.zeros(
        (batch_size - len(batch), *batch.shape[1:]), batch.dtype)])
    for path, p in zip(paths[start:start + batch_size],
                       np.asarray(probabilities(state, padded))):
      top = np.argsort(-p, kind='stable')[:TOP_K]
      lines.append(' '.join([path] + [f'{names[i]}:{p[i]:.4f}' for i in top]))
  return lines


def main(argv):
  console.quiet(FLAGS.verbosity)
  if len(argv) < 2:
    raise app.UsageError('Pass one or more image files: predict.py '
                         '--workdir=DIR IMAGE...')
  try:
    lines = predict(FLAGS.workdir, argv[1:], FLAGS.batch_size, FLAGS.ema)
  except ValueError as e:
    sys.exit(f'Error: {e}')
  print('\n'.join(lines))


def define_flags():
  """The command line (only when run as a script: modules that import
  this one keep their own flags)."""
  flags.DEFINE_string('workdir', None, 'Workdir of a training run.')
  flags.DEFINE_integer('batch_size', 32, 'Images per forward pass.')
  flags.DEFINE_bool('ema', False, 'Predict with the moving average of the '
                    'weights (a run with ema_decay > 0).')
  flags.mark_flags_as_required(['workdir'])


if __name__ == '__main__':
  define_flags()
  app.run(main)
