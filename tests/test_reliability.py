"""Reliability: kills and signals, corrupted checkpoints, divergence, and
configs that do not fit a workdir. Real processes and signals. (Bad inputs,
refused before anything is written: tests/test_bad_inputs.py.)"""

import functools
import glob
import hashlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from runtime import network_keys
from training import compiling
from runtime import config_error
from data import datasets
from training import config_compatibility
from training import nonfinite
from training import optimizer
from runtime import preemption
from runtime import sharding
from training import run_state
from training import update
import train
import processes
from helpers import DETERMINISTIC_TAGS
from helpers import LOG_LINE
from helpers import VIT
from helpers import REPO
from helpers import assert_same_state
from helpers import events
from helpers import restore_final
from helpers import tiny_config
from helpers import write_checkpoint


KILL_RUN = dict(num_layers=2, width=8, batch_size=16, num_train_steps=30,
                log_every_steps=5, eval_every_steps=10, steps_per_eval=2,
                checkpoint_every_steps=10,
                # DeiT's parts on: their randomness resumes with the step.
                drop_path_rate=0.1, mixup_alpha=0.8, cutmix_alpha=1.0,
                repeated_augments=3, ema_decay=0.99, label_smoothing=0.1,
                min_learning_rate=1e-4,
                # Fine-tuning's: a frozen stem, decayed stages.
                trainable='stages/.*|head/.*', layer_decay=0.75)


@pytest.mark.slow
def test_sigkill_after_first_checkpoint_then_resume_is_bit_identical(
    tmp_path, caplog):
  reference_dir, killed_dir = str(tmp_path / 'ref'), str(tmp_path / 'killed')
  # Distilled from a frozen teacher, which no checkpoint holds: each start
  # reads it again from its file.
  teacher_dir = tmp_path / 'teacher'
  write_checkpoint(teacher_dir, tiny_config(num_layers=2, width=8, seed=5),
                   datasets.load_digits().info, noise=0.3)
  overrides = {**KILL_RUN, 'teacher_model': 'SmallResNet',
               'teacher_init_from': str(teacher_dir),
               'distillation_type': 'soft'}
  config = tiny_config(**overrides)
  reference = train.train_and_evaluate(config, reference_dir)

  command = processes.main_command(killed_dir, overrides)
  environment = dict(os.environ)
  first = os.path.join(killed_dir, 'checkpoints', '10')
  with processes.Processes([command], [environment]) as run:
    deadline = time.monotonic() + 300
    while not os.path.isdir(first) and run.popens[0].poll() is None:
      assert time.monotonic() < deadline, (
          f'no checkpoint at step 10 in 300 s:{run.stacks()}')
      time.sleep(0.02)
    run.popens[0].send_signal(signal.SIGKILL)
    # Killed, not finished.
    assert run.wait(timeout=60) == [-signal.SIGKILL], run.log(0)[-3000:]
  killed_at = max(checkpointing.create_manager(killed_dir, 3).all_steps())
  assert 10 <= killed_at < 30

  # The kill needs a process; the resume is the trainer's own, in process
  # (main.py's relaunch after a kill: tests/test_restarts.py).
  with caplog.at_level(logging.INFO):
    train.train_and_evaluate(config, killed_dir)
  assert f'Restored checkpoint at step {killed_at}' in caplog.text

  assert_same_state(restore_final(killed_dir, config), reference)
  reference_events, killed_events = events(reference_dir), events(killed_dir)
  for tag in DETERMINISTIC_TAGS:
    # Same steps, each once, same values: the killed run's events after its
    # checkpoint were dropped and written again by the resumed run.
    assert killed_events[tag] == reference_events[tag], tag
  assert [s for s, _ in killed_events['compile_seconds']] == [0, killed_at]


