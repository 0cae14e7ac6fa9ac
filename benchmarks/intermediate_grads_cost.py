"""What an intermediate-gradient summary costs next to an ordinary step.

  python benchmarks/intermediate_grads_cost.py --config=configs/default.py \
      --variants='num_layers=8;model=ViT_Ti16,image_size=32,scan_unroll=1'

For each variant: the median time of the compiled train step, of the
compiled summary step, and of a whole summary as the trainer writes it
(summary step, transfer, histograms, heatmap and event-file writes), and
the compile seconds of both steps. Variants as in `step_time.py`.
"""

import functools
import os
import sys
import tempfile
import time

from absl import app
from absl import flags
from clu import metric_writers
import jax
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import input_pipeline
import models
from training import compiling
from training import intermediate_grads
from data import datasets  # pylint: disable=g-import-not-at-top
from training import optimizer
from runtime import console
from runtime import sharding
from training import run_state
import train
from training import update
import variants

config_flags.DEFINE_config_file('config', None, 'Config file.')
flags.DEFINE_string('variants', '', "';'-separated override sets.")
flags.DEFINE_integer('steps', 10, 'Timed repetitions of each step.')
FLAGS = flags.FLAGS


def median_seconds(fn, repetitions: int) -> float:
  """Median wall time of `fn()` (which waits for its result), after a
  warm-up call."""
  fn()
  times = []
  for _ in range(repetitions):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def measure_variant(config, repetitions: int) -> dict:
  dataset = datasets.create_dataset(
      input_pipeline.DataSource.from_config(config))
  lr_fn = optimizer.learning_rate_schedule(config, 1000, 10)
  mesh = sharding.create_mesh(config.mesh, config.step_mode)
  dtype = models.compute_dtype(config)
  graphdef, state, state_sharding, tx = run_state.create_sharded_train_state(
      config, dataset.info, lr_fn, mesh, dtype=dtype)
  batch_sharding = sharding.batch_sharding(mesh)
  batch = next(dataset.train_batches(config.batch_size, 0, 0, batch_sharding,
                                     dtype))
  step_kwargs = train.train_step_kwargs(config, graphdef, tx, lr_fn)
  step_fn = functools.partial(update.train_step, **step_kwargs)
  # Not donated here, so the same state serves every repetition.
  train_step, train_compile = compiling.compile_step(
      step_fn, state_sharding, batch_sharding, state, batch,
      out_shardings=(state_sharding, sharding.replicated(mesh)),
      donate_state=False)
  with tempfile.TemporaryDirectory() as workdir:
    writer = metric_writers.create_default_writer(workdir)
    start = time.perf_counter()
    summaries = intermediate_grads.compiled_summaries(
        step_kwargs, 1, state, batch, state_sharding, batch_sharding, writer)
    summary_compile = time.perf_counter() - start
    steps = iter(range(1, 10**9))
    result = {
        'train_ms': median_seconds(
            lambda: jax.block_until_ready(train_step(state, batch)),
            repetitions),
        'summary_step_ms': median_seconds(
            lambda: jax.block_until_ready(
                summaries.compiled_summary_step(state, batch)), repetitions),
        'summary_written_ms': median_seconds(
            lambda: summaries.write(next(steps), state, batch), repetitions),
    }
    writer.close()
  result = {k: 1000 * v for k, v in result.items()}
  result.update(train_compile_s=train_compile, summary_compile_s=summary_compile)
  return result


def main(_):
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  print(f'{jax.devices()[0].device_kind}, {jax.device_count()} device(s)')
  print('| variant | train step ms | summary step ms (x train) | '
        'summary written ms (x train) | compile s train / summary |')
  print('| --- | ---: | ---: | ---: | ---: |')
  for variant, config in variants.configs(FLAGS.config, FLAGS.variants):
    r = measure_variant(config, FLAGS.steps)
    print(f'| {variant} | {r["train_ms"]:.1f} | '
          f'{r["summary_step_ms"]:.1f} '
          f'({r["summary_step_ms"] / r["train_ms"]:.2f}) | '
          f'{r["summary_written_ms"]:.1f} '
          f'({r["summary_written_ms"] / r["train_ms"]:.2f}) | '
          f'{r["train_compile_s"]:.1f} / {r["summary_compile_s"]:.1f} |',
          flush=True)


if __name__ == '__main__':
  app.run(main)
