"""What TFDS knows of a data set before any of it is read: its classes and
input shape, whether it is prepared in a data directory (and, when not,
the command that prepares it), and whether TensorFlow reaches a bucket
that holds it. Imported only when a TFDS data set is used.
"""

import difflib
import os

import tensorflow as tf
import tensorflow_datasets as tfds

from input_pipeline import DatasetInfo
from runtime import paths


class UnknownDatasetError(ValueError):
  """TFDS knows no data set of this name; the message names close ones."""


def described(name: str, data_dir, image_size: int) -> DatasetInfo:
  """TFDS data set `name`'s classes and the model's input shape for
  `image_size`, from TFDS's description of it: nothing is read, and it
  need not be prepared (no example counts)."""
  builder = dataset_builder(name, data_dir)
  if builder.info.supervised_keys is None:
    raise ValueError(f'dataset {name!r} has no (image, label) supervised '
                     'keys; use an image classification data set')
  image_key, label_key = builder.info.supervised_keys
  label = builder.info.features[label_key]
  channels = builder.info.features[image_key].shape[-1]
  return DatasetInfo(label.num_classes, (image_size, image_size, channels),
                     0, 0, tuple(label.names))


def dataset_builder(name: str, data_dir):
  """TFDS's builder of data set `name` (`name:version` too) in `data_dir`
  (None: TFDS's default); an unknown name is an UnknownDatasetError naming
  close ones, an unreachable bucket a ValueError."""
  if data_dir and paths.is_remote(data_dir):
    check_tensorflow_reaches(data_dir)
  base_name = name.split(':')[0].split('/')[0]
  known = tfds.list_builders(with_community_datasets=False)
  try:
    # A name outside TFDS's own registry (and not a community data set's
    # `namespace:name`) is refused here: asking TFDS would search the
    # community index in a bucket, which offline prints a credentials
    # warning before failing.
    if ':' not in name and base_name not in known:
      raise tfds.core.DatasetNotFoundError(name)
    return tfds.builder(name, data_dir=data_dir)
  except tfds.core.DatasetNotFoundError:
    close = difflib.get_close_matches(base_name, known, n=3)
    hint = f' (close: {", ".join(close)})' if close else ''
    raise UnknownDatasetError(
        f'a TFDS data set{hint}, such as imagenet2012 (tfds.list_builders() '
        'lists them)') from None


def check_tensorflow_reaches(data_dir: str) -> None:
  """ValueError, in one line naming the cause and the fix, unless
  TensorFlow's own GCS client reaches `data_dir` (gs://...).

  TFDS's records are read by tf.data through that client, whatever reads
  the rest of the run's gs:// paths (gcsfs: runtime/paths.py), so a
  bucket that gcsfs reaches may still fail there, and would fail only
  when the first batch is read.
  """
  try:
    tf.io.gfile.stat(data_dir)
  except tf.errors.NotFoundError:
    return  # the bucket answers: an absent data set is said by TFDS
  except tf.errors.OpError as e:
    cause = ' '.join(str(e.message).split())[:300]
    raise ValueError(
        f'data_dir {data_dir} cannot be read through TensorFlow\'s GCS '
        f'client, which reads TFDS data sets ({type(e).__name__}: {cause}); '
        'check the network and the credentials TensorFlow finds '
        '(GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default '
        'login`, or the VM\'s service account), or copy the data set to a '
        'local disk and point config.data_dir there') from None


# Files a user downloads by hand into `manual_dir` for these data sets.
_MANUAL_FILES = {
    'imagenet2012': 'ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar '
                    '(from image-net.org)',
}


def missing(name: str, data_dir) -> str | None:
  """None when TFDS data set `name` (`name:version` too) is prepared in
  `data_dir` (None: TFDS's default); else `not_prepared`'s clause. An
  unknown name or an unreachable bucket is a ValueError."""
  builder = dataset_builder(name, data_dir)
  return None if builder.is_prepared() else not_prepared(builder, name)


def not_prepared(builder, name: str) -> str:
  """'not prepared in DATA_DIR: COMMAND', one clause without ';': where
  TFDS looked for `name` (what else that directory holds, if anything),
  and the command that prepares it there."""
  data_dir = builder.data_dir_root
  # A pinned version (`cars196:2.1.0`) is built as pinned.
  target = (f'{builder.name}:{builder.version}'
            if ':' in name and '*' not in name else builder.name)
  command = f'tfds build {target} --data_dir={data_dir}'
  steps = f'run `{command}`'
  if builder.MANUAL_DOWNLOAD_INSTRUCTIONS:
    files = _MANUAL_FILES.get(builder.name,
                              'the files its documentation names')
    steps = (f'put {files} in a directory MANUAL_DIR and run '
             f'`{command} --manual_dir=MANUAL_DIR`')
  others = [d for d in prepared_datasets(data_dir) if d != builder.name]
  held = f' (which holds {", ".join(others)})' if others else ''
  return f'not prepared in {data_dir}{held}: {steps}'


def not_prepared_message(builder) -> str:
  """One line: where TFDS looked, and the command that prepares the data."""
  return (f'dataset {builder.name} is {not_prepared(builder, builder.name)} '
          '(see docs/data.md), or point config.data_dir or TFDS_DATA_DIR at '
          'the directory where it is prepared')


def prepared_datasets(data_dir: str) -> list[str]:
  """Names of the data sets prepared under a TFDS `data_dir`."""
  if not os.path.isdir(data_dir):
    return []
  return sorted(
      name for name in os.listdir(data_dir)
      if any('dataset_info.json' in files
             for _, _, files in os.walk(os.path.join(data_dir, name))))


def label_names(name: str, data_dir) -> list[str]:
  """The label names of a TFDS data set (its metadata; the data itself
  need not be prepared)."""
  info = dataset_builder(name, data_dir).info
  if info.supervised_keys is None:
    raise ValueError(f'dataset {name!r} has no (image, label) supervised '
                     'keys; use an image classification data set')
  return list(info.features[info.supervised_keys[1]].names)
