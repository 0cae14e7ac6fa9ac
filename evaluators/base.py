"""What every evaluator does alike: compile its step for the run's state and
mesh, feed it a data set's evaluation batches exactly once (the last one
padded, the padding masked out), and evaluate a moving average of the
weights beside the weights. An evaluator gives its step and turns the
step's outputs into its metrics (`_metrics`)."""

import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from evaluators import common
from runtime import sharding
from training import compiling


class Evaluator:
  """The base of the evaluators: a step `step(state, batch)` compiled by
  `compile` for the mesh's batch sharding, its outputs replicated on every
  device; `totals` and `examples` run it over a data set's batches. Tags
  are `KIND_[ema_][NAME_]METRIC` (`common.prefix`); the metrics in
  `SAME_FOR_MOVING_AVERAGE` are not repeated for a moving average (the
  same examples, the same teacher)."""

  KIND = 'eval'
  SAME_FOR_MOVING_AVERAGE = ()

  def __init__(self, mesh, *, batch_size: int, dtype, tag_name: str = ''):
    self._mesh = mesh
    self._batch_sharding = sharding.batch_sharding(mesh)
    self._batch_size, self._dtype = batch_size, dtype
    self._tag_name = tag_name
    self.compile_seconds = 0.0  # of every step compiled here

  def compile(self, step: Callable, state, state_sharding, data):
    """`step` compiled for `state` (placed as `state_sharding`; any
    pytree, e.g. the train state with arrays of the evaluator's own) and
    the batches of `data` (every data set the step reads has their
    shape)."""
    compiled, seconds = compiling.compile_step(
        step, state_sharding, self._batch_sharding, state,
        next(self.batches(data)), out_shardings=sharding.replicated(
            self._mesh), donate_state=False)
    self.compile_seconds += seconds
    return compiled

  def batches(self, data, steps: int = -1):
    """`data`'s evaluation batches on the mesh: the first `steps` (> 0),
    else the whole split once."""
    batches = data.eval_batches(self._batch_size, self._batch_sharding,
                                self._dtype)
    return itertools.islice(batches, steps) if steps > 0 else batches

  def totals(self, step, state, data, steps: int = -1) -> dict:
    """The sums `step` gives of each batch of `data` (sums over the
    unmasked examples), added up, on the host."""
    totals = None
    for sums in common.step_outputs(step, state, self.batches(data, steps)):
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    return jax.device_get(totals)

  def examples(self, step, state, data) -> dict:
    """The outputs `step` gives of each example of `data` (it passes on
    the batch's 'index' and 'mask'), padding left out, in the split's
    order: every example once, the same on any number of processes."""
    parts = []
    for outputs in common.step_outputs(step, state, self.batches(data)):
      outputs = jax.device_get(outputs)
      mask = outputs['mask'].astype(bool)
      parts.append({key: value[mask] for key, value in outputs.items()
                    if key != 'mask'})
    joined = {key: np.concatenate([part[key] for part in parts])
              for key in parts[0]}
    order = np.argsort(joined['index'], kind='stable')
    return {key: value[order] for key, value in joined.items()}

  def prefix(self, ema: bool) -> str:
    return common.prefix(self.KIND, self._tag_name, ema)

  def run(self, state, ema: bool = False) -> dict:
    """The tagged metrics of `state`'s weights (a moving average's with
    `ema`: --mode=eval --ema) and, when it holds a moving average, of that
    too."""
    metrics = common.with_moving_average(self._metrics, state, ema)
    if state.ema is not None:
      for metric in self.SAME_FOR_MOVING_AVERAGE:
        metrics.pop(self.prefix(True) + metric, None)
    return metrics

  def _metrics(self, state, ema: bool) -> dict:
    """The metrics of `state`'s weights, tagged `self.prefix(ema)`..."""
    raise NotImplementedError
