"""Evaluation: loss, top-1 and top-5 accuracy over the eval split.

An `Evaluator` (big_vision's evaluators are the shape) is built once per run
with what it needs and compiles its own step; `run(state)` returns the
metrics. The trainer runs one on its eval schedule, and `create` one per
classification evaluator of `config.evals`; `--mode=eval`
(`python main.py --config=... --workdir=DIR --mode=eval`) runs them through
`evaluate_checkpoint`: it evaluates the newest checkpoint of DIR, with the
config it was trained with (or, when DIR holds none, the weights of
`config.init_from`), over the whole eval split, every example once, writes
the eval_* tags at the checkpoint's step (0 for init_from) to DIR's
TensorBoard and prints them, one line per evaluator. It reads checkpoints
only: none is written, moved or removed.
"""

import functools
import sys

import jax
import jax.numpy as jnp
import ml_collections

from evaluators import base
from evaluators import common
from evaluators import eval_splits
from evaluators import registry
from runtime import checkpointing
from training import config_checks
from training import data_checks
from data import datasets
from training import distillation
from training import losses
from runtime import sharding
from training import run_state
from training import teacher as teacher_lib


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


def evaluate_checkpoint(config: ml_collections.ConfigDict, workdir: str,
                        events_dir: str | None = None, ema: bool = False,
                        overridden=()) -> dict:
  """The eval metrics of DIR's newest checkpoint, or of init_from, written
  to the event files in `events_dir` (default: the workdir); with `ema`,
  of the checkpoint's moving average of the weights (eval_ema_*).

  `config` is the command line's, `overridden` the keys it sets: a
  checkpoint is evaluated with the config it was trained with, changed
  only in what is evaluated (`run_state.evaluated_config`); init_from with
  `config` itself."""
  # CLU (and TensorFlow under it) only here, as in the trainer.
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  with config_checks.as_config_error():  # e.g. a bucket that is not there
    step_dir = checkpointing.checkpoint_dir(workdir,
                                            config.restore_retry_seconds)
  if step_dir is None and not config.init_from:
    raise config_checks.ConfigError(
        f'nothing to evaluate: {workdir!r} holds no checkpoint and '
        'config.init_from is not set; train first, or pass --config.init_from')
  config = (ml_collections.ConfigDict(config.to_dict()) if step_dir is None
            else run_state.evaluated_config(config, set(overridden), step_dir))
  config.steps_per_eval = -1  # the whole split
  config_checks.validate_config(config)
  with config_checks.as_config_error():
    config_checks.check_workdir(events_dir or workdir)  # what it writes
    data_checks.check_data(config)
    dataset = datasets.create_dataset(config)
    mesh = sharding.create_mesh(config.mesh, config.step_mode)
  run = run_state.create(config, dataset.info, mesh, workdir,
                         new_head=False, abstract=step_dir is not None)
  if step_dir is None:
    run, source = run_state.weights_alone(run), config.init_from
  else:
    run = run_state.restore_checkpoint(run, step_dir, config,
                                       dataset.info.class_names, ema=ema)
    source = step_dir
  context = registry.Context.of_run(config, dataset.info, mesh,
                                    run.graphdef, run.state, run.sharding)
  evaluated = teacher_lib.eval_data(dataset, run.teacher, mesh,
                                    batch_size=config.batch_size,
                                    dtype=context.dtype)
  evaluators = {'': Evaluator(evaluated, mesh, run.graphdef, run.state,
                              run.sharding, batch_size=config.batch_size,
                              dtype=context.dtype)}
  evaluators.update({name: scheduled.evaluator for name, scheduled in
                     registry.create_all(config.evals, context).items()})
  writer = metric_writers.create_default_writer(
      events_dir or workdir, just_logging=jax.process_index() > 0)
  step = run.step or 0
  metrics = {}
  for name, evaluator in evaluators.items():  # one line each
    results = {tag: float(value)
               for tag, value in evaluator.run(run.state, ema).items()}
    if not name and run.teacher:  # its accuracy beside the main evaluation
      results.update(evaluated.metrics)
    writer.write_scalars(step, results)
    # The writer logs from a thread of its own: its line is out before the
    # result's, which is written whole and flushed at once, so that with
    # stdout and stderr redirected to one file neither cuts into the other.
    writer.flush()
    if jax.process_index() == 0:
      sys.stdout.write(
          f'Evaluated {source} (step {step}){" " + name if name else ""}: '
          + ', '.join(f'{tag}={value:.6g}'
                      for tag, value in sorted(results.items())) + '\n')
      sys.stdout.flush()
    metrics.update(results)
  writer.flush()
  return metrics
