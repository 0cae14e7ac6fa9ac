"""Gradient accumulation: k micro-batches in one compiled step make one
update, with everything that happens per update happening once.

The references are written by hand: plain forward passes of the model and
the SGD update (Nesterov, momentum 0.9: the first update is lr x 1.9 x the
gradient). Each comparison's rounding floor is measured: the same reference
on the same examples in another order, which changes nothing but the order
of sums.
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data import datasets
import models
from training import compiling
from training import losses
from training import optimizer
from runtime import sharding
from training import run_state
from training import update
import train
from helpers import LEARNING_RATE
from helpers import ULP
from helpers import VIT
from helpers import assert_same_state
from helpers import copy_checkpoint
from helpers import cross_entropy_and_grads
from helpers import initial_state_and_batch
from helpers import max_difference
from helpers import read_scalars
from helpers import tiny_config


def accumulated_step(config, graphdef, state, tx, batch, **kwargs):
  """The trainer's step under `config`, on one device."""
  kwargs = {**train.train_step_kwargs(config, graphdef, tx,
                                      lambda step: LEARNING_RATE), **kwargs}
  return jax.jit(lambda s, b: update.train_step(s, b, **kwargs))(state, batch)


def reference_update(graphdef, state, micro_batches):
  """The first SGD update from the mean gradient of `micro_batches`, each a
  plain forward pass whose BatchNorm statistics the next one starts from:
  (parameters, BatchNorm statistics, mean loss)."""
  model_state, grads, micro_losses = state.model_state, [], []
  for batch in micro_batches:
    (loss, model_state), micro_grads = cross_entropy_and_grads(
        graphdef, state.replace(model_state=model_state), batch)
    grads.append(micro_grads)
    micro_losses.append(loss)
  return (_sgd_first_update(state.params, grads), model_state,
          np.mean(micro_losses))


@jax.jit
def _sgd_first_update(params, grads):
  """The parameters after the first SGD update from the mean of `grads`,
  compiled once rather than once per array."""
  mean_grads = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
  return jax.tree.map(lambda p, g: p - LEARNING_RATE * 1.9 * g, params,
                      mean_grads)


def strided(batch, k):
  """The trainer's micro-batches: examples i, i + k, i + 2k, ..."""
  return [jax.tree.map(lambda x, i=i: x[i::k], batch) for i in range(k)]


def reversed_examples(batches):
  return [jax.tree.map(lambda x: x[::-1], b) for b in batches]


def test_vit_four_micro_batches_of_8_make_the_update_of_one_batch_of_32():
  config = tiny_config(**VIT, optimizer='sgd', weight_decay=0.0,
                       grad_accum_steps=4)
  graphdef, state, tx, batch = initial_state_and_batch(config, 32)
  new_state, metrics = accumulated_step(config, graphdef, state, tx, batch)
  params, _, loss = reference_update(graphdef, state, [batch])
  floor = max_difference(reference_update(
      graphdef, state, reversed_examples([batch]))[0], params)
  difference = max_difference(new_state.params, params)
  assert difference <= 2 * floor + ULP, (difference, floor)
  assert max_difference(params, state.params) > 1e3 * (2 * floor + ULP)
  assert float(metrics['loss']) == pytest.approx(float(loss), rel=1e-6)
  assert int(new_state.step) == 1


def test_resnet_normalises_each_micro_batch_with_its_own_statistics():
  config = tiny_config(optimizer='sgd', weight_decay=0.0, batch_size=32,
                       grad_accum_steps=4)
  graphdef, state, tx, batch = initial_state_and_batch(config, 32)
  new_state, metrics = accumulated_step(config, graphdef, state, tx, batch)
  micro = strided(batch, 4)
  params, model_state, loss = reference_update(graphdef, state, micro)
  other_order = reference_update(graphdef, state, reversed_examples(micro))
  floor = max_difference(other_order[:2], (params, model_state))
  difference = max_difference((new_state.params, new_state.model_state),
                              (params, model_state))
  assert difference <= 2 * floor + ULP, (difference, floor)
  assert float(metrics['loss']) == pytest.approx(float(loss), rel=1e-6)
  # Statistics of the whole batch would have given another update.
  whole_batch = reference_update(graphdef, state, [batch])
  assert max_difference(whole_batch[0], params) > 100 * (2 * floor + ULP)


