"""Nested remat segments, mixed precision, throughput tags, the benchmark."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checks import config_values
from runtime import config_error
from configs import default
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from data import datasets
import input_pipeline
import models
from training import optimizer
from training import run_state
from training import throughput
from training import update
import train
import processes
from helpers import REPO
from helpers import assert_trees_close
from helpers import console_of
from helpers import read_scalars
from helpers import squared_logits_and_grads
from helpers import tiny_config


def stack_config(**overrides):
  config = default.get_config()
  config.num_layers = 4
  config.width = 8
  config.scan_unroll = 1
  config.update(overrides)
  return config


@pytest.mark.parametrize('make_config, x, k', [
    (stack_config, jax.random.normal(jax.random.key(1), (4, 8, 8, 1)), 2),
    (lambda **kw: stack_config(model='ViT_Ti16', image_size=32,
                               dropout_rate=0.1, remat_policy='dots', **kw),
     jax.random.normal(jax.random.key(1), (2, 32, 32, 1)), 4),
])
def test_segments_give_the_plain_stacks_outputs_gradients_and_statistics(
    make_config, x, k):
  plain = squared_logits_and_grads(make_config(), x)
  segmented = squared_logits_and_grads(make_config(scan_segments=k), x)
  # Same parameter and BatchNorm-statistics layout: (depth, ...) leaves.
  assert jax.tree.map(jnp.shape, segmented[1:]) == jax.tree.map(
      jnp.shape, plain[1:])
  # Float32 rounding of sums regrouped by segment: entries near zero in
  # leaves of magnitude up to 20 differ by up to 2e-6.
  assert_trees_close(segmented, plain, rtol=1e-5, atol=1e-5)


def test_segments_hold_less_activation_memory_than_the_plain_stack():
  def temp_bytes(**overrides):
    config = stack_config(num_layers=16, width=16, remat_policy='full',
                          **overrides)
    model = models.create_model(config.model, 10, 1, rngs=nnx.Rngs(0),
                                **models.options(config))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
      model = nnx.merge(graphdef, params, rest, copy=True)
      return jnp.sum(model(x, train=True)**2)
    x = jax.ShapeDtypeStruct((256, 8, 8, 1), jnp.float32)
    return jax.jit(jax.grad(loss)).lower(params, x).compile(
    ).memory_analysis().temp_size_in_bytes

  # The plain stack keeps 16 layer inputs for the backward pass; 4 segments
  # keep 4 segment inputs plus one segment's 4 layer inputs.
  activation_bytes = 256 * 8 * 8 * 16 * 4
  saved = temp_bytes() - temp_bytes(scan_segments=4)
  assert saved >= 0.9 * (16 - 8) * activation_bytes


def test_segments_that_do_not_divide_the_depth_are_a_config_error(tmp_path):
  with pytest.raises(config_error.ConfigError,
                     match='scan_segments 3 does not divide the depth 4'):
    train.train_and_evaluate(stack_config(scan_segments=3), str(tmp_path))
  assert os.listdir(tmp_path) == []


def test_unknown_half_precision_dtype_lists_valid_names():
  with pytest.raises(config_error.ConfigError,
                     match="'float8'; valid names: bfloat16, float16"):
    config_values.validate_config(stack_config(half_precision=True,
                                               half_precision_dtype='float8'))


def test_float16_step_scales_the_loss_skips_an_overflowing_step_and_grows():
  config = tiny_config(half_precision=True, half_precision_dtype='float16')
  data = datasets.load_digits()
  lr_fn = optimizer.learning_rate_schedule(config, 10, 0)
  graphdef, state, tx = run_state.create_train_state(
      config, data.info, lr_fn, dtype=models.compute_dtype(config))
  assert jax.tree.leaves(state.params)[0].dtype == jnp.float32
  state = state.replace(loss_scale=state.loss_scale.replace(growth_interval=2))
  batch = {'image': jnp.asarray(data.train_images[:16], jnp.float16),
           'label': data.train_labels[:16]}
  step = jax.jit(lambda s, b: update.train_step(
      s, b, graphdef=graphdef, tx=tx, learning_rate_fn=lr_fn,
      label_smoothing=0.0, dropout_seed=1))

  def step_from(scale, start=state):
    return step(start.replace(loss_scale=start.loss_scale.replace(
        scale=jnp.asarray(scale, jnp.float32))), batch)

  new_state, metrics = step_from(2.0**10)
  assert np.isfinite(float(metrics['loss']))
  assert float(metrics['loss_scale']) == 2.0**10
  assert int(new_state.step) == 1
  assert float(new_state.loss_scale.scale) == 2.0**10
  assert int(new_state.loss_scale.fin_steps) == 1
  assert not np.array_equal(jax.tree.leaves(new_state.params)[0],
                            jax.tree.leaves(state.params)[0])
  # The unscaled loss does not depend on the scale.
  _, metrics_small = step_from(4.0)
  np.testing.assert_allclose(metrics['loss'], metrics_small['loss'],
                             rtol=1e-3)
  # The finite step after growth_interval (2) finite steps doubles it.
  grown, _ = step(step(new_state, batch)[0], batch)
  assert float(grown.loss_scale.scale) == 2.0**11
  assert int(grown.loss_scale.fin_steps) == 0

  # A scale that overflows in the backward pass: the update is dropped,
  # the scale halved, the count of finite steps reset, the step counted.
  overflowed, _ = step_from(3e38, start=new_state)
  assert int(overflowed.step) == 2
  assert float(overflowed.loss_scale.scale) == pytest.approx(1.5e38)
  assert int(overflowed.loss_scale.fin_steps) == 0
  jax.tree.map(np.testing.assert_array_equal,
               (overflowed.params, overflowed.model_state,
                overflowed.opt_state),
               (new_state.params, new_state.model_state, new_state.opt_state))


def test_checkpoints_keep_the_loss_scale(tmp_path):
  config = tiny_config(half_precision=True, half_precision_dtype='float16')
  info = input_pipeline.DatasetInfo(10, (8, 8, 1), 100, 10)
  lr_fn = optimizer.learning_rate_schedule(config, 10, 1)
  _, state, _ = run_state.create_train_state(
      config, info, lr_fn, dtype=models.compute_dtype(config))
  saved = state.replace(loss_scale=state.loss_scale.replace(
      scale=jnp.asarray(2.0**7, jnp.float32),
      fin_steps=jnp.asarray(7, jnp.int32)))
  manager = checkpointing.create_manager(str(tmp_path), keep=1)
  checkpointing.save(manager, 3, saved, compatibility.as_json(config))
  manager.wait_until_finished()
  restored = checkpointing.restore_latest(
      checkpointing.create_manager(str(tmp_path), keep=1), state,
      compatibility.as_json(config)).state
  assert float(restored.loss_scale.scale) == 2.0**7
  assert int(restored.loss_scale.fin_steps) == 7
  assert float(state.loss_scale.scale) != 2.0**7


def test_every_peak_entry_is_reachable_and_device_kinds_find_theirs():
  """The table is searched first match first: an entry whose name contains
  an earlier one's (v5p after v5) would be shadowed by it."""
  for name, peak in throughput.PEAK_BF16_FLOPS_PER_SECOND:
    assert throughput.peak_flops_per_second(name) == peak, name
  # Device kinds as JAX reports them find the entry their name contains.
  for device_kind, entry in (('TPU v5 lite', 'TPU v5 lite'),
                             ('TPU v5p', 'TPU v5p'),
                             ('NVIDIA A100-SXM4-80GB', 'A100'),
                             ('NVIDIA H100 80GB HBM3', 'H100')):
    assert throughput.peak_flops_per_second(device_kind) == dict(
        throughput.PEAK_BF16_FLOPS_PER_SECOND)[entry], device_kind
  # The PCIe card, whose kind contains 'H100', is the slower one.
  assert (throughput.peak_flops_per_second('NVIDIA H100 PCIe') <
          throughput.peak_flops_per_second('NVIDIA H100 80GB HBM3'))
  assert throughput.peak_flops_per_second('cpu') is None  # so no mfu


