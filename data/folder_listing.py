"""Image folders listed: `ROOT/train/<class>/*` and `ROOT/val/<class>/*`,
the layout torchvision's `ImageFolder` reads, as `Listing`s of files and
labels (classes numbered in sorted order of their folder names; files in
nested folders count for their class; other files than images skipped and
counted). ROOT may be in a bucket (gs://...), listed through
`runtime/paths.py`, each class folder in one listing of its prefix.
"""

import collections
import concurrent.futures
import os

import numpy as np

from runtime import paths

TRAIN_SPLIT = 'train'
# The evaluation split: the first of these folders that exists.
EVAL_SPLITS = ('val', 'validation', 'test')
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.gif', '.webp')
# Class folders listed at once: listing waits on the file system, most of
# all when its directories are not cached or are on a network file system
# (docs/performance.md has the measured times).
LISTING_THREADS = 32


class Listing:
  """The image files of one split, in sorted order, with their labels."""

  def __init__(self, directory: str, classes: list[str], files: list[str],
               labels: list[int], skipped: collections.Counter):
    self.directory = directory
    self.classes = classes
    self.files = files
    self.labels = np.asarray(labels, np.int32)
    self.skipped = skipped  # {extension: files that are not images}


def split_directories(root: str) -> tuple[str, str]:
  """(training folder, evaluation folder) of `root`, or ValueError naming
  the fix."""
  if not _is_dir(root):
    raise ValueError(f'folder {root!r} does not exist: put the images in '
                     'its train/<class>/ and val/<class>/ folders')
  train = os.path.join(root, TRAIN_SPLIT)
  if not _is_dir(train):
    raise ValueError(f'{root!r} has no train/ folder (it holds: '
                     f'{_some_entries(root)}); put the training images in '
                     f'{os.path.join(root, "train", "<class>")}/')
  for name in EVAL_SPLITS:
    if _is_dir(os.path.join(root, name)):
      return train, os.path.join(root, name)
  raise ValueError(f'{root!r} has none of the evaluation folders '
                   f'{", ".join(n + "/" for n in EVAL_SPLITS)} (it holds: '
                   f'{_some_entries(root)}); put the held-out images in '
                   f'{os.path.join(root, "val", "<class>")}/')


def _is_dir(name: str) -> bool:
  return paths.path(name).is_dir()


def _some_entries(directory: str, limit: int = 5) -> str:
  names = sorted(entry.name for entry in paths.path(directory).iterdir())
  shown = ', '.join(names[:limit]) or 'nothing'
  return shown + (f' and {len(names) - limit} more' if len(names) > limit
                  else '')


def list_split(directory: str) -> Listing:
  """The image files under `directory/<class>/`, classes sorted by name,
  files sorted by path within a class; ValueError for a split without class
  folders or with an empty class."""
  classes = [name for name in paths.subdirectories(directory)
             if not name.startswith('.')]
  if not classes:
    loose = sum(1 for entry in paths.path(directory).iterdir()
                if not entry.is_dir())
    raise ValueError(
        f'{directory!r} has no class folders ({loose} files directly in '
        f'it); move each image into {os.path.join(directory, "<class>")}/ '
        '(for ImageNet\'s flat val/, see docs/data.md)')
  with concurrent.futures.ThreadPoolExecutor(LISTING_THREADS) as pool:
    listed = list(pool.map(lambda name: images_below(
        os.path.join(directory, name)), classes))
  files, labels, skipped = [], [], collections.Counter()
  for label, (name, (images, others)) in enumerate(zip(classes, listed)):
    if not images:
      raise ValueError(
          f'class folder {os.path.join(directory, name)!r} holds no images '
          f'({", ".join(IMAGE_EXTENSIONS)}); add its images or remove it')
    files.extend(images)
    labels.extend([label] * len(images))
    skipped.update(others)
  return Listing(directory, classes, files, labels, skipped)


def images_below(directory: str) -> tuple[list[str], collections.Counter]:
  """(image paths sorted, {extension: other files}) under `directory`,
  its subfolders included: a class folder's files, or predict.py's."""
  if paths.is_remote(directory):
    return _sort_files(paths.objects_below(directory))
  images, others = [], collections.Counter()
  pending = [directory]
  while pending:
    with os.scandir(pending.pop()) as entries:
      for entry in entries:
        if entry.is_dir(follow_symlinks=True):
          pending.append(entry.path)
        elif os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS:
          images.append(entry.path)
        else:
          others[os.path.splitext(entry.name)[1].lower() or entry.name] += 1
  return sorted(images), others


def _sort_files(names: list[str]) -> tuple[list[str], collections.Counter]:
  """(image files sorted, {extension: other files}) of `names`."""
  images, others = [], collections.Counter()
  for name in names:
    base = os.path.basename(name)
    if not base:  # a bucket's placeholder object for a folder
      continue
    extension = os.path.splitext(base)[1].lower()
    if extension in IMAGE_EXTENSIONS:
      images.append(name)
    else:
      others[extension or base] += 1
  return sorted(images), others


def check_same_classes(train: Listing, held_out: Listing) -> None:
  """ValueError listing the class folders that only one split has."""
  if train.classes != held_out.classes:
    raise ValueError(
        f'the class folders of {train.directory!r} and {held_out.directory!r} '
        f'differ: {describe_difference(train.classes, held_out.classes)}; '
        'give both splits the same class folders')


def describe_difference(first: list[str], second: list[str]) -> str:
  """'only in the first: a, b; only in the second: c', at most 10 each."""
  parts = []
  for name, mine, theirs in (('first', first, second),
                             ('second', second, first)):
    only = sorted(set(mine) - set(theirs))
    if only:
      more = f' and {len(only) - 10} more' if len(only) > 10 else ''
      parts.append(f'only in the {name}: {", ".join(only[:10])}{more}')
  return '; '.join(parts)


def relabeled(listing: Listing, labels) -> Listing:
  """`listing` with `labels` (one per file) in place of its own."""
  return Listing(listing.directory, listing.classes, listing.files, labels,
                 listing.skipped)
