"""Telling a damaged checkpoint from storage that fails for a while.

Reading a committed checkpoint can fail for two kinds of reasons, which a
run must treat in opposite ways:

- damage: a file of the checkpoint is missing or cannot be decoded (JSON
  that does not parse, TensorStore's DATA_LOSS or OUT_OF_RANGE, an array
  of another shape than its metadata says). Reading again gives the same
  answer, so the checkpoint is set aside.
- an outage: the storage, the network or the machine did not answer
  (HTTP 408, 429 or 5xx, expired or refused credentials, a refused or
  dropped connection, a timeout, memory exhausted, a signal). Reading
  again later may succeed, so nothing is moved.

An error that shows neither is taken for an outage: a checkpoint is set
aside only on proof of damage, never because a read failed somehow.

`attempt` runs one read in a thread of its own, so that the caller keeps
its deadline and sees a signal while the storage clients retry inside
(gcsfs retries for about a minute, TensorStore for about 15).
"""

import json
import threading
import time
from typing import Any, Callable

from absl import logging

DAMAGE, OUTAGE = 'damage', 'outage'

# TensorStore's status codes (the start of its errors' messages) that say a
# stored file is missing or undecodable, and those that say the storage or
# the machine did not answer.
_DAMAGE_STATUSES = ('DATA_LOSS', 'OUT_OF_RANGE', 'NOT_FOUND',
                    'FAILED_PRECONDITION', 'INVALID_ARGUMENT')
_OUTAGE_STATUSES = ('UNAVAILABLE', 'DEADLINE_EXCEEDED', 'RESOURCE_EXHAUSTED',
                    'ABORTED', 'CANCELLED', 'UNAUTHENTICATED',
                    'PERMISSION_DENIED', 'INTERNAL', 'UNKNOWN')
_OUTAGE_HTTP_WORDS = ('HTTP response code 408', 'HTTP response code 429',
                      'HTTP response code 5', 'HTTP status 5', 'timed out',
                      'Connection reset', 'Connection refused',
                      'Server disconnected', 'Failed to connect')
# Exception classes of the storage clients (matched by name, so that none
# of them is imported here) that mean the service did not answer.
_OUTAGE_CLASSES = ('ClientConnectionError', 'ClientOSError',
                   'ServerDisconnectedError', 'ServerTimeoutError',
                   'ConnectionError', 'Timeout', 'TransportError',
                   'ServiceUnavailable', 'TooManyRequests', 'GatewayTimeout',
                   'InternalServerError', 'BadGateway', 'RetryError',
                   'Forbidden', 'Unauthorized', 'RefreshError',
                   'DefaultCredentialsError')


def _chain(error: BaseException):
  """`error` and the errors it was raised from or while handling."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def _http_status(error: BaseException) -> int | None:
  status = getattr(error, 'code', None)
  if status is None:
    status = getattr(error, 'status', None)
  return status if isinstance(status, int) else None


def _is_outage(error: BaseException) -> bool:
  if isinstance(error, (MemoryError, TimeoutError, ConnectionError,
                        KeyboardInterrupt, SystemExit)):
    return True
  if any(cls.__name__ in _OUTAGE_CLASSES for cls in type(error).__mro__):
    return True
  status = _http_status(error)
  if status is not None and (status in (401, 403, 408, 429) or
                             500 <= status < 600):
    return True
  message = str(error)
  return (message.startswith(_OUTAGE_STATUSES) or
          any(word in message for word in _OUTAGE_HTTP_WORDS))


def _is_damage(error: BaseException) -> bool:
  if isinstance(error, (json.JSONDecodeError, FileNotFoundError,
                        UnicodeDecodeError)):
    return True
  if _http_status(error) == 404:
    return True
  return str(error).startswith(_DAMAGE_STATUSES)


def classify(error: BaseException) -> str:
  """DAMAGE when `error`, raised while reading a committed checkpoint,
  proves one of its files missing or undecodable and nothing in its chain
  is an outage; OUTAGE otherwise."""
  chain = list(_chain(error))
  if any(_is_outage(e) for e in chain):
    return OUTAGE
  return DAMAGE if any(_is_damage(e) for e in chain) else OUTAGE


def first_line(error: BaseException) -> str:
  """The error's type and the first line of its message, shortened."""
  lines = str(error).strip().splitlines()
  return f'{type(error).__name__}: {lines[0][:300] if lines else ""}'


class Stopped(Exception):
  """A signal asked the launch to stop while a read was under way."""


# How often a read that takes long says that it still waits.
_PROGRESS_SECONDS = 20.0


def attempt(read: Callable[[], Any], what: str, deadline: float,
            stop_requested: Callable[[], str | None]) -> Any:
  """`read()`'s value, read in a thread of its own.

  Raises what `read` raised; TimeoutError when `time.monotonic()` passes
  `deadline` before it answers; Stopped when `stop_requested()` names a
  signal meanwhile. A read given up on is left to end in its thread (a
  daemon) and its result is dropped.
  """
  outcome = {}
  done = threading.Event()

  def run():
    try:
      outcome['value'] = read()
    except BaseException as e:  # pylint: disable=broad-except
      outcome['error'] = e
    done.set()

  threading.Thread(target=run, name=f'read {what}', daemon=True).start()
  started = time.monotonic()
  next_report = started + _PROGRESS_SECONDS
  while not done.wait(0.25):
    now = time.monotonic()
    if (signal_name := stop_requested()) is not None:
      raise Stopped(signal_name)
    if now >= deadline:
      raise TimeoutError(f'no answer from storage for {now - started:.0f} s')
    if now >= next_report:
      logging.warning('Still reading %s from storage after %.0f s; giving '
                      'up in %.0f s.', what, now - started, deadline - now)
      next_report = now + _PROGRESS_SECONDS
  if 'error' in outcome:
    raise outcome['error']
  return outcome['value']
