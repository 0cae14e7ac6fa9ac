"""Stopping cleanly when asked, and resuming without seams in the dashboards.

`StopRequest` turns SIGTERM (what preemptible TPUs and cluster schedulers
send) and SIGINT (Ctrl-C) into a request that the loop sees after the current
step: it saves a checkpoint there, flushes its writers and exits normally.
On several processes the processes agree on the step to stop at, through
JAX's coordination service (never a device collective: see `StopRequest`).

`drop_events_after` removes from the TensorBoard event files the events that
a killed run wrote after the checkpoint it is resumed from; the resumed run
writes those steps again, so every step appears once. A run that restored
no checkpoint drops nothing: it moves the event files of the runs before it
into a folder of their own (`note_fresh_start`), so that those of the
directory are always the run's own.
"""

import io
import signal
import tempfile
import threading

from absl import logging
import jax
from jax.experimental import multihost_utils
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.compat.proto import event_pb2
from tensorboard.summary.writer import record_writer

from runtime import paths
from runtime import process_agreement


# How long a process waits at a host-sync step for the others' answers. A
# process that died is noticed sooner, by the heartbeat timeout; this bounds
# a live process that stopped reaching steps.
STOP_AGREEMENT_TIMEOUT_MS = 300_000


class StopRequest:
  """While entered, SIGTERM and SIGINT ask the training loop to stop.

  A second signal of the same kind, while the first is being honoured, acts
  as if no handler were installed (an impatient second Ctrl-C kills).

  On one process the request is a flag read each step, at no cost. On
  several, JAX's distributed runtime already catches SIGTERM and
  `multihost_utils.reached_preemption_sync_point` makes every process stop
  at the same step (it is cheap to call each step); SIGINT is shared through
  the coordination service's key-value store, only on steps that synchronise
  with the host anyway. Not with a device collective (`process_allgather`):
  device collectives must reach every process in one order, beside the
  train step's own; the service matches keys by name, in any order.
  """

  def __init__(self):
    self.signal_name = None
    self._previous = {}
    self._shared_question = None  # this process's last answer in the store

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self  # signal handlers can only be set from the main thread
    signals = [signal.SIGINT]
    if jax.process_count() == 1:
      signals.append(signal.SIGTERM)
    for signum in signals:
      self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    name = signal.Signals(signum).name
    if self.signal_name is not None:
      signal.signal(signum, self._previous.pop(signum, signal.SIG_DFL))
      signal.raise_signal(signum)
      return
    self.signal_name = name
    logging.warning('%s received: stopping after the current step, with a '
                    'checkpoint.', name)

  def should_stop(self, step: int, host_sync_step: bool) -> bool:
    """Whether every process stops after `step`.

    `host_sync_step`: the loop synchronises with the host at this step anyway
    (logging, evaluation, checkpoint), so waiting for the other processes
    here costs nothing.
    """
    if jax.process_count() == 1:
      return self.signal_name is not None
    if multihost_utils.reached_preemption_sync_point(step):
      self.signal_name = self.signal_name or 'SIGTERM'
      return True
    if host_sync_step:
      return self._any_process_signalled(step)
    return False

  def _any_process_signalled(self, step: int) -> bool:
    """Every process posts whether it caught a signal at `step` and reads
    every other's; all of them see the same answers."""
    question = f'stop_request/{step}'
    answers = process_agreement.share(question, self.signal_name or '-',
                                      STOP_AGREEMENT_TIMEOUT_MS)
    # Every other process has read this process's previous answer (it read
    # it before posting its answer for this step), so it can go.
    if self._shared_question is not None:
      process_agreement.forget(self._shared_question)
    self._shared_question = question
    signalled = [answer for answer in answers if answer != '-']
    if signalled and self.signal_name is None:
      self.signal_name = signalled[0]
    return bool(signalled)


def drop_events_after(events_dir: str, step: int) -> None:
  """Removes events with a step above `step` from `events_dir`'s event
  files, once the run was restored from its checkpoint at `step`.

  A run killed after its checkpoint at `step` may have logged later steps;
  the resumed run logs them again. Each file is replaced whole
  (`paths.replace_file`), so a kill here loses nothing.
  """
  if jax.process_index() != 0:
    return
  for path in paths.path(events_dir).glob('*tfevents*'):
    records = _read_records(path)
    kept = [r for r in records
            if event_pb2.Event.FromString(r).step <= step]
    if len(kept) == len(records):
      continue
    buffer = io.BytesIO()
    writer = record_writer.RecordWriter(buffer)
    for record in kept:
      writer.write(record)
    paths.replace_file(path, buffer.getvalue())
    logging.info('Dropped %d events after step %d from %s (the resumed run '
                 'writes them again).', len(records) - len(kept), step, path)


# Where a fresh start moves the event files of the runs before it, each
# into a folder of its own (1, 2, ...): a run of its own on TensorBoard.
EARLIER_RUNS_DIR = 'earlier_runs'


def note_fresh_start(events_dir: str, checkpoints_dir,
                     init_from: str = '') -> None:
  """Says so, in one line, when a run that restored no checkpoint starts
  in a workdir that has a history: event files, which it moves into a
  folder of their own under EARLIER_RUNS_DIR (so that neither this run's
  resumes nor its dashboards mix them with its own), or checkpoints set
  aside as damaged, which it keeps. `init_from`: the weights it starts
  from, if not random ones."""
  if jax.process_index() != 0:
    return
  event_files = sorted(paths.path(events_dir).glob('*tfevents*'))
  set_aside = paths.path(checkpoints_dir).parent / 'corrupt_checkpoints'
  kept = []
  if event_files:
    earlier = paths.path(events_dir) / EARLIER_RUNS_DIR
    number = 1 + max((int(d.name) for d in earlier.glob('*')
                      if d.name.isdigit()), default=0)
    destination = earlier / str(number)
    destination.mkdir(parents=True, exist_ok=True)
    for file in event_files:
      file.rename(destination / file.name)
    kept.append(f'moved the {len(event_files)} event files of the run '
                f'before to {destination}')
  if set_aside.is_dir():
    kept.append(f'kept the damaged checkpoints in {set_aside}')
  if kept:
    start = f' from the weights of {init_from}' if init_from else ''
    logging.warning('No checkpoint to resume from in %s: starting at step 0'
                    '%s; %s.', checkpoints_dir, start, ' and '.join(kept))


def _read_records(path) -> list[bytes]:
  """The records of an event file, read with TensorBoard's reader from a
  local copy (the reader itself opens only what TensorFlow's file system
  reaches)."""
  with tempfile.NamedTemporaryFile(suffix='.tfevents') as local:
    local.write(path.read_bytes())
    local.flush()
    return list(event_file_loader.RawEventFileLoader(local.name).Load())
