"""What a run reports as it trains: CLU's metric writer (the log and the
event files, with the config as hparams), a logged step's console line and
the profile.

CLU (and TensorFlow under it) is imported only when these are made: models
and the compiled steps import without them, e.g. on a machine that runs
benchmarks only.
"""

import concurrent.futures
import datetime
import importlib
import time

from absl import logging
import jax
import jax.numpy as jnp

from runtime import goodput
from training import throughput

# The losses of a logged step's console line (distillation: its parts).
CONSOLE_LOSSES = ('train_loss', 'train_base_loss', 'train_distillation_loss')


def import_writers() -> None:
  """Imports CLU's writers and periodic actions, and TensorFlow under them
  (seconds: a startup phase of its own, unless a TFDS or image-folder data
  set imported TensorFlow already)."""
  for module in ('clu.metric_writers', 'clu.periodic_actions'):
    importlib.import_module(module)


# `start_importing_writers`'s import, once started.
_writers_imported: concurrent.futures.Future | None = None


def start_importing_writers() -> concurrent.futures.Future:
  """`import_writers` on a thread of its own, started once per process:
  its seconds pass while the accelerator opens and the state is made
  (XLA and most of an import release Python's lock)."""
  global _writers_imported
  if _writers_imported is None:
    pool = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix='import_writers')
    _writers_imported = pool.submit(import_writers)
    pool.shutdown(wait=False)
  return _writers_imported


# Whether `create_writer` made a writer in this process: its writes may
# wait in memory for the import.
_writer_made = False


def writers_importing_unused() -> bool:
  """Whether `start_importing_writers`'s import is still under way and no
  writer waits for it: a launch that fails now (a bad config, a refused
  resume) has written nothing, and would otherwise wait out the import,
  seconds, at its exit (`console.exit_at_once` does not)."""
  return (_writers_imported is not None and not _writers_imported.done()
          and not _writer_made)


def create_writer(hparams: dict, events_dir: str, start_step: int,
                  timeline: goodput.Timeline | None = None) -> 'PendingWriter':
  """CLU's default writer: metrics to the log and, on process 0, to the
  event files in `events_dir`; a run's first start writes `hparams` (the
  config's values, TensorBoard's HPARAMS tab; main.py keeps its log line,
  over a thousand characters, off the console). Made once TensorFlow has
  imported (`PendingWriter`); a wait for that import goes to `timeline`'s
  'tensorflow'."""
  global _writer_made
  _writer_made = True

  def make_writer():
    from clu import metric_writers  # pylint: disable=g-import-not-at-top
    writer = metric_writers.create_default_writer(
        events_dir, just_logging=jax.process_index() > 0)
    if start_step == 0:
      writer.write_hparams(hparams)
    return writer
  return PendingWriter(start_importing_writers(), make_writer, timeline)


class PendingWriter:
  """A metric writer made by `make_writer` once `imported` is done: until
  then its writes wait in memory, in order, so that a launch's first steps
  run while TensorFlow still imports (about 15 s on a TPU host, longer
  than a start from the compilation cache takes to make the state).
  `flush` and `close` wait for the import: what they return after is on
  disk."""

  def __init__(self, imported: concurrent.futures.Future, make_writer,
               timeline: goodput.Timeline | None = None):
    self._imported, self._make_writer = imported, make_writer
    self._timeline = timeline
    self._writer = None
    self._pending = []

  def _made(self, wait: bool):
    """The writer, made now if the import is done (or waited for)."""
    if self._writer is None and (wait or self._imported.done()):
      if not self._imported.done() and self._timeline is not None:
        with self._timeline.during('tensorflow'):
          self._imported.result()
      self._imported.result()  # the import's error, if it failed
      self._writer = self._make_writer()
      for method, args in self._pending:
        getattr(self._writer, method)(*args)
      self._pending.clear()
    return self._writer

  def _write(self, method: str, *args):
    if (writer := self._made(wait=False)) is None:
      self._pending.append((method, args))
    else:
      getattr(writer, method)(*args)

  def write_scalars(self, step: int, scalars):
    self._write('write_scalars', step, scalars)

  def write_images(self, step: int, images):
    self._write('write_images', step, images)

  def write_histograms(self, step: int, arrays, num_buckets=None):
    self._write('write_histograms', step, arrays, num_buckets)

  def flush(self):
    self._made(wait=True).flush()

  def close(self):
    self._made(wait=True).close()


