"""Eval-only mode: `python main.py --config=... --workdir=DIR --mode=eval`.

Evaluates the newest checkpoint of DIR (or, when DIR holds none, the weights
of `config.init_from`) over the whole eval split, every example once, writes
the eval_* tags at the checkpoint's step (0 for init_from) to DIR's
TensorBoard and prints them. It reads checkpoints only: none is written,
moved or removed.
"""

import functools
import os

import jax
import ml_collections

from runtime import checkpointing
from training import config_checks
from data import datasets
from training import mixed_precision
from weights import pretrained
from runtime import sharding
import train


def evaluate_checkpoint(config: ml_collections.ConfigDict,
                        workdir: str) -> dict:
  """The eval metrics of DIR's newest checkpoint, or of init_from."""
  # CLU (and TensorFlow under it) only here, as in train.train_and_evaluate.
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict(config.to_dict())
  config.steps_per_eval = -1  # the whole split
  train.validate_config(config)
  step_dir = pretrained.checkpoint_dir(workdir)
  try:
    if step_dir is None and not config.init_from:
      raise ValueError(f'nothing to evaluate: {workdir!r} holds no checkpoint '
                       'and config.init_from is not set; train first, or pass '
                       '--config.init_from')
    config_checks.check_workdir(workdir)
    dataset = datasets.create_dataset(config)
    mesh = train.create_mesh(config)
    graphdef, state, state_sharding, _ = train.create_sharded_train_state(
        config, dataset.info, 0.0, mesh)
    if step_dir is not None:
      step = int(os.path.basename(os.path.normpath(step_dir)))
      checkpointing.check_compatible(pretrained.saved_config(step_dir), config,
                                     step)
      checkpointing.check_same_classes(
          checkpointing.saved_class_names(step_dir),
          dataset.info.class_names, step)
      source, init_format = step_dir, 'checkpoint'
    else:
      step, source, init_format = 0, config.init_from, config.init_format
    params, model_state = pretrained.load(
        source, init_format, config, [state.params, state.model_state],
        new_head=False)
  except ValueError as e:
    raise train.ConfigError(str(e)) from None
  state = state.replace(params=params, model_state=model_state)

  batch_sharding = sharding.batch_sharding(mesh)
  dtype = mixed_precision.compute_dtype(config)
  eval_batch = next(dataset.eval_batches(config.batch_size, batch_sharding,
                                         dtype))
  compiled_eval_step, _ = train.compile_step(
      functools.partial(train.eval_step, graphdef=graphdef), state_sharding,
      batch_sharding, state, eval_batch,
      out_shardings=sharding.replicated(mesh), donate_state=False)
  metrics = train.evaluate(compiled_eval_step, state, dataset.eval_batches(
      config.batch_size, batch_sharding, dtype))
  metrics = {name: float(value) for name, value in metrics.items()}
  writer = metric_writers.create_default_writer(
      workdir, just_logging=jax.process_index() > 0)
  writer.write_scalars(step, metrics)
  writer.flush()
  if jax.process_index() == 0:
    print(f'Evaluated {source} (step {step}): ' + ', '.join(
        f'{name}={value:.6g}' for name, value in sorted(metrics.items())))
  return metrics
