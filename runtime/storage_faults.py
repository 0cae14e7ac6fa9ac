"""Telling a damaged checkpoint from storage that fails for a while.

Reading a committed checkpoint can fail for two kinds of reasons, which a
run must treat in opposite ways:

- damage: a file of the checkpoint is missing or cannot be decoded (JSON
  that does not parse, TensorStore's DATA_LOSS or OUT_OF_RANGE, an array
  of another shape than its metadata says). A bucket's object is missing
  when its listing says so, not on TensorStore's word alone. Reading again gives the same
  answer, so the checkpoint is set aside.
- an outage or a refusal: the storage, the network or the machine did not
  answer, or answered with any HTTP status but 404, 410 and 416 (408, 429
  or 5xx, expired or refused credentials, a redirect, a bad request), a
  refused or dropped connection, a timeout, memory exhausted, a signal.
  Reading again later may succeed, so nothing is moved.

An error that shows neither is taken for an outage: a checkpoint is set
aside only on proof of damage, never because a read failed somehow.

`attempt` runs one read in a thread of its own, so that the caller sees a
stall and a signal while the storage clients retry inside (gcsfs retries
for about a minute, TensorStore for about 15). A stall is time in which no
byte arrived for the storage clients (`Transferred`): a slow read that keeps
receiving runs to its end however long it takes, and says how far it is
every 20 s.
"""

import dataclasses
import json
import os
import re
import socket
import struct
import threading
import time
from typing import Any, Callable

from absl import logging
# The coordination service's address: JAX has no public handle to it.
from jax._src import distributed
import tensorstore as ts

from runtime import paths
from runtime import storage_errors

DAMAGE, OUTAGE = 'damage', 'outage'

# TensorStore's status codes (the start of its errors' messages) that say a
# stored file is missing or undecodable, and those that say the storage or
# the machine did not answer.
_DAMAGE_STATUSES = ('DATA_LOSS', 'OUT_OF_RANGE', 'NOT_FOUND',
                    'FAILED_PRECONDITION', 'INVALID_ARGUMENT')
_OUTAGE_STATUSES = ('UNAVAILABLE', 'DEADLINE_EXCEEDED', 'RESOURCE_EXHAUSTED',
                    'ABORTED', 'CANCELLED', 'UNAUTHENTICATED',
                    'PERMISSION_DENIED', 'INTERNAL', 'UNKNOWN')
# The HTTP statuses that prove an object missing or shorter than the
# checkpoint's index says. Any other is an outage or a refusal, whatever
# TensorStore's code for it: FAILED_PRECONDITION for a redirect or 413,
# INVALID_ARGUMENT for 400 and 411 (a proxy's answer, a bad request).
_DAMAGE_HTTP_STATUSES = (404, 410, 416)
# The object a TensorStore NOT_FOUND names. TensorStore reports some
# answers that are not 404 as a missing object too (412, which a proxy or
# a conditional read can give), so a bucket's object is proven missing
# only when a listing of the bucket agrees.
_NAMED_OBJECT = re.compile(r'(gs://[^\s"\'\\,\]]+)')
# Exception classes of the storage clients (matched by name, so that none
# of them is imported here) that mean it refused the credentials (an
# outage too: they expire).
_REFUSAL_CLASSES = ('Forbidden', 'Unauthorized', 'RefreshError',
                    'DefaultCredentialsError')


def _is_outage(error: BaseException) -> bool:
  if isinstance(error, (MemoryError, KeyboardInterrupt, SystemExit)):
    return True
  if storage_errors.unanswered(error) or any(
      cls.__name__ in _REFUSAL_CLASSES for cls in type(error).__mro__):
    return True
  status = storage_errors.http_status(error)
  if status is not None:
    return status not in _DAMAGE_HTTP_STATUSES
  return str(error).startswith(_OUTAGE_STATUSES)


