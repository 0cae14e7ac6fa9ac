"""The trainer: compiled steps over devices, logging, checkpoints, resume."""

import concurrent.futures
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from clu import metric_writers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from runtime import goodput
from runtime import config_error
from data import datasets
import input_pipeline
import processes
from training import optimizer
from training import reporting
from training import run_state
from training import flop_count
from training import update
import train
from helpers import REPO
from helpers import foreign_lines
from helpers import read_scalars
from helpers import tiny_config

CONTRACT_TAGS = {
    'train_loss', 'train_accuracy', 'train_learning_rate', 'steps_per_second',
    'eval_loss', 'eval_accuracy', 'eval_examples', 'compile_seconds',
    'memory_temp_bytes', 'memory_argument_bytes', 'memory_output_bytes',
    'step_flops'}


def step_on(devices, config, state, graphdef, tx, lr_fn, batch):
  mesh = jax.sharding.Mesh(np.array(devices), ('data',))
  step = jax.jit(
      lambda s, b: update.train_step(
          s, b, graphdef=graphdef, tx=tx, learning_rate_fn=lr_fn,
          label_smoothing=0.1, dropout_seed=1),
      in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))))
  return step(state, batch)


def test_train_step_on_eight_devices_matches_one_device():
  assert jax.device_count() == 8
  config = tiny_config()
  data = datasets.load_digits()
  lr_fn = optimizer.learning_rate_schedule(config, 10, 0)  # no warmup
  graphdef, state, tx = run_state.create_train_state(
      config, data.info, lr_fn, dtype=models.compute_dtype(config))
  batch = {'image': data.train_images[:16], 'label': data.train_labels[:16]}
  state8, metrics8 = step_on(jax.devices(), config, state, graphdef, tx,
                             lr_fn, batch)
  state1, metrics1 = step_on(jax.devices()[:1], config, state, graphdef, tx,
                             lr_fn, batch)
  np.testing.assert_allclose(metrics8['loss'], metrics1['loss'], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               (state8.params, state8.model_state),
               (state1.params, state1.model_state))
  # The step really moved the parameters.
  assert not np.allclose(state8.params['head']['kernel'],
                         state.params['head']['kernel'])


def step_of(**overrides):
  """The trainer's step arguments, initial state and a batch of zeros for
  `tiny_config(**overrides)`."""
  config = tiny_config(**overrides)
  size = config.image_size
  info = input_pipeline.DatasetInfo(10, (size, size, 1), 100, 10)
  lr_fn = optimizer.learning_rate_schedule(config, 10, 1)
  graphdef, state, tx = run_state.create_train_state(
      config, info, lr_fn, dtype=models.compute_dtype(config))
  batch = {'image': jnp.zeros((16, size, size, 1)),
           'label': jnp.zeros((16,), jnp.int32)}
  kwargs = train.train_step_kwargs(config, graphdef, tx, lr_fn)
  return graphdef, kwargs, state, batch


def reported_and_compiled_flops(**overrides):
  """The trainer's step_flops for a config, and XLA's count for the compiled
  step of that same config."""
  graphdef, kwargs, state, batch = step_of(**overrides)
  reported = flop_count.true_step_flops(update.train_step, graphdef, kwargs, state, batch)
  compiled = jax.jit(lambda s, b: update.train_step(s, b, **kwargs)).lower(
      state, batch).compile()
  return reported, compiled.cost_analysis()['flops']


def test_step_flops_of_a_scanned_model_counts_every_layer():
  vit = dict(model='ViT_Ti16', image_size=32, num_layers=4)
  scanned, xla_rolled = reported_and_compiled_flops(
      **vit, scan_layers=True, scan_unroll=1, remat_policy='full')
  looped, xla_looped = reported_and_compiled_flops(
      **vit, scan_layers=False, remat_policy='none')
  assert scanned == looped
  # XLA's own count agrees on the Python loop, undercounts the rolled scan.
  assert scanned == pytest.approx(xla_looped, rel=0.01)
  assert xla_rolled < 0.5 * scanned


