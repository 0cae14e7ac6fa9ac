"""How a checkpoint's files are read: by every process alike, each read's
outcome shared, so that all of them restore, retry, stop or set a
checkpoint aside together.

A storage error is read again, after a backoff, until a stall of
`restore_retry_seconds` (`stall_bound`, or a read's own bound); a signal
stops the reads; a damaged checkpoint (`runtime/storage_faults.py`) is an
outcome the caller acts on. Each stop is a RestoreError: nothing was
changed.
"""

import contextlib
import contextvars
import dataclasses
import itertools
import json
import time
from typing import Any

from absl import logging

from runtime import checkpoint_compatibility as compatibility
from runtime import paths
from runtime import process_agreement
from runtime import storage_errors
from runtime import storage_faults

# The default of restore_retry_seconds, for the commands that read a
# checkpoint before they have its config.
RETRY_SECONDS = 120
# The bound on a stall of the reads that are given none (`stall_bound`).
_STALL_SECONDS = contextvars.ContextVar('stall_seconds',
                                        default=RETRY_SECONDS)


@contextlib.contextmanager
def stall_bound(seconds: float):
  """Within it, the reads given no bound of their own (`checkpoint_dir`,
  `read_retried`, `restore_checkpoint`) stop after `seconds` without
  progress: a command's restore_retry_seconds."""
  token = _STALL_SECONDS.set(seconds)
  try:
    yield
  finally:
    _STALL_SECONDS.reset(token)


def bound(retry_seconds: float | None) -> float:
  """`retry_seconds`, or `stall_bound`'s when None."""
  return _STALL_SECONDS.get() if retry_seconds is None else retry_seconds

class RestoreError(Exception):
  """The launch stops without having changed anything: the storage did not
  answer for `restore_retry_seconds`, a signal came while restoring, or a
  checkpoint that a command reads without setting it aside is damaged."""


def read_retried(read, what: str, retry_seconds: float | None = None):
  """`read()`'s value, read by this process alone as a restore reads:
  again after storage errors until `retry_seconds` (None: `stall_bound`'s)
  pass without progress. Then, or when what arrived proves `what`
  damaged, RestoreError."""
  outcome = agreed_read(lambda _: read(), what, bound(retry_seconds),
                         lambda: None, alone=True)
  if outcome.kind == storage_faults.DAMAGE:
    raise RestoreError(f'{what} is damaged ({outcome.message}); nothing was '
                       'changed; resume training in its workdir to set it '
                       'aside, or pass an older checkpoint '
                       '(WORKDIR/checkpoints/STEP)')
  return outcome.value

@dataclasses.dataclass
class Outcome:
  kind: str  # 'ok', storage_faults.DAMAGE or OUTAGE, 'refused', 'bucket',
  # 'stopped'
  message: str = ''
  value: Any = None
  # Seconds since the read last got further, when the attempt ended.
  stalled_seconds: float = 0.0


_READS = itertools.count()
# The first wait after a storage error, doubled after each until this cap.
_FIRST_BACKOFF_SECONDS, _MAX_BACKOFF_SECONDS = 1.0, 16.0


def agreed_read(read, what: str, retry_seconds: float, stop_requested,
                 alone: bool = False) -> Outcome:
  """`read(progress)`'s outcome, the same on every process: 'ok' with its
  value, or DAMAGE. `read` may set `progress.total`. Storage errors on any
  process are read again by all, after a backoff, until one of them has
  gone `retry_seconds` without an attempt getting further (a stall); then,
  or at a signal, RestoreError. A refusal on any process is raised on
  all. `alone`: this process's outcome, shared with none."""
  # Every process makes the same agreed reads in turn.
  read_index = None if alone else next(_READS)
  progress = storage_faults.Progress()
  backoff, last_error = _FIRST_BACKOFF_SECONDS, None
  for attempt in itertools.count():
    outcome = _attempt(lambda: read(progress), what, progress,
                       retry_seconds, stop_requested)
    left = lambda: progress.at + retry_seconds - time.monotonic()
    outcome.stalled_seconds = time.monotonic() - progress.at
    shared = [outcome] if alone else [
        _decode(answer) for answer in process_agreement.share(
            f'restore/{read_index}/{attempt}', _encode(outcome),
            int(1000 * (max(left(), 0) + 120)))]
    kinds = {o.kind for o in shared}
    for kind in ('stopped', 'refused', 'bucket', storage_faults.OUTAGE):
      if kind in kinds:
        first = next(o for o in shared if o.kind == kind)
        break
    else:
      first = next((o for o in shared if o.kind == storage_faults.DAMAGE),
                   outcome)
    if first.kind == 'stopped':
      raise RestoreError(f'{first.message} received while reading {what}; '
                         'nothing was changed; run the same command again')
    if first.kind == 'refused':
      raise compatibility.IncompatibleCheckpointError(first.message)
    if first.kind == 'bucket':
      raise paths.BucketError(first.message)
    if first.kind != storage_faults.OUTAGE:
      return first if first.kind == storage_faults.DAMAGE else outcome
    # The longest stall of any process, so that all print the same line.
    stalled = max(o.stalled_seconds for o in shared)
    if stalled >= retry_seconds:
      earlier = f'; before that: {last_error}' if last_error not in (
          None, first.message) else ''
      raise RestoreError(
          f'{what} could not be read: stalled for '
          f'{stalled:.0f} s ({first.message}'
          f'{earlier}); nothing was changed; run the same command again '
          '(restore_retry_seconds bounds a stall)')
    last_error = first.message
    pause = min(backoff, max(left(), 0))
    logging.warning('Storage error reading %s (%s); reading it again in '
                    '%.0f s (%.0f s left of restore_retry_seconds without '
                    'progress).', what, first.message, pause, left())
    _sleep_unless_stopped(pause, stop_requested)
    backoff = min(2 * backoff, _MAX_BACKOFF_SECONDS)


def _attempt(read, what: str, progress, stall_seconds: float,
             stop_requested) -> Outcome:
  """This process's outcome of one `read()`."""
  try:
    return Outcome('ok', value=storage_faults.attempt(
        read, what, progress, stall_seconds, stop_requested))
  except storage_faults.Stopped as e:
    return Outcome('stopped', str(e))
  except compatibility.IncompatibleCheckpointError as e:
    return Outcome('refused', str(e))
  except paths.BucketError as e:  # the workdir's, not the checkpoint's
    return Outcome('bucket', str(e))
  except Exception as e:  # pylint: disable=broad-except
    # Orbax, TensorStore and the storage clients raise many types; the
    # chain of each says which kind of failure it is.
    return Outcome(storage_faults.classify(e), storage_errors.first_line(e))


def _encode(outcome: Outcome) -> str:
  return json.dumps([outcome.kind, outcome.message, outcome.stalled_seconds])


def _decode(answer: str) -> Outcome:
  kind, message, stalled_seconds = json.loads(answer)
  return Outcome(kind, message, stalled_seconds=stalled_seconds)


def _sleep_unless_stopped(seconds: float, stop_requested) -> None:
  """Waits `seconds`, less when a signal comes (the next read sees it)."""
  end = time.monotonic() + seconds
  while time.monotonic() < end and stop_requested() is None:
    time.sleep(min(0.25, end - time.monotonic()))