def _is_damage(error: BaseException) -> bool:
  if isinstance(error, (json.JSONDecodeError, FileNotFoundError,
                        UnicodeDecodeError)):
    return True
  if storage_errors.http_status(error) in _DAMAGE_HTTP_STATUSES:
    return True
  message = str(error)
  if message.startswith('NOT_FOUND') and (
      named := _NAMED_OBJECT.search(message)):
    return _listed_missing(named[1])
  return message.startswith(_DAMAGE_STATUSES)


def _listed_missing(name: str) -> bool:
  """Whether the bucket's listing says object `name` is not there (False
  when it is there, or when the listing fails: nothing is proven)."""
  try:
    return not paths.path(name).exists()
  except Exception:  # pylint: disable=broad-except
    return False


def classify(error: BaseException) -> str:
  """DAMAGE when `error`, raised while reading a committed checkpoint,
  proves one of its files missing or undecodable and nothing in its chain
  is an outage; OUTAGE otherwise."""
  chain = list(storage_errors.chain(error))
  if any(_is_outage(e) for e in chain):
    return OUTAGE
  return DAMAGE if any(_is_damage(e) for e in chain) else OUTAGE


class Stopped(Exception):
  """A signal asked the launch to stop while a read was under way."""


class Transferred:
  """The bytes that arrived for this process's storage clients (`sent`:
  that they sent and the other end acknowledged), counted as they go: over
  every TCP connection of the process but those of JAX's coordination
  service (Linux's per-connection count, TCP_INFO), plus what TensorStore
  read from (wrote to) local files. One instance per read or wait: it
  counts from its creation."""

  def __init__(self, sent: bool = False):
    self._field = _BYTES_ACKED if sent else _BYTES_RECEIVED
    self._file_metric = _FILE_BYTES_WRITTEN if sent else _FILE_BYTES_READ
    self._seen = {}  # socket inode: its count when last looked at
    self._total = -self._tcp_bytes() - _file_bytes(self._file_metric)

  def total(self) -> int:
    """The bytes transferred since this counter was made."""
    return (self._total + self._tcp_bytes() +
            _file_bytes(self._file_metric))

  def _tcp_bytes(self) -> int:
    """The bytes over the TCP connections open now or seen open before (a
    connection that closed keeps its last count)."""
    for inode, count in _tcp_connections(self._field):
      self._seen[inode] = count
    return sum(self._seen.values())


# Where Linux's struct tcp_info holds tcpi_bytes_acked and
# tcpi_bytes_received (since 4.1).
_TCP_INFO_SIZE = 136
_BYTES_ACKED, _BYTES_RECEIVED = 120, 128
_COUNT = struct.Struct('=Q')
_FILE_BYTES_READ = '/tensorstore/kvstore/file/bytes_read'
_FILE_BYTES_WRITTEN = '/tensorstore/kvstore/file/bytes_written'


def _tcp_connections(field: int):
  """(inode, the count at offset `field` of its tcp_info) of each TCP
  connection of this process but the coordination service's; none where
  /proc is not Linux's."""
  try:
    names = os.listdir('/proc/self/fd')
  except OSError:
    return
  service_port = _coordination_port()
  for name in names:
    try:
      link = os.readlink(f'/proc/self/fd/{name}')
      if not link.startswith('socket:'):
        continue
      with socket.socket(fileno=os.dup(int(name))) as connection:
        if (connection.type != socket.SOCK_STREAM or connection.family
            not in (socket.AF_INET, socket.AF_INET6)):
          continue
        ports = (connection.getsockname()[1], connection.getpeername()[1])
        if service_port in ports:
          continue
        info = connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO,
                                     _TCP_INFO_SIZE)
    except OSError:  # closed meanwhile, or not connected
      continue
    if len(info) >= _TCP_INFO_SIZE:
      yield link, _COUNT.unpack_from(info, field)[0]


def _coordination_port() -> int | None:
  """The port of JAX's coordination service in a multi-process run: its
  heartbeats arrive whether the storage answers or not."""
  address = getattr(distributed.global_state, 'coordinator_address', None)
  return int(address.rsplit(':', 1)[1]) if address else None