def test_step_flops_of_an_accumulating_step_count_every_micro_batch():
  whole, _ = reported_and_compiled_flops(scan_unroll=1)
  accumulated, xla_rolled = reported_and_compiled_flops(scan_unroll=1,
                                                        grad_accum_steps=2)
  assert accumulated == pytest.approx(whole, rel=0.01)
  # XLA's own count of the rolled loop over micro-batches sees one.
  assert xla_rolled < 0.6 * accumulated


def test_step_flops_grow_linearly_with_depth():
  # Three depths make two increments; the smallest ones compile fastest.
  flops = {depth: flop_count.true_step_flops(update.train_step, *step_of(num_layers=depth,
                                                scan_unroll=1))
           for depth in (1, 2, 3)}
  assert flops[3] - flops[2] == pytest.approx(flops[2] - flops[1], rel=1e-3)
  assert flops[2] > flops[1]


def test_run_writes_contract_tags_and_checkpoints_then_resumes(tmp_path):
  workdir = str(tmp_path)
  config = tiny_config()
  final = train.train_and_evaluate(config, workdir)
  assert int(final.step) == 8
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == ['4', '8']
  scalars = read_scalars(workdir)
  assert CONTRACT_TAGS <= set(scalars)
  assert sorted(scalars['train_loss']) == [2, 4, 6, 8]
  assert sorted(scalars['eval_accuracy']) == [4, 8]
  assert scalars['eval_examples'][8] == 360  # the whole held-out split
  assert scalars['step_flops'][0] > 0 and scalars['compile_seconds'][0] > 0
  # The warmup of 178 steps is cut to 10% of the 8 steps (0): each logged
  # rate is the one of the logged step's update, not the mean over the
  # logging window.
  lr_fn = optimizer.learning_rate_schedule(
      config, 8, optimizer.steps_per_epoch(config, datasets.load_digits().info))
  assert scalars['train_learning_rate'] == {
      step: pytest.approx(float(lr_fn(step - 1)), rel=1e-6)
      for step in (2, 4, 6, 8)}

  # Lose the last checkpoint; the same command resumes from step 4 and
  # ends where the uninterrupted run ended, bit for bit.
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '8'))
  resumed = train.train_and_evaluate(config, workdir)
  assert int(resumed.step) == 8
  jax.tree.map(np.testing.assert_array_equal,
               (final.params, final.model_state, final.opt_state),
               (resumed.params, resumed.model_state, resumed.opt_state))
  scalars = read_scalars(workdir)
  assert scalars['compile_seconds'].keys() == {0, 4}  # the resumed start


def test_writes_before_tensorflow_has_imported_reach_the_event_files(
    tmp_path):
  """The writer of a launch whose TensorFlow import is still under way
  keeps the first steps' scalars in order and writes them once the import
  is done; a flush waits for it, its wait a 'tensorflow' startup phase."""
  imported = concurrent.futures.Future()
  timeline = goodput.Timeline()
  timeline.switch('steps')
  writer = reporting.PendingWriter(
      imported, lambda: metric_writers.create_default_writer(str(tmp_path)),
      timeline)
  writer.write_scalars(1, {'train_loss': 2.5})
  writer.write_scalars(2, {'train_loss': 2.0})
  assert not os.listdir(tmp_path)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pool.submit(lambda: (timeline_waits(timeline), imported.set_result(None)))
    writer.flush()
  writer.write_scalars(3, {'train_loss': 1.5})
  writer.flush()
  assert read_scalars(str(tmp_path))['train_loss'] == {1: 2.5, 2: 2.0, 3: 1.5}
  assert timeline.seconds['tensorflow'] > 0
  assert timeline.activity == 'steps'


def timeline_waits(timeline: goodput.Timeline):
  """Returns once `timeline` has switched to 'tensorflow'."""
  while timeline.activity != 'tensorflow':
    time.sleep(0.01)


