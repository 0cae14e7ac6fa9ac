"""Compiled train-step time of a config under overrides, as a table; with
`--profile`, where the device spends each step's time.

  python benchmarks/step_time.py --config=configs/default.py \
      --variants='scan_unroll=1;scan_unroll=8;scan_layers=False'
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python \
      benchmarks/step_time.py --config=configs/default.py \
      --variants='mesh.fsdp=1;mesh.fsdp=8;step_mode=pmap'
  python benchmarks/step_time.py --config=configs/imagenet.py \
      --config.dataset=fake --config.batch_size=256 \
      --variants='scan_layers=True;scan_layers=False' --profile
  python benchmarks/step_time.py --config=configs/imagenet.py \
      --config.dataset=fake --config.batch_size=256 --topology=v5e:1x1 \
      --variants='scan_layers=True;scan_layers=False'

Each variant is a ';'-separated entry of ','-separated KEY=VALUE overrides.
Its train step is compiled as the trainer compiles it, run 3 times, then
`--steps` times dispatched back to back as a training loop dispatches them:
step ms and images/s are their mean. GFLOPs count every layer of the step
(`training/flop_count.py`); memory is XLA's `memory_analysis()` of the
compiled step, per device.

`--profile` traces 3 more steps with `jax.profiler` and sums the first
device's op times (its `XLA Ops` line, which CPUs lack) by kind, per step:
convolutions and matrix products (with what they write into stacked
arrays, e.g. a rolled stack's per-layer gradients), stack writes (other
fusions writing into stacked arrays: in a rolled stack, mostly copies of
its saved activations), the other fusions (elementwise work and
reductions), layout copies, and waits on asynchronous copies.

`--topology` (a name `--mode=compile` takes) compiles each variant for
that TPU topology without a device, as `--mode=compile` does, and prints
instead XLA:TPU's own estimate of the step: the `estimated_cycles` its
compiled program gives each op, summed by the same kinds per step (a
loop's body once per iteration). On a TPU v5e the sums ran 1.6-1.8x the
measured steps' cycles at the chip's 1.5 GHz: a guide to where a step
spends its time and to changes of it, not a measurement
(docs/performance.md).
"""

import collections
import dataclasses
import functools
import glob
import os
import re
import sys
import tempfile
import time

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import datasets  # pylint: disable=g-import-not-at-top
import input_pipeline
import models
from training import compiling
from training import optimizer
from runtime import accelerators
from runtime import console
from runtime import sharding
from training import run_state
from training import flop_count
import train
from training import update
import variants

config_flags.DEFINE_config_file('config', None, 'Config file.')
flags.DEFINE_string('variants', '', "';'-separated override sets.")
flags.DEFINE_integer('steps', 20, 'Timed steps per variant.')
flags.DEFINE_bool('profile', False,
                  "Print each variant's device op time by kind.")
flags.DEFINE_string('topology', '',
                    'Compile for this TPU topology without a device and '
                    "print XLA's estimated cycles by kind instead.")
FLAGS = flags.FLAGS

WARMUP_STEPS = 3
PROFILED_STEPS = 3


@dataclasses.dataclass
class StepTiming:
  """What `time_variant` measures of one compiled train step."""
  compile_seconds: float
  step_seconds: float  # mean of steps dispatched back to back
  memory: object  # the executable's memory_analysis()
  flops: float
  optimizer_bytes: int
  op_seconds: dict | None  # per step, by kind (`--profile`)


def time_variant(config, steps: int, profile: bool = False) -> StepTiming:
  """`config`'s train step, compiled as the trainer compiles it, measured
  on one batch of its data."""
  dataset = datasets.create_dataset(
      input_pipeline.DataSource.from_config(config))
  lr_fn = optimizer.learning_rate_schedule(config, 1000, 10)
  mesh = sharding.create_mesh(config.mesh, config.step_mode)
  dtype = models.compute_dtype(config)
  graphdef, state, state_sharding, tx = run_state.create_sharded_train_state(
      config, dataset.info, lr_fn, mesh, dtype=dtype)
  batch_sharding = sharding.batch_sharding(mesh)
  batches = dataset.train_batches(config.batch_size, 0, 0, batch_sharding,
                                  dtype)
  batch = next(batches)
  step_kwargs = train.train_step_kwargs(config, graphdef, tx, lr_fn)
  flops = flop_count.true_step_flops(update.train_step, graphdef, step_kwargs,
                                     state, batch)
  optimizer_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
  compiled, executable, compile_seconds, _ = compiling.compile_train_step(
      config.step_mode, mesh,
      functools.partial(update.train_step, **step_kwargs), state_sharding,
      state, batch)

  def run(state, count):
    for _ in range(count):
      state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    return state

  state = run(state, WARMUP_STEPS)
  start = time.perf_counter()
  state = run(state, steps)
  step_seconds = (time.perf_counter() - start) / steps
  op_seconds = None
  if profile:
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir):
        state = run(state, PROFILED_STEPS)
      op_seconds = device_op_seconds(trace_dir, PROFILED_STEPS,
                                     executable.as_text())
  return StepTiming(compile_seconds, step_seconds,
                    executable.memory_analysis(), flops, optimizer_bytes,
                    op_seconds)


