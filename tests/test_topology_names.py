"""`--topology` as users write it: Cloud TPU's accelerator types
(`v5litepod-4`, `v4-8`) and names in any case are the slices they name; a
shape no slice has, or a count no slice has, is one line listing the
slices there are, before libtpu is called; the GPUs' compiler, when
missing, is named with its download."""

import importlib.util
import subprocess
import sys

import pytest

from processes import Processes
from processes import REPO
from runtime import accelerators
import tpu_compiles

V5E_SLICES = ('v5e slices are v5e:1x1 (v5litepod-1), v5e:2x2 (v5litepod-4), '
              'v5e:2x4 (v5litepod-8), v5e:4x4 (v5litepod-16), v5e:4x8 '
              '(v5litepod-32), v5e:8x8 (v5litepod-64), v5e:8x16 '
              '(v5litepod-128), v5e:16x16 (v5litepod-256)')


def compile_command(topology: str) -> list[str]:
  """`main.py --mode=compile` of a two-layer default config, as a user
  types it."""
  return [sys.executable, 'main.py', '--config=configs/default.py',
          '--mode=compile', f'--topology={topology}',
          '--config.num_layers=2', '--config.width=8']


def error_line(topology: str) -> str:
  """The one line `--topology=topology` ends with, after checking that it
  exits 1 printing nothing on stdout."""
  result = subprocess.run(compile_command(topology), cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          check=False, env=tpu_compiles.user_environment())
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stdout == ''
  return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize('name, topology', [
    ('v5litepod-1', 'v5e:1x1'), ('v5litepod-4', 'v5e:2x2'),
    ('v5e-8', 'v5e:2x4'), ('v5litepod-256', 'v5e:16x16'),
    ('v6e-16', 'v6e:4x4'),
    # v4 and v5p count TensorCores, 2 a chip.
    ('v4-8', 'v4:2x2x1'), ('v4-16', 'v4:2x2x2'), ('v4-64', 'v4:2x4x4'),
    ('v4-128', 'v4:4x4x4'), ('v4-1536', 'v4:8x8x12'),
    ('v5p-8', 'v5p:2x2x1'), ('v5p-384', 'v5p:4x4x12'),
    ('v5p-768', 'v5p:4x8x12'), ('v5p-17920', 'v5p:16x20x28'),
])
def test_cloud_tpu_accelerator_types_are_the_slices_they_name(name,
                                                               topology):
  assert accelerators.cloud_slice(name) == topology


def test_a_shape_no_slice_has_is_one_line_listing_the_slices_there_are():
  # libtpu itself would say: 'INVALID_ARGUMENT: Topology layout "v5e:3x3"
  # is not divisible by ... chips_per_host_bounds "2x2x1"'.
  assert error_line('v5e:3x3') == (
      f'Error: --topology=v5e:3x3: no v5e slice has that shape; '
      f'{V5E_SLICES}')


@pytest.mark.parametrize('name, error', [
    ('v5litepod-3', f'no v5e slice has 3 chips; {V5E_SLICES}'),
    ('v4-7', 'v4-N counts TensorCores, 2 a chip (e.g. v4-8 is 4 chips); '
             'v4 slices are v4:2x2x1 (v4-8), v4:2x2x2 (v4-16)'),
    ('v4:4x4x6', 'no v4 slice has that shape; v4 slices are v4:2x2x1 '
                 '(v4-8), v4:2x2x2 (v4-16), v4:2x2x4 (v4-32), v4:2x4x4 '
                 '(v4-64), then 4Ax4Bx4C chips, A <= B <= C, up to 4096 '
                 'chips'),
    ('v3-8', 'TPU v3 is not one that can be compiled for here; TPU kinds: '
             'v4 (v4-N), v5e (v5litepod-N), v5p (v5p-N), v6e (v6e-N), or a '
             'GPU: h100, h200, a100, l4'),
])
def test_a_slice_that_does_not_exist_names_those_that_do(name, error):
  with pytest.raises(accelerators.TopologyError) as raised:
    accelerators.topology(name)
  assert str(raised.value).startswith(f'--topology={name}: {error}')
  assert '\n' not in str(raised.value)


def test_every_slice_named_as_existing_is_one_libtpu_knows():
  """Each shape the errors list, and the first shapes of 4A x 4B x 4C
  chips, made into compile-only devices by libtpu (no program
  compiled)."""
  names = [f'{kind}:{shape}' for kind, spec in accelerators.TPU_KINDS.items()
           for shape in (accelerators.SHAPES_2D if spec.axes == 2 else
                         accelerators.SMALL_SHAPES_3D + ('4x4x4', '4x4x12'))]
  result = subprocess.run(
      [sys.executable, '-c',
       'import sys, jax; jax.config.update("jax_platforms", "cpu"); '
       'from runtime import accelerators; '
       '[print(accelerators.topology(name).describe()) '
       'for name in sys.argv[1:]]', *names],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
      env=tpu_compiles.user_environment())
  assert result.returncode == 0, result.stderr[-3000:]
  described = result.stdout.splitlines()
  assert [line.split(' ')[0] for line in described] == names
  assert described[names.index('v5e:16x16')].startswith(
      'v5e:16x16 (v5litepod-256): 256 x TPU v5 lite (15.75 GiB each), 64 '
      'host(s)')
  assert described[names.index('v4:4x4x12')].startswith(
      'v4:4x4x12 (v4-384): 192 x TPU v4')


@pytest.mark.parametrize('name, started', [
    ('V5litepod-4', 'V5litepod-4 is v5e:2x2. Compiling the programs of '
                    'SmallResNet at batch_size 64 for v5e:2x2'),
    ('V5E:2x2', 'Compiling the programs of SmallResNet at batch_size 64 '
                'for v5e:2x2'),
])
def test_a_cloud_tpu_name_or_capitals_compile_for_the_slice_named(name,
                                                                  started):
  pytest.importorskip('libtpu')
  with Processes([compile_command(name)],
                 [tpu_compiles.user_environment()]) as processes:
    line = processes.wait_for_line(
        0, lambda line: 'Compiling the programs' in line, timeout=300)
  assert line.startswith(started), line


@pytest.mark.skipif(importlib.util.find_spec('jax_cuda12_plugin') is not None,
                    reason='the CUDA plugin is installed')
def test_a_missing_gpu_compiler_is_named_with_its_download():
  assert error_line('H100:8') == (
      'Error: compiling for this topology needs jax_cuda12_plugin: pip '
      'install "jax[cuda12]==0.10.2" (the CUDA plugin and NVIDIA\'s '
      'libraries: a 3.2 GB download, more once installed; it compiles on a '
      'machine without a GPU)')
