"""`--mode=eval` (`python main.py --config=... --workdir=DIR --mode=eval`):
evaluates the newest checkpoint of DIR, with the config it was trained with
(or, when DIR holds none, the weights of `config.init_from`), over the
whole eval split, every example once, with the main evaluation and each of
`config.evals`; writes the eval_* tags at the checkpoint's step (0 for
init_from) to DIR's TensorBoard and prints them, one line per evaluator.
It reads checkpoints only: none is written, moved or removed.
"""

import sys

import jax
import ml_collections

from checks import config_values
from checks import data_checks
from checks import workdir_access
from data import datasets
from evaluators import classification
from evaluators import registry
import input_pipeline
import models
from runtime import checkpointing
from runtime import config_error
from runtime import sharding
import train
from training import run_state
from training import teacher as teacher_lib


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
  with config_error.as_config_error():  # e.g. a bucket that is not there
    step_dir = checkpointing.checkpoint_dir(workdir,
                                            config.restore_retry_seconds)
  if step_dir is None and not config.init_from:
    raise config_error.ConfigError(
        f'nothing to evaluate: {workdir!r} holds no checkpoint and '
        'config.init_from is not set; train first, or pass --config.init_from')
  config = (ml_collections.ConfigDict(config.to_dict()) if step_dir is None
            else run_state.evaluated_config(config, set(overridden), step_dir))
  config.steps_per_eval = -1  # the whole split
  config_values.validate_config(config)
  with config_error.as_config_error():
    workdir_access.check_workdir(events_dir or workdir)  # what it writes
    data_checks.check_data(config)
    dataset = datasets.create_dataset(
        input_pipeline.DataSource.from_config(config))
    mesh = sharding.create_mesh(config.mesh, config.step_mode)
  run = run_state.create(config, dataset.info, mesh, workdir,
                         dtype=models.compute_dtype(config),
                         new_head=False, abstract=step_dir is not None)
  if step_dir is None:
    run, source = run_state.weights_alone(run), config.init_from
  else:
    run = run_state.restore_checkpoint(run, step_dir, config,
                                       dataset.info.class_names, ema=ema)
    source = step_dir
  context = train.evaluator_context(config, dataset.info, mesh,
                                    run.graphdef, run.state, run.sharding,
                                    run.dtype)
  evaluated = teacher_lib.eval_data(dataset, run.teacher, mesh,
                                    batch_size=config.batch_size,
                                    dtype=context.dtype)
  evaluators = {'': classification.Evaluator(
      evaluated, mesh, run.graphdef, run.state, run.sharding,
      batch_size=config.batch_size, dtype=context.dtype)}
  evaluators.update({name: scheduled.evaluator for name, scheduled in
                     registry.create_all(config.evals, context).items()})
  writer = metric_writers.create_default_writer(
      events_dir or workdir, just_logging=jax.process_index() > 0)
  return run_evaluators(evaluators, run, ema,
                        evaluated.metrics if run.teacher else {}, source,
                        writer)


def run_evaluators(evaluators: dict, run, ema: bool, teacher_metrics: dict,
                   source: str, writer) -> dict:
  """Every metric of `evaluators` (by name; '' the main evaluation, beside
  it `teacher_metrics`) on `run`'s weights or, with `ema`, their moving
  average: written at the run's step, and a line each on stdout naming
  `source`."""
  step = run.step or 0
  metrics = {}
  for name, evaluator in evaluators.items():
    results = {tag: float(value)
               for tag, value in evaluator.run(run.state, ema).items()}
    if not name:
      results.update(teacher_metrics)
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
