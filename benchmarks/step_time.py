"""Median compiled train-step time of a config under overrides, as a table.

  python benchmarks/step_time.py --config=configs/default.py \
      --variants='scan_unroll=1;scan_unroll=8;scan_layers=False'
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python \
      benchmarks/step_time.py --config=configs/default.py \
      --variants='mesh.fsdp=1;mesh.fsdp=8;step_mode=pmap'
  python benchmarks/step_time.py --config=configs/finetune.py \
      --config.dataset=fake --config.batch_size=8 \
      --variants="trainable=;trainable=head/.*;layer_decay=0.65"

Each variant is a ';'-separated entry of ','-separated KEY=VALUE overrides.
GFLOPs count every layer of the step (`training/flop_count.py`).
"""

import functools
import os
import sys
import time

from absl import app
from absl import flags
import jax
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import datasets  # pylint: disable=g-import-not-at-top
from runtime import mixed_precision
from training import compiling
from training import optimizer
from runtime import sharding
from training import state as train_state
from training import flop_count
import train
import variants

config_flags.DEFINE_config_file('config', None, 'Config file.')
flags.DEFINE_string('variants', '', "';'-separated override sets.")
flags.DEFINE_integer('steps', 20, 'Timed steps per variant.')
FLAGS = flags.FLAGS


def time_variant(config, steps: int):
  """Compile seconds, median step seconds, XLA's memory analysis per
  device, true FLOPs and optimizer-state bytes of `config`'s train step,
  as the trainer compiles it."""
  dataset = datasets.create_dataset(config)
  lr_fn = optimizer.learning_rate_schedule(config, 1000, 10)
  mesh = sharding.create_mesh(config.mesh, config.step_mode)
  dtype = mixed_precision.compute_dtype(config)
  graphdef, state, state_sharding, tx = train_state.create_sharded_train_state(
      config, dataset.info, lr_fn, mesh, dtype=dtype)
  batch_sharding = sharding.batch_sharding(mesh)
  batches = dataset.train_batches(config.batch_size, 0, 0, batch_sharding,
                                  dtype)
  batch = next(batches)
  step_kwargs = train.train_step_kwargs(config, graphdef, tx, lr_fn)
  flops = flop_count.true_step_flops(train.train_step, graphdef, step_kwargs, state, batch)
  optimizer_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
  compiled, executable, compile_seconds, _ = compiling.compile_train_step(
      config.step_mode, mesh,
      functools.partial(train.train_step, **step_kwargs), state_sharding,
      state, batch)
  for _ in range(3):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return (compile_seconds, float(np.median(times)),
          executable.memory_analysis(), flops, optimizer_bytes)


def main(_):
  print(f'{jax.devices()[0].device_kind}, {jax.device_count()} device(s)')
  print('| variant | compile s | median step ms | step GFLOPs | argument '
        'MiB per device | temp MiB per device | optimizer state MiB |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: |')
  for variant, config in variants.configs(FLAGS.config, FLAGS.variants):
    compile_s, step_s, memory, flops, optimizer_bytes = time_variant(
        config, FLAGS.steps)
    print(f'| {variant} | {compile_s:.1f} | {1000 * step_s:.1f} | '
          f'{flops / 1e9:.1f} | {memory.argument_size_in_bytes / 2**20:.2f} | '
          f'{memory.temp_size_in_bytes / 2**20:.2f} | '
          f'{optimizer_bytes / 2**20:.2f} |', flush=True)


if __name__ == '__main__':
  app.run(main)
