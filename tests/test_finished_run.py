"""A finished run's workdir: exported and read back bit for bit, read as
its weights alone, a new run's init_from (a new head from zeros), evaluated
by --mode=eval as trained, and started again without compiling."""

import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import safetensors

import input_pipeline
import models
from runtime import config_error
from configs import default
import eval_checkpoint
import export
from data import datasets
from training import optimizer
from weights import factory
from weights import pretrained
from training import run_state
import train
from helpers import REPO
from helpers import read_scalars
from weight_references import run_config


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """(workdir, config, final state) of a finished tiny run."""
  workdir = str(tmp_path_factory.mktemp('trained'))
  config = run_config()
  return workdir, config, train.train_and_evaluate(config, workdir)


def fresh_state(config):
  info = datasets.create_dataset(
      input_pipeline.DataSource.from_config(config)).info
  return run_state.create_train_state(
      config, info, optimizer.learning_rate_schedule(config, 4, 1),
      dtype=models.compute_dtype(config))[1]


def initialized(config, workdir, state=None):
  """`state` (by default a fresh one of `config`) with the weights a run
  of `config` in `workdir` starts from."""
  return pretrained.initialize(
      fresh_state(config) if state is None else state, workdir,
      config.restore_retry_seconds, **run_state.init_weights(config))


def assert_same_arrays(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_export_reads_back_bit_for_bit_and_so_does_the_workdir(trained,
                                                               tmp_path):
  workdir, config, final = trained
  output = str(tmp_path / 'model.safetensors')
  export.export(workdir, output)
  with safetensors.safe_open(output, framework='numpy') as f:
    metadata = f.metadata()
    assert f.get_tensor('stages.0.rest.layers.conv1.kernel').shape == (
        2, 3, 3, 8, 8)
  assert json.loads(metadata['config'])['width'] == 8
  assert metadata['step'] == '4'
  assert factory.detect_format(output) == 'export'
  for source in (output, workdir):
    state = initialized(run_config(init_from=source),
                        str(tmp_path / 'new_run'))
    assert int(state.step) == 0
    assert_same_arrays((state.params, state.model_state),
                       (final.params, final.model_state))
  # The same weights under every stack layout.
  for layout in (dict(scan_layers=False), dict(scan_segments=2)):
    config = run_config(init_from=output, **layout)
    state = initialized(config, str(tmp_path / 'new_run'))
    assert_same_arrays(state.params, final.params)


def test_a_finished_run_is_read_as_its_weights_alone(trained):
  """predict.py, export.py and --mode=eval read a checkpoint's weights and
  BatchNorm statistics, not the optimizer's moments: the state they hold
  has none, and its weights are the run's last."""
  workdir, _, final = trained
  run = run_state.load_trained(workdir, default.get_config())[1]
  assert run.state.opt_state is None and run.sharding.opt_state is None
  assert run.state.ema is None and int(run.state.step) == 4
  assert_same_arrays((run.state.params, run.state.model_state),
                     (final.params, final.model_state))


def test_export_refuses_a_bad_output_and_writes_nothing(trained, tmp_path):
  with pytest.raises(ValueError, match=r"name the file FILE.safetensors"):
    export.export(trained[0], str(tmp_path / 'model.npz'))
  with pytest.raises(ValueError, match='no checkpoint in'):
    export.export(str(tmp_path), str(tmp_path / 'model.safetensors'))
  assert os.listdir(tmp_path) == []


def test_new_head_for_other_classes_starts_from_zeros_and_is_logged(
    trained, tmp_path, caplog):
  caplog.set_level(logging.INFO)
  workdir, _, final = trained
  config = run_config(dataset='digits_0to4', init_from=workdir)
  before = fresh_state(config)
  state = initialized(config, str(tmp_path / 'finetune'), before)
  assert ('head re-initialised to zeros: the file has 10 classes, the '
          'model 5') in caplog.text
  assert_same_arrays(state.params['head'], jax.tree.map(
      jnp.zeros_like, before.params['head']))
  assert_same_arrays(state.params['stages'], final.params['stages'])
  assert_same_arrays(state.model_state, final.model_state)


def checkpoint_files(workdir) -> dict:
  """{path: (size, mtime)} of every file under the checkpoints."""
  found = {}
  for root, _, files in os.walk(os.path.join(workdir, 'checkpoints')):
    for name in files:
      status = os.stat(os.path.join(root, name))
      found[os.path.join(root, name)] = (status.st_size, status.st_mtime_ns)
  return found


def eval_command(workdir, *overrides):
  return subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py',
       f'--workdir={workdir}', '--mode=eval', *overrides],
      cwd=REPO, capture_output=True, text=True, timeout=300)


