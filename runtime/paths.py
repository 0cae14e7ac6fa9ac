"""Every file operation on a workdir or weights file, local or in a bucket
(gs://).

Through `etils.epath`, which orbax uses for the same directories. `path` is
the one door to a gs:// name, in every command: before the process's first
one it points epath at fsspec's GCS file system (gcsfs) rather than
TensorFlow's, and it asks the bucket once whether it answers, so that a
bucket that is missing, refuses access or cannot be reached is said as such
within seconds. gcsfs and orbax's array store (TensorStore) can both be
pointed at another endpoint (`STORAGE_EMULATOR_HOST`,
`TENSORSTORE_GCS_HTTP_URL`), so the code that runs against a real bucket is
the code the tests run against a GCS emulator. TensorBoard's event writer
still goes through TensorFlow.

An object store cannot rename: a move there is a copy, then a delete.
"""

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import uuid

from etils import epath
from etils.epath import gpath

from runtime import storage_errors

# Schemes whose paths reach every layer of the trainer: orbax stores arrays
# through TensorStore, which knows local files and GCS.
REMOTE_SCHEMES = ('gs',)

# How long a bucket's first answer may take. gcsfs retries a request that
# finds no server for about half a minute; an unreachable endpoint is said
# sooner.
REACH_SECONDS = 10


def _use_gcsfs_for_buckets() -> None:
  """Makes epath (ours and orbax's) reach gs:// through gcsfs in this
  process; EPATH_USE_TF=true in the environment keeps TensorFlow's.

  Only once a name of ours is in a bucket: until then TFDS's own gs://
  look-ups (of data sets not prepared locally) stay on TensorFlow, which
  gives up within seconds without network where gcsfs retries for minutes.
  """
  if os.environ.get('EPATH_USE_TF') is None:
    os.environ['EPATH_USE_TF'] = 'false'
    # epath caches its choice at the process's first gs:// path, which
    # TFDS may have made already: it chooses again from the variable.
    gpath._is_tf_installed.cache_clear()  # pylint: disable=protected-access


def _bucket_file_system():
  """epath's own instance of gcsfs (fsspec keeps one per set of
  arguments)."""
  import fsspec  # pylint: disable=g-import-not-at-top
  return fsspec.filesystem('gs', finalize_on_close=True)


class BucketError(ValueError):
  """A bucket that does not exist, cannot be reached or refuses access:
  the message names the cause and the fix."""


@functools.cache
def _reach_bucket(bucket: str) -> None:
  """Raises BucketError, naming the cause and the fix, unless gs://`bucket`
  lists its objects within REACH_SECONDS (what every command needs of it)."""
  file_system = _bucket_file_system()
  retried = _Retries()
  try:
    file_system.call('GET', 'b/{}/o', bucket, maxResults=1, json_out=True,
                     timeout=REACH_SECONDS)
  except FileNotFoundError:
    raise BucketError(f'bucket gs://{bucket} does not exist; create it '
                     f'(`gcloud storage buckets create gs://{bucket}`) or '
                     'check the path') from None
  except TimeoutError:
    raise BucketError(
        f'bucket gs://{bucket} cannot be reached: no answer from '
        f'{file_system.base} in {REACH_SECONDS} s'
        f'{f" ({retried.cause})" if retried.cause else ""}; check the '
        'network (and STORAGE_EMULATOR_HOST if you use an emulator)'
    ) from None
  except Exception as e:  # pylint: disable=broad-except
    # gcsfs and google-auth report refused access and missing credentials
    # with their own exception types.
    if storage_errors.unavailable(e):
      raise BucketError(
          f'bucket gs://{bucket} did not answer ({storage_errors.first_line(e)}'
          '); nothing was changed; run the same command again once it '
          'answers') from None
    raise BucketError(
        f'bucket gs://{bucket} refused access ({type(e).__name__}: '
        f'{str(e).splitlines()[0][:200] if str(e) else "no detail"}); check '
        'that these credentials may read it (`gcloud storage buckets describe '
        f'gs://{bucket}`)') from None
  finally:
    retried.close()


