"""Gradient accumulation's cost: one train step over k micro-batches of b
examples against one over a single batch of k x b, as a table.

  python3 benchmarks/grad_accum.py --config=configs/default.py \
      --micro_batch=16 --accum_steps=4 --variants='model=SmallResNet'

`--config`, `--variants` (';'-separated sets of ','-separated KEY=VALUE
overrides) and `--steps` are benchmarks/step_time.py's. Memory is from
XLA's `memory_analysis()` of the compiled step: its temporaries
(activations, gradients, workspace), and the peak of its buffers:
arguments and outputs (parameters, optimizer state, the batch; the donated
state counted once) plus temporaries.
"""

import os
import sys

from absl import app
from absl import flags
import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import console  # pylint: disable=g-import-not-at-top
import step_time  # pylint: disable=g-import-not-at-top  (and its flags)
import variants

flags.DEFINE_integer('micro_batch', 16, 'Examples per micro-batch (b).')
flags.DEFINE_integer('accum_steps', 4, 'Micro-batches per update (k).')
FLAGS = flags.FLAGS


def main(_):
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  k, b = FLAGS.accum_steps, FLAGS.micro_batch
  print(f'{jax.devices()[0].device_kind}, {jax.device_count()} device(s); '
        f'k = {k} micro-batches of b = {b}')
  print(f'| variant | {k * b}: ms | {k} x {b}: ms | time ratio | '
        f'{k * b}: temp MiB | {k} x {b}: temp MiB | {k * b}: peak MiB | '
        f'{k} x {b}: peak MiB | peak ratio |')
  print('| --- |' + ' ---: |' * 8)
  for variant, config in variants.configs(FLAGS.config, FLAGS.variants):
    config.batch_size = k * b
    results = []
    for grad_accum_steps in (1, k):
      config.grad_accum_steps = grad_accum_steps
      timing = step_time.time_variant(config, FLAGS.steps)
      seconds, memory = timing.step_seconds, timing.memory
      peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes -
              memory.alias_size_in_bytes + memory.temp_size_in_bytes)
      results.append((seconds, memory.temp_size_in_bytes, peak))
    (one_s, one_temp, one_peak), (accum_s, accum_temp, accum_peak) = results
    mib = lambda x: f'{x / 2**20:.1f}'
    print(f'| {variant} | {1000 * one_s:.1f} | {1000 * accum_s:.1f} | '
          f'{accum_s / one_s:.3f} | {mib(one_temp)} | {mib(accum_temp)} | '
          f'{mib(one_peak)} | {mib(accum_peak)} | '
          f'{accum_peak / one_peak:.3f} |', flush=True)


if __name__ == '__main__':
  app.run(main)
