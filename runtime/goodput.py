"""Where a run's wall time goes: its startup by phase, and its goodput over
every launch.

A launch gives each of its seconds to one activity (`Timeline`): the
startup phases first (imports and set-up, `jax.distributed`, the data set,
the model, TensorFlow's import, the restore, the writers and the first
batch, the compiles), then training steps, evaluations, checkpoint saves
and the rest. The time from the launch
to the first step's result is its startup, logged once by phase.

Goodput is the share of the wall time since the run's first launch spent
in training steps whose result is kept (the definition of MaxText and of
ml-goodput-measurement). The rest is badput, by cause: startup, compile,
checkpoint (saves and the restore), evaluation, lost steps (steps done past
the checkpoint a later launch resumed from, so done again), idle (no launch
recording: between launches, and the end of a launch that was killed),
teardown (stopping the input pipeline after the last step) and other
(intermediate-gradient summaries). The tally lives in
`WORKDIR/goodput.json`, written by process 0 at every logged step and
save, so that it spans every launch.
"""

import contextlib
import json
import time

from absl import logging

from runtime import paths

RECORD_FILE = 'goodput.json'
# Activities of a launch and the cause each one's time counts under;
# 'steps' is goodput unless a later launch finds its steps lost.
CAUSES = {'imports': 'startup', 'distributed': 'startup', 'data': 'startup',
          'model': 'startup', 'tensorflow': 'startup',
          'restore': 'checkpoint', 'input': 'startup',
          'compile': 'compile', 'steps': 'steps', 'evaluation': 'evaluation',
          'checkpoint': 'checkpoint', 'teardown': 'teardown',
          'other': 'other'}
BADPUT = ('startup', 'compile', 'checkpoint', 'evaluation', 'lost_steps',
          'idle', 'teardown', 'other')


class Timeline:
  """One launch's wall time, every second given to one activity of
  CAUSES, from `start` (a `time.time()`; main.py takes it at its first
  line) on."""

  def __init__(self, start: float | None = None):
    self.start = time.time() if start is None else start
    self.activity = 'imports'
    self.last_switch = self.start
    self.seconds = dict.fromkeys(CAUSES, 0.0)

  def switch(self, activity: str) -> str:
    """Gives the time since the last switch to the current activity and
    makes `activity` current; returns the one it replaces."""
    now = time.time()
    self.seconds[self.activity] += now - self.last_switch
    previous, self.activity, self.last_switch = self.activity, activity, now
    return previous

  @contextlib.contextmanager
  def during(self, activity: str):
    """The block's time goes to `activity`, then back to the one before."""
    previous = self.switch(activity)
    try:
      yield
    finally:
      self.switch(previous)

  def startup_phases(self) -> dict:
    """Seconds by startup phase, to be read right after the first step:
    every activity so far with time, the one step as 'first step'."""
    self.switch(self.activity)
    phases = {name: seconds for name, seconds in self.seconds.items()
              if seconds and name != 'steps'}
    phases['first step'] = self.seconds['steps']
    return phases


def describe_startup(phases: dict) -> str:
  """The console line of a launch's startup."""
  return (f'Started in {sum(phases.values()):.1f} s: ' + ', '.join(
      f'{name} {seconds:.1f} s' for name, seconds in phases.items()) + '.')