class _Retries(logging.Handler):
  """The cause of the first request gcsfs retried, from its debug line of
  each retry, which it records while it lives (and keeps from the log)."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.cause = None
    self._logger = logging.getLogger('gcsfs')
    self._saved = self._logger.level, self._logger.propagate
    self._logger.setLevel(logging.DEBUG)
    self._logger.propagate = False
    self._logger.addHandler(self)

  def close(self) -> None:
    self._logger.removeHandler(self)
    self._logger.setLevel(self._saved[0])
    self._logger.propagate = self._saved[1]
    super().close()

  def emit(self, record: logging.LogRecord) -> None:
    message = record.getMessage()
    if self.cause is None and 'retrying after exception: ' in message:
      self.cause = message.split('retrying after exception: ', 1)[1][:200]


def is_remote(name) -> bool:
  """Whether `name` is a URL (gs://...) rather than a local path."""
  return '://' in os.fspath(name)


def bucket(name) -> str:
  """'bucket' of 'gs://bucket/dir'."""
  return os.fspath(name).split('://', 1)[1].split('/', 1)[0]


def path(name) -> epath.Path:
  """`name` as an epath.Path: a URL as it is, a local path made absolute.

  A gs:// name's bucket is asked once per process whether it answers: a
  ValueError names the cause when it does not.
  """
  if not is_remote(name):
    return epath.Path(os.path.abspath(os.fspath(name)))
  if scheme(name) in REMOTE_SCHEMES:
    _use_gcsfs_for_buckets()
    _reach_bucket(bucket(name))
  return epath.Path(name)


@contextlib.contextmanager
def local_copy(name, download=lambda copy: copy()):
  """A local path with the content of `name`, for readers that open files
  by name (safetensors, PyTorch): `name` itself unless it is a file in a
  bucket, which is downloaded to a temporary directory, under its own file
  name, for the duration, by `download(copy)` (which calls `copy`: a
  caller's retries go there)."""
  remote = path(name)
  if not is_remote(name) or remote.is_dir():
    yield os.fspath(name)
    return
  directory = tempfile.mkdtemp(prefix='weights_')
  try:
    local = os.path.join(directory, remote.name)
    download(lambda: remote.copy(epath.Path(local), overwrite=True))
    yield local
  finally:
    shutil.rmtree(directory, ignore_errors=True)


def scheme(name) -> str:
  """'gs' of 'gs://bucket/dir'; '' for a local path."""
  name = os.fspath(name)
  return name.split('://', 1)[0] if is_remote(name) else ''


def size_and_version(file: epath.Path) -> tuple[int, int]:
  """A file's size and a number that changes whenever it is written: its
  modification time in nanoseconds, or in a bucket the object's
  generation. Neither reads the file."""
  if not is_remote(file):
    found = os.stat(file)
    return found.st_size, found.st_mtime_ns
  import fsspec  # pylint: disable=g-import-not-at-top
  # epath's own instance of gcsfs (see _reach_bucket).
  info = fsspec.filesystem(scheme(file), finalize_on_close=True).info(
      os.fspath(file))
  return int(info['size']), int(info['generation'])


def files_under(directory: epath.Path) -> list[epath.Path]:
  """Every file below `directory`, at any depth."""
  found = []
  for child in directory.iterdir():
    if child.is_dir():
      found.extend(files_under(child))
    else:
      found.append(child)
  return found


def subdirectories(name) -> list[str]:
  """The names of the directories directly in the directory `name` (in a
  bucket: the prefixes one level below it), sorted; one listing."""
  if not is_remote(name):
    return sorted(entry.name for entry in os.scandir(name) if entry.is_dir())
  path(name)  # the bucket answers, through gcsfs
  return sorted(
      os.path.basename(entry['name'].rstrip('/'))
      for entry in _bucket_file_system().ls(os.fspath(name), detail=True)
      if entry['type'] == 'directory')


def size_below(name) -> int:
  """The total size of the files below the directory `name`, at any depth;
  in a bucket, one listing of its prefix."""
  if not is_remote(name):
    return sum(os.path.getsize(os.path.join(root, file))
               for root, _, files in os.walk(os.fspath(name))
               for file in files)
  path(name)  # the bucket answers, through gcsfs
  return int(_bucket_file_system().du(os.fspath(name)))


def objects_below(name) -> list[str]:
  """Every object below the bucket directory `name` (gs://...), at any
  depth, as gs:// names, sorted: one listing of its prefix (pages of 1,000
  objects), where walking it would ask once per directory."""
  path(name)  # the bucket answers, through gcsfs
  prefix = scheme(name) + '://'
  found = _bucket_file_system().find(os.fspath(name))
  return sorted(prefix + found_name for found_name in found)


def read_bytes(name) -> bytes:
  """The whole content of the file `name`; in a bucket, one request
  (opening the object would ask for its metadata first)."""
  if not is_remote(name):
    with open(name, 'rb') as f:
      return f.read()
  path(name)  # the bucket answers, through gcsfs
  return _bucket_file_system().cat_file(os.fspath(name))


def move_tree(source: epath.Path, destination: epath.Path,
              delete_first: str | None = None) -> None:
  """Moves the directory `source` to `destination`, which must not exist.

  A file system renames it in one step. An object store copies every file
  first and only then deletes the source, so a kill at any moment leaves
  at least one whole copy: the source until the copy is complete. The
  source's file `delete_first` (a marker that readers require, such as
  orbax's commit file) goes before the rest, so that a half-deleted source
  is not mistaken for a whole one.
  """
  if destination.exists():
    raise FileExistsError(f'{destination} exists; not moving {source} there')
  destination.parent.mkdir(parents=True, exist_ok=True)
  if not is_remote(source):
    source.rename(destination)
    return
  files = files_under(source)
  for file in files:
    target = destination / os.path.relpath(os.fspath(file),
                                           os.fspath(source))
    file.copy(target)
  if delete_first and (source / delete_first).exists():
    (source / delete_first).unlink()
  source.rmtree()


def replace_file(file: epath.Path, data: bytes) -> None:
  """Writes `data` as the whole content of `file`, all or nothing.

  An object store makes an upload visible only once it is complete, so
  writing the object itself is atomic there. On a file system the data goes
  to a temporary file beside it, then a rename puts it in place.
  """
  if is_remote(file):
    file.write_bytes(data)
    return
  # A name no reader globs for (event files are '*tfevents*').
  temporary = file.parent / f'.replace-{uuid.uuid4().hex}.tmp'
  temporary.write_bytes(data)
  temporary.replace(file)