OP_KINDS = ('convolutions and products', 'stack writes',
            'other fusions', 'layout copies', 'waits on copies')


def op_kind(op: str, stack_writes: frozenset) -> str | None:
  """The kind (OP_KINDS) of the device op whose HLO text is `op`, a stack
  write where its name is in `stack_writes` (`stack_writing_fusions`) or
  says so; None for what is counted elsewhere: loops and calls (their ops
  are listed themselves) and asynchronous copies' starts (they overlap
  other ops)."""
  name = op.split(' ', 1)[0].lstrip('%')
  kind = re.search(r'kind=(k\w+)', op)
  if re.match(r'(while|conditional|call|copy-start)\b', name):
    return None
  if name.startswith('copy-done'):
    return 'waits on copies'
  if (kind and kind.group(1) == 'kOutput') or 'convolution' in name:
    return 'convolutions and products'
  if 'dynamic-update-slice' in name or name in stack_writes:
    return 'stack writes'
  if name.startswith('copy'):
    return 'layout copies'
  return 'other fusions'


def hlo_computations(hlo_text: str) -> tuple[dict, str]:
  """The computations of a compiled program (`hlo_text`, its optimised
  HLO): ({name: its op lines, stripped}, the entry computation's name)."""
  computations, name, entry = {}, None, None
  for line in hlo_text.splitlines():
    header = re.match(r'(ENTRY )?%?(\S+) .*\{$', line)
    if header and not line.startswith(' '):
      name = header.group(2)
      computations[name] = []
      if header.group(1):
        entry = name
    elif name and line.startswith('  '):
      computations[name].append(line.strip())
  return computations, entry


def stack_writing_fusions(computations: dict) -> frozenset:
  """The names of the fusions among `computations` (`hlo_computations`)
  whose result is a dynamic-update-slice: writes into stacked arrays,
  whatever XLA named them. With two layers per loop iteration, XLA writes
  both layers' activations into a stack through one fusion named
  `fusion.N`, their concatenation included."""
  roots = {}
  for name, ops in computations.items():
    for op in ops:
      root = re.match(r'ROOT %?\S+ = \S+ ([\w-]+)\(', op)
      if root:
        roots[name] = root.group(1)
  return frozenset(
      fusion.group(1) for ops in computations.values() for op in ops
      if (fusion := re.match(
          r'(?:ROOT )?%?(\S+) = .* fusion\(.*calls=%?([\w.-]+)', op))
      and roots.get(fusion.group(2)) == 'dynamic-update-slice')


def device_op_seconds(trace_dir: str, steps: int,
                      hlo_text: str) -> dict | None:
  """Seconds per step by op kind on the first device of the trace in
  `trace_dir`, of the compiled program whose HLO is `hlo_text`; None where
  no device lists its ops (CPUs)."""
  stack_writes = stack_writing_fusions(hlo_computations(hlo_text)[0])
  path, = glob.glob(f'{trace_dir}/**/*.xplane.pb', recursive=True)
  data = jax.profiler.ProfileData.from_file(path)
  for plane in data.planes:
    if not plane.name.startswith('/device:') or not plane.name.endswith(':0'):
      continue
    for line in plane.lines:
      if line.name != 'XLA Ops':
        continue
      seconds = collections.Counter()
      for event in line.events:
        kind = op_kind(event.name, stack_writes)
        if kind:
          seconds[kind] += event.duration_ns / 1e9 / steps
      return {kind: seconds[kind] for kind in OP_KINDS}
  return None