@pytest.mark.slow
def test_sigusr1_prints_every_stack_and_sigterm_stops_within_a_step_and_saves(
    tmp_path):
  workdir = str(tmp_path)
  command = processes.main_command(workdir, dict(
      num_layers=2, width=8, batch_size=16, num_train_steps=100_000,
      log_every_steps=1, eval_every_steps=100_000,
      checkpoint_every_steps=100_000))
  with processes.Processes([command], [dict(os.environ)]) as run:
    run.wait_for_line(0, lambda line: (
        (m := processes.LOGGED_STEP.search(line)) and int(m[1]) >= 20),
                      timeout=300)
    # A wait past its deadline fails with the stack of every thread, which
    # the trainer prints on SIGUSR1 and goes on.
    with pytest.raises(AssertionError, match=r'(?s)still running after 1 s'
                       r'.*Thread 0x.*in train_loop'):
      run.wait(timeout=1)
    assert run.popens[0].poll() is None
    signalled_after = max(int(m[1]) for line in list(run.lines[0])
                          if (m := processes.LOGGED_STEP.search(line)))
    run.popens[0].send_signal(signal.SIGTERM)
    codes = run.wait(timeout=120)
    rest = run.log(0)
  assert codes == [0], rest[-3000:]
  stopped = [l for l in rest.splitlines() if 'Stopped by SIGTERM' in l]
  assert len(stopped) == 1, rest[-3000:]
  step = int(stopped[0].split('after step ')[1].split()[0])
  # The loop is at most one step ahead of what it has logged; it finishes
  # that step and stops.
  assert signalled_after <= step <= signalled_after + 2
  assert checkpointing.create_manager(workdir, 3).all_steps() == [step]
  assert max(s for s, _ in events(workdir)['train_loss']) == step


def test_sigint_in_process_stops_at_the_next_step_with_a_checkpoint(tmp_path):
  workdir = str(tmp_path)
  config = tiny_config(num_train_steps=100_000, log_every_steps=1,
                       eval_every_steps=100_000, checkpoint_every_steps=5)
  first = os.path.join(workdir, 'checkpoints', '5')

  def interrupt_after_first_checkpoint():
    # Interrupts anyway after a while, so that a run that never saves
    # fails the assertions below instead of training for ever.
    deadline = time.monotonic() + 300
    while not os.path.isdir(first) and time.monotonic() < deadline:
      time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)

  # What was installed before (Python's own handler, or SIG_IGN when the
  # suite runs as a background job) must be back afterwards.
  handler_before = signal.getsignal(signal.SIGINT)
  threading.Thread(target=interrupt_after_first_checkpoint, daemon=True).start()
  with preemption.StopRequest() as stop_request:
    state = train.train_and_evaluate(config, workdir, stop_request)
  assert stop_request.signal_name == 'SIGINT'
  step = int(state.step)
  assert 5 <= step < 100
  assert max(checkpointing.create_manager(workdir, 3).all_steps()) == step
  assert signal.getsignal(signal.SIGINT) is handler_before


def _tree_digest(directory) -> dict:
  return {os.path.relpath(p, directory): hashlib.sha256(
      open(p, 'rb').read()).hexdigest()
          for p in glob.glob(os.path.join(directory, '**'), recursive=True)
          if os.path.isfile(p)}


