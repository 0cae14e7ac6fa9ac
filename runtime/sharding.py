"""The device mesh and the shardings of the train state and of batches.

The mesh has two axes: `data` (replicas of the parameters) and `fsdp`
(parameters and optimizer state split ZeRO-3 style). Every batch is split
over both axes, so each device sees `batch_size / device_count` examples.
Across slices (several TPU slices, or processes elsewhere) the `data` axis
is `dcn_data` slices times the replicas within one: only the gradients'
all-reduce crosses the slower network between slices, FSDP's gathers stay
within a slice.
"""

import math

import jax
from jax.experimental import mesh_utils
import numpy as np
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ('data', 'fsdp')
# The config key of the number of slices the `data` axis spans.
DCN_DATA = 'dcn_data'
# The leading axis of every array under a `StackedBlocks` module's `layers`
# is the layer axis that `nnx.scan` slices; it is never the sharded axis.
STACKED_LAYERS_KEY = 'layers'
# Arrays smaller than this stay replicated: gathering them would cost more
# latency than their memory is worth (norm scales, biases, small heads).
MIN_SHARDED_SIZE = 2**10


def mesh_shape(mesh_config, num_devices: int,
               num_slices: int = 1) -> tuple[int, ...]:
  """The (data, fsdp) sizes of `config.mesh`, with a -1 filled in; `data`
  counts the replicas of every slice (`dcn_data` x those of one)."""
  unknown = set(mesh_config) - {*MESH_AXES, DCN_DATA}
  if unknown:
    raise ValueError(f'unknown mesh axes {sorted(unknown)}; valid names: '
                     f'{", ".join((*MESH_AXES, DCN_DATA))}')
  dcn = int(mesh_config.get(DCN_DATA, 1))
  if dcn != 1 and dcn != num_slices:
    choices = '1' if num_slices == 1 else f'{num_slices} (or 1)'
    raise ValueError(
        f'mesh.{DCN_DATA}={dcn}, but this run has {num_slices} slice(s) (TPU '
        f'slices, or processes elsewhere); set --config.mesh.{DCN_DATA}='
        f'{choices}')
  num_devices //= dcn
  sizes = [int(mesh_config.get(axis, 1)) for axis in MESH_AXES]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(
        f'mesh sizes {dict(zip(MESH_AXES, sizes))} must be positive, with at '
        'most one -1 (fills the rest); e.g. --config.mesh.fsdp=-1')
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes and num_devices % known == 0:
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    where = f' of each of the {dcn} slices' if dcn > 1 else ''
    raise ValueError(
        f'mesh {dict(zip(MESH_AXES, sizes))} does not cover the {num_devices} '
        f'devices{where}; make the product of its sizes equal the device '
        'count, or set one size to -1')
  return (dcn * sizes[0], sizes[1])


def _slices_are_processes(devices) -> bool:
  """TPUs tell the slice of each device; elsewhere a process counts as
  one."""
  return devices[0].platform != 'tpu'


def num_slices(devices=None) -> int:
  """The slices of `devices` (default: this run's): TPU slices, or
  processes elsewhere."""
  devices = devices or jax.devices()
  if _slices_are_processes(devices):
    return len({device.process_index for device in devices})
  return len({getattr(device, 'slice_index', 0) for device in devices})


def pmap_devices() -> list:
  """All devices, grouped by process: the order `jax.pmap` maps over."""
  return [d for process in range(jax.process_count())
          for d in jax.local_devices(process_index=process)]


def create_mesh(mesh_config, step_mode: str = 'jit', devices=None) -> Mesh:
  """The (data, fsdp) mesh over every device of every process, or over
  `devices` (the compile-only devices of an accelerator topology).

  Both axes are `Auto`: XLA inserts the gathers FSDP needs, so the model
  code does not change. Under `pmap` the devices are in pmap's order, so
  the same global arrays feed both steps without moving data. With
  `dcn_data` > 1, a hybrid mesh: each slice holds `data / dcn_data`
  consecutive rows of the `data` axis.
  """
  devices = devices or jax.devices()
  shape = mesh_shape(mesh_config, len(devices), num_slices(devices))
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  dcn = int(mesh_config.get(DCN_DATA, 1))
  if step_mode == 'pmap':
    return Mesh(np.array(pmap_devices()).reshape(shape), MESH_AXES,
                axis_types=axis_types)
  if dcn > 1:
    hybrid = mesh_utils.create_hybrid_device_mesh(
        (shape[0] // dcn, shape[1]), (dcn, 1), devices,
        process_is_granule=_slices_are_processes(devices))
    return Mesh(hybrid, MESH_AXES, axis_types=axis_types)
  return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types,
                       devices=devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """The leading (example) axis split over every device."""
  return NamedSharding(mesh, P(MESH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def _is_stacked(path) -> bool:
  return any(getattr(key, 'key', None) == STACKED_LAYERS_KEY for key in path)


def fsdp_spec(path, shape, fsdp_size: int) -> P:
  """Splits the largest dimension divisible by `fsdp_size` over `fsdp` (a
  convolution kernel's input features where they divide).

  Small arrays, arrays with no divisible dimension and the layer axis of
  stacked blocks stay replicated.
  """
  if fsdp_size == 1 or math.prod(shape) < MIN_SHARDED_SIZE:
    return P()
  first = 1 if _is_stacked(path) else 0
  candidates = [i for i in range(first, len(shape))
                if shape[i] % fsdp_size == 0]
  if not candidates:
    return P()
  if len(shape) - first == 4 and len(shape) - 2 in candidates:
    # A convolution kernel (H, W, in, out) splits its input features: XLA's
    # SPMD partitioner aborts on a grouped convolution (RegNet's) whose
    # kernel is split along its output features.
    axis = len(shape) - 2
  else:
    # The largest dimension; among equals the last (contiguous shards).
    axis = max(candidates, key=lambda i: (shape[i], i))
  spec = [None] * len(shape)
  spec[axis] = 'fsdp'
  return P(*spec)


def state_shardings(state, mesh: Mesh):
  """A NamedSharding for every array of `state` (params, optimizer state,
  BatchNorm statistics): FSDP-split where `fsdp_spec` says, else replicated.

  Optimizer state mirrors the parameter tree, so each moment is split as
  its parameter is.
  """
  fsdp_size = mesh.shape['fsdp']
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(
          mesh, fsdp_spec(path, x.shape, fsdp_size)), state)
