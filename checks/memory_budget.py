"""Whether a run fits the accelerator it is for, from its programs compiled
for that accelerator without one (`--mode=compile`, `train.
compile_for_topology`): what each program holds per chip, one line when it
does not fit (by how much, and a change that fits, tried), and the largest
batch per chip that fits.

The figure that must fit is a program's peak (`accelerators.memory_in_use`):
the TPU compiler refuses a program whose peak exceeds the chip, and the
GPU's must stay under the device's memory.
"""

import contextlib
import dataclasses
import math
from typing import Callable

import jax
import ml_collections

from checks import config_values
from runtime import accelerators
from runtime import config_error
from runtime import mixed_precision

GIB = accelerators.GIB
# Batches per chip are searched in steps of this many examples.
BATCH_GRANULE = 8
# The largest batch per chip the search tries.
MAX_BATCH_PER_CHIP = 4096


@dataclasses.dataclass
class Sizing:
  """A config's programs compiled for a topology: per program its memory
  (`accelerators.memory_in_use`) and compile seconds; `needed` the largest
  peak (when the compiler refused, the peak its message states, or None).
  """
  config: ml_collections.ConfigDict
  topology: accelerators.Topology
  programs: dict
  needed: int | None
  state_bytes: int = 0  # per chip: parameters, optimizer state, ...
  step_flops: float = 0.0
  recomputed_flops: float = 0.0

  @property
  def fits(self) -> bool:
    return self.needed is not None and (
        self.needed <= self.topology.memory_bytes and bool(self.programs))

  @property
  def per_chip(self) -> int:
    return self.config.batch_size // len(self.topology.devices)


def size(config, topology: accelerators.Topology, compile_run: Callable,
         count_flops: bool = False) -> Sizing:
  """`config`'s programs compiled for `topology` by `compile_run`
  (`train.compile_for_topology`; with `count_flops`, the step's FLOPs
  counted too), or, when the compiler runs out of memory, what its message
  says the program needs."""
  config_values.validate_config(config, topology.devices)
  try:
    compiled = compile_run(config, topology, count_flops)
  except Exception as e:  # pylint: disable=broad-except
    if not accelerators.is_out_of_memory(e):
      raise
    return Sizing(config, topology, {}, accelerators.required_bytes(e))
  programs = {name: {**accelerators.memory_in_use(executable),
                     'compile_seconds': seconds}
              for name, (executable, seconds) in compiled['programs'].items()}
  return Sizing(config, topology, programs,
                max(p['peak'] for p in programs.values()),
                compiled['state_bytes'], compiled.get('step_flops', 0.0),
                compiled.get('recomputed_flops', 0.0))


def with_values(config, **values) -> ml_collections.ConfigDict:
  """A copy of `config` with `values` (dotted keys for nested ones)."""
  changed = ml_collections.ConfigDict(config.to_dict())
  for key, value in values.items():
    parent, _, leaf = key.rpartition('.')
    (changed[parent] if parent else changed)[leaf] = value
  return changed


def alternatives(config, num_devices: int) -> list[dict]:
  """Changes that lower a step's peak, cheapest first: gradient
  accumulation (the same update, in micro-batches of a half, a quarter,
  ... of the batch), FSDP (parameters and optimizer state split over the
  chips), recomputing each block's forward pass (about a third more
  FLOPs)."""
  per_chip = config.batch_size // num_devices
  changes = []
  k = config.grad_accum_steps * 2
  while per_chip % k == 0 and k <= 16:
    changes.append({'grad_accum_steps': k})
    k *= 2
  if config.mesh.get('fsdp', 1) == 1:
    changes.append({'mesh.data': 1, 'mesh.fsdp': -1})
  if config.remat_policy != 'full':
    changes.append({'remat_policy': 'full'})
  return changes


def flags_of(change: dict) -> str:
  return ' '.join(f'--config.{key}={value}' for key, value in change.items())


def refusal(sizing: Sizing, compile_run: Callable) -> str:
  """One line: how much more than a chip the step needs, and the first
  change of `alternatives` that fits, compiled to be sure."""
  topology = sizing.topology
  needed = (f'needs {sizing.needed / GIB:.2f} GiB per chip, '
            f'{(sizing.needed - topology.memory_bytes) / GIB:.2f} GiB more '
            'than' if sizing.needed else 'does not fit in')
  line = (f'{sizing.config.model} at {sizing.per_chip} images per chip '
          f'(batch_size {sizing.config.batch_size}) {needed} the '
          f'{topology.memory_bytes / GIB:.2f} GiB of a {topology.device_kind}')
  changes = alternatives(sizing.config, len(topology.devices))
  for change in changes:
    tried = size(with_values(sizing.config, **change), topology, compile_run)
    if tried.fits:
      return (f'{line}; it fits with {flags_of(change)} '
              f'({tried.needed / GIB:.2f} GiB)')
  tried = ', '.join(flags_of(change) for change in changes)
  return (f'{line}; {f"none of {tried} fits: " if changes else ""}use more '
          'chips (--topology) or a smaller --config.batch_size')


@contextlib.contextmanager
def refused_when_out_of_memory(config, compile_run: Callable):
  """Turns the devices running out of memory (the TPU compiler refusing a
  program, a GPU failing to allocate) into a ConfigError of `refusal`'s
  line for this run's devices."""
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if not accelerators.is_out_of_memory(e):
      raise
    raise config_error.ConfigError(refusal(Sizing(
        config, accelerators.this_machine(), {},
        accelerators.required_bytes(e)), compile_run)) from None


