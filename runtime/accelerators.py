"""Accelerators a run can be compiled for without having them: a named TPU
slice or GPU cluster as compile-only devices, and the memory of each chip.

`--topology` names what a run would run on:

  TPU   KIND:DIMS, a slice as Cloud TPU names its topology: `v5e:2x2`,
        `v5e:4x4` (16 chips, 4 hosts), `v4:2x2x2`, `v5p:4x4x4`, `v6e:2x4`;
        kinds v4, v5e, v5p, v6e. `num_slices` > 1: that many such slices
        (multislice), their devices told apart by `slice_index`.
  GPU   KIND[:GPUS] or KIND:HOSTSxGPUS: `h100` (one GPU), `h100:8` (one
        host of 8), `a100:4x8` (4 hosts of 8); kinds in GPU_KINDS.
        Each host counts as a slice (`mesh.dcn_data` spans hosts).

TPUs compile through libtpu (`pip install "libtpu==0.0.42.*"`, the
release `jax[tpu]==0.10.2` pins), GPUs through the CUDA plugin
(`pip install "jax[cuda12]==0.10.2"`); either compiles ahead of time on a
machine without the accelerator (docs/accelerators.md). The compile-only
devices number every chip of every host, each with its `process_index`,
so a mesh over them places every array and collective as a real run of
that many processes would.
"""

import dataclasses
import math
import os
import re

import jax

from runtime import sharding


class TopologyError(ValueError):
  """A topology that cannot be compiled for, in one line naming the fix."""


@dataclasses.dataclass(frozen=True)
class TpuKind:
  chip_config: str  # libtpu's chip configuration (v4, v5p: one device a chip)
  memory_bytes: int  # what libtpu 0.0.42's compiler lets a program use
  cloud_name: str  # Cloud TPU's accelerator type, without its count
  cores_per_chip: int  # what that count counts per chip


@dataclasses.dataclass(frozen=True)
class GpuKind:
  """The figures XLA's GPU compiler needs of a GPU (its published
  specifications; memory as CUDA reports it)."""
  description: str
  compute_capability: tuple  # (major, minor)
  sm_count: int
  memory_bytes: int
  memory_bandwidth: int  # bytes/s
  l2_cache_bytes: int
  clock_ghz: float
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int
  threads_per_sm: int = 2048
  fp32_units_per_sm: int = 128
  # sm_90a's wgmma and TMA (Hopper): XLA emits them only when told.
  accelerated_features: bool = False


GIB = 2**30
# The usable memory per chip is the compiler's own figure: the "available
# HBM" its out-of-memory message states, in GiB (measured with libtpu
# 0.0.42.1).
TPU_KINDS = {
    'v4': TpuKind('megacore', int(30.75 * GIB), 'v4', 2),
    'v5e': TpuKind('default', int(15.75 * GIB), 'v5litepod', 1),
    'v5p': TpuKind('megacore', int(95.74 * GIB), 'v5p', 2),
    'v6e': TpuKind('default', int(31.25 * GIB), 'v6e', 1),
}
# TPU VMs of v5e and v6e hold up to 8 chips: smaller slices are one host.
# Larger slices, and every v4 and v5p slice, have 4 chips per host.
_SINGLE_HOST_CHIPS = {'v5e': 8, 'v6e': 8}

GPU_KINDS = {
    'h100': GpuKind('NVIDIA H100 80GB HBM3', (9, 0), 132, 84_942_979_072,
                    3_352_320_000_000, 50 * 2**20, 1.98, 233_472, 232_448,
                    accelerated_features=True),
    'h200': GpuKind('NVIDIA H200', (9, 0), 132, 151_397_597_184,
                    4_800_000_000_000, 50 * 2**20, 1.98, 233_472, 232_448,
                    accelerated_features=True),
    'a100': GpuKind('NVIDIA A100-SXM4-80GB', (8, 0), 108, 85_100_068_864,
                    2_039_040_000_000, 40 * 2**20, 1.41, 167_936, 166_912,
                    fp32_units_per_sm=64),
    'l4': GpuKind('NVIDIA L4', (8, 9), 58, 24_152_899_584, 300_000_000_000,
                  48 * 2**20, 2.04, 102_400, 101_376, threads_per_sm=1536),
}

_LIBTPU_INSTALL = ('pip install "libtpu==0.0.42.*" (the TPU compiler; it '
                   'runs on any Linux machine)')
_CUDA_INSTALL = ('pip install "jax[cuda12]==0.10.2" (the CUDA plugin; it '
                 'compiles on a machine without a GPU)')