def create_hooks(logdir: str, start_step: int, num_steps: int, *,
                 profile: bool, profile_delay_steps: int,
                 profile_num_steps: int) -> list:
  """The periodic actions of process 0: the profile, when `profile` asks
  for one; none on the other processes."""
  if jax.process_index() > 0 or not profile:
    return []
  return profile_hooks(logdir, start_step, num_steps,
                       profile_delay_steps, profile_num_steps)


class StepConsole:
  """A logged step's one console line (process 0): its losses, the steps'
  rate, images/s, TFLOP/s per device and MFU (MaxText's figures), and the
  time left at this launch's pace so far (evaluations and saves included).
  TensorBoard gets every scalar; `runtime/console.py`
  keeps CLU's line of them off the console."""

  def __init__(self, start_step: int, num_steps: int):
    self._start_step, self._num_steps = start_step, num_steps
    self._started = time.monotonic()

  def log(self, step: int, summary: dict) -> None:
    if jax.process_index() > 0:
      return
    per_step = (time.monotonic() - self._started) / (step - self._start_step)
    left = datetime.timedelta(seconds=round(per_step *
                                            (self._num_steps - step)))
    losses = ', '.join(f'{key}={summary[key]:.4g}' for key in CONSOLE_LOSSES
                       if key in summary)
    logging.info('[%d] %s, %.3g steps/s, %s, %s left', step, losses,
                 summary['steps_per_second'],
                 ', '.join(throughput.console_fields(summary)), left)


def profile_hooks(logdir: str, start_step: int, num_steps: int,
                  profile_delay_steps: int, profile_num_steps: int) -> list:
  """CLU's Profile set for one trace of `profile_num_steps` steps that
  starts `profile_delay_steps` steps after this (re)start, written under
  `logdir/plugins/profile/`; none when fewer steps are left (the trace
  would never be stopped and written)."""
  from clu import periodic_actions  # pylint: disable=g-import-not-at-top
  first = start_step + profile_delay_steps
  if first + profile_num_steps > num_steps:
    logging.warning('Not profiling: %d steps left, fewer than the %d of '
                    'profile_delay_steps + profile_num_steps.',
                    num_steps - start_step,
                    profile_delay_steps + profile_num_steps)
    return []
  return [periodic_actions.Profile(
      logdir=logdir, num_profile_steps=profile_num_steps,
      profile_duration_ms=None, first_profile=first, every_secs=None)]


def train_summary(train_metrics: list, steps: int, seconds: float,
                  batch_size: int, step_flops: float) -> dict:
  """The logged means of `train_metrics` (one dict per step; a count of
  skipped steps; the last step's learning rate), with steps/s, examples/s,
  FLOP/s and MFU."""
  # nanmean: a step skipped as non-finite has a NaN loss.
  summary = jax.tree.map(lambda *x: jnp.nanmean(jnp.stack(x)),
                         *train_metrics)
  if 'skipped_steps' in summary:  # a count, not a mean
    summary['skipped_steps'] = sum(m['skipped_steps'] for m in train_metrics)
  # The rate the logged step used: a mean over the window lags the
  # schedule (half the reached rate over a warmup).
  summary['learning_rate'] = train_metrics[-1]['learning_rate']
  summary = {f'train_{k}': v for k, v in jax.device_get(summary).items()}
  summary['steps_per_second'] = steps / seconds
  summary.update(throughput.throughput_metrics(
      summary['steps_per_second'], batch_size, step_flops, jax.devices()))
  return summary


def report_startup(tally: goodput.Goodput, writer, step: int,
                   metrics) -> None:
  """Once the launch's first step is done: its startup by phase on the
  console, `startup_seconds` on TensorBoard, the tally told."""
  jax.block_until_ready(metrics)
  phases = tally.timeline.startup_phases()
  tally.started(phases['first step'])
  logging.info(goodput.describe_startup(phases))
  writer.write_scalars(step, {'startup_seconds': sum(phases.values())})