def test_run_writes_examples_and_flops_per_second(tmp_path):
  config = tiny_config(num_train_steps=4, eval_every_steps=4,
                       checkpoint_every_steps=4)
  train.train_and_evaluate(config, str(tmp_path))
  scalars = read_scalars(str(tmp_path))
  for step, steps_per_second in scalars['steps_per_second'].items():
    assert scalars['examples_per_second'][step] == pytest.approx(
        steps_per_second * config.batch_size, rel=1e-5)
    assert scalars['flops_per_second'][step] == pytest.approx(
        steps_per_second * scalars['step_flops'][0], rel=1e-5)
    assert scalars['flops_per_second_per_device'][step] == pytest.approx(
        scalars['flops_per_second'][step] / jax.device_count(), rel=1e-5)
  assert 'mfu' not in scalars  # the CPU's peak is unknown


def test_console_shows_images_tflops_per_device_and_mfu_of_a_known_chip():
  class Chip:
    device_kind = 'TPU v5 lite'
  summary = throughput.throughput_metrics(
      steps_per_second=2.0, batch_size=256, step_flops=4 * 197e12 * 0.25,
      devices=[Chip()] * 4)
  assert throughput.console_fields(summary) == [
      '512 images/s', '98.5 TFLOP/s/device', 'MFU 50.0%']
  assert 'mfu' not in throughput.throughput_metrics(
      2.0, 256, 1e12, jax.devices())


