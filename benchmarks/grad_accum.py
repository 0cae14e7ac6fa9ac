"""Gradient accumulation's cost: one train step over k micro-batches of b
examples against one over a single batch of k x b, as a table.

  python3 benchmarks/grad_accum.py --micro_batch=16 --accum_steps=4 \
      --variants='model=SmallResNet;model=ViT_Ti16,num_layers=0,dataset=fake,image_size=224'

Each variant is a ';'-separated entry of ','-separated KEY=VALUE overrides
of configs/default.py (see benchmarks/variants.py). Peak memory is XLA's
`memory_analysis()` of the compiled step: parameters, optimizer state,
batch and temporaries at their largest.
"""

import os
import sys

from absl import app
from absl import flags
import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import default  # pylint: disable=g-import-not-at-top
import step_time
import variants

flags.DEFINE_string('variants', 'model=SmallResNet', "';'-separated "
                    'override sets of configs/default.py.')
flags.DEFINE_integer('micro_batch', 16, 'Examples per micro-batch (b).')
flags.DEFINE_integer('accum_steps', 4, 'Micro-batches per update (k).')
flags.DEFINE_integer('steps', 10, 'Timed steps per measurement.')
FLAGS = flags.FLAGS


def main(_):
  k, b = FLAGS.accum_steps, FLAGS.micro_batch
  print(f'{jax.devices()[0].device_kind}, {jax.device_count()} device(s); '
        f'k = {k} micro-batches of b = {b}')
  print(f'| variant | one batch of {k * b}: ms | peak MiB | {k} x {b}: ms '
        '| peak MiB | time ratio | peak memory ratio |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: |')
  for variant, config in variants.configs(default.get_config(),
                                          FLAGS.variants):
    config.batch_size = k * b
    results = []
    for grad_accum_steps in (1, k):
      config.grad_accum_steps = grad_accum_steps
      _, seconds, memory = step_time.time_variant(config, FLAGS.steps)
      results.append((seconds, memory.peak_memory_in_bytes))
    (one_s, one_peak), (accum_s, accum_peak) = results
    print(f'| {variant} | {1000 * one_s:.1f} | {one_peak / 2**20:.1f} | '
          f'{1000 * accum_s:.1f} | {accum_peak / 2**20:.1f} | '
          f'{accum_s / one_s:.3f} | {accum_peak / one_peak:.3f} |', flush=True)


if __name__ == '__main__':
  app.run(main)
