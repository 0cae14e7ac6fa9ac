"""The true forward FLOPs of scanned ConvNeXt and Swin stages (every trip of
each stage's scan counted), against XLA's count of the same model run as a
Python loop; the families benchmark at a tiny size."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from families import convnext
from families import swin
from training import flop_count
import processes
import tpu_compiles
from helpers import REPO


def abstract_split(build):
  """Graph definition, parameters and other state of `build()`, as
  shapes only."""
  return nnx.split(nnx.eval_shape(build), nnx.Param, ...)


def xla_forward_flops(graphdef, params, rest, images) -> float:
  """XLA's own count of the inference forward pass, as the model runs."""
  def forward(params, rest, images):
    return nnx.merge(graphdef, params, rest)(images, train=False)
  return jax.jit(forward).lower(params, rest, images).cost_analysis()['flops']


# Small models whose stages have several scanned steps (Swin: pairs of
# blocks), built as scan(remat(block)) or as a Python loop.
FAMILIES = {
    'convnext': (lambda **stack: convnext.ConvNeXt(
        (2, 2, 4, 2), (8, 16, 32, 64), 10, stack_options=stack,
        rngs=nnx.Rngs(0)), 32),
    'swin': (lambda **stack: swin.Swin(
        (4, 4, 2, 2), (1, 2, 2, 4), 10, embed_dim=8, window=4,
        image_size=64, stack_options=stack, rngs=nnx.Rngs(0)), 64),
}


@pytest.mark.parametrize('family', FAMILIES)
def test_forward_flops_of_scanned_stages_count_every_step(family):
  build, size = FAMILIES[family]
  images = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)
  scanned = abstract_split(lambda: build(remat_policy='full',
                                         scan_layers=True, scan_unroll=1))
  looped = abstract_split(lambda: build(remat_policy='none',
                                        scan_layers=False))
  counted = flop_count.true_forward_flops(*scanned, images)
  reference = xla_forward_flops(*looped, images)
  assert counted == pytest.approx(reference, rel=0.01)
  # XLA alone counts one step of each rolled scan.
  assert xla_forward_flops(*scanned, images) < 0.8 * reference


def _column(stdout: str, model: str, header: str, table_header: str):
  """The value of `header`'s column in `model`'s row of the table whose
  header line contains `table_header`."""
  lines = stdout.splitlines()
  start = next(i for i, line in enumerate(lines) if table_header in line)
  headers = [h.strip() for h in lines[start].strip('|').split('|')]
  for line in lines[start + 2:]:
    if not line.startswith('|'):
      break
    cells = [c.strip() for c in line.strip('|').split('|')]
    if cells[0] == model:
      return float(cells[headers.index(header)])
  raise AssertionError(f'no row {model!r} under {table_header!r}')


def test_families_benchmark_runs_tiny_and_its_breakdown_sums_to_the_count():
  env = processes.one_device_environment()
  result = subprocess.run(
      [sys.executable, 'benchmarks/families.py', '--names=ViT_Ti16',
       '--breakdown_names=ViT_Ti16', '--depth_names=',
       '--image_size=64', '--batch_size=2',
       '--steps=1', '--seconds=0'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  forward = _column(result.stdout, 'ViT_Ti16',
                    'forward GFLOPs per image (XLA)', 'train step GFLOPs')
  parts = _column(result.stdout, 'ViT_Ti16', 'sum', 'erfc (exact GELU)')
  assert parts == pytest.approx(forward, abs=0.006)
  assert _column(result.stdout, 'ViT_Ti16', 'step ms', 'images/s') > 0


# On a TPU (and under TPU's compile-only devices) an uncompiled program's
# cost analysis is None; the count lowers the same step for the CPU.
_COUNT_ON_TPU_DEVICES = '''
import json, sys
import jax, jax.numpy as jnp
jax.config.update('jax_platforms', 'cpu')
sys.path.insert(0, '.')
from runtime import accelerators
from training import flop_count
devices = accelerators.topology('v5e:2x2').devices
mesh = jax.sharding.Mesh(devices, ('data',))
on_tpu = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
def step(w, x):
  return jnp.tanh(x @ w).sum()
w = jax.ShapeDtypeStruct((64, 32), jnp.float32,
                         sharding=jax.sharding.NamedSharding(
                             mesh, jax.sharding.PartitionSpec()))
x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=on_tpu)
print(json.dumps({
    'uncompiled_on_tpu': jax.jit(step).lower(w, x).cost_analysis(),
    'counted_on_tpu': flop_count.lowered_flops(step, w, x),
    'counted_on_cpu': flop_count.lowered_flops(
        step, jnp.zeros((64, 32)), jnp.zeros((16, 64)))}))
'''


def test_flops_are_counted_for_arrays_on_tpu_devices():
  result = subprocess.run(
      [sys.executable, '-c', _COUNT_ON_TPU_DEVICES], cwd=REPO,
      capture_output=True, text=True, timeout=300,
      env=tpu_compiles.user_environment())
  assert result.returncode == 0, result.stderr[-3000:]
  counts = json.loads(result.stdout.strip().splitlines()[-1])
  assert counts['uncompiled_on_tpu'] is None
  # 16x64x32 multiply-adds, a tanh and a sum per output.
  assert counts['counted_on_tpu'] == counts['counted_on_cpu'] >= 2 * 16 * 64 * 32
