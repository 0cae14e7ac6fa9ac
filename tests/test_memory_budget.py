"""What the compile mode tells of a step that does not fit, and of the
largest batch, read from a stand-in for the TPU compiler whose peak is a
formula of the config: every change that fits named with its cost, and a
search that stops at its ceiling saying so; a search compiles each
program once. (tests/
test_accelerator_compile.py runs the real compiler, in processes of their
own.)"""

import types

import jax
import jax.numpy as jnp

from checks import memory_budget
from configs import default
from runtime import accelerators
from training import compiling

GIB = accelerators.GIB
CHIP = int(15.75 * GIB)
# 4 of the suite's CPU devices standing for a v5e:2x2 slice.
SLICE = accelerators.Topology('v5e:2x2', 'tpu', 'TPU v5 lite',
                              tuple(jax.devices()[:4]), CHIP, 1, 1,
                              'v5litepod-4')


def compiler(peak_of):
  """A `compile_run` whose train step's peak is `peak_of(config)` bytes,
  refused as libtpu refuses it when over the chip; the remat policy
  `full` counted as 1.3x the step's FLOPs."""
  def compile_run(config, topology, count_flops):
    del topology, count_flops
    peak = peak_of(config)
    if peak > CHIP:
      raise RuntimeError(f'RESOURCE_EXHAUSTED: XLA:TPU compile permanent '
                         f'error. Ran out of memory; HLO temporaries '
                         f'({peak / GIB:.2f}G) exceeds available HBM '
                         f'(15.75G)')
    analysis = types.SimpleNamespace(
        peak_memory_in_bytes=peak, argument_size_in_bytes=0,
        output_size_in_bytes=0, alias_size_in_bytes=0,
        temp_size_in_bytes=peak)
    step = types.SimpleNamespace(memory_analysis=lambda: analysis)
    return {'programs': {'train step': (step, 1.0)},
            'state_bytes': {'parameters': GIB},
            'step_flops': 1e12,
            'recomputed_flops': 1.3e12 if config.remat_policy == 'full'
                                else 1e12}
  return compile_run


def config_of(**values):
  return memory_budget.with_values(default.get_config(), **values)


def test_a_refusal_names_each_kind_of_change_that_fits_with_its_cost():
  # Activations of 20 GiB at 64 per chip, halved by each doubling of the
  # micro-batches, a third of them kept under full remat; the state, 2 GiB,
  # split 4 ways by FSDP.
  def peak_of(config):
    activations = 20 * GIB / config.grad_accum_steps
    if config.remat_policy == 'full':
      activations /= 3
    state = 2 * GIB / (4 if config.mesh.fsdp == -1 else 1)
    return int(activations + state)
  compile_run = compiler(peak_of)
  config = config_of(batch_size=256, remat_policy='none')
  sizing = memory_budget.size(config, SLICE, compile_run)
  shown = []
  line = memory_budget.refusal(sizing, compile_run, shown.append)
  assert line == (
      'SmallResNet at 64 images per chip (batch_size 256) needs 22.00 GiB '
      'per chip, 6.25 GiB more than the 15.75 GiB of a TPU v5 lite. Tried '
      'in order: gradient accumulation, FSDP, full remat. It fits with '
      '--config.grad_accum_steps=2 (12.00 GiB; 2 micro-batches of 32 '
      'images per chip in each step: the same update, in 2 sequential '
      'passes); also fits: --config.remat_policy=full (8.67 GiB; each '
      "block's forward pass computed again for the backward pass: 1.30x "
      "the step's FLOPs)")
  # FSDP alone does not fit (20.50 GiB): shown as it was tried, and not in
  # the line.
  assert [s.split(':')[0] for s in shown[1:]] == [
      '  --config.grad_accum_steps=2', '  --config.mesh.data=1 '
      '--config.mesh.fsdp=-1', '  --config.remat_policy=full']
  assert 'peak 20.50 GiB, does not fit (compiled in ' in shown[2]


def test_a_search_that_reaches_its_ceiling_says_so_not_that_more_fails(
    capsys):
  compile_run = compiler(lambda config: GIB + config.batch_size * 1000)
  assert memory_budget.report(config_of(batch_size=64), SLICE, compile_run,
                              find_largest_batch=True) == 0
  out, err = capsys.readouterr()
  assert out.strip().splitlines()[-1] == (
      'Largest batch that fits: 4096 per chip (--config.batch_size=16384), '
      'peak 1.02 GiB; the search goes no higher than 4096 per chip.')
  tried = [line for line in err.splitlines() if ' per chip (' in line]
  assert tried[0].startswith('  16 per chip (--config.batch_size=64): peak '
                             '1.00 GiB, fits (compiled in ')
  assert tried[-1].startswith('  4096 per chip (--config.batch_size=16384)')


def test_a_search_compiles_each_program_once():
  """Inside a search a program lowered again (a change of config that
  leaves it as it was) is the executable compiled the first time; another
  program, and any program outside a search, compile anew."""
  def double(x):
    return 2 * x
  x = jnp.ones(3)
  with compiling.compiling_each_program_once():
    first = compiling.lower_and_compile(jax.jit(double), x)[0]
    again = compiling.lower_and_compile(jax.jit(double), x)[0]
    other_shape = compiling.lower_and_compile(jax.jit(double), x[:2])[0]
  assert again is first and other_shape is not first
  assert compiling.lower_and_compile(jax.jit(double), x)[0] is not first
