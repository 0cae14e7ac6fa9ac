"""Compiling for accelerators this machine does not have: libtpu, the TPU
compiler, compiles a run's programs for a TPU slice ahead of time, in
processes of their own: `main.py --mode=compile` as users run it, its one
line for a step that does not fit and its search for the largest batch,
the rolled stack's memory against the same network unrolled, and a
two-slice mesh whose gradients, alone, cross the network between the
slices."""

import re
import subprocess
import sys

import pytest

from helpers import REPO
from processes import Processes
import tpu_compiles

pytest.importorskip('libtpu')  # the TPU compiler; .ci/run installs it

# The tests that read `compiled` share one process's compiles: one worker
# runs them.
shares_compiles = pytest.mark.xdist_group('tpu_compiles')

TOPOLOGY = 'v5e:2x2'  # 4 chips of 15.75 GiB, one host
# A ViT's encoder rolled in bfloat16 (4 layers of 4 tokens, 512 images per
# chip): activations, not parameters, fill the chip.
VIT = dict(model='ViT_Ti16', dataset='fake', image_size=32, num_layers=4,
           batch_size=2048, half_precision=True, remat_policy='none',
           scan_unroll=1)


def compile_command(workdir, *flags: str) -> list[str]:
  """`main.py --config=configs/default.py --mode=compile` on TOPOLOGY, as a
  user types it (no flag of XLA's)."""
  return [sys.executable, 'main.py', '--config=configs/default.py',
          f'--workdir={workdir}', '--mode=compile', f'--topology={TOPOLOGY}',
          *flags]


def compile_mode(workdir, *flags: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      compile_command(workdir, *flags), cwd=REPO, capture_output=True,
      text=True, timeout=600, check=False,
      env=tpu_compiles.user_environment())


@pytest.fixture(scope='module')
def compiled():
  """The train steps the tests below read, compiled in one process; FLOPs
  counted for the two whose counts they read."""
  one_slice = lambda count_flops=False, **config: dict(
      topology=TOPOLOGY, num_slices=1, config=config, count_flops=count_flops)
  results = tpu_compiles.run([
      one_slice(**VIT, count_flops=True),
      one_slice(**dict(VIT, scan_layers=False), count_flops=True),
      one_slice(**dict(VIT, remat_policy='everything')),
      one_slice(batch_size=64, num_layers=2),
      dict(topology=TOPOLOGY, num_slices=2, count_flops=False,
           config={'batch_size': 64, 'num_layers': 2, 'mesh.dcn_data': 2,
                   'mesh.fsdp': -1, 'mesh.data': 1}),
  ])
  return dict(zip(('rolled', 'unrolled', 'everything', 'one_slice',
                   'two_slices'), results))


@shares_compiles
def test_a_rolled_stack_needs_the_memory_of_the_network_unrolled(compiled):
  rolled, unrolled = compiled['rolled'], compiled['unrolled']
  assert rolled['peak'] <= 1.05 * unrolled['peak']
  # Only elementwise work is recomputed.
  assert rolled['recomputed_flops'] <= 1.02 * rolled['step_flops']
  assert unrolled['recomputed_flops'] == unrolled['step_flops']
  # Kept as differentiation names them (every float32 copy, every mask),
  # the residuals of a rolled stack need far more.
  assert compiled['everything']['peak'] > 1.5 * unrolled['peak']


@shares_compiles
def test_only_the_gradient_reduction_crosses_between_two_slices(compiled):
  """Two slices of 4 chips, FSDP within each slice (`mesh.dcn_data=2`):
  the all-reduces of the gradients go over the network between the slices
  (host transfers of the megascale runtime), FSDP's gathers do not."""
  assert compiled['one_slice']['cross_slice'] == []
  crossing = compiled['two_slices']['cross_slice']
  assert crossing and set(crossing) == {'all-reduce'}


def table_rows(stdout: str) -> dict:
  """{program: (arguments, temporaries, peak)} in GiB, of the table the
  compile mode prints."""
  return {name: tuple(map(float, numbers)) for name, *numbers, _ in
          re.findall(r'^\| ([a-z ]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| '
                     r'([\d.-]+) \|$', stdout, re.M)}


def test_compile_mode_prints_what_every_program_needs_and_writes_nothing(
    tmp_path):
  workdir = tmp_path / 'run'
  # Two blocks: the report does not depend on the depth, the compiles do.
  result = compile_mode(workdir, '--config.intermediate_grads_every_steps=10',
                        '--config.num_layers=2')
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith(
      f'Compiled for {TOPOLOGY} (v5litepod-4): 4 x TPU v5 lite (15.75 GiB '
      'each), 1 host(s); jax 0.10.2, libtpu 0.0.42'), result.stdout
  # No moving average, no teacher: the state is what the run holds.
  assert re.search(r'^State per chip: [\d.]+ GiB \(parameters [\d.]+, '
                   r'optimizer state [\d.]+\)\.$', result.stdout, re.M)
  rows = table_rows(result.stdout)
  assert set(rows) == {'train step', 'evaluation step', 'summary step'}
  # Under the table: which figure must fit, and why the other can be more.
  assert re.search(r'^\| summary step .*\n\nThe peak is what must fit: the '
                   r'most a program holds at once\. Temporaries can be more: '
                   r'with loops, ', result.stdout, re.M), result.stdout
  peak = float(re.search(r'^Peak ([\d.]+) GiB of the 15.75 GiB per chip '
                         r'\(\d+%\): fits\.$', result.stdout, re.M).group(1))
  assert peak == max(row[2] for row in rows.values())
  assert re.search(r'^Train step: [\d.]+ GFLOP per example, every layer '
                   r'counted; with remat_policy full\'s recomputation '
                   r'1\.\d+x\.$', result.stdout, re.M), result.stdout
  assert not workdir.exists()