class Goodput:
  """The run's tally across launches, kept in `WORKDIR/goodput.json`.

  Steps are goodput once a checkpoint at or after them is known complete;
  until then they are pending, by the step that ends them, and a launch
  that resumes from an earlier checkpoint counts the pending ones past it
  as lost. Orbax finishes a save before it starts the next, so a save's
  call completes the one before.
  """

  def __init__(self, workdir: str, timeline: Timeline, writes: bool):
    self.timeline = timeline
    self._file = paths.path(workdir) / RECORD_FILE
    self._writes = writes
    record = self._read()
    self.first_launch = record.get('first_launch', timeline.start)
    self.launches = record.get('launches', 0) + 1
    # Seconds by cause before this launch, pending steps apart.
    self._before = dict.fromkeys(('steps', *BADPUT), 0.0)
    self._before.update(record.get('seconds', {}))
    if 'updated' in record:  # the gap since the last launch's last record
      self._before['idle'] += max(timeline.start - record['updated'], 0.0)
    self._pending = [tuple(p) for p in record.get('pending_steps', [])]
    self._marked = 0.0  # this launch's step seconds pending or startup's
    self._first_step = 0.0
    self._saved_step = None

  def _read(self) -> dict:
    if not self._file.exists():
      return {}
    try:
      return json.loads(self._file.read_text())
    except ValueError as e:
      logging.warning('%s is unreadable (%s); goodput counts from this '
                      'launch on.', self._file, e)
      return {}

  def started(self, first_step_seconds: float) -> None:
    """The launch's first step took `first_step_seconds`: startup, since it
    holds what the first execution waits for (other processes still
    compiling, the devices' warm-up)."""
    self._first_step = first_step_seconds
    self._marked += first_step_seconds

  def restored(self, step: int) -> None:
    """The launch goes on from `step`: earlier launches' pending steps
    after it are lost, the others kept."""
    for end_step, seconds in self._pending:
      self._before['steps' if end_step <= step else 'lost_steps'] += seconds
    self._pending = []

  def mark(self, step: int) -> None:
    """The step time since the last mark ends at `step`: pending."""
    self.timeline.switch(self.timeline.activity)
    seconds = self.timeline.seconds['steps'] - self._marked
    self._marked += seconds
    self._pending.append((step, seconds))

  def saved(self, step: int) -> None:
    """A save of `step` has been started: the one before is complete."""
    self.mark(step)
    if self._saved_step is not None:
      self._keep_pending_until(self._saved_step)
    self._saved_step = step
    self._write()

  def finished(self) -> None:
    """Every save is complete: the pending steps up to the last are kept."""
    self.timeline.switch(self.timeline.activity)
    if self._saved_step is not None:
      self._keep_pending_until(self._saved_step)
    self._write()

  def scalars(self, step: int) -> dict:
    """The logged step's `goodput` and `badput/CAUSE`, recorded."""
    self.mark(step)
    self._write()
    return self.fractions()

  def _keep_pending_until(self, step: int) -> None:
    self._before['steps'] += sum(s for end, s in self._pending if end <= step)
    self._pending = [p for p in self._pending if p[0] > step]

  def _recorded_seconds(self) -> dict:
    """Seconds by cause up to the last switch, pending steps apart."""
    totals = dict(self._before)
    for activity, seconds in self.timeline.seconds.items():
      totals[CAUSES[activity]] += seconds
    totals['steps'] -= self._marked
    totals['startup'] += self._first_step
    return totals

  def _write(self) -> None:
    if self._writes:
      paths.replace_file(self._file, json.dumps({
          'first_launch': self.first_launch, 'launches': self.launches,
          'updated': self.timeline.last_switch,
          'seconds': self._recorded_seconds(),
          'pending_steps': self._pending}).encode())

  def fractions(self) -> dict:
    """`goodput` (pending steps counted as kept) and `badput/CAUSE`, as
    shares of the wall time from the first launch to the last switch."""
    totals = self._recorded_seconds()
    totals['steps'] += sum(seconds for _, seconds in self._pending)
    return shares(totals, self.timeline.last_switch - self.first_launch)

  def summary(self) -> str:
    """The last console line of a launch."""
    return describe(self.fractions(),
                    self.timeline.last_switch - self.first_launch,
                    self.launches)


def shares(seconds: dict, wall: float) -> dict:
  """`goodput` and `badput/CAUSE` of seconds by cause (and 'steps')."""
  return {'goodput': seconds['steps'] / wall,
          # A record of an older version may lack a cause: none of it.
          **{f'badput/{cause}': seconds.get(cause, 0.0) / wall
             for cause in BADPUT}}


def describe(fractions: dict, wall: float, launches: int) -> str:
  """`fractions` (of `Goodput.fractions`) as one line."""
  return (f'Goodput {fractions["goodput"]:.1%} of {wall:.1f} s since the '
          f"run's first launch ({launches} launches); badput: " +
          ', '.join(f'{cause.replace("_", " ")} '
                    f'{fractions["badput/" + cause]:.1%}'
                    for cause in BADPUT) + '.')


def describe_record(workdir: str) -> str:
  """The line of `describe` for the tally a finished run left in
  `workdir`."""
  record = json.loads((paths.path(workdir) / RECORD_FILE).read_text())
  wall = record['updated'] - record['first_launch']
  return describe(shares(record['seconds'], wall), wall, record['launches'])