def test_completed_run_started_again_does_no_more_steps(tmp_path):
  """Started again with another learning rate (a key that may change on
  resume), it returns the saved state as it is: a run that restarted from
  scratch would train to other parameters."""
  config = tiny_config(num_train_steps=2, eval_every_steps=2,
                       checkpoint_every_steps=2)
  saved = train.train_and_evaluate(config, str(tmp_path))
  again = train.train_and_evaluate(
      tiny_config(num_train_steps=2, eval_every_steps=2,
                  checkpoint_every_steps=2, learning_rate=0.5),
      str(tmp_path))
  assert int(again.step) == 2
  jax.tree.map(np.testing.assert_array_equal,
               (saved.params, saved.model_state, saved.opt_state),
               (again.params, again.model_state, again.opt_state))
  initial = run_state.create_train_state(
      config, datasets.load_digits().info, lambda step: 0.0,
      dtype=models.compute_dtype(config))[1]
  assert not np.array_equal(saved.params['head']['kernel'],
                            initial.params['head']['kernel'])


@pytest.mark.parametrize('overrides, message', [
    (dict(model='ResNet51'), 'valid names: ResNet18'),
    (dict(optimizer='lamb'), 'valid names: sgd, adamw, lars'),
    (dict(remat_policy='most'), 'valid names: none, full'),
    (dict(dataset='mnist_digits'), 'valid names: digits, fake'),
    (dict(batch_size=12), 'not divisible by the 8 devices'),
    (dict(batch_size=0), 'batch_size must be positive'),
    (dict(num_train_steps=0), 'num_train_steps > 0'),
    (dict(num_train_steps=-1, num_epochs=0.0), 'num_epochs > 0'),
    (dict(learning_rate=0.0), 'learning_rate must be positive'),
    (dict(grad_accum_steps=3), 'grad_accum_steps 3 does not divide the 16 '
     'examples each process loads per step; use a divisor of 2'),
    (dict(grad_accum_steps=4), 'micro-batches of 4 examples, which do not '
     'split evenly over the 8 devices; use a divisor of 2'),
    (dict(grad_accum_steps=0), 'grad_accum_steps 0 must be >= 1'),
])
def test_bad_config_is_refused_before_anything_is_written(tmp_path, overrides,
                                                          message):
  with pytest.raises(config_error.ConfigError, match=message):
    train.train_and_evaluate(tiny_config(**overrides), str(tmp_path))
  assert os.listdir(tmp_path) == []


def test_bad_config_on_the_command_line_is_one_line_and_keeps_the_workdir(
    tmp_path):
  config = tiny_config(num_train_steps=2, eval_every_steps=2,
                       checkpoint_every_steps=2)
  train.train_and_evaluate(config, str(tmp_path))
  before = sorted(os.listdir(tmp_path)) + sorted(
      os.listdir(tmp_path / 'checkpoints'))
  result = subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py',
       f'--workdir={tmp_path}', '--config.model=ResNet51'],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1].startswith(
      "Error: unknown model 'ResNet51'; valid names:")
  assert before == sorted(os.listdir(tmp_path)) + sorted(
      os.listdir(tmp_path / 'checkpoints'))


@pytest.mark.slow
@pytest.mark.xdist_group('quick_start')
def test_default_config_trains_to_97_percent_from_the_command_line(
    quick_start):
  """The README's quick start, as a user runs it: one process, one device."""
  workdir, console = quick_start
  accuracy = read_scalars(str(workdir))['eval_accuracy']
  assert accuracy[max(accuracy)] >= 0.97
  assert len(console) <= 60 and not foreign_lines(console), console


def test_keep_checkpoints_keeps_only_the_newest(tmp_path):
  config = tiny_config(num_train_steps=6, checkpoint_every_steps=1,
                       keep_checkpoints=2, eval_every_steps=6)
  train.train_and_evaluate(config, str(tmp_path))
  checkpoints = str(tmp_path / 'checkpoints')
  assert sorted(int(step) for step in os.listdir(checkpoints)) == [5, 6]
  # A longer run in the same workdir goes on pruning.
  config.num_train_steps = 8
  train.train_and_evaluate(config, str(tmp_path))
  assert sorted(int(step) for step in os.listdir(checkpoints)) == [7, 8]