def largest_batch(sizing: Sizing, compile_run: Callable) -> Sizing:
  """The largest batch per chip that fits (in steps of BATCH_GRANULE),
  as the sizing of `sizing.config` at that batch; `sizing` itself when
  not even BATCH_GRANULE fits. The first guess follows the peak's line
  through two batches; then bisection between the largest batch that
  fits and the smallest that does not."""
  devices = len(sizing.topology.devices)

  def at(per_chip: int) -> Sizing:
    return size(with_values(sizing.config, batch_size=per_chip * devices),
                sizing.topology, compile_run)

  tried = {sizing.per_chip: sizing}
  fitting = [b for b, s in tried.items() if s.fits]
  if not fitting:
    tried[BATCH_GRANULE] = at(BATCH_GRANULE)
  else:
    half = max(BATCH_GRANULE, _granular(sizing.per_chip // 2))
    if half not in tried:
      tried[half] = at(half)
    guess = _linear_guess(tried, sizing.topology.memory_bytes)
    if guess and guess not in tried:
      tried[guess] = at(guess)
  while True:
    fitting = [b for b, s in tried.items() if s.fits]
    if not fitting:
      return sizing
    low = max(fitting)
    failing = [b for b, s in tried.items() if not s.fits and b > low]
    high = min(failing) if failing else min(low * 2, MAX_BATCH_PER_CHIP +
                                            BATCH_GRANULE)
    if high - low <= BATCH_GRANULE or low >= MAX_BATCH_PER_CHIP:
      return tried[low]
    probe = _granular((low + high) // 2) if failing else high
    if probe in tried or probe <= low:
      return tried[low]
    tried[probe] = at(probe)


def _granular(per_chip: int) -> int:
  return max(BATCH_GRANULE, per_chip // BATCH_GRANULE * BATCH_GRANULE)


def _linear_guess(tried: dict, memory_bytes: int) -> int | None:
  """The batch at which the line through two fitting batches' peaks
  reaches `memory_bytes`, rounded down to the granule."""
  points = sorted((b, s.needed) for b, s in tried.items() if s.fits)
  if len(points) < 2:
    return None
  (b0, m0), (b1, m1) = points[0], points[-1]
  if m1 <= m0:
    return None
  per_example = (m1 - m0) / (b1 - b0)
  return min(_granular(int(b1 + (memory_bytes - m1) / per_example)),
             MAX_BATCH_PER_CHIP)


def report(config, topology: accelerators.Topology, compile_run: Callable,
           find_largest_batch: bool = False) -> int | str:
  """`--mode=compile`: prints the table of `config`'s programs compiled for
  `topology` by `compile_run` and, with `find_largest_batch`, the largest
  batch per chip that fits. Returns the exit code: 0, or the refusal line
  when the step does not fit."""
  sizing = size(config, topology, compile_run, count_flops=True)
  if not sizing.fits:
    return f'Error: {refusal(sizing, compile_run)}'
  print('\n'.join(table(sizing)), flush=True)
  if find_largest_batch:
    largest = largest_batch(sizing, compile_run)
    beyond = largest.per_chip + BATCH_GRANULE
    print(f'Largest batch that fits: {largest.per_chip} per chip '
          f'(--config.batch_size={largest.config.batch_size}), peak '
          f'{largest.needed / GIB:.2f} GiB; {beyond} per chip does not fit.',
          flush=True)
  return 0


def table(sizing: Sizing) -> list[str]:
  """The report of `sizing`: what was compiled for what, one row per
  program, the step's FLOPs, and whether it fits."""
  topology, config = sizing.topology, sizing.config
  compiler = ('libtpu ' + _version('libtpu') if topology.platform == 'tpu'
              else 'jax-cuda12-plugin ' + _version('jax-cuda12-plugin'))
  mesh = {axis: config.mesh.get(axis, 1) for axis in ('data', 'fsdp')}
  lines = [
      f'Compiled for {topology.describe()}; jax {jax.__version__}, '
      f'{compiler}.',
      f'{config.model}, batch_size {config.batch_size} ({sizing.per_chip} '
      f'per chip), {jax.numpy.dtype(mixed_precision.compute_dtype(config))}'
      f', remat_policy '
      f'{config.remat_policy}, scan_layers {config.scan_layers}, '
      f'grad_accum_steps {config.grad_accum_steps}, mesh {mesh}.',
      f'State per chip (parameters, optimizer state, moving average, '
      f'teacher): {sizing.state_bytes / GIB:.2f} GiB.',
      '',
      '| program | arguments GiB | temporaries GiB | peak GiB | '
      'compile s |',
      '| --- | ---: | ---: | ---: | ---: |',
  ]
  for name, memory in sizing.programs.items():
    seconds = memory['compile_seconds']
    lines.append(
        f'| {name} | {memory["arguments"] / GIB:.2f} | '
        f'{memory["temporaries"] / GIB:.2f} | {memory["peak"] / GIB:.2f} | '
        f'{"-" if seconds is None else f"{seconds:.1f}"} |')
  examples = config.batch_size
  lines += [
      '',
      f'Train step: {sizing.step_flops / examples / 1e9:.2f} GFLOP per '
      f'example, every layer counted; with remat_policy '
      f'{config.remat_policy}\'s recomputation '
      f'{sizing.recomputed_flops / max(sizing.step_flops, 1):.3f}x.',
      f'Peak {sizing.needed / GIB:.2f} GiB of the '
      f'{topology.memory_bytes / GIB:.2f} GiB per chip '
      f'({sizing.needed / topology.memory_bytes:.0%}): fits.'
  ]
  return lines


def _version(package: str) -> str:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return '(version unknown)'


def state_bytes(state) -> int:
  """Bytes per chip of `state`'s arrays (shapes with shardings): each
  array's shard on one chip."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(state))
