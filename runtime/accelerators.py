"""Accelerators a run can be compiled for without having them: a named TPU
slice or GPU cluster as compile-only devices, and the memory of each chip.

`--topology` names what a run would run on:

  TPU   KIND:DIMS, a slice as Cloud TPU names its topology: `v5e:2x2`,
        `v5e:4x4` (16 chips, 4 hosts), `v4:2x2x2`, `v5p:4x4x4`, `v6e:2x4`;
        kinds v4, v5e, v5p, v6e, shapes those Cloud TPU offers (checked
        here, before libtpu). Or Cloud TPU's accelerator type, KIND-COUNT:
        `v5litepod-4` (= `v5e-4`, `v5e:2x2`), `v6e-8`, counting chips;
        `v4-8`, `v5p-16`, counting TensorCores, 2 a chip (`v4:2x2x1`,
        `v5p:2x2x2`). `num_slices` > 1: that many such slices
        (multislice), their devices told apart by `slice_index`.
  GPU   KIND[:GPUS] or KIND:HOSTSxGPUS: `h100` (one GPU), `h100:8` (one
        host of 8), `a100:4x8` (4 hosts of 8); kinds in GPU_KINDS.
        Each host counts as a slice (`mesh.dcn_data` spans hosts).

Names are read in any case (`V5E:2x2`, `H100:8`).

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
  axes: int  # of its torus: 2 (v5e, v6e) or 3 (v4, v5p)
  largest_slice: int  # chips: a whole pod


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
    'v4': TpuKind('megacore', int(30.75 * GIB), 'v4', 2, 3, 4096),
    'v5e': TpuKind('default', int(15.75 * GIB), 'v5litepod', 1, 2, 256),
    'v5p': TpuKind('megacore', int(95.74 * GIB), 'v5p', 2, 3, 8960),
    'v6e': TpuKind('default', int(31.25 * GIB), 'v6e', 1, 2, 256),
}
# The slices Cloud TPU offers of the kinds with a 2D torus (v5litepod-1,
# -4, -8, ..., -256; v6e likewise). libtpu would compile other shapes too
# (v5e:1x2, v5e:3x1), for slices no one can rent.
SHAPES_2D = ('1x1', '2x2', '2x4', '4x4', '4x8', '8x8', '8x16', '16x16')
# Of the 3D kinds (v4, v5p), the slices of fewer than 64 chips; larger
# ones are 4A x 4B x 4C chips, A <= B <= C.
SMALL_SHAPES_3D = ('2x2x1', '2x2x2', '2x2x4', '2x4x4')
# Cloud TPU's accelerator types: KIND-COUNT, e.g. v5litepod-4, v4-8.
_CLOUD_TYPE = re.compile(r'(v\d+[a-z]*)-(\d+)')
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
# The download as pip reported it for jax 0.10.2 (2026-12-06): the plugin's
# 2 wheels and NVIDIA's 13 (cuDNN 717 MB, cuBLAS 581 MB, ...).
_CUDA_INSTALL = ('pip install "jax[cuda12]==0.10.2" (the CUDA plugin and '
                 "NVIDIA's libraries: a 3.2 GB download, more once "
                 'installed; it compiles on a machine without a GPU)')


@dataclasses.dataclass(frozen=True)
class Topology:
  """Compile-only devices of every chip of a named topology."""
  name: str  # e.g. 'v5e:4x4' or 'h100:2x8'
  platform: str  # 'tpu' or 'gpu'
  device_kind: str  # e.g. 'TPU v5 lite', 'NVIDIA H100 80GB HBM3'
  devices: tuple
  memory_bytes: int  # usable memory per chip
  num_hosts: int  # processes, over every slice
  num_slices: int
  cloud_name: str = ''  # a TPU slice's Cloud TPU type, e.g. 'v5litepod-16'
  requested: str = ''  # the name it was asked for by, e.g. 'v5e-16'

  def describe(self) -> str:
    slices = (f' x {self.num_slices} slices' if self.platform == 'tpu' and
              self.num_slices > 1 else '')
    cloud = f' ({self.cloud_name})' if self.cloud_name else ''
    return (f'{self.name}{cloud}{slices}: {len(self.devices)} x '
            f'{self.device_kind} ({self.memory_bytes / GIB:.2f} GiB each), '
            f'{self.num_hosts} host(s)')

  def renamed(self) -> str:
    """'v5litepod-4 is v5e:2x2.' when it was asked for by another name
    (not merely in other capitals); else ''."""
    if self.requested.strip().lower() in ('', self.name):
      return ''
    return f'{self.requested} is {self.name}.'


def slice_of(kind: str, chips: int) -> str:
  """The topology name of Cloud TPU's `kind` slice of `chips` chips (v5e,
  v6e: SHAPES_2D; v4, v5p: SMALL_SHAPES_3D, then the most cubic
  4A x 4B x 4C), or of `chips` GPUs in hosts of 8."""
  if kind in GPU_KINDS:
    return f'{kind}:{chips}' if chips <= 8 else f'{kind}:{chips // 8}x8'
  if kind not in TPU_KINDS:
    raise TopologyError(f'unknown accelerator {kind!r}; valid kinds: '
                        f'{kinds()}')
  spec = TPU_KINDS[kind]
  shapes = [shape for shape in (SHAPES_2D if spec.axes == 2 else
                                SMALL_SHAPES_3D) if _chips(shape) == chips]
  if not shapes and spec.axes == 3 and chips % 64 == 0 and (
      chips <= spec.largest_slice):
    n = chips // 64
    factors = [(a, b, n // (a * b)) for a in range(1, n + 1) if n % a == 0
               for b in range(a, n // a + 1) if (n // a) % b == 0 and
               n // (a * b) >= b]
    shapes = ['x'.join(str(4 * f) for f in min(
        factors, key=lambda abc: (abc[2], abc[1])))]
  if not shapes:
    raise TopologyError(f'no {kind} slice has {chips} chips; '
                        f'{_slices_of(kind)}')
  return f'{kind}:{shapes[0]}'


def _chips(shape: str) -> int:
  return math.prod(int(d) for d in shape.split('x'))


def _offered(kind: str, shape: str) -> bool:
  """Whether Cloud TPU offers a `kind` slice of `shape` ('2x4')."""
  spec = TPU_KINDS[kind]
  if spec.axes == 2:
    return shape in SHAPES_2D
  if shape in SMALL_SHAPES_3D:
    return True
  dims = [int(d) for d in shape.split('x')]
  return (len(dims) == 3 and dims == sorted(dims) and
          all(d % 4 == 0 for d in dims) and
          math.prod(dims) <= spec.largest_slice)


def _slices_of(kind: str) -> str:
  """The slices of `kind` there are, by topology and by Cloud TPU's name."""
  spec = TPU_KINDS[kind]
  cloud = lambda shape: (f'{spec.cloud_name}-'
                         f'{_chips(shape) * spec.cores_per_chip}')
  if spec.axes == 2:
    return (f'{kind} slices are ' + ', '.join(
        f'{kind}:{shape} ({cloud(shape)})' for shape in SHAPES_2D))
  return (f'{kind} slices are ' + ', '.join(
      f'{kind}:{shape} ({cloud(shape)})' for shape in SMALL_SHAPES_3D) +
          f', then 4Ax4Bx4C chips, A <= B <= C, up to {spec.largest_slice} '
          f'chips: {kind}:4x4x4 ({cloud("4x4x4")}), {kind}:4x4x8, '
          f'{kind}:4x4x12, {kind}:4x8x8, ...')