def test_each_micro_batch_draws_its_own_mixup_ratio_and_dropout_masks():
  config = tiny_config(**VIT, dropout_rate=0.2, mixup_alpha=0.2,
                       grad_accum_steps=4)
  graphdef, state, tx, batch = initial_state_and_batch(config, 32)
  _, metrics = accumulated_step(config, graphdef, state, tx, batch)
  step_key = jax.random.fold_in(jax.random.key(config.seed + 1), 0)
  keys = jax.random.split(step_key, 4)

  @jax.jit  # once, not op by op for each micro-batch
  def micro_loss(micro_batch, key):
    images, loss_of_output, _ = losses.training_inputs(
        micro_batch, key, label_smoothing=0.0, mixup_alpha=0.2)
    model = nnx.merge(graphdef, state.params, state.model_state, copy=True)
    return loss_of_output(model(images, train=True, dropout_key=key))

  micro_losses, ratios = [], []
  for micro_batch, key in zip(strided(batch, 4), keys):
    micro_losses.append(micro_loss(micro_batch, key))
    ratios.append(float(losses.mixup_ratio(jax.random.fold_in(key, 1), 0.2)))
  assert len(set(ratios)) == 4
  assert float(metrics['loss']) == pytest.approx(
      float(np.mean(micro_losses)), rel=1e-5)


def test_pmap_step_accumulates_as_the_jit_step():
  """Each device splits its own rows into its share of every micro-batch,
  so under pmap the micro-batches hold the examples they hold under jit
  (BatchNorm statistics averaged over the devices)."""
  config = tiny_config(grad_accum_steps=2)
  data = datasets.load_digits()
  results = []
  for step_mode in ('jit', 'pmap'):
    config.step_mode = step_mode
    mesh = sharding.create_mesh(config.mesh, config.step_mode)
    lr_fn = lambda step: LEARNING_RATE
    graphdef, state, state_sharding, tx = (
        run_state.create_sharded_train_state(
            config, data.info, lr_fn, mesh,
            dtype=models.compute_dtype(config)))
    batch = jax.device_put(
        {'image': data.train_images[:16], 'label': data.train_labels[:16]},
        sharding.batch_sharding(mesh))
    step, _, _, _ = compiling.compile_train_step(
        step_mode, mesh, functools.partial(
            update.train_step,
            **train.train_step_kwargs(config, graphdef, tx, lr_fn)),
        state_sharding, state, batch)
    results.append(step(state, batch))
  (jit_state, jit_metrics), (pmap_state, pmap_metrics) = results
  assert float(pmap_metrics['loss']) == pytest.approx(
      float(jit_metrics['loss']), rel=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
               (pmap_state.params, pmap_state.model_state),
               (jit_state.params, jit_state.model_state))


def test_a_non_finite_micro_batch_skips_the_whole_update():
  config = tiny_config(batch_size=32, grad_accum_steps=4,
                       skip_nonfinite_steps=1)
  graphdef, state, tx, batch = initial_state_and_batch(config, 32)
  batch['image'] = batch['image'].at[5].set(jnp.nan)  # in micro-batch 1
  new_state, metrics = accumulated_step(config, graphdef, state, tx, batch)
  assert float(metrics['skipped_steps']) == 1.0
  assert int(new_state.step) == 1 and int(new_state.nonfinite_streak) == 1
  assert_same_state(new_state.replace(step=state.step), state)


def test_float16_loss_scale_acts_once_per_update():
  """Halved once when any micro-batch overflows; else its count of finite
  steps grows by one per update, not per micro-batch."""
  config = tiny_config(batch_size=32, grad_accum_steps=4, half_precision=True,
                       half_precision_dtype='float16', skip_nonfinite_steps=1)
  graphdef, state, tx, batch = initial_state_and_batch(config, 32)
  scale = float(state.loss_scale.scale)
  finite_state, _ = accumulated_step(config, graphdef, state, tx, batch)
  assert float(finite_state.loss_scale.scale) == scale
  assert int(finite_state.loss_scale.fin_steps) == 1
  batch['image'] = batch['image'].at[5].set(jnp.inf)  # in micro-batch 1
  overflowed, _ = accumulated_step(config, graphdef, state, tx, batch)
  assert float(overflowed.loss_scale.scale) == scale / 2
  assert int(overflowed.loss_scale.fin_steps) == 0
  jax.tree.map(np.testing.assert_array_equal, overflowed.params,
               state.params)


def test_accumulating_run_logs_and_saves_per_update_and_resumes_bit_exact(
    tmp_path):
  config = tiny_config(grad_accum_steps=2, mixup_alpha=0.2, num_train_steps=4,
                       log_every_steps=1, checkpoint_every_steps=2,
                       eval_every_steps=4)
  whole = train.train_and_evaluate(config, str(tmp_path / 'whole'))
  scalars = read_scalars(str(tmp_path / 'whole'))
  assert sorted(scalars['train_loss']) == [1, 2, 3, 4]
  lr_fn = optimizer.learning_rate_schedule(config, 4, 1437 // 16)
  for step, rate in scalars['train_learning_rate'].items():
    assert rate == pytest.approx(float(lr_fn(step - 1)))
  copy_checkpoint(str(tmp_path / 'whole'), 2, tmp_path / 'resumed')
  resumed = train.train_and_evaluate(config, str(tmp_path / 'resumed'))
  assert_same_state(resumed, whole)
