"""Whether a run fits the accelerator it is for, from its programs compiled
for that accelerator without one (`--mode=compile`, `train.
compile_for_topology`): what each program holds per chip, one line when it
does not fit (by how much, and the changes that fit, tried, with what each
costs), and the largest batch per chip that fits. Each compile is minutes
for a large model: each is announced on stderr as it ends.

The figure that must fit is a program's peak (`accelerators.memory_in_use`):
the TPU compiler refuses a program whose peak exceeds the chip, and the
GPU's must stay under the device's memory.
"""

import contextlib
import dataclasses
import math
import sys
import time
from typing import Callable

import jax
import ml_collections

from checks import config_values
import models
from runtime import accelerators
from runtime import config_error
from training import compiling

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
  # Per chip, of each part of the state the run holds (`state_bytes`).
  state_bytes: dict = dataclasses.field(default_factory=dict)
  step_flops: float = 0.0
  recomputed_flops: float = 0.0
  seconds: float = 0.0  # compiling (and counting) it took, wall time

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
  start = time.monotonic()
  try:
    compiled = compile_run(config, topology, count_flops)
  except Exception as e:  # pylint: disable=broad-except
    if not accelerators.is_out_of_memory(e):
      raise
    return Sizing(config, topology, {}, accelerators.required_bytes(e),
                  seconds=time.monotonic() - start)
  programs = {name: {**accelerators.memory_in_use(executable),
                     'compile_seconds': seconds}
              for name, (executable, seconds) in compiled['programs'].items()}
  return Sizing(config, topology, programs,
                max(p['peak'] for p in programs.values()),
                compiled['state_bytes'], compiled.get('step_flops', 0.0),
                compiled.get('recomputed_flops', 0.0),
                time.monotonic() - start)


def outcome(sizing: Sizing) -> str:
  """'peak 8.95 GiB, fits (compiled in 42 s)', or does not."""
  verdict = 'fits' if sizing.fits else 'does not fit'
  peak = f'peak {sizing.needed / GIB:.2f} GiB, ' if sizing.needed else ''
  return f'{peak}{verdict} (compiled in {sizing.seconds:.0f} s)'


def to_stderr(line: str) -> None:
  """Shows a line of progress at once, apart from the report on stdout."""
  print(line, file=sys.stderr, flush=True)


def with_values(config, **values) -> ml_collections.ConfigDict:
  """A copy of `config` with `values` (dotted keys for nested ones)."""
  changed = ml_collections.ConfigDict(config.to_dict())
  for key, value in values.items():
    parent, _, leaf = key.rpartition('.')
    (changed[parent] if parent else changed)[leaf] = value
  return changed


def alternatives(config, num_devices: int) -> list[tuple[str, list]]:
  """Changes that lower a step's peak, by kind, cheapest first: gradient
  accumulation (the same update, in micro-batches of a half, a quarter,
  ... of the batch, tried in that order), FSDP (parameters and optimizer
  state split over the chips), recomputing each block's forward pass
  (`remat_policy=full`). [(kind, [change, ...])] of the kinds that apply."""
  per_chip = config.batch_size // num_devices
  accumulation = []
  k = config.grad_accum_steps * 2
  while per_chip % k == 0 and k <= 16:
    accumulation.append({'grad_accum_steps': k})
    k *= 2
  kinds = [('gradient accumulation', accumulation)]
  if config.mesh.get('fsdp', 1) == 1:
    kinds.append(('FSDP', [{'mesh.data': 1, 'mesh.fsdp': -1}]))
  if config.remat_policy != 'full':
    kinds.append(('full remat', [{'remat_policy': 'full'}]))
  return [(kind, changes) for kind, changes in kinds if changes]


def flags_of(change: dict) -> str:
  return ' '.join(f'--config.{key}={value}' for key, value in change.items())


def cost(change: dict, tried: Sizing) -> str:
  """What a step pays for `change` of `alternatives`, as `tried` (the
  config with it, FLOPs counted) compiled."""
  if 'grad_accum_steps' in change:
    k = change['grad_accum_steps']
    return (f'{k} micro-batches of {tried.per_chip // k} images per chip in '
            f'each step: the same update, in {k} sequential passes')
  if 'mesh.fsdp' in change:
    return (f'parameters and optimizer state split over the '
            f'{len(tried.topology.devices)} chips, each layer\'s gathered '
            'in every pass: more traffic between chips')
  return ("each block's forward pass computed again for the backward pass: "
          f'{tried.recomputed_flops / max(tried.step_flops, 1):.2f}x the '
          "step's FLOPs")