def test_truncated_latest_checkpoint_is_set_aside_and_the_run_resumes(
    tmp_path, caplog):
  workdir = str(tmp_path)
  config = tiny_config()
  final = train.train_and_evaluate(config, workdir)
  checkpoints = tmp_path / 'checkpoints'
  # Damage the newest checkpoint: truncate its largest data file.
  data = max(glob.glob(str(checkpoints / '8' / 'state' / 'd' / '*')),
             key=os.path.getsize)
  size = os.path.getsize(data)
  with open(data, 'r+b') as f:
    f.truncate(size // 2)
  damaged = _tree_digest(checkpoints / '8')
  # And leave a half-written save behind, as a kill during saving does.
  shutil.copytree(checkpoints / '4', checkpoints / '12.orbax-checkpoint-tmp')

  with caplog.at_level(logging.WARNING):
    resumed = train.train_and_evaluate(config, workdir)
  assert 'Checkpoint at step 8 is unreadable' in caplog.text
  # Resumed from step 4, retrained to the same parameters, bit for bit.
  assert_same_state(resumed, final)
  assert sorted(os.listdir(checkpoints)) == ['4', '8']
  # The damaged checkpoint is kept, byte for byte, out of the way.
  assert _tree_digest(tmp_path / 'corrupt_checkpoints' / '8') == damaged


def test_divergent_run_stops_naming_the_step_and_keeps_the_last_checkpoint(
    tmp_path):
  workdir = str(tmp_path)
  train.train_and_evaluate(tiny_config(num_train_steps=4), workdir)
  before = _tree_digest(tmp_path / 'checkpoints')
  diverging = tiny_config(num_train_steps=40, learning_rate=1e9,
                          warmup_epochs=0.0, checkpoint_every_steps=100)
  with pytest.raises(nonfinite.NonFiniteError,
                     match=r'non-finite loss or gradients at step (\d+) .*'
                     r'last good checkpoint: step 4 in .*checkpoints '
                     r'\(untouched\)') as error:
    train.train_and_evaluate(diverging, workdir)
  bad_step = int(error.value.args[0].split('at step ')[1].split()[0])
  assert _tree_digest(tmp_path / 'checkpoints') == before
  assert bad_step == first_skipped_step(diverging, workdir, start_step=4)


def first_skipped_step(config, workdir, start_step):
  """Replays `config` from the checkpoint at `start_step` one step at a time
  with an unbounded skip budget; the first step its train step skips."""
  data = datasets.load_digits()
  lr_fn = optimizer.learning_rate_schedule(
      config, optimizer.num_train_steps(config, data.info),
      optimizer.steps_per_epoch(config, data.info))
  graphdef, state, tx = run_state.create_train_state(
      config, data.info, lr_fn, dtype=models.compute_dtype(config))
  mesh = sharding.create_mesh(config.mesh, config.step_mode)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  batch_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('data'))
  manager = checkpointing.create_manager(workdir, 3)
  state = checkpointing.restore_latest(
      manager, jax.device_put(state, replicated),
      compatibility.as_json(config)).state
  manager.close()
  assert int(state.step) == start_step
  batches = data.train_batches(config.batch_size, config.seed, start_step,
                               batch_sharding, jnp.float32)
  first_batch = next(batches)
  batches = itertools.chain([first_batch], batches)
  step, _ = compiling.compile_step(functools.partial(
      update.train_step, graphdef=graphdef, tx=tx, learning_rate_fn=lr_fn,
      label_smoothing=config.label_smoothing, dropout_seed=config.seed + 1,
      skip_nonfinite_steps=10**6), replicated, batch_sharding,
      state, first_batch, out_shardings=(replicated, replicated),
      donate_state=False)
  for number in range(start_step + 1, config.num_train_steps + 1):
    state, metrics = step(state, next(batches))
    if metrics['skipped_steps'] == 1:
      return number
  return None


def nan_and_good_batches():
  data = datasets.load_digits()
  good = {'image': jnp.asarray(data.train_images[:16]),
          'label': jnp.asarray(data.train_labels[:16])}
  nan = dict(good, image=good['image'].at[0, 0, 0, 0].set(jnp.nan))
  return data.info, good, nan


@pytest.mark.parametrize('max_skips', [0, 1])
def test_a_nonfinite_step_is_not_applied_and_a_streak_freezes_the_state(
    max_skips):
  config = tiny_config()
  info, good, nan = nan_and_good_batches()
  lr_fn = optimizer.learning_rate_schedule(config, 10, 0)
  graphdef, state, tx = run_state.create_train_state(
      config, info, lr_fn, dtype=models.compute_dtype(config))
  step = jax.jit(lambda s, b: update.train_step(
      s, b, graphdef=graphdef, tx=tx, learning_rate_fn=lr_fn,
      label_smoothing=0.0, dropout_seed=1, skip_nonfinite_steps=max_skips))

  skipped, metrics = step(state, nan)
  assert int(skipped.step) == 1 and int(skipped.nonfinite_streak) == 1
  assert not np.isfinite(metrics['grad_norm'])
  jax.tree.map(np.testing.assert_array_equal,
               (skipped.params, skipped.model_state, skipped.opt_state),
               (state.params, state.model_state, state.opt_state))
  after, _ = step(skipped, good)
  if max_skips == 0:  # frozen: nothing moves until the host stops the run
    assert_same_state(after, skipped)
    assert int(after.nonfinite_streak) == 1
  else:  # the good step applies, as if the skipped one had not happened
    expected, _ = step(state.replace(step=jnp.ones((), jnp.int32)), good)
    assert_same_state(after, expected)
    assert int(after.nonfinite_streak) == 0
    assert metrics['skipped_steps'] == 1


def test_skipping_counts_skipped_steps_on_tensorboard_then_stops(tmp_path):
  workdir = str(tmp_path)
  config = tiny_config(num_train_steps=40, learning_rate=1e9,
                       warmup_epochs=0.0, skip_nonfinite_steps=3,
                       log_every_steps=1)
  with pytest.raises(nonfinite.NonFiniteError, match=r'4 such steps in a row, '
                     r'skip_nonfinite_steps=3'):
    train.train_and_evaluate(config, workdir)
  skipped = dict(events(workdir)['train_skipped_steps'])
  # Each logged step counts itself; the three skipped before the stop show.
  assert set(skipped.values()) <= {0.0, 1.0}
  assert sum(skipped.values()) >= 3