@dataclasses.dataclass(frozen=True)
class Topology:
  """Compile-only devices of every chip of a named topology."""
  name: str  # as given, e.g. 'v5e:4x4' or 'h100:2x8'
  platform: str  # 'tpu' or 'gpu'
  device_kind: str  # e.g. 'TPU v5 lite', 'NVIDIA H100 80GB HBM3'
  devices: tuple
  memory_bytes: int  # usable memory per chip
  num_hosts: int  # processes, over every slice
  num_slices: int

  def describe(self) -> str:
    slices = (f' x {self.num_slices} slices' if self.platform == 'tpu' and
              self.num_slices > 1 else '')
    return (f'{self.name}{slices}: {len(self.devices)} x {self.device_kind} '
            f'({self.memory_bytes / GIB:.2f} GiB each), '
            f'{self.num_hosts} host(s)')


def slice_of(kind: str, chips: int) -> str:
  """The topology name of a `kind` slice of `chips` chips, as Cloud TPU
  shapes them (v5e, v6e: 2x2, 2x4, 4x4, 4x8, ...; v4, v5p: 2x2x1, 2x2x2,
  2x2x4, 2x4x4, ...), or of `chips` GPUs in hosts of 8."""
  if kind in GPU_KINDS:
    return f'{kind}:{chips}' if chips <= 8 else f'{kind}:{chips // 8}x8'
  if kind not in TPU_KINDS or chips < 1 or chips & (chips - 1):
    raise TopologyError(f'no {kind} slice of {chips} chips; give a power '
                        'of 2 chips of ' + ', '.join(TPU_KINDS))
  axes = [1, 1] if kind in _SINGLE_HOST_CHIPS else [2, 2, 1]
  while math.prod(axes) < chips:
    smallest = min(range(len(axes)), key=lambda i: (axes[i], -i))
    axes[smallest] *= 2
  return f'{kind}:' + 'x'.join(map(str, sorted(axes[:2]) + axes[2:]))


def this_machine() -> Topology:
  """This run's own devices, with the memory the runtime gives a program
  on each (0 where it does not say)."""
  devices = jax.devices()
  stats = devices[0].memory_stats() or {}
  return Topology(devices[0].device_kind, devices[0].platform,
                  devices[0].device_kind, tuple(devices),
                  stats.get('bytes_limit', 0), jax.process_count(),
                  sharding.num_slices(devices))


def kinds() -> str:
  return ', '.join([*TPU_KINDS, *GPU_KINDS])


def topology(name: str, num_slices: int = 1) -> Topology:
  """The compile-only devices of topology `name` (see the module's
  docstring) times `num_slices`; a TopologyError names the fix."""
  kind, _, dims = name.partition(':')
  if num_slices < 1:
    raise TopologyError(f'--num_slices={num_slices}: give 1 or more')
  if kind in TPU_KINDS:
    return _tpu_topology(name, kind, dims, num_slices)
  if kind in GPU_KINDS:
    if num_slices != 1:
      raise TopologyError(
          f'--num_slices is for TPU slices; give a GPU cluster\'s hosts in '
          f'--topology, e.g. --topology={kind}:{num_slices}x8')
    return _gpu_topology(name, kind, dims)
  raise TopologyError(
      f'unknown accelerator {kind!r} in --topology={name}; valid kinds: '
      f'{kinds()} (e.g. --topology=v5e:2x2, --topology=h100:8)')


def _tpu_topology(name, kind, dims, num_slices) -> Topology:
  if not re.fullmatch(r'\d+x\d+(x\d+)?', dims):
    raise TopologyError(
        f'--topology={name}: give the slice as {kind}:DIMS, chips along '
        'each axis, e.g. v5e:2x2, v5e:4x4, v4:2x2x2')
  shape = [int(d) for d in dims.split('x')]
  chips = math.prod(shape)
  spec = TPU_KINDS[kind]
  if chips <= _SINGLE_HOST_CHIPS.get(kind, 0):
    host_bounds = (*shape, 1)[:3]
  else:
    host_bounds = (2, 2, 1)
  _import_compiler('libtpu', _LIBTPU_INSTALL)
  # A local TPU, if any, stays free for the runs that use it; off a TPU VM,
  # libtpu would ask for the VM's accelerator type and hosts and print
  # warnings: neither matters to a compile-only topology.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  os.environ.setdefault('TPU_ACCELERATOR_TYPE',
                        f'{spec.cloud_name}-{chips * spec.cores_per_chip}')
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    devices = topologies.get_topology_desc(
        platform='tpu', topology_name=f'{kind}:{dims}',
        chip_config_name=spec.chip_config,
        chips_per_host_bounds=host_bounds,
        num_slices=num_slices).devices
  except Exception as e:  # pylint: disable=broad-except
    raise TopologyError(f'libtpu does not know --topology={name}: '
                        f'{_first_line(e)}') from None
  return Topology(name, 'tpu', devices[0].device_kind, tuple(devices),
                  spec.memory_bytes,
                  len({d.process_index for d in devices}), num_slices)


