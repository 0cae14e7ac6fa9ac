"""`profile`: one profiler trace per (re)start, of the steps just after it."""

import glob
import os

from jax.profiler import ProfileData

from training import reporting
import train
from helpers import tiny_config


def traced_train_steps(trace_path: str) -> list[int]:
  """Step numbers of the `train` step annotations recorded in a trace."""
  steps = set()
  for plane in ProfileData.from_file(trace_path).planes:
    for line in plane.lines:
      for event in line.events:
        if event.name == 'train':
          steps.add(dict(event.stats)['step_num'])
  return sorted(steps)


def test_each_start_traces_the_steps_after_it_into_the_workdir(tmp_path):
  """A run of 4 steps, then the same run resumed from its checkpoint at
  step 4 to step 12: a trace of 2 steps, 1 step after each start."""
  profiled = dict(profile=True, profile_delay_steps=1, profile_num_steps=2,
                  eval_every_steps=4, checkpoint_every_steps=4)
  train.train_and_evaluate(tiny_config(num_train_steps=4, **profiled),
                           str(tmp_path))
  resumed = train.train_and_evaluate(
      tiny_config(num_train_steps=12, **profiled), str(tmp_path))
  assert int(resumed.step) == 12
  # One directory per trace, named by the time it started.
  traces = sorted(glob.glob(str(tmp_path / 'plugins' / 'profile' / '*' /
                                '*.xplane.pb')))
  assert len(traces) == 2
  assert traced_train_steps(traces[0]) == [2, 3]
  assert traced_train_steps(traces[1]) == [6, 7]
  assert len({os.path.dirname(t) for t in traces}) == 2


def test_no_trace_is_started_that_the_run_ends_before_stopping(tmp_path):
  config = tiny_config(profile=True, profile_delay_steps=2,
                       profile_num_steps=3)
  delay, traced = config.profile_delay_steps, config.profile_num_steps
  assert reporting.profile_hooks(str(tmp_path), 10, 14, delay, traced) == []
  assert len(reporting.profile_hooks(str(tmp_path), 10, 15, delay,
                                     traced)) == 1