@pytest.mark.slow
@pytest.mark.xdist_group('quick_start')
def test_bfloat16_trains_the_default_config_to_float32_accuracy(quick_start,
                                                                tmp_path):
  """bfloat16 for 8 epochs against the quick start's 15 in float32."""
  console_of(tmp_path, '--config.half_precision=True',
             '--config.num_epochs=8',
             compile_flags=processes.LONG_RUN_COMPILE_FLAGS)
  accuracy = {}
  for half_precision, workdir in ((False, quick_start[0]), (True, tmp_path)):
    by_step = read_scalars(str(workdir))['eval_accuracy']
    accuracy[half_precision] = by_step[max(by_step)]
  assert accuracy[False] >= 0.95
  assert abs(accuracy[True] - accuracy[False]) <= 0.01, accuracy


# Makes `import clu` / `import tensorflow` fail, as on the GPU machine.
_WITHOUT_CLU_AND_TF = '''
import runpy, sys
class Absent:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in ('clu', 'tensorflow', 'tensorflow_datasets'):
      raise ModuleNotFoundError(f'No module named {name!r}')
sys.meta_path.insert(0, Absent())
sys.argv = ['benchmarks/scan_remat.py'] + sys.argv[1:]
sys.path.insert(0, 'benchmarks')  # as `python benchmarks/scan_remat.py` has it
runpy.run_path('benchmarks/scan_remat.py', run_name='__main__')
assert 'clu' not in sys.modules and 'tensorflow' not in sys.modules
'''


def test_benchmark_runs_tiny_without_clu_or_tensorflow_and_only_named_modes(
    tmp_path):
  out = tmp_path / 'result.json'
  env = processes.one_device_environment()
  result = subprocess.run(
      [sys.executable, '-c', _WITHOUT_CLU_AND_TF, '--models=default',
       '--depths=2', '--modes=loop,scan,segments', '--policies=full',
       '--segments_depth=4', '--default_batch_size=4', '--steps=1',
       '--throughput', '--throughput_models=vit',
       '--throughput_num_layers=1', '--throughput_batch_size=2',
       '--throughput_image_size=16', '--throughput_policies=full',
       f'--json={out}'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert '| default | 4 | segments_2 |' in result.stdout
  rows = json.loads(out.read_text())['rows']
  # Without --modes: also remat_full and remat_full_unroll at depth 2, and
  # remat_full at depth 4.
  assert [(r['depth'], r['mode']) for r in rows] == [
      (2, 'loop'), (2, 'scan'), (4, 'segments_2')]
  for row in rows:
    assert row['compile_s'] > 0 and row['temp_bytes'] > 0
    assert row['step_s'] > 0
  # True FLOPs do not depend on how the stack runs.
  assert len({r['flops'] for r in rows if r['depth'] == 2}) == 1
  [vit] = json.loads(out.read_text())['throughput']
  assert vit['examples_per_second'] == pytest.approx(2 / vit['step_s'])
  assert 'mfu' not in vit