DIGITS_WITHOUT_SKLEARN = '''
import sys
from data import datasets
datasets.load_digits()
assert 'sklearn' not in sys.modules and 'scipy' not in sys.modules
'''


def test_digits_are_scikit_learns_and_load_without_importing_it():
  from sklearn import datasets as sklearn_datasets  # pylint: disable=g-import-not-at-top
  digits = sklearn_datasets.load_digits()
  images = digits.images.astype(np.float32)[..., None] / 16
  held_out = np.random.default_rng(0).permutation(len(images))
  train_rows, held_out = held_out[:-360], held_out[-360:]
  mean, std = images[train_rows].mean(), images[train_rows].std()
  for classes in (10, 5):
    loaded = datasets.load_digits(classes)
    train_rows_kept = train_rows[digits.target[train_rows] < classes]
    held_out_kept = held_out[digits.target[held_out] < classes]
    np.testing.assert_array_equal(loaded.train_labels,
                                  digits.target[train_rows_kept])
    np.testing.assert_array_equal(loaded.eval_labels,
                                  digits.target[held_out_kept])
    np.testing.assert_array_equal(loaded.train_images,
                                  (images[train_rows_kept] - mean) / std)
    np.testing.assert_array_equal(loaded.eval_images,
                                  (images[held_out_kept] - mean) / std)
  subprocess.run([sys.executable, '-c', DIGITS_WITHOUT_SKLEARN], cwd=REPO,
                 check=True, timeout=120)


# A training launch as a user runs it, reporting at its exit which of the
# packages that Keras and Flax import for helpers of their own the process
# holds, and how many full collections ran before any object was frozen.
LAUNCH_REPORTING_IMPORTS = '''
import atexit, gc, runpy, sys
unfrozen_full_collections = []
gc.callbacks.append(lambda phase, info: unfrozen_full_collections.append(1)
                    if phase == 'start' and info['generation'] == 2 and
                    not gc.get_freeze_count() else None)
atexit.register(lambda: print('imported', sorted(
    name for name in ('sklearn', 'scipy.stats', 'matplotlib', 'IPython')
    if name in sys.modules), 'unfrozen full collections',
    len(unfrozen_full_collections)))
sys.argv = ['main.py', '--config=configs/default.py', '--workdir=' + sys.argv[1],
            '--config.num_train_steps=2']
runpy.run_path('main.py', run_name='__main__')
'''


def test_a_launch_imports_without_optional_packages_or_full_collections(
    tmp_path):
  """Keras (under TensorFlow and CLU's writer) would import scikit-learn
  with SciPy's statistics, and matplotlib's pyplot: a second of CPU in
  every launch; Flax and Keras, IPython: 0.3 s more. A launch trains and
  writes its events without them, and they still import for anything
  else. Python's collector rescans no object that the launch's module
  imports made: they are frozen before its first full collection."""
  result = subprocess.run(
      [sys.executable, '-c', LAUNCH_REPORTING_IMPORTS, str(tmp_path / 'run')],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
      env=processes.one_device_environment())
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines()[-1] == (
      'imported [] unfrozen full collections 0'), result.stdout
  assert os.listdir(tmp_path / 'run' / 'checkpoints') == ['2']
  scalars = read_scalars(tmp_path / 'run')
  assert 'eval_accuracy' in scalars and 'train_loss' in scalars, scalars
  check = ('import sys; from runtime import lean_imports; '
           'lean_imports.leave_optional_imports_out(); '
           'import flax.nnx, tensorflow, keras; '
           "assert not {'sklearn', 'IPython'} & set(sys.modules); "
           'import sklearn.base, matplotlib.pyplot, IPython')
  subprocess.run([sys.executable, '-c', check], cwd=REPO, check=True,
                 timeout=300, env=processes.one_device_environment())
