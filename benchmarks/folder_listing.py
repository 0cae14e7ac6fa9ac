"""How long listing an ImageNet-sized folder tree takes at the start of a run.

  python benchmarks/folder_listing.py                 # 1000 x 1281 files
  python benchmarks/folder_listing.py --root=/data/imagenet/train

Without `--root`, writes a tree of `classes` folders of `per_class` empty
`.JPEG` files (ImageNet's training split has 1,281,167 files in 1,000
folders) in a temporary directory. Times `folder_listing.list_split` (the
listing a run does before its first step: every class folder, in
`LISTING_THREADS` threads, sorted) and one thread, then turning the paths
into the tensor the pipeline reads from. Prints a table (best of `repeats`;
the first run after writing finds the directories in the page cache, as a
second run of a training job does).
"""

import os
import shutil
import sys
import tempfile
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import folder_listing  # pylint: disable=g-import-not-at-top
from runtime import console
import tensorflow as tf

flags.DEFINE_string('root', '', 'A split folder to list ("": write one).')
flags.DEFINE_integer('classes', 1000, 'Class folders of the written tree.')
flags.DEFINE_integer('per_class', 1281, 'Files per class folder.')
flags.DEFINE_integer('repeats', 3, 'Timed listings; the best counts.')
FLAGS = flags.FLAGS


def write_tree(root: str, classes: int, per_class: int) -> float:
  """Empty files ROOT/nNNNNNNNN/nNNNNNNNN_I.JPEG; returns seconds taken."""
  start = time.perf_counter()
  for label in range(classes):
    directory = os.path.join(root, f'n{label:08d}')
    os.makedirs(directory)
    for index in range(per_class):
      open(os.path.join(directory, f'n{label:08d}_{index}.JPEG'), 'wb').close()
  return time.perf_counter() - start


def best_seconds(function, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    function()
    times.append(time.perf_counter() - start)
  return min(times)


def main(_):
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  written = tempfile.mkdtemp() if not FLAGS.root else None
  root = FLAGS.root or os.path.join(written, 'train')
  try:
    if written:
      print(f'Wrote {FLAGS.classes * FLAGS.per_class:,} files in '
            f'{write_tree(root, FLAGS.classes, FLAGS.per_class):.0f} s.')
    listing = folder_listing.list_split(root)
    threads = folder_listing.LISTING_THREADS
    parallel = best_seconds(lambda: folder_listing.list_split(root),
                            FLAGS.repeats)
    folder_listing.LISTING_THREADS = 1
    serial = best_seconds(lambda: folder_listing.list_split(root),
                          FLAGS.repeats)
    folder_listing.LISTING_THREADS = threads
    to_tensor = best_seconds(lambda: tf.constant(listing.files), FLAGS.repeats)
  finally:
    if written:
      shutil.rmtree(written)
  print(f'{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; '
        f'{len(listing.files):,} files in {len(listing.classes):,} class '
        f'folders; best of {FLAGS.repeats}')
  print('| step | seconds |')
  print('| --- | ---: |')
  print(f'| list and sort, {threads} threads | {parallel:.2f} |')
  print(f'| list and sort, 1 thread | {serial:.2f} |')
  print(f'| paths to a tf.string tensor | {to_tensor:.2f} |')


if __name__ == '__main__':
  app.run(main)
