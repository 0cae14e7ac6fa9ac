"""Classifies images: `python predict.py --workdir=DIR IMAGE...`, or
`python predict.py --model=EXPORT IMAGE...` with the directory that
`export.py --format=serving` wrote.

An IMAGE may be a folder: its image files (and its subfolders'), in
sorted order, as an image folder's class folder is read.

Prints one line per image: its path, then the five most probable classes as
`name:probability` (the class names saved with the checkpoint, spaces as
underscores: an image folder's class folder names; imagenet2012's WordNet
synset ids such as n01440764; the digits' '0' to '9'). Each image, JPEG,
PNG, BMP, GIF or WebP of any size, goes through exactly the evaluation
preprocessing of the data set the model in DIR's newest checkpoint was
trained on (for the digits: made an 8x8 digit, see
`datasets.digit_image`); the model runs on batches of them. With
`--model`, the export's SavedModel does the same, without the workdir.
"""

# First: while the modules below import, Python's collector pauses and
# their libraries' optional imports are left out (runtime/lean_imports.py).
from runtime import lean_imports  # pylint: disable=g-bad-import-order
lean_imports.before_imports()

import os
import sys

from absl import app
from absl import flags
from flax import nnx
import jax
import numpy as np

from configs import default
from data import datasets
from data import folder_listing
import input_pipeline
from runtime import checkpoint_reads
from runtime import console
from training import run_state
from weights import fitting
from weights import pretrained

FLAGS = flags.FLAGS


TOP_K = 5


def predict(workdir: str | None, paths: list[str], batch_size: int = 32,
            ema: bool = False, model: str | None = None) -> list[str]:
  """One line per image of `paths`: the path, then the top-5 classes, by
  the newest checkpoint of `workdir` (its weights or, with `ema`, their
  moving average), or by the serving export `model`."""
  if batch_size < 1:
    raise ValueError(f'--batch_size={batch_size} must be positive')
  if (workdir is None) == (model is None):
    raise ValueError('pass either --workdir=DIR (a training run) or '
                     '--model=EXPORT (export.py --format=serving), '
                     f'{"not both" if model else "one of them"}')
  paths = image_files(paths)
  if model is not None:
    if ema:
      raise ValueError('--ema reads a workdir; export the moving average '
                       '(export.py --ema) and pass that --model')
    names, top = classify_with_export(model, paths, batch_size)
  else:
    names, top = classify_with_run(workdir, paths, batch_size, ema)
  return [' '.join([path] + [f'{names[i].replace(" ", "_")}:{p:.4f}'
                             for i, p in zip(indices, probabilities)])
          for path, (indices, probabilities) in zip(paths, top)]


def image_files(paths: list[str]) -> list[str]:
  """`paths` with each folder replaced by the image files below it,
  sorted; ValueError for a folder that holds none."""
  files = []
  for path in paths:
    if not os.path.isdir(path):
      files.append(path)
      continue
    images, others_by_extension = folder_listing.images_below(path)
    if not images:
      others = sum(others_by_extension.values())
      raise ValueError(
          f'folder {path!r} holds no images '
          f'({", ".join(folder_listing.IMAGE_EXTENSIONS)}), in it or its '
          f'subfolders ({others} other file{"s" * (others != 1)}); '
          'pass image files or a folder of them')
    files.extend(images)
  return files


def classify_with_run(workdir: str, paths: list[str], batch_size: int,
                      ema: bool = False) -> tuple[list[str], list]:
  """(class names, [(indices, probabilities) of the top-5 classes of
  each image]) by the model in `workdir`'s newest checkpoint."""
  config, run = run_state.load_trained(workdir, default.get_config(),
                                       ema=ema)
  model = run.model()
  names = pretrained.class_names(workdir, config.dataset, config.data_dir)
  channels = fitting.image_channels(fitting.model_shapes(model))
  source = input_pipeline.DataSource.from_config(config)
  images = np.stack([datasets.eval_image_file(source, path, channels,
                                              run.dtype) for path in paths])
  graphdef, state = nnx.split(model)
  probabilities = jax.jit(lambda state, x: jax.nn.softmax(
      run_state.eval_logits(graphdef, state, x)))
  top = []
  for start in range(0, len(paths), batch_size):
    batch = images[start:start + batch_size]
    # Padded to a whole batch: one compiled shape for every batch.
    padded = np.concatenate([batch, np.zeros(
        (batch_size - len(batch), *batch.shape[1:]), batch.dtype)])
    for p in np.asarray(probabilities(state, padded))[:len(batch)]:
      indices = np.argsort(-p, kind='stable')[:TOP_K]
      top.append((indices, p[indices]))
  return names, top


def classify_with_export(model: str, paths: list[str], batch_size: int
                         ) -> tuple[list[str], list]:
  """`classify_with_run` by the serving export in the directory `model`."""
  # TensorFlow only here (the images of a workdir's model load it too).
  from exporting import serving  # pylint: disable=g-import-not-at-top
  classify, names = serving.load(model)
  top = []
  for start in range(0, len(paths), batch_size):
    top.extend(zip(*classify(paths[start:start + batch_size])))
  return names, top


def main(argv):
  lean_imports.freeze_imports()
  console.quiet(FLAGS.verbosity)
  if FLAGS.verbosity < 1:
    # TensorFlow's runtime logs an op's failure (an image it cannot decode,
    # a program it cannot run) again in C++, pages of it, above the
    # command's one line that names the cause. (Set, not defaulted: an
    # imported library sets it to 1.)
    os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'
  if len(argv) < 2:
    raise app.UsageError('Pass one or more image files or folders: '
                         'predict.py --workdir=DIR IMAGE... (or '
                         '--model=EXPORT)')
  try:
    with checkpoint_reads.stall_bound(FLAGS.restore_retry_seconds):
      lines = predict(FLAGS.workdir, argv[1:], FLAGS.batch_size, FLAGS.ema,
                      FLAGS.model)
  except checkpoint_reads.RestoreError as e:
    console.exit_at_once(f'Error: {e}')
  except ValueError as e:
    sys.exit(f'Error: {e}')
  print('\n'.join(lines))


def define_flags():
  """The command line (only when run as a script: modules that import
  this one keep their own flags)."""
  flags.DEFINE_string('workdir', None, 'Workdir of a training run.')
  flags.DEFINE_string('model', None, 'Instead of --workdir: the directory '
                      'export.py --format=serving wrote.')
  flags.DEFINE_integer('batch_size', 32, 'Images per forward pass.')
  flags.DEFINE_float('restore_retry_seconds', checkpoint_reads.RETRY_SECONDS,
                     'How long the reads of the checkpoint may go without '
                     'progress (an outage) before the command stops.',
                     lower_bound=0)
  flags.DEFINE_bool('ema', False, 'Predict with the moving average of the '
                    'weights (a run with ema_decay > 0).')


if __name__ == '__main__':
  define_flags()
  app.run(main)
