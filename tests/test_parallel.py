"""Several processes, FSDP and pmap give the results of one data-parallel run.

The reference is one process with eight CPU devices, data parallel under
`jax.jit`. Against it: two real processes of four CPU devices each
(`jax.distributed` on 127.0.0.1, gloo collectives), FSDP over the eight
devices, and the pmap step; and its checkpoint continuing under FSDP,
within rounding (on another device count: tests/test_multihost.py). SGD,
because Adam turns rounding noise on parameters with zero gradient into
learning-rate-sized steps.
"""

import os
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from runtime import config_error
from runtime import sharding
import train

import processes
from helpers import assert_trees_close
from helpers import assert_within_rounding
from helpers import copy_checkpoint
from helpers import read_scalars
from helpers import restore_final
from helpers import tiny_config

# The module's fixtures (the reference run, the FSDP run) are made once, on
# one xdist worker.
pytestmark = pytest.mark.xdist_group('parallel_reference')
NUM_STEPS = 4
OVERRIDES = dict(num_layers=2, width=8, batch_size=16, optimizer='sgd',
                 warmup_epochs=0.0, num_train_steps=NUM_STEPS,
                 log_every_steps=1, eval_every_steps=NUM_STEPS,
                 checkpoint_every_steps=2)


def reference_config(**overrides):
  """The tiny config of this module's runs (SGD, 4 steps, every step
  logged) with `overrides`."""
  return tiny_config(**{**OVERRIDES, **overrides})


def assert_same_run(workdir, final_state, reference):
  """Same train losses at every step and same final state as `reference`."""
  ref_dir, ref_state = reference
  losses = read_scalars(workdir)['train_loss']
  ref_losses = read_scalars(ref_dir)['train_loss']
  assert sorted(losses) == list(range(1, NUM_STEPS + 1))
  np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                             [ref_losses[s] for s in sorted(ref_losses)],
                             rtol=1e-5)
  assert_trees_close((final_state.params, final_state.model_state),
                     (ref_state.params, ref_state.model_state), rtol=1e-5,
                     atol=1e-5)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """One process, eight devices, data parallel: its workdir and state."""
  assert jax.device_count() == 8 and jax.process_count() == 1
  workdir = str(tmp_path_factory.mktemp('reference'))
  state = train.train_and_evaluate(reference_config(), workdir)
  # The last steps really moved the parameters, so agreeing to 1e-5 means
  # something.
  manager = checkpointing.create_manager(workdir, keep=3)
  step_2 = manager.restore(2, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(state))).state
  assert not np.allclose(state.params['head']['kernel'][...],
                         step_2.params['head']['kernel'][...], atol=1e-3)
  return workdir, state


def run_processes(workdir, num_processes, devices_per_process, overrides,
                  timeout=600):
  """`main.py` in `num_processes` real processes on this machine; their
  stderr texts. No process outlives this call."""
  address = f'127.0.0.1:{processes.free_port()}'
  commands = [processes.main_command(
      workdir, overrides, f'--coordinator_address={address}',
      f'--num_processes={num_processes}', f'--process_id={i}')
              for i in range(num_processes)]
  return processes.run(
      commands, [processes.cpu_environment(devices_per_process)] *
      num_processes, timeout)


FSDP_MESH = {'data': 2, 'fsdp': 4}


@pytest.fixture(scope='module')
def fsdp_run(tmp_path_factory):
  """The reference's run with FSDP over four of the eight devices: its
  workdir and state."""
  workdir = str(tmp_path_factory.mktemp('fsdp'))
  return workdir, train.train_and_evaluate(reference_config(mesh=FSDP_MESH),
                                           workdir)


def test_fsdp_matches_data_parallel_and_shards_large_arrays(fsdp_run,
                                                            reference):
  workdir, state = fsdp_run
  config = reference_config(mesh=FSDP_MESH)
  assert_same_run(workdir, state, reference)

  stacked = state.params['stages'][0]['rest']['layers']
  kernel = stacked['conv1']['kernel'][...]  # (layers, 3, 3, 8, 8)
  # A convolution kernel splits its input features.
  assert tuple(kernel.sharding.spec) == (None, None, None, 'fsdp', None)
  assert kernel.addressable_shards[0].data.shape == (2, 3, 3, 2, 8)
  momentum = state.opt_state[1][0].trace['stages'][0]['rest']['layers']
  assert momentum['conv1']['kernel'][...].sharding.spec == kernel.sharding.spec
  # Small arrays stay replicated.
  assert state.params['head']['bias'][...].sharding.is_fully_replicated
  assert stacked['bn1']['scale'][...].sharding.is_fully_replicated

  # The data-parallel checkpoint restores onto the FSDP shardings.
  ref_dir, ref_state = reference
  restored = checkpointing.restore_latest(
      checkpointing.create_manager(ref_dir, keep=3), state,
      compatibility.as_json(config)).state
  restored_kernel = restored.params['stages'][0]['rest']['layers'][
      'conv1']['kernel'][...]
  assert restored_kernel.sharding == kernel.sharding
  assert_trees_close((restored.params, restored.opt_state),
                     (ref_state.params, ref_state.opt_state), rtol=1e-5,
                     atol=1e-5)


