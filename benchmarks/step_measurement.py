"""Compiling and timing one train step on one batch: what the benchmarks of
the stack (`scan_remat.py`) and of the families (`families.py`) measure.

`--compile_repeats`, `--steps` and `--seconds` (defined here) apply to
every script that measures with it.
"""

import functools
import math
import time

from absl import flags
import jax
import numpy as np

# pylint: disable=g-bad-import-order
import input_pipeline
import models
from runtime import sharding
from training import compiling
from training import flop_count
from training import optimizer
from training import run_state
import train
from training import update
# pylint: enable=g-bad-import-order

flags.DEFINE_integer('compile_repeats', 1,
                     'Compile each row this many times and report the '
                     'fastest (compile time is noisy on a busy machine).')
flags.DEFINE_integer('steps', 5, 'Timed steps per row (at most).')
flags.DEFINE_float('seconds', 10.0,
                   'Stop timing a row after this long (at least 2 steps).')
FLAGS = flags.FLAGS


def fake_inputs(config, channels: int, num_classes: int):
  """Data set info and one random global batch sharded over the mesh."""
  info = input_pipeline.DatasetInfo(
      num_classes, (config.image_size, config.image_size, channels), 100_000,
      10_000)
  mesh = sharding.create_mesh(config.mesh, config.step_mode)
  batch_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('data'))
  key = jax.random.key(0)
  batch = {
      'image': jax.random.normal(key, (config.batch_size, *info.image_shape),
                                 models.compute_dtype(config)),
      'label': jax.random.randint(key, (config.batch_size,), 0, num_classes),
  }
  return info, jax.device_put(batch, batch_sharding), mesh


def sharded_train_state(config, info, mesh):
  """`config`'s graph definition, sharded initial state, its shardings and
  the train step's keyword arguments."""
  lr_fn = optimizer.learning_rate_schedule(config, 1000, 10)
  graphdef, state, state_sharding, tx = run_state.create_sharded_train_state(
      config, info, lr_fn, mesh, dtype=models.compute_dtype(config))
  return (graphdef, state, state_sharding,
          train.train_step_kwargs(config, graphdef, tx, lr_fn))


def compile_step(config, mesh, step_kwargs, state_sharding, state, batch):
  """The compiled train step and its compile seconds."""
  # A fresh partial each time: jax's caches must not serve a repeat.
  _, compiled, seconds, _ = compiling.compile_train_step(
      config.step_mode, mesh,
      functools.partial(update.train_step, **step_kwargs), state_sharding,
      state, batch)
  return compiled, seconds


def measure(config, channels: int, num_classes: int, flops_cache=None,
            batch=None, info=None, timed=True) -> dict:
  """Compiles `config`'s train step and measures it on one fixed batch."""
  if batch is None:
    info, batch, mesh = fake_inputs(config, channels, num_classes)
  else:
    mesh = sharding.create_mesh(config.mesh, config.step_mode)
  graphdef, state, state_sharding, step_kwargs = sharded_train_state(
      config, info, mesh)
  compile_seconds = math.inf
  for _ in range(max(FLAGS.compile_repeats, 1)):
    compiled, seconds = compile_step(config, mesh, step_kwargs,
                                     state_sharding, state, batch)
    compile_seconds = min(compile_seconds, seconds)
  memory = compiled.memory_analysis()
  flops_cache = {} if flops_cache is None else flops_cache
  flops_key = (config.model, config.num_layers, config.image_size,
               config.batch_size)
  if flops_key not in flops_cache:
    flops_cache[flops_key] = flop_count.true_step_flops(
        update.train_step, graphdef, step_kwargs, state, batch)
  result = {'compile_s': compile_seconds,
            'temp_bytes': int(memory.temp_size_in_bytes),
            'argument_bytes': int(memory.argument_size_in_bytes),
            'output_bytes': int(memory.output_size_in_bytes),
            'step_s': None, 'timed_steps': 0,
            'flops': flops_cache[flops_key]}
  if not timed:
    return result

  state, metrics = compiled(state, batch)  # warm-up
  jax.block_until_ready(metrics)
  times = []
  started = time.perf_counter()
  while len(times) < max(FLAGS.steps, 1) and (
      len(times) < 2 or time.perf_counter() - started < FLAGS.seconds):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return {**result, 'step_s': float(np.median(times)),
          'timed_steps': len(times)}


def compiled_step(config):
  """`config`'s train step on fake ImageNet-shaped data, compiled."""
  info, batch, mesh = fake_inputs(config, 3, 1000)
  _, state, state_sharding, step_kwargs = sharded_train_state(config, info,
                                                              mesh)
  return compile_step(config, mesh, step_kwargs, state_sharding, state,
                      batch)[0]