def test_eval_mode_evaluates_the_checkpoint_as_trained_and_changes_none(
    trained, tmp_path):
  """No training override repeated: the checkpoint's own config; an eval
  batch size of the command line's."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(trained[0], workdir)
  before = checkpoint_files(workdir)
  events_before = set(glob.glob(os.path.join(workdir, 'events.out.*')))
  result = eval_command(workdir, '--config.batch_size=24')
  assert result.returncode == 0, result.stderr[-3000:]
  assert checkpoint_files(workdir) == before
  trained_eval = read_scalars(trained[0])
  new_files = set(glob.glob(os.path.join(workdir, 'events.out.*'))) - (
      events_before)
  assert len(new_files) == 1
  evaluated = read_scalars_of(new_files.pop())
  # The same state, data and compiled step as the run's own last eval.
  assert evaluated['eval_examples'] == {4: 360.0}
  assert evaluated['eval_accuracy'][4] == pytest.approx(
      trained_eval['eval_accuracy'][4], abs=1e-6)
  assert evaluated['eval_loss'][4] == pytest.approx(
      trained_eval['eval_loss'][4], rel=1e-5)
  assert re.search(r'step 4\): eval_accuracy=[\d.]+, eval_examples=360, '
                   r'eval_loss=', result.stdout)


def test_eval_config_is_the_checkpoints_changed_only_in_what_is_evaluated(
    trained, caplog):
  caplog.set_level(logging.WARNING)
  step_dir = os.path.join(trained[0], 'checkpoints', '4')
  command = default.get_config()  # none of the run's overrides
  command.update(batch_size=24, learning_rate=5.0, eval_split='test')
  command.evals.copy = ml_collections.ConfigDict(
      dict(type='classification', dataset='digits'))
  evaluated = run_state.evaluated_config(
      command, {'batch_size', 'learning_rate'}, step_dir)
  assert (evaluated.num_layers, evaluated.width) == (2, 8)
  assert evaluated.batch_size == 24  # what is evaluated, given
  assert evaluated.eval_split == ''  # what is evaluated, not given
  assert evaluated.learning_rate == run_config().learning_rate
  assert '--config.learning_rate is not used by --mode=eval' in caplog.text
  assert evaluated.evals.copy.dataset == 'digits'  # its config file's
  # Another model than the one trained: refused from the saved config,
  # naming the fix, before any state is restored or anything written
  # (main.py prints it as its one Error line).
  command.update(width=16)
  with pytest.raises(config_error.ConfigError, match=(
      r'^--config.width=16: the checkpoint at step 4 was trained with '
      r'width=8, and --mode=eval evaluates the model as trained; drop the '
      r'override \(or evaluate another --workdir\)$')):
    run_state.evaluated_config(command, {'width'}, step_dir)


def read_scalars_of(path) -> dict:
  """{tag: {step: float}} of one event file."""
  directory = os.path.join(os.path.dirname(path), 'one_file')
  os.makedirs(directory, exist_ok=True)
  shutil.copy(path, directory)
  return read_scalars(directory)


def test_eval_mode_evaluates_init_from_in_a_fresh_workdir(trained, tmp_path):
  workdir, config, _ = trained
  output = str(tmp_path / 'model.safetensors')
  export.export(workdir, output)
  metrics = eval_checkpoint.evaluate_checkpoint(run_config(init_from=output),
                                           str(tmp_path / 'eval'))
  assert metrics['eval_accuracy'] == pytest.approx(
      read_scalars(workdir)['eval_accuracy'][4], abs=1e-6)
  assert not os.path.exists(tmp_path / 'eval' / 'checkpoints')
  with pytest.raises(config_error.ConfigError, match=(
      r'does not fit the data set: the file has 10 classes, the model 5')):
    eval_checkpoint.evaluate_checkpoint(
        run_config(init_from=output, dataset='digits_0to4'),
        str(tmp_path / 'eval5'))
  with pytest.raises(config_error.ConfigError, match='nothing to evaluate'):
    eval_checkpoint.evaluate_checkpoint(run_config(), str(tmp_path / 'empty'))


def test_finished_run_started_again_exits_before_compiling_its_steps(
    trained, caplog):
  caplog.set_level(logging.INFO)
  workdir, config, final = trained
  events = {path: os.path.getsize(path)
            for path in glob.glob(os.path.join(workdir, 'events.out.*'))}
  again = train.train_and_evaluate(config, workdir)
  assert int(again.step) == 4
  assert 'The run is complete' in caplog.text
  # No writer was opened and nothing was logged to TensorBoard.
  assert {path: os.path.getsize(path) for path in
          glob.glob(os.path.join(workdir, 'events.out.*'))} == events
