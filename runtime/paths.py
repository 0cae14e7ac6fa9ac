"""Every file operation on a workdir, local or in a bucket (gs://).

Through `etils.epath`, which orbax uses for the same directories. A run
with a workdir in a bucket points epath at fsspec's GCS file system (gcsfs)
rather than TensorFlow's (`use_gcsfs_for_buckets`): gcsfs and orbax's array
store (TensorStore) can both be pointed at another endpoint
(`STORAGE_EMULATOR_HOST`, `TENSORSTORE_GCS_HTTP_URL`), so the code that runs
against a real bucket is the code the tests run against a GCS emulator.
TensorBoard's event writer still goes through TensorFlow.

An object store cannot rename: a move there is a copy, then a delete.
"""

import os
import uuid

from etils import epath

# Schemes whose paths reach every layer of the trainer: orbax stores arrays
# through TensorStore, which knows local files and GCS.
REMOTE_SCHEMES = ('gs',)


def use_gcsfs_for_buckets() -> None:
  """Makes epath (ours and orbax's) reach gs:// through gcsfs in this
  process; EPATH_USE_TF=true in the environment keeps TensorFlow's.

  epath decides once per process, at its first gs:// path, so this comes
  before any. Only for runs with a workdir in a bucket: elsewhere TFDS's own
  gs:// look-ups (of data sets not prepared locally) stay on TensorFlow,
  which gives up within seconds without network where gcsfs retries for
  minutes.
  """
  os.environ.setdefault('EPATH_USE_TF', 'false')


def is_remote(name) -> bool:
  """Whether `name` is a URL (gs://...) rather than a local path."""
  return '://' in os.fspath(name)


def path(name) -> epath.Path:
  """`name` as an epath.Path: a URL as it is, a local path made absolute."""
  if is_remote(name):
    return epath.Path(name)
  return epath.Path(os.path.abspath(os.fspath(name)))


def scheme(name) -> str:
  """'gs' of 'gs://bucket/dir'; '' for a local path."""
  name = os.fspath(name)
  return name.split('://', 1)[0] if is_remote(name) else ''


def files_under(directory: epath.Path) -> list[epath.Path]:
  """Every file below `directory`, at any depth."""
  found = []
  for child in directory.iterdir():
    if child.is_dir():
      found.extend(files_under(child))
    else:
      found.append(child)
  return found


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
