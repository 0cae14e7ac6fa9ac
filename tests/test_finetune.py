"""`trainable`: only the matching parameters get gradients, updates and
optimizer state; the frozen ones stay as they were, bit for bit."""

import functools
import os
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from training import trainable as trainable_lib
import train
from test_grad_accum import VIT
from test_grad_accum import setup
from test_train import tiny_config

LEARNING_RATE = 0.1
PROBE = 'head/.*'
ADAMW = dict(optimizer='adamw', weight_decay=0.05,
             weight_decay_form='pytorch')


def run_steps(config, num_steps=2, batch_size=16):
  """The initial and the final state of `num_steps` trainer steps on one
  batch of `config`'s model, at a constant learning rate."""
  graphdef, state, tx, batch = setup(config, batch_size)
  kwargs = train.train_step_kwargs(config, graphdef, tx,
                                   lambda step: LEARNING_RATE)
  step = jax.jit(lambda s, b: train.train_step(s, b, **kwargs))
  final = state
  for _ in range(num_steps):
    final, metrics = step(final, batch)
  return graphdef, state, final, metrics, batch


def named(tree) -> dict:
  return {trainable_lib.param_name(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_frozen_parameters_stay_bit_identical_while_trained_ones_move():
  config = tiny_config(trainable='stem/.*|head/.*', grad_accum_steps=2,
                       ema_decay=0.5, grad_clip_norm=1.0, **ADAMW)
  _, initial, final, metrics, _ = run_steps(config)
  before, after = named(initial.params), named(final.params)
  assert sorted(n for n in before if not np.array_equal(
      before[n], after[n])) == ['head/bias', 'head/kernel', 'stem/kernel']
  jax.tree.map(np.testing.assert_array_equal, initial.model_state,
               final.model_state)  # every BatchNorm's parameters are frozen
  assert np.isfinite(metrics['grad_norm']) and metrics['grad_norm'] > 0


def test_batch_norms_with_frozen_parameters_keep_their_statistics():
  """timm's frozen BatchNorm: in training too, a BatchNorm whose scale and
  bias are frozen normalises with its running statistics and keeps them;
  one that trains updates them."""
  config = tiny_config(trainable='stem_bn/.*|head/.*')
  _, initial, final, _, batch = run_steps(config)
  before, after = named(initial.model_state), named(final.model_state)
  assert sorted(n for n in before if not np.array_equal(
      before[n], after[n])) == ['stem_bn/mean', 'stem_bn/var']
  # Statistics the batch does not have: a frozen BatchNorm uses them (with
  # unit scales: the residual branches' last BatchNorms start at zero).
  graphdef, state, tx, _ = setup(config, 1)
  state = state.replace(params=jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.ones_like(x) if trainable_lib.param_name(
          path).endswith('scale') else x, state.params))
  shifted = state.replace(model_state=jax.tree.map(
      lambda x: x + 3.0, state.model_state))
  kwargs = train.train_step_kwargs(config, graphdef, tx,
                                   lambda step: LEARNING_RATE)
  step = jax.jit(lambda s, b: train.train_step(s, b, **kwargs))
  assert step(shifted, batch)[1]['loss'] != step(state, batch)[1]['loss']


def test_optimizer_state_holds_only_the_trained_parameters_moments():
  def moments(config):  # (arrays, values) of the opt_state, step aside
    _, state, _, _ = setup(config, 1)
    arrays = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    return len(arrays), sum(x.size for x in arrays), state.params

  full, _, params = moments(tiny_config(**ADAMW))
  probe = moments(tiny_config(trainable=PROBE, **ADAMW))[:2]
  assert full == 2 * len(jax.tree.leaves(params))  # adam's mu and nu
  head = named(params['head'])
  assert probe == (2 * len(head), 2 * sum(x.size for x in head.values()))


def test_trained_update_is_adamw_of_the_trained_subtree_alone():
  """Two steps against optax.adamw on the head by hand, from jax.grad of a
  plain cross-entropy with respect to the head."""
  config = tiny_config(trainable=PROBE, **ADAMW)
  graphdef, initial, final, _, batch = run_steps(config)

  def loss(head, params, model_state):
    params = jax.tree.map(lambda x: x, params)  # a copy to put `head` in
    params['head'] = head
    model = nnx.merge(graphdef, params, model_state, copy=True)
    # Every BatchNorm is frozen and the model has no dropout: the probe's
    # forward pass is the evaluation one.
    logits = model(batch['image'], train=False)
    log_p = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_p, batch['label'][:, None], 1))

  tx = optax.adamw(LEARNING_RATE, weight_decay=0.05,
                   mask=lambda head: jax.tree_util.tree_map_with_path(
                       lambda path, _: trainable_lib.param_name(path) ==
                       'kernel', head))
  head = initial.params['head']
  opt_state = tx.init(head)
  for _ in range(2):
    grads = jax.grad(loss)(head, initial.params, initial.model_state)
    updates, opt_state = tx.update(grads, opt_state, head)
    head = optax.apply_updates(head, updates)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5,
                                 atol=1e-6), final.params['head'], head)


