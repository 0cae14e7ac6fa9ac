"""The moving average of the weights (`ema_decay`): timm's recursion,
computed here from the weights every checkpoint saved; its evaluation,
resume, sharding, and the commands that take it."""

import json
import os

from flax import nnx
import jax
import numpy as np
import pytest

from configs import default
import export
from data import datasets
import models
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from runtime import sharding
from runtime import config_error
import eval_checkpoint
from training import config_compatibility
from training import optimizer
from training import run_state
from weights import pretrained
from weights import project_files
import train

from helpers import copy_checkpoint
from helpers import read_scalars

pytestmark = pytest.mark.xdist_group('ema')
DECAY = 0.5  # far from 1: four steps move the average visibly
NUM_STEPS = 4


def ema_config(**overrides):
  config = default.get_config()
  config.update(num_layers=2, width=8, batch_size=16, num_train_steps=NUM_STEPS,
                log_every_steps=1, eval_every_steps=NUM_STEPS,
                checkpoint_every_steps=1, keep_checkpoints=NUM_STEPS,
                ema_decay=DECAY, warmup_epochs=0.0)
  config.update(overrides)
  return config


@pytest.fixture(scope='module')
def ema_run(tmp_path_factory):
  """A run with a checkpoint at every step: its workdir."""
  workdir = str(tmp_path_factory.mktemp('ema'))
  train.train_and_evaluate(ema_config(), workdir)
  return workdir


def named(graphdef, state) -> dict:
  """The weights of a train state by the names the readers give them."""
  return pretrained.trained_arrays(nnx.merge(graphdef, state.params,
                                             state.model_state))


def saved(workdir, step: int, ema: bool) -> dict:
  step_dir = os.path.join(workdir, checkpointing.CHECKPOINTS_DIR, str(step))
  read = (project_files.read_checkpoint_ema if ema else
          project_files.read_checkpoint)
  return read(step_dir, {}).arrays


def test_the_moving_average_follows_timms_recursion_from_the_saved_weights(
    ema_run):
  info = datasets.load_digits().info
  graphdef, initial, _ = run_state.create_train_state(
      ema_config(), info, optimizer.learning_rate_schedule(
          ema_config(), NUM_STEPS, 1),
      dtype=models.compute_dtype(ema_config()))
  # The average starts at the initial weights (parameters and statistics).
  average = named(graphdef, initial)
  for step in range(1, NUM_STEPS + 1):
    weights, ema = saved(ema_run, step, False), saved(ema_run, step, True)
    assert ema.keys() == weights.keys() == average.keys()
    average = {name: np.float32(DECAY) * average[name] +
               np.float32(1 - DECAY) * weights[name] for name in weights}
    for name in weights:
      np.testing.assert_allclose(ema[name], average[name], rtol=1e-6,
                                 atol=1e-7, err_msg=name)
    assert any(not np.allclose(ema[n], weights[n]) for n in weights)


def test_every_evaluation_also_evaluates_the_moving_average(ema_run):
  scalars = read_scalars(ema_run)
  for metric in ('loss', 'accuracy', 'top5_accuracy'):
    assert sorted(scalars[f'eval_ema_{metric}']) == [NUM_STEPS]
  assert (scalars['eval_ema_loss'][NUM_STEPS] !=
          scalars['eval_loss'][NUM_STEPS])


def test_eval_mode_and_export_take_the_moving_average_when_asked(
    ema_run, tmp_path):
  metrics = eval_checkpoint.evaluate_checkpoint(
      ema_config(steps_per_eval=-1), ema_run, events_dir=str(tmp_path),
      ema=True)
  assert metrics['eval_ema_loss'] == pytest.approx(
      read_scalars(ema_run)['eval_ema_loss'][NUM_STEPS], rel=1e-6)
  arrays = export.export(ema_run, str(tmp_path / 'ema.safetensors'),
                         ema=True)
  average = saved(ema_run, NUM_STEPS, True)
  for name, value in average.items():
    np.testing.assert_array_equal(arrays[name], value)


def test_a_run_starts_from_a_checkpoints_moving_average(ema_run, tmp_path):
  config = ema_config(init_from=ema_run, init_format='checkpoint_ema',
                      ema_decay=0.0)
  info = datasets.load_digits().info
  graphdef, state, _ = run_state.create_train_state(
      config, info, lambda step: 0.0,
      dtype=models.compute_dtype(config))
  loaded = named(graphdef, pretrained.initialize(
      state, str(tmp_path), config.restore_retry_seconds,
      **run_state.init_weights(config)))
  for name, value in saved(ema_run, NUM_STEPS, True).items():
    np.testing.assert_array_equal(loaded[name], value)


def test_resumed_after_a_kill_the_moving_average_is_bit_exact(
    ema_run, tmp_path):
  copy_checkpoint(ema_run, 2, tmp_path)
  train.train_and_evaluate(ema_config(), str(tmp_path))
  for ema in (False, True):
    resumed, reference = (saved(w, NUM_STEPS, ema)
                          for w in (str(tmp_path), ema_run))
    for name in reference:
      np.testing.assert_array_equal(resumed[name], reference[name])


def test_the_moving_average_is_sharded_like_the_parameters():
  config = ema_config()
  config.mesh.fsdp = 2
  config.update(model='ViT_Ti16', image_size=32, num_layers=2)
  mesh = sharding.create_mesh(config.mesh)
  info = datasets.load_digits().info
  _, _, state_sharding, _ = run_state.create_sharded_train_state(
      config, info, lambda step: 0.0, mesh,
      dtype=models.compute_dtype(config))
  assert jax.tree.leaves(state_sharding.ema['params']) == jax.tree.leaves(
      state_sharding.params)
  assert any('fsdp' in s.spec for s in jax.tree.leaves(state_sharding.params))


def test_switching_the_moving_average_on_or_off_is_refused_on_resume():
  saved_config = json.loads(ema_config().to_json())  # as a checkpoint holds it
  shaped, _ = config_compatibility.config_differences(
      saved_config, compatibility.as_json(ema_config(ema_decay=0.0)))
  assert shaped == ['ema_decay']
  shaped, harmless = config_compatibility.config_differences(
      saved_config, compatibility.as_json(ema_config(ema_decay=0.999)))
  assert shaped == [] and harmless == ['ema_decay']


def test_a_checkpoint_without_a_moving_average_names_the_fix(tmp_path):
  train.train_and_evaluate(ema_config(ema_decay=0.0, num_train_steps=1),
                           str(tmp_path))
  with pytest.raises(ValueError, match=r'holds no moving average of the '
                     r'weights \(trained with ema_decay 0\); drop the EMA '
                     r'option'):
    export.export(str(tmp_path), str(tmp_path / 'x.safetensors'), ema=True)
  with pytest.raises(config_error.ConfigError, match='ema_decay 1.0 must '
                     r'be in \[0, 1\) \(0: off\)'):
    train.train_and_evaluate(ema_config(ema_decay=1.0), str(tmp_path / 'y'))