def refusal(sizing: Sizing, compile_run: Callable,
            progress: Callable[[str], None] = to_stderr) -> str:
  """One line: how much more than a chip the step needs, the kinds of
  change of `alternatives` tried in order, and, compiled to be sure, the
  cheapest change of each kind that fits, with its cost. Each compile is
  a line of `progress` as it ends."""
  topology = sizing.topology
  needed = (f'needs {sizing.needed / GIB:.2f} GiB per chip, '
            f'{(sizing.needed - topology.memory_bytes) / GIB:.2f} GiB more '
            'than' if sizing.needed else 'does not fit in')
  line = (f'{sizing.config.model} at {sizing.per_chip} images per chip '
          f'(batch_size {sizing.config.batch_size}) {needed} the '
          f'{topology.memory_bytes / GIB:.2f} GiB of a {topology.device_kind}')
  kinds = alternatives(sizing.config, len(topology.devices))
  if kinds:
    progress(f'{line}. Trying, cheapest first: '
             f'{", ".join(kind for kind, _ in kinds)}.')
  fitting = []
  with compiling.compiling_each_program_once():
    for _, changes in kinds:
      for change in changes:
        tried = size(with_values(sizing.config, **change), topology,
                     compile_run, count_flops='remat_policy' in change)
        progress(f'  {flags_of(change)}: {outcome(tried)}')
        if tried.fits:
          fitting.append(f'{flags_of(change)} ({tried.needed / GIB:.2f} '
                         f'GiB; {cost(change, tried)})')
          break
  if fitting:
    others = ''.join(f'; also fits: {fit}' for fit in fitting[1:])
    return (f'{line}. Tried in order: '
            f'{", ".join(kind for kind, _ in kinds)}. It fits with '
            f'{fitting[0]}{others}')
  tried = ', '.join(flags_of(change) for _, changes in kinds
                    for change in changes)
  return (f'{line}; {f"none of {tried} fits: " if kinds else ""}use more '
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


def largest_batch(sizing: Sizing, compile_run: Callable,
                  progress: Callable[[Sizing], None] = lambda tried: None
                  ) -> Sizing:
  """The largest batch per chip that fits (in steps of BATCH_GRANULE),
  as the sizing of `sizing.config` at that batch; `sizing` itself when
  not even BATCH_GRANULE fits. The first guess follows the peak's line
  through two batches; then bisection between the largest batch that
  fits and the smallest that does not. Each batch compiled is given to
  `progress` as its compile ends."""
  devices = len(sizing.topology.devices)

  def at(per_chip: int) -> Sizing:
    tried = size(with_values(sizing.config, batch_size=per_chip * devices),
                 sizing.topology, compile_run)
    progress(tried)
    return tried

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
  batch per chip that fits, each batch tried a line on stderr as its
  compile ends. Returns the exit code: 0, or the refusal line when the step
  does not fit."""
  to_stderr(f'{topology.renamed()} Compiling the programs of {config.model} '
            f'at batch_size {config.batch_size} for {topology.name} '
            '(ResNet-50: about 5 minutes of a CPU core; '
            'docs/accelerators.md).'.lstrip())
  with compiling.compiling_each_program_once():
    sizing = size(config, topology, compile_run, count_flops=True)
    if not sizing.fits:
      return f'Error: {refusal(sizing, compile_run)}'
    print('\n'.join(table(sizing)), flush=True)
    if find_largest_batch:
      show_tried = lambda s: to_stderr(
          f'  {s.per_chip} per chip (--config.batch_size='
          f'{s.config.batch_size}): {outcome(s)}')
      to_stderr(f'Searching for the largest batch per chip that fits, in '
                f'steps of {BATCH_GRANULE} up to {MAX_BATCH_PER_CHIP}: each '
                'batch tried is compiled again.')
      show_tried(sizing)
      largest = largest_batch(sizing, compile_run, show_tried)
      beyond = (f'{largest.per_chip + BATCH_GRANULE} per chip does not fit'
                if largest.per_chip < MAX_BATCH_PER_CHIP else
                f'the search goes no higher than {MAX_BATCH_PER_CHIP} per chip')
      print(f'Largest batch that fits: {largest.per_chip} per chip '
            f'(--config.batch_size={largest.config.batch_size}), peak '
            f'{largest.needed / GIB:.2f} GiB; {beyond}.', flush=True)
  return 0


def table(sizing: Sizing) -> list[str]:
  """The report of `sizing`: what was compiled for what, the state the
  run holds, one row per program (and which figure must fit), the step's
  FLOPs, and whether it fits."""
  topology, config = sizing.topology, sizing.config
  compiler = ('libtpu ' + _version('libtpu') if topology.platform == 'tpu'
              else 'jax-cuda12-plugin ' + _version('jax-cuda12-plugin'))
  mesh = {axis: config.mesh.get(axis, 1) for axis in ('data', 'fsdp')}
  lines = [
      f'Compiled for {topology.describe()}; jax {jax.__version__}, '
      f'{compiler}.',
      f'{config.model}, batch_size {config.batch_size} ({sizing.per_chip} '
      f'per chip), {jax.numpy.dtype(models.compute_dtype(config))}'
      f', remat_policy '
      f'{config.remat_policy}, scan_layers {config.scan_layers}, '
      f'grad_accum_steps {config.grad_accum_steps}, mesh {mesh}.',
      f'State per chip: {sum(sizing.state_bytes.values()) / GIB:.2f} GiB ('
      + ', '.join(f'{part} {held / GIB:.2f}' for part, held in
                  sizing.state_bytes.items()) + ').',
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
      'The peak is what must fit: the most a program holds at once. '
      'Temporaries can be more: with loops, XLA counts the buffers of a '
      "loop's body beside the loop's own, never all live at once.",
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


# The parts of a train state (`training/state.py`) by its fields; the
# step and its counters are a few bytes.
STATE_PARTS = {
    'parameters': ('params', 'model_state'),  # with BatchNorm statistics
    'optimizer state': ('opt_state',),
    'moving average': ('ema',),
    'teacher': ('teacher',),
}


def state_bytes(state) -> dict:
  """Bytes per chip of each part of `state` (STATE_PARTS) that the run
  holds: each array's shard on one chip, of arrays with shardings."""
  parts = {part: sum(math.prod(x.sharding.shard_shape(x.shape)) *
                     x.dtype.itemsize for field in fields
                     for x in jax.tree.leaves(getattr(state, field)))
           for part, fields in STATE_PARTS.items()}
  return {part: held for part, held in parts.items() if held}
