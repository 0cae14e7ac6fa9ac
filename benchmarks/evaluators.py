"""Time of each evaluator per 1,000 images beside the main evaluation, and
of the few-shot solve for 1,000 classes.

The default config's model on the digits: the main evaluation, a
classification evaluator over a copy of the validation set, and a few-shot
probe on the digits (features of the 1,437 training and 360 test digits,
then one solve per shot count). Each evaluator runs once to warm up, then
`--repeats` times; the median is reported. The evaluators' steps are
compiled ahead of time, once, so later runs cannot recompile the model's
forward (a compiled step refuses other shapes instead).

The solve: random float32 features of 1,000 classes, `shots` examples each
(N = 1,000 x shots) and 10,000 test examples, of width D, solved on the
host as `fewshot.probe_accuracy` does (D > N: the N x N branch); the
median of `--repeats` solves.

  python benchmarks/evaluators.py [--repeats=3] [--solve_dims=384,2048]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import jax
import ml_collections
import numpy as np

from configs import default
from data import datasets
from evaluators import classification
from evaluators import fewshot
from evaluators import registry
import input_pipeline
import models
from runtime import console
from runtime import sharding
import train
from training import run_state

flags.DEFINE_integer('repeats', 3, 'Timed runs of each evaluator.')
flags.DEFINE_list('solve_dims', ['384', '2048'], 'Feature widths D.')
flags.DEFINE_list('solve_shots', ['1', '5', '25'], 'Shots per class.')
FLAGS = flags.FLAGS

NUM_CLASSES = 1000
TEST_EXAMPLES = 10_000


def median_seconds(fn, repeats: int) -> float:
  fn()  # warm: pipelines started, nothing compiled here
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def evaluator_rows(repeats: int) -> list[tuple[str, int, float]]:
  """(evaluator, images read per run, median seconds per run)."""
  config = default.get_config()
  config.evals.copy = ml_collections.ConfigDict(
      dict(type='classification', dataset='digits'))
  config.evals.probe = ml_collections.ConfigDict(
      dict(type='fewshot', datasets={'digits': 'digits'}))
  dataset = datasets.create_dataset(
      input_pipeline.DataSource.from_config(config))
  mesh = sharding.create_mesh(config.mesh)
  dtype = models.compute_dtype(config)
  graphdef, state, state_sharding, _ = run_state.create_sharded_train_state(
      config, dataset.info, 0.0, mesh, dtype=dtype)
  context = train.evaluator_context(config, dataset.info, mesh,
                                    graphdef, state, state_sharding, dtype)
  runs = {'main evaluation': classification.Evaluator(
      dataset, mesh, graphdef, state, state_sharding,
      batch_size=config.batch_size, dtype=context.dtype)}
  runs.update({name: scheduled.evaluator for name, scheduled in
               registry.create_all(config.evals, context).items()})
  digits = datasets.load_digits()
  images = {'main evaluation': len(digits.eval_labels),
            'copy': len(digits.eval_labels),
            'probe': len(digits.train_labels) + len(digits.eval_labels)}
  return [(name, images[name],
           median_seconds(lambda e=evaluator: e.run(state), repeats))
          for name, evaluator in runs.items()]


def solve_seconds(dim: int, shots: int) -> float:
  rng = np.random.default_rng(0)
  train_y = np.repeat(np.arange(NUM_CLASSES), shots)
  train_x = rng.normal(size=(len(train_y), dim)).astype(np.float32)
  test_x = rng.normal(size=(TEST_EXAMPLES, dim)).astype(np.float32)
  test_y = rng.integers(0, NUM_CLASSES, TEST_EXAMPLES)
  times = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    fewshot.probe_accuracy(train_x, train_y, test_x, test_y, NUM_CLASSES,
                           2.0**10)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv):
  del argv
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  print(f'{jax.device_count()} {jax.devices()[0].platform} device(s), '
        f'{os.cpu_count()} CPU cores.\n')
  print('| evaluator | images per run | seconds per run | ms per 1,000 '
        'images |\n| --- | --- | --- | --- |')
  for name, images, seconds in evaluator_rows(FLAGS.repeats):
    print(f'| {name} | {images} | {seconds:.3f} | '
          f'{1000 * seconds / images * 1000:.0f} |')
  print('\n| D | shots | N | branch | solve seconds |\n'
        '| --- | --- | --- | --- | --- |')
  for dim in map(int, FLAGS.solve_dims):
    for shots in map(int, FLAGS.solve_shots):
      n = NUM_CLASSES * shots
      branch = 'D x D' if n >= dim + 1 else 'N x N'
      print(f'| {dim} | {shots} | {n} | {branch} | '
            f'{solve_seconds(dim, shots):.2f} |')


if __name__ == '__main__':
  app.run(main)