def test_a_step_that_does_not_fit_is_one_line_naming_a_change_that_fits(
    tmp_path):
  workdir = tmp_path / 'run'
  # The default model rolled: 262,144 images per chip do not fit,
  # micro-batches of half do.
  result = compile_mode(workdir, '--config.scan_unroll=1',
                        '--config.batch_size=1048576')
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stdout == ''
  lines = result.stderr.strip().splitlines()
  line = lines[-1]
  needs = (r'SmallResNet at 262144 images per chip \(batch_size 1048576\) '
           r'needs [\d.]+ GiB per chip, [\d.]+ GiB more than the 15.75 GiB '
           r'of a TPU v5 lite\. ')
  # The default config already recomputes every block (remat_policy
  # full): accumulation and FSDP are left, tried in that order, each
  # compile a line as it ends; FSDP alone does not fit.
  assert re.fullmatch(
      f'Error: {needs}Tried in order: gradient accumulation, FSDP. It fits '
      r'with --config.grad_accum_steps=2 \([\d.]+ GiB; 2 micro-batches of '
      r'131072 images per chip in each step: the same update, in 2 '
      r'sequential passes\)', line), line
  trying = [i for i, text in enumerate(lines) if 'Trying' in text]
  assert len(trying) == 1 and re.fullmatch(
      f'{needs}Trying, cheapest first: gradient accumulation, FSDP.',
      lines[trying[0]]), lines
  tried = [text for text in lines[trying[0]:] if text.startswith('  --')]
  assert len(tried) == 2, lines
  assert re.fullmatch(r'  --config.grad_accum_steps=2: peak [\d.]+ GiB, '
                      r'fits \(compiled in \d+ s\)', tried[0])
  assert re.fullmatch(r'  --config.mesh.data=1 --config.mesh.fsdp=-1: peak '
                      r'[\d.]+ GiB, does not fit \(compiled in \d+ s\)',
                      tried[1])
  assert not workdir.exists()


def test_the_largest_batch_search_shows_each_batch_as_it_is_compiled(
    tmp_path):
  """Each batch the search compiles is a line as its compile ends, while
  the search goes on (a two-layer model: its batches compile in
  seconds)."""
  command = compile_command(tmp_path / 'run', '--largest_batch',
                            '--config.num_layers=2', '--config.width=8')
  with Processes([command], [tpu_compiles.user_environment()]) as processes:
    searching = processes.wait_for_line(
        0, lambda line: line.startswith('Searching'), timeout=600)
    # The batch of the table, then half of it, compiled in the search.
    halved = processes.wait_for_line(
        0, lambda line: line.startswith('  8 per chip'), timeout=600)
    assert processes.popens[0].poll() is None  # more batches to compile
  assert searching == ('Searching for the largest batch per chip that '
                       'fits, in steps of 8 up to 4096: each batch tried is '
                       'compiled again.\n')
  assert re.fullmatch(r'  16 per chip \(--config.batch_size=64\): peak '
                      r'[\d.]+ GiB, fits \(compiled in \d+ s\)\n',
                      processes.log(0).split(searching)[1].splitlines(
                          keepends=True)[0])
  assert re.fullmatch(r'  8 per chip \(--config.batch_size=32\): peak '
                      r'[\d.]+ GiB, fits \(compiled in \d+ s\)\n', halved)


def test_step_time_estimates_a_rolled_stack_per_iteration_with_its_writes():
  """`benchmarks/step_time.py --topology` as a user runs it: XLA:TPU's
  estimated cycles of the rolled and the unrolled step by kind. The rolled
  stack's convolutions are counted once per layer (as many as unrolled,
  not one layer's), and it alone writes stacks. Two blocks: counted once,
  their convolutions would be about two thirds of the unrolled step's."""
  result = subprocess.run(
      [sys.executable, 'benchmarks/step_time.py',
       '--config=configs/default.py', '--config.num_layers=2',
       '--topology=v5e:1x1', '--variants=scan_unroll=1;scan_layers=False'],
      cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
      env=tpu_compiles.user_environment())
  assert result.returncode == 0, result.stderr[-3000:]
  # No library's INFO lines (JAX's backend probing): the table alone.
  assert not re.search(r'^I\d{4} ', result.stderr, re.M), result.stderr
  rows = {}
  for line in result.stdout.splitlines():
    cells = [cell.strip() for cell in line.strip('|').split('|')]
    if cells[0] in ('scan_unroll=1', 'scan_layers=False'):
      total, *kinds = (float(cell.split()[0]) for cell in cells[3:])
      assert sum(kinds) == pytest.approx(total, abs=0.003)
      rows[cells[0]] = dict(zip(('products', 'stack writes'), kinds))
  rolled, unrolled = rows['scan_unroll=1'], rows['scan_layers=False']
  assert rolled['products'] == pytest.approx(unrolled['products'], rel=0.1)
  assert rolled['stack writes'] > 0 == unrolled['stack writes']
