"""What the evaluators share: the model's apply functions, the features
step, the loop over an evaluation's batches, tag names, and evaluating a
moving average beside the weights."""

from typing import Callable, Iterator

from flax import nnx
import jax

import input_pipeline


def apply_fn(graphdef, method: str = '__call__') -> Callable:
  """(state, images) -> the model's `method` of the images in evaluation
  mode: `__call__` gives the logits, `features` the pooled pre-logit
  features (N, D)."""
  def apply(state, images):
    model = nnx.merge(graphdef, state.params, state.model_state)
    return getattr(model, method)(images, train=False)
  return apply


def features_step(state, batch, *, features_fn):
  """Each example's features (`features_fn(state, images)`), with its
  label, position and mask."""
  return {'features': features_fn(state, batch['image']),
          'label': batch['label'], 'index': batch['index'],
          'mask': batch['mask']}


def step_outputs(step: Callable, state, batches: Iterator) -> Iterator:
  """`step(state, batch)` of every batch, one step at a time.

  The steps do not depend on each other, so XLA may run several at once;
  each gathers or all-reduces across processes with the same instruction of
  the same program, and two-process CPU runs were seen to hang with both
  processes waiting on such a step. Waiting for the previous outputs
  orders them.
  """
  outputs = None
  for batch in input_pipeline.prefetch(batches):
    if outputs is not None:
      jax.block_until_ready(outputs)
    outputs = step(state, batch)
    yield outputs


def prefix(kind: str, name: str, ema: bool) -> str:
  """The tags' prefix: 'eval_', 'eval_ema_', 'eval_NAME_',
  'eval_ema_NAME_' (kind 'eval'), likewise for 'fewshot' and 'knn'."""
  return f'{kind}_' + ('ema_' if ema else '') + (f'{name}_' if name else '')


def with_moving_average(metrics: Callable[[object, bool], dict], state,
                        ema: bool = False) -> dict:
  """`metrics(state, ema)` of the state's weights (a moving average when
  `ema`: --mode=eval --ema) and, when the state holds a moving average,
  `metrics(that, True)` beside them, by the same compiled program."""
  result = metrics(state, ema)
  if state.ema is not None:
    result.update(metrics(state.replace(**state.ema), True))
  return result