@pytest.mark.slow
def test_two_processes_as_slices_with_fsdp_within_each_match_one_process(
    tmp_path, reference, fsdp_run):
  """Two processes of four devices, each process a slice of a hybrid mesh:
  the data axis across them, FSDP over each one's own devices. The run
  ends within the rounding that separates FSDP from data parallelism."""
  workdir = str(tmp_path)
  hybrid = {'mesh.data': -1, 'mesh.fsdp': 4, 'mesh.dcn_data': 2}
  logs = run_processes(workdir, 2, 4, {**OVERRIDES, **hybrid})
  for i, log in enumerate(logs):
    assert processes.joined_run(log) == (i, 2, 8)
    assert f"Mesh {{'data': 2, 'fsdp': 4}}; process {i} loads rows " in log
  final = restore_final(workdir, reference_config(mesh=FSDP_MESH))
  assert_same_run(workdir, final, reference)
  assert_within_rounding(final, reference[1], fsdp_run[1])


def test_data_parallel_checkpoint_continues_under_fsdp_within_rounding(
    tmp_path, reference, fsdp_run):
  """Killed after its checkpoint at step 2 and resumed with FSDP, the
  data-parallel run ends within the rounding that separates FSDP from data
  parallelism over the whole run."""
  copy_checkpoint(reference[0], 2, tmp_path)
  resumed = train.train_and_evaluate(reference_config(mesh=FSDP_MESH),
                                     str(tmp_path))
  kernel = resumed.params['stages'][0]['rest']['layers']['conv1']['kernel']
  assert 'fsdp' in tuple(kernel[...].sharding.spec)
  assert_within_rounding(resumed, reference[1], fsdp_run[1])


def test_pmap_step_matches_jit_step(tmp_path, reference):
  state = train.train_and_evaluate(reference_config(step_mode='pmap'),
                                   str(tmp_path))
  assert_same_run(str(tmp_path), state, reference)
  eval_accuracy = read_scalars(str(tmp_path))['eval_accuracy'][NUM_STEPS]
  assert eval_accuracy == pytest.approx(
      read_scalars(reference[0])['eval_accuracy'][NUM_STEPS], abs=1e-6)


@pytest.mark.parametrize('shape, path, fsdp, spec', [
    # Convolution kernels: the input features, else the largest.
    ((2, 3, 3, 64, 128), ('layers', 'kernel'), 8, (None,) * 3 + ('fsdp', None)),
    ((3, 3, 64, 1088), ('conv2', 'kernel'), 2, (None, None, 'fsdp', None)),
    ((7, 7, 1, 768), ('dwconv', 'kernel'), 8, (None,) * 3 + ('fsdp',)),
    ((16, 64, 32), ('layers', 'kernel'), 16, (None, 'fsdp', None)),
    ((16, 32, 32), ('layers', 'kernel'), 16, (None, None, 'fsdp')),  # tie
    ((16, 64, 64), ('layers', 'kernel'), 128, ()),  # layer axis never split
    ((512, 1000), ('head', 'kernel'), 8, (None, 'fsdp')),
    ((512, 1000), ('head', 'kernel'), 16, ('fsdp', None)),  # 1000 % 16 != 0
    ((1000,), ('head', 'bias'), 8, ()),  # small: replicated
    ((3, 3, 3, 64), ('stem', 'kernel'), 8, (None, None, None, 'fsdp')),
    ((3, 3, 3, 64), ('stem', 'kernel'), 1, ()),
])
def test_fsdp_splits_the_largest_divisible_dimension_or_a_kernels_inputs(shape, path, fsdp, spec):
  keys = tuple(jax.tree_util.DictKey(k) for k in path)
  assert tuple(sharding.fsdp_spec(keys, shape, fsdp)) == spec


@pytest.mark.parametrize('mesh, message', [
    ({'data': 3, 'fsdp': -1}, 'does not cover the 8 devices'),
    ({'data': 2, 'fsdp': 2}, 'does not cover the 8 devices'),
    ({'data': -1, 'fsdp': -1}, 'at most one -1'),
    ({'data': -1, 'model': 2}, "unknown mesh axes ['model']; valid names"),
    ({'data': -1, 'dcn_data': 2},
     'mesh.dcn_data=2, but this run has 1 slice(s)'),
])
def test_bad_mesh_is_refused_naming_the_fix(tmp_path, mesh, message):
  with pytest.raises(config_error.ConfigError, match=re.escape(message)):
    train.train_and_evaluate(reference_config(mesh=mesh), str(tmp_path))
  assert os.listdir(tmp_path) == []


def test_bad_step_mode_is_refused_naming_the_fix(tmp_path):
  with pytest.raises(config_error.ConfigError, match='valid names: jit, pmap'):
    train.train_and_evaluate(reference_config(step_mode='xmap'), str(tmp_path))
  with pytest.raises(config_error.ConfigError, match='mesh.fsdp=1'):
    train.train_and_evaluate(
        reference_config(step_mode='pmap', mesh={'data': 2, 'fsdp': 4}),
        str(tmp_path))
  assert os.listdir(tmp_path) == []
