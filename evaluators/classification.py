"""Evaluation: loss, top-1 and top-5 accuracy over the eval split.

An `Evaluator` (big_vision's evaluators are the shape) is built once per run
with what it needs and compiles its own step; `run(state)` returns the
metrics. The trainer runs one on its eval schedule, `--mode=eval`
(eval_checkpoint.py) one over a checkpoint, and `create` one per
classification evaluator of `config.evals`.
"""

import functools

import jax
import jax.numpy as jnp

from evaluators import base
from evaluators import common
from evaluators import eval_splits
from training import distillation
from training import losses


def eval_step(state, batch, *, apply_fn):
  """Sums of loss, top-1 and top-5 correct predictions over the unmasked
  examples; `apply_fn(state, images)` gives the logits. With the teacher's
  top-1 classes in the batch (`teacher.EvalPredictions`), the student's
  agreement with it too."""
  logits = apply_fn(state, batch['image'])
  mask = batch['mask'].astype(jnp.float32)
  labels = batch['label']
  _, top5 = jax.lax.top_k(logits, min(5, logits.shape[-1]))
  teacher = ({} if 'teacher_top1' not in batch else
             distillation.agreement_sums(logits, batch['teacher_top1'], mask))
  return teacher | {
      'loss': jnp.sum(losses.cross_entropy(logits, labels) * mask),
      'correct': jnp.sum((top5[:, 0] == labels) * mask),
      'correct_top5': jnp.sum(jnp.any(top5 == labels[:, None], axis=-1) *
                              mask),
      'examples': jnp.sum(mask),
  }


class Evaluator(base.Evaluator):
  """The eval metrics of a train state over `dataset`'s eval batches (the
  first `steps` of them when > 0), by one eval step compiled here for the
  state's shardings and the mesh; tagged eval_* (the main evaluation) or,
  for the evaluator `name`, eval_NAME_*. A data set of
  `teacher.EvalPredictions` adds the student's agreement with the
  teacher."""

  SAME_FOR_MOVING_AVERAGE = ('examples',)

  def __init__(self, dataset, mesh, graphdef, state, state_sharding, *,
               batch_size: int, dtype, steps: int = -1, name: str = ''):
    super().__init__(mesh, batch_size=batch_size, dtype=dtype, tag_name=name)
    self._dataset, self._steps = dataset, steps
    self.compiled_step = self.compile(
        functools.partial(eval_step, apply_fn=common.apply_fn(graphdef)),
        state, state_sharding, dataset)

  def run(self, state, ema: bool = False) -> dict:
    """`eval_loss`, `eval_accuracy`, `eval_top5_accuracy` and
    `eval_examples` (how many examples were counted) of `state` (eval_ema_*
    with `ema`: its weights are a moving average), and, when it holds a
    moving average, `eval_ema_loss`, `eval_ema_accuracy` and
    `eval_ema_top5_accuracy` of those weights (by the same program); with
    the evaluator's name after `eval_` or `eval_ema_`. With a teacher,
    `eval_teacher_agreement` (and `eval_ema_teacher_agreement`) too."""
    return super().run(state, ema)

  def _metrics(self, state, ema: bool) -> dict:
    totals = self.totals(self.compiled_step, state, self._dataset,
                         self._steps)
    examples = max(float(totals['examples']), 1.0)
    prefix = self.prefix(ema)
    return {f'{prefix}loss': totals['loss'] / examples,
            f'{prefix}accuracy': totals['correct'] / examples,
            f'{prefix}top5_accuracy': totals['correct_top5'] / examples,
            f'{prefix}examples': totals['examples'],
            **distillation.agreement_metrics(totals, examples, prefix)}


def create(name: str, settings: dict, context):
  """Classification evaluator `name` (`registry.create`): `settings`'
  data set and split (`eval_splits.classification_split`), with its
  class map, or scored by ReaL's label sets."""
  data = eval_splits.classification_split(name, settings, context)
  if settings['labels'] == 'real':
    from evaluators import real_labels  # pylint: disable=g-import-not-at-top
    return real_labels.create(name, settings['real_labels_file'], data,
                              context)
  return Evaluator(data, context.mesh, context.graphdef, context.state,
                   context.state_sharding, batch_size=context.batch_size,
                   dtype=context.dtype, name=name)