def test_shape_changing_config_is_refused_and_harmless_one_is_logged(
    tmp_path, caplog, monkeypatch):
  workdir = str(tmp_path)
  train.train_and_evaluate(tiny_config(num_train_steps=4), workdir)
  before = _tree_digest(tmp_path)
  with pytest.raises(config_error.ConfigError, match=(
      r'another model: num_layers: 2 -> 3, width: 8 -> 16; use a new '
      r'--workdir')):
    train.train_and_evaluate(
        tiny_config(num_train_steps=8, num_layers=3, width=16), workdir)
  # A shape change through a key not listed as shape-changing is still
  # caught by the checkpoint's array shapes, and the checkpoint is kept.
  monkeypatch.setattr(network_keys, 'ARRAY_KEYS',
                      dict.fromkeys(network_keys.ARRAY_KEYS, ()))
  with pytest.raises(config_error.ConfigError,
                     match=r'other array shapes .*width'):
    train.train_and_evaluate(tiny_config(num_train_steps=8, width=16),
                             workdir)
  assert _tree_digest(tmp_path) == before
  monkeypatch.undo()

  with caplog.at_level(logging.INFO):
    state = train.train_and_evaluate(
        tiny_config(num_train_steps=6, learning_rate=0.05), workdir)
  assert int(state.step) == 6
  assert ('harmless keys: learning_rate: 0.1 -> 0.05, num_train_steps: 4 -> 6'
          in caplog.text)


def test_a_convnext_without_its_layer_scales_is_another_network_but_not_another_initial_value():
  """layer_scale_init=None leaves a ConvNeXt's layer scales out (its
  arrays change); another value only starts them elsewhere."""
  saved = compatibility.as_json(tiny_config(model='ConvNeXt_T'))
  assert config_compatibility.config_differences(
      saved, compatibility.as_json(
          tiny_config(model='ConvNeXt_T', layer_scale_init=None))) == (
          ['layer_scale_init'], [])
  assert config_compatibility.config_differences(
      saved, compatibility.as_json(
          tiny_config(model='ConvNeXt_T', layer_scale_init=1e-5))) == (
          [], ['layer_scale_init'])


def test_a_resume_that_changes_what_the_network_computes_is_refused(
    tmp_path):
  """vit_gelu changes no array's shape: only the table of the keys that
  define the network tells the resume that it would train another one."""
  run = dict(VIT, num_layers=1, image_size=16, dataset='fake', width=8,
             batch_size=16, num_train_steps=2, log_every_steps=1,
             eval_every_steps=2, checkpoint_every_steps=2)
  train.train_and_evaluate(tiny_config(**run), str(tmp_path))
  before = _tree_digest(tmp_path)
  done = subprocess.run(
      processes.main_command(tmp_path, run | {'vit_gelu': 'exact'}),
      cwd=REPO, env=processes.one_device_environment(), capture_output=True,
      text=True, timeout=300, check=False)
  assert done.returncode == 1, done.stderr[-3000:]
  assert [line for line in done.stderr.splitlines()
          if not LOG_LINE.fullmatch(line)] == [
              'Error: the workdir holds checkpoints (step 2) of another '
              "model: vit_gelu: 'tanh' -> 'exact'; use a new --workdir, or "
              'the saved values to resume (--config.vit_gelu=tanh)'], (
                  done.stderr[-3000:])
  assert _tree_digest(tmp_path) == before


def test_drop_events_after_keeps_the_restored_step_and_earlier_ones(
    tmp_path):
  from clu import metric_writers  # pylint: disable=g-import-not-at-top
  writer = metric_writers.create_default_writer(str(tmp_path))
  for step in (0, 2, 4):
    writer.write_scalars(step, {'train_loss': float(step)})
  writer.close()
  preemption.drop_events_after(str(tmp_path), 2)
  assert events(str(tmp_path))['train_loss'] == [(0, 0.0), (2, 2.0)]
  preemption.drop_events_after(str(tmp_path), 0)  # restored at step 0
  assert events(str(tmp_path))['train_loss'] == [(0, 0.0)]
  assert len(glob.glob(str(tmp_path / '*'))) == 1  # no temporary file left