def cloud_slice(name: str) -> str | None:
  """The topology of Cloud TPU's accelerator type `name` (v5litepod-4:
  v5e:2x2; v4-8: v4:2x2x1, 4 chips of 2 TensorCores), None when `name`
  is not of that form (KIND-COUNT)."""
  found = _CLOUD_TYPE.fullmatch(name)
  if not found:
    return None
  prefix, count = found.group(1), int(found.group(2))
  kind = next((kind for kind, spec in TPU_KINDS.items()
               if prefix in (kind, spec.cloud_name)), None)
  if kind is None:
    raise TopologyError(
        f'--topology={name}: TPU {prefix} is not one that can be compiled '
        'for here; TPU kinds: ' + ', '.join(
            f'{kind} ({spec.cloud_name}-N)' for kind, spec in
            TPU_KINDS.items()) + ', or a GPU: ' + ', '.join(GPU_KINDS))
  cores = TPU_KINDS[kind].cores_per_chip
  if count % cores:
    raise TopologyError(
        f'--topology={name}: {prefix}-N counts TensorCores, {cores} a chip '
        f'(e.g. {prefix}-8 is 4 chips); {_slices_of(kind)}')
  try:
    return slice_of(kind, count // cores)
  except TopologyError as e:
    raise TopologyError(f'--topology={name}: {e}') from None


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
  if num_slices < 1:
    raise TopologyError(f'--num_slices={num_slices}: give 1 or more')
  canonical = name.strip().lower()
  canonical = cloud_slice(canonical) or canonical
  kind, _, dims = canonical.partition(':')
  if kind in TPU_KINDS:
    found = _tpu_topology(canonical, kind, dims, num_slices)
  elif kind in GPU_KINDS:
    if num_slices != 1:
      raise TopologyError(
          f'--num_slices is for TPU slices; give a GPU cluster\'s hosts in '
          f'--topology, e.g. --topology={kind}:{num_slices}x8')
    found = _gpu_topology(canonical, kind, dims)
  else:
    raise TopologyError(
        f'unknown accelerator {kind!r} in --topology={name}; valid kinds: '
        f'{kinds()} (e.g. --topology=v5e:2x2, --topology=v5litepod-4, '
        '--topology=h100:8)')
  return dataclasses.replace(found, requested=name)


def _tpu_topology(name, kind, dims, num_slices) -> Topology:
  if not re.fullmatch(r'\d+x\d+(x\d+)?', dims):
    raise TopologyError(
        f'--topology={name}: give the slice as {kind}:DIMS, chips along '
        f'each axis; {_slices_of(kind)}')
  if not _offered(kind, dims):
    raise TopologyError(f'--topology={name}: no {kind} slice has that '
                        f'shape; {_slices_of(kind)}')
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
                  len({d.process_index for d in devices}), num_slices,
                  f'{spec.cloud_name}-{chips * spec.cores_per_chip}')


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