@pytest.mark.parametrize('model', ['SmallResNet', 'ViT_Ti16'])
def test_linear_probe_step_costs_under_045_of_the_full_step(model):
  overrides = VIT if model == 'ViT_Ti16' else {}
  flops = {}
  for pattern in ('', PROBE):
    config = tiny_config(trainable=pattern, **overrides)
    graphdef, state, tx, batch = setup(config, 8)
    flops[pattern] = train.true_step_flops(
        graphdef, train.train_step_kwargs(config, graphdef, tx,
                                          lambda step: LEARNING_RATE),
        state, batch)
  print(model, flops)
  assert flops[PROBE] < 0.45 * flops['']


@pytest.mark.parametrize('pattern, why', [
    ('heads/.*', 'matches no parameter'),
    ('head/(', 'is not a regular expression')])
def test_bad_pattern_is_refused_naming_the_top_level_parameters(pattern, why):
  with pytest.raises(ValueError) as e:
    setup(tiny_config(trainable=pattern), 1)
  message = str(e.value)
  assert why in message and '\n' not in message
  assert message.endswith('top-level parameters: head, stages, stem, stem_bn')


def test_empty_pattern_trains_as_a_pattern_matching_everything():
  """'' leaves the optimizer's state as it was (no multi_transform) and
  trains exactly as '.*', which goes through the split gradient."""
  _, _, everything, _, _ = run_steps(tiny_config(trainable='', **ADAMW))
  _, _, matched, _, _ = run_steps(tiny_config(trainable='.*', **ADAMW))
  jax.tree.map(np.testing.assert_array_equal,
               (everything.params, everything.model_state),
               (matched.params, matched.model_state))
  assert isinstance(everything.opt_state[0], optax.ScaleByAdamState)


def test_probe_from_init_from_under_fsdp_resumes_bit_exact(tmp_path):
  """A probe of another run's weights, FSDP-split, with accumulation and a
  moving average: the frozen weights stay the loaded ones, and a resumed
  run ends where the uninterrupted one did."""
  source = str(tmp_path / 'source')
  loaded = train.train_and_evaluate(
      tiny_config(num_train_steps=2, eval_every_steps=2,
                  checkpoint_every_steps=2), source)
  config = tiny_config(init_from=source, trainable=PROBE, grad_accum_steps=2,
                       ema_decay=0.5, num_train_steps=4, eval_every_steps=2,
                       checkpoint_every_steps=2)
  config.mesh.fsdp = 2
  workdir = str(tmp_path / 'probe')
  final = train.train_and_evaluate(config, workdir)
  before, after = named(loaded.params), named(final.params)
  assert [n for n in before if not np.array_equal(before[n], after[n])] == [
      'head/bias', 'head/kernel']
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '4'))
  resumed = train.train_and_evaluate(config, workdir)
  jax.tree.map(np.testing.assert_array_equal,
               (final.params, final.model_state, final.opt_state, final.ema),
               (resumed.params, resumed.model_state, resumed.opt_state,
                resumed.ema))


def test_startup_line_counts_trained_and_frozen_arrays_and_values():
  _, state, _, _ = setup(tiny_config(trainable=PROBE), 1)
  values = sum(x.size for x in jax.tree.leaves(state.params))
  head = sum(x.size for x in jax.tree.leaves(state.params['head']))
  line = trainable_lib.describe(state.params, PROBE)
  assert line.startswith(f"trainable='head/.*': training 2 arrays ({head} "
                         f"values): head/bias, head/kernel; frozen "
                         f"{len(jax.tree.leaves(state.params)) - 2} arrays "
                         f"({values - head:,} values): ")
  assert '\n' not in line