def _file_bytes(metric_name: str) -> int:
  """TensorStore's count `metric_name` of the bytes it read from or wrote
  to local files in this process (counted as each piece is complete)."""
  return sum(int(value.get('value', 0))
             for metric in ts.experimental_collect_matching_metrics(
                 metric_name)
             for value in metric.get('values', ()))


# How often a read that takes long says how far it is.
_PROGRESS_SECONDS = 20.0


@dataclasses.dataclass
class Progress:
  """How far the attempts at one read got: `best` bytes received by one
  attempt, `at` (time.monotonic()) when an attempt last got further than
  any before; `total` the bytes the read is expected to receive, if known
  (set by the read itself)."""
  best: int = 0
  at: float = dataclasses.field(default_factory=time.monotonic)
  total: int | None = None

  def report(self, what: str, received: int, started: float,
             now: float, verb: str = 'Reading') -> str:
    """A line saying how far the read (or write: `verb`) of `what` is."""
    rate = received / max(now - started, 1e-9)
    done = _size(received) + (f' of {_size(self.total)}' if self.total
                              else '')
    left = (f', about {(self.total - received) / rate:.0f} s left'
            if self.total and 0 < rate and received < self.total else '')
    return (f'{verb} {what}: {done} in {now - started:.0f} s '
            f'({_size(rate)}/s){left}.')


def _size(count: float) -> str:
  """A number of bytes as people write it: 812 B, 40.1 kB, 5.2 GB."""
  for unit in ('B', 'kB', 'MB', 'GB'):
    if count < 1000 or unit == 'GB':
      return f'{count:.0f} {unit}' if unit == 'B' else f'{count:.1f} {unit}'
    count /= 1000


def attempt(read: Callable[[], Any], what: str, progress: Progress,
            stall_seconds: float,
            stop_requested: Callable[[], str | None]) -> Any:
  """`read()`'s value, read in a thread of its own.

  Raises what `read` raised; TimeoutError when `stall_seconds` pass with
  no attempt getting further than `progress.best` (updated here); Stopped
  when `stop_requested()` names a signal meanwhile. A read given up on is
  left to end in its thread (a daemon) and its result is dropped.
  """
  outcome = {}
  done = threading.Event()

  def run():
    try:
      outcome['value'] = read()
    except BaseException as e:  # pylint: disable=broad-except
      outcome['error'] = e
    done.set()

  received_bytes = Transferred()
  threading.Thread(target=run, name=f'read {what}', daemon=True).start()
  started = time.monotonic()
  next_report = started + _PROGRESS_SECONDS
  while not done.wait(0.25):
    now = time.monotonic()
    if (signal_name := stop_requested()) is not None:
      raise Stopped(signal_name)
    received = received_bytes.total()
    if received > progress.best:
      progress.best, progress.at = received, now
    if now - progress.at >= stall_seconds:
      raise TimeoutError(
          f'no byte from storage for {now - progress.at:.0f} s')
    if now >= next_report:
      logging.warning(progress.report(what, received, started, now))
      next_report = now + _PROGRESS_SECONDS
  if 'error' in outcome:
    raise outcome['error']
  return outcome['value']


def wait_reporting(busy: Callable[[], bool], what: str,
                   total: int | None) -> None:
  """Waits while `busy()` (a write of `what`, about `total` bytes, under
  way), saying every 20 s how far it is: the bytes sent and acknowledged,
  the rate, the time left."""
  if not busy():
    return
  sent, progress = Transferred(sent=True), Progress(total=total)
  started = time.monotonic()
  next_report = started + _PROGRESS_SECONDS
  while busy():
    time.sleep(0.25)
    now = time.monotonic()
    if now >= next_report:
      logging.info(progress.report(what, sent.total(), started, now,
                                   verb='Writing'))
      next_report = now + _PROGRESS_SECONDS