def _gpu_topology(name, kind, dims) -> Topology:
  found = re.fullmatch(r'(?:(\d+)x)?(\d+)', dims) if dims else None
  if dims and not found:
    raise TopologyError(
        f'--topology={name}: give {kind} (one GPU), {kind}:GPUS (one host) '
        f'or {kind}:HOSTSxGPUS, e.g. {kind}:8 or {kind}:2x8')
  hosts = int(found.group(1) or 1) if found else 1
  gpus = int(found.group(2)) if found else 1
  if hosts < 1 or gpus < 1:
    raise TopologyError(f'--topology={name}: hosts and GPUs must be >= 1')
  _import_compiler('jax_cuda12_plugin', _CUDA_INSTALL)
  # Without a device to tune on, XLA cannot tile some matrix products for
  # Triton ("Couldn't find output tile sizes"): its other emitters compile
  # them (read by XLA when its first backend starts).
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_gpu_enable_triton_gemm=false')
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    devices = topologies.get_topology_desc(
        platform='cuda', target_config=gpu_target_config(GPU_KINDS[kind]),
        topology=f'1x{hosts}x{gpus}').devices
  except Exception as e:  # pylint: disable=broad-except
    raise TopologyError(f'the CUDA plugin cannot compile for '
                        f'--topology={name}: {_first_line(e)}') from None
  return Topology(name, 'gpu', GPU_KINDS[kind].description, tuple(devices),
                  GPU_KINDS[kind].memory_bytes, hosts, hosts)


def gpu_target_config(gpu: GpuKind) -> str:
  """`gpu` as the text of XLA's `stream_executor.GpuTargetConfigProto`,
  what the CUDA plugin compiles for in place of a device it asks."""
  major, minor = gpu.compute_capability
  extension = 'ACCELERATED_FEATURES' if gpu.accelerated_features else 'NONE'
  return f'''gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {gpu.shared_memory_per_sm}
  threads_per_core_limit: {gpu.threads_per_sm}
  core_count: {gpu.sm_count}
  fpus_per_core: {gpu.fp32_units_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {gpu.memory_bandwidth}
  l2_cache_size: {gpu.l2_cache_bytes}
  clock_rate_ghz: {gpu.clock_ghz}
  device_memory_size: {gpu.memory_bytes}
  shared_memory_per_block_optin: {gpu.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
    feature_extension: {extension}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
device_description_str: "{gpu.description}"
'''


def _import_compiler(module: str, install: str) -> None:
  try:
    __import__(module)
  except ImportError:
    raise TopologyError(f'compiling for this topology needs {module}: '
                        f'{install}') from None


def _first_line(error: Exception) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def is_out_of_memory(error: Exception) -> bool:
  """Whether a compile or run failed for want of device memory."""
  return 'RESOURCE_EXHAUSTED' in str(error)


def required_bytes(error: Exception) -> int | None:
  """The memory a program needs, as the TPU compiler's out-of-memory
  message states it ('... HLO temporaries (17.56G) exceeds available HBM
  (15.75G)'); None when the message gives none."""
  found = re.search(r'temporaries \((\d+(?:\.\d+)?)([KMGT])\)', str(error))
  if not found:
    return None
  return int(float(found.group(1)) * 1024**' KMGT'.index(found.group(2)))


def memory_in_use(compiled) -> dict:
  """Per chip, what a compiled program holds in device memory, in bytes:
  `arguments` (the state and the batch it reads), `temporaries`, and
  `peak`, the most it holds at once, the figure that must fit (XLA's
  `peak_memory_in_bytes`; its `temp_size_in_bytes` counts every buffer of
  a loop's body beside the loop's own, more than is ever live)."""
  memory = compiled.memory_analysis()
  peak = memory.peak_memory_in_bytes or (
      memory.argument_size_in_bytes + memory.output_size_in_bytes -
      memory.alias_size_in_bytes + memory.temp_size_in_bytes)
  return {'arguments': memory.argument_size_in_bytes,
          'temporaries': memory.temp_size_in_bytes,
          'peak': peak}
