"""The workdir, checked before a run writes to it: a local directory, or
one in a gs:// bucket, that is or can become writable; a ValueError of one
line names the fix."""

import os
import tempfile
import uuid

from runtime import paths
from runtime import storage_errors


def check_workdir(workdir: str) -> None:
  """Raises ValueError unless `workdir` is, or can become, a writable
  directory: a local one, or one in a gs:// bucket."""
  if paths.is_remote(workdir):
    _check_remote_workdir(workdir)
    return
  path = os.path.abspath(workdir)
  existing = path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ValueError(f'workdir {workdir!r}: {existing} is a file, not a '
                     'directory; pass a directory path as --workdir')
  try:  # a real probe: permission bits do not bind root, read-only mounts do
    tempfile.TemporaryFile(dir=existing).close()
  except OSError as e:
    raise ValueError(f'workdir {workdir!r} is not writable ({e.strerror} in '
                     f'{existing}); choose another --workdir or fix its '
                     'permissions') from None


def _check_remote_workdir(workdir: str) -> None:
  """A supported scheme, not an object, and a bucket that takes a write."""
  scheme = paths.scheme(workdir)
  if scheme not in paths.REMOTE_SCHEMES:
    raise ValueError(f'workdir {workdir!r}: {scheme}:// is not supported; '
                     'use a local directory or a gs://BUCKET/DIR path')
  path = paths.path(workdir)
  if path.is_file():
    raise ValueError(f'workdir {workdir!r} is an object, not a directory; '
                     'pass a directory path as --workdir')
  probe = path / f'.write-probe-{uuid.uuid4().hex}'
  try:  # what a save needs: the bucket exists and takes a write
    probe.write_bytes(b'')
    probe.unlink()
  except Exception as e:  # pylint: disable=broad-except
    # gcsfs and google-auth report a missing bucket, a refused write and
    # missing credentials with their own exception types.
    bucket = workdir.split('://', 1)[1].split('/', 1)[0]
    if storage_errors.unavailable(e):
      raise ValueError(
          f'bucket {bucket!r} did not answer a write to workdir {workdir!r} '
          f'({storage_errors.first_line(e)}); nothing was changed; run the '
          'same command again once it answers') from None
    raise ValueError(
        f'workdir {workdir!r} is not writable ({type(e).__name__}: '
        f'{str(e).splitlines()[0][:200]}); check that bucket {bucket!r} '
        'exists and that these credentials may write to it (`gcloud storage '
        f'buckets describe gs://{bucket}`), or choose another --workdir'
    ) from None