def estimate_variant(config, topology) -> tuple[float, object, dict]:
  """`config`'s train step compiled for the compile-only devices of
  `topology` as `--mode=compile` compiles it: (compile seconds, its
  memory_analysis(), `estimated_cycles` of its program)."""
  mesh, run, _, batch, lr_fn = train.abstract_topology_run(config, topology)
  step_kwargs = train.train_step_kwargs(config, run.graphdef, run.tx, lr_fn,
                                        run.teacher_graphdef)
  _, (_, executable, compile_seconds, _) = train.compile_train_step(
      config.step_mode, mesh, step_kwargs, run, batch)
  return (compile_seconds, executable.memory_analysis(),
          estimated_cycles(executable.as_text()))


def estimated_cycles(hlo_text: str) -> dict:
  """XLA:TPU's `estimated_cycles` of the ops of a compiled program
  (`hlo_text`, its optimised HLO), per run, by kind (OP_KINDS): a while
  loop's body counted once per iteration, the count read from its
  condition (`scan` lowers to `i < N`, i from 0; a loop of no such bound,
  e.g. a sampler's, once)."""
  computations, entry = hlo_computations(hlo_text)
  cycles = collections.Counter()
  stack_writes = stack_writing_fusions(computations)

  def add(computation: str, times: int):
    for op in computations[computation]:
      op = re.sub(r'^ROOT ', '', op)
      loop = re.search(r' while\(.*?condition=%?([\w.-]+), body=%?([\w.-]+)',
                       op)
      if loop:
        bound = re.findall(r's32\[\]\S* constant\((\d+)\)',
                           '\n'.join(computations[loop.group(1)]))
        add(loop.group(2), times * (int(bound[0]) if len(bound) == 1 else 1))
        continue
      estimate = re.search(r'"estimated_cycles":"(\d+)"', op)
      kind = op_kind(op, stack_writes)
      if estimate and kind:
        cycles[kind] += int(estimate.group(1)) * times

  add(entry, 1)
  return {kind: cycles[kind] for kind in OP_KINDS}


def print_estimates(topology_name: str):
  """The table of `--topology`: each variant's compile, memory and
  estimated cycles per step by kind."""
  topology = accelerators.topology(topology_name)
  print(f'{topology_name}, compiled without a device; XLA:TPU\'s estimated '
        'Mcycles per step (share)')
  print('| variant | compile s | temp MiB per device | estimated Mcycles | ' +
        ' | '.join(OP_KINDS) + ' |')
  print('| --- | ---: | ---: | ---: |' + ' ---: |' * len(OP_KINDS))
  for variant, config in variants.configs(FLAGS.config, FLAGS.variants):
    compile_seconds, memory, cycles = estimate_variant(config, topology)
    total = sum(cycles.values())
    print(f'| {variant} | {compile_seconds:.1f} | '
          f'{memory.temp_size_in_bytes / 2**20:.2f} | {total / 1e6:,.3f} | ' +
          ' | '.join(f'{c / 1e6:,.3f} ({c / total:.0%})'
                     for c in cycles.values()) + ' |', flush=True)


def main(_):
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  if FLAGS.topology:
    print_estimates(FLAGS.topology)
    return
  print(f'{jax.devices()[0].device_kind}, {jax.device_count()} device(s)')
  print('| variant | compile s | step ms | images/s | step GFLOPs | argument '
        'MiB per device | temp MiB per device | optimizer state MiB |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
  profiles = []
  for variant, config in variants.configs(FLAGS.config, FLAGS.variants):
    timing = time_variant(config, FLAGS.steps, FLAGS.profile)
    memory = timing.memory
    print(f'| {variant} | {timing.compile_seconds:.1f} | '
          f'{1000 * timing.step_seconds:.1f} | '
          f'{config.batch_size / timing.step_seconds:,.0f} | '
          f'{timing.flops / 1e9:.1f} | '
          f'{memory.argument_size_in_bytes / 2**20:.2f} | '
          f'{memory.temp_size_in_bytes / 2**20:.2f} | '
          f'{timing.optimizer_bytes / 2**20:.2f} |', flush=True)
    profiles.append((variant, timing))
  if FLAGS.profile:
    print('\nDevice op time per step, ms (share of the step):\n')
    print('| variant | ' + ' | '.join(OP_KINDS) + ' |')
    print('| --- |' + ' ---: |' * len(OP_KINDS))
    for variant, timing in profiles:
      if timing.op_seconds is None:
        print(f'| {variant} | no device ops traced |')
        continue
      print(f'| {variant} | ' + ' | '.join(
          f'{1000 * s:.1f} ({s / timing.step_seconds:.0%})'
          for s in timing.op_seconds.values()) + ' |')


if __name__ == '__main__':
  app.run(main)
