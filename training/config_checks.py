"""Checks of what a user passes in (config file, overrides, workdir, data set).

Each mistake becomes one line that names the fix, before anything is
compiled or written. The checks raise ValueError; `train` turns them into
ConfigErrors and `main` prints them.
"""

import difflib
import importlib.util
import os
import re
import sys
import tempfile
import uuid

from absl import flags
import ml_collections

from runtime import paths


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (for `app.run(flags_parser=...)`), with config-file
  and override mistakes reported as one line and exit code 1."""
  try:
    remaining = flags.FLAGS(argv)
    _ = flags.FLAGS.config.keys()  # config_flags defers a missing file's error
  except Exception as e:  # pylint: disable=broad-except
    # config_flags raises IOError, AttributeError, KeyError, TypeError or
    # flags.Error; find the cause ourselves and name the fix.
    sys.exit(f'Error: {describe_flag_error(argv, e)}')
  return remaining


def describe_flag_error(argv: list[str], error: Exception) -> str:
  """The one-line cause and fix of a flag-parsing failure."""
  path = _flag_value(argv, 'config')
  if path is not None:
    path = path.split(':', 1)[0]
    try:
      config = load_config_file(path)
    except ValueError as e:
      return str(e)
    for key in _override_keys(argv):
      try:
        _get_nested(config, key)
      except (KeyError, AttributeError):
        return unknown_key_message(key, config, path)
  return str(error).strip().splitlines()[0]


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of the file at `path`, or a ValueError naming the fix."""
  if not os.path.isfile(path):
    raise ValueError(f'config file {path!r} not found; pass an existing '
                     'file, e.g. --config=configs/default.py')
  spec = importlib.util.spec_from_file_location('user_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not callable(getattr(module, 'get_config', None)):
    raise ValueError(f'config file {path!r} has no get_config(); define '
                     '`def get_config():` returning an ml_collections.'
                     'ConfigDict')
  config = module.get_config()
  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(f'get_config() of {path!r} returned '
                     f'{type(config).__name__}, not an ml_collections.'
                     'ConfigDict; return the config')
  return config


def unknown_key_message(key: str, config, path: str) -> str:
  keys = sorted(_flat_keys(config))
  close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
  hint = (f'close keys: {", ".join(close)}' if close
          else 'see the key table in README.md')
  return f'--config.{key}: {path} has no key {key!r}; {hint}'


def _flat_keys(config, prefix: str = ''):
  for key, value in config.items():
    yield prefix + key
    if isinstance(value, ml_collections.ConfigDict):
      yield from _flat_keys(value, f'{prefix}{key}.')


def _get_nested(config, dotted: str):
  for part in dotted.split('.'):
    config = config[part]
  return config


def _flag_value(argv: list[str], name: str) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      return arg.split('=', 1)[1]
    if arg == f'--{name}' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _override_keys(argv: list[str]) -> list[str]:
  """KEY of each --config.KEY[=VALUE] (and --noconfig.KEY) in `argv`."""
  return [m.group(1) for arg in argv
          if (m := re.match(r'--(?:no)?config\.([^=]+)', arg))]


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
    raise ValueError(
        f'workdir {workdir!r} is not writable ({type(e).__name__}: '
        f'{str(e).splitlines()[0][:200]}); check that bucket {bucket!r} '
        'exists and that these credentials may write to it (`gcloud storage '
        f'buckets describe gs://{bucket}`), or choose another --workdir'
    ) from None
