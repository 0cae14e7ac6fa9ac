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

from data import datasets
import models
from runtime import sharding
from training import compiling
from training import layer_decay
from training import run_state
from training import state as train_state
from training import trainable as trainable_lib
from training import flop_count
from training import update
import train
from helpers import LEARNING_RATE
from helpers import VIT
from helpers import cross_entropy_and_grads
from helpers import initial_state_and_batch
from helpers import tiny_config

PROBE = 'head/.*'
ADAMW = dict(optimizer='adamw', weight_decay=0.05,
             weight_decay_form='pytorch')


def run_steps(config, num_steps=2, batch_size=16):
  """The initial and the final state of `num_steps` trainer steps on one
  batch of `config`'s model, at a constant learning rate."""
  graphdef, state, tx, batch = initial_state_and_batch(config, batch_size)
  kwargs = train.train_step_kwargs(config, graphdef, tx,
                                   lambda step: LEARNING_RATE)
  step = jax.jit(lambda s, b: update.train_step(s, b, **kwargs))
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
  graphdef, state, tx, _ = initial_state_and_batch(config, 1)
  state = state.replace(params=jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.ones_like(x) if trainable_lib.param_name(
          path).endswith('scale') else x, state.params))
  shifted = state.replace(model_state=jax.tree.map(
      lambda x: x + 3.0, state.model_state))
  kwargs = train.train_step_kwargs(config, graphdef, tx,
                                   lambda step: LEARNING_RATE)
  step = jax.jit(lambda s, b: update.train_step(s, b, **kwargs))
  assert step(shifted, batch)[1]['loss'] != step(state, batch)[1]['loss']


def test_optimizer_state_holds_only_the_trained_parameters_moments():
  def moments(config):  # (arrays, values) of the opt_state, step aside
    _, state, _, _ = initial_state_and_batch(config, 1)
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
  @jax.jit  # op by op, each operation would compile
  def adamw_step(head, opt_state):
    grads = jax.grad(loss)(head, initial.params, initial.model_state)
    updates, opt_state = tx.update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state

  head = initial.params['head']
  opt_state = tx.init(head)
  for _ in range(2):
    head, opt_state = adamw_step(head, opt_state)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5,
                                 atol=1e-6), final.params['head'], head)


@pytest.mark.parametrize('model', ['SmallResNet', 'ViT_Ti16'])
def test_linear_probe_step_costs_under_045_of_the_full_step(model):
  overrides = VIT if model == 'ViT_Ti16' else {}
  flops = {}
  for pattern in ('', PROBE):
    config = tiny_config(trainable=pattern, **overrides)
    graphdef, state, tx, batch = initial_state_and_batch(config, 8)
    flops[pattern] = flop_count.true_step_flops(update.train_step, 
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
    initial_state_and_batch(tiny_config(trainable=pattern), 1)
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
  _, state, _, _ = initial_state_and_batch(tiny_config(trainable=PROBE), 1)
  values = sum(x.size for x in jax.tree.leaves(state.params))
  head = sum(x.size for x in jax.tree.leaves(state.params['head']))
  line = trainable_lib.describe(state.params, PROBE)
  assert line.startswith(f"trainable='head/.*': training 2 arrays ({head} "
                         f"values): head/bias, head/kernel; frozen "
                         f"{len(jax.tree.leaves(state.params)) - 2} arrays "
                         f"({values - head:,} values): ")
  assert '\n' not in line


# ------------------------------------------------------------- layer decay

VIT_TOKENS = dict(VIT, vit_pool='cls', vit_posemb='learn')  # + cls, posemb


def cross_entropy_grad(graphdef, params, model_state, batch):
  """jax.grad of a plain cross-entropy of `graphdef`'s forward pass."""
  return cross_entropy_and_grads(graphdef, train_state.TrainState(
      step=None, params=params, model_state=model_state, opt_state=None,
      nonfinite_streak=None), batch)[1]


def kernel_mask(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: trainable_lib.param_name(path).endswith('kernel'),
      params)


def test_layer_decayed_stack_update_is_sgd_scaled_per_layer_by_hand():
  """Two steps of a scanned two-block ViT against optax's SGD with L2 decay
  on the gradients of an unrolled copy (jax.grad), each update scaled by
  hand: decay^3 for the embeddings and class token (depth 0), decay^(2 - i)
  for block i's slice of the stack, 1 for the final norm and the head.
  (SGD: Adam would turn the rounding noise of gradients that are zero in
  exact arithmetic, such as the attention's key bias, into whole steps.)"""
  decay, weight_decay = 0.5, 0.05
  config = tiny_config(layer_decay=decay, weight_decay=weight_decay,
                       **VIT_TOKENS)
  _, initial, final, _, batch = run_steps(config)
  unrolled, _, _, _ = initial_state_and_batch(
      tiny_config(scan_layers=False, **VIT_TOKENS), 1)

  def scaled_by_hand(path, update):
    name = trainable_lib.param_name(path)
    if name.startswith('encoder/'):
      return jnp.stack([update[i] * decay ** (2 - i) for i in range(2)])
    if name.split('/')[0] in ('patch_embed', 'posemb', 'cls'):
      return update * decay ** 3
    assert name.split('/')[0] in ('encoder_norm', 'head'), name
    return update

  tx = optax.chain(
      optax.add_decayed_weights(weight_decay, mask=kernel_mask),
      optax.sgd(LEARNING_RATE, momentum=0.9, nesterov=True))
  @jax.jit  # op by op, each operation would compile
  def sgd_step(params, opt_state, batch):
    grads = cross_entropy_grad(unrolled, params, initial.model_state, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, jax.tree_util.tree_map_with_path(
        scaled_by_hand, updates)), opt_state

  params = initial.params
  opt_state = tx.init(params)
  for _ in range(2):
    params, opt_state = sgd_step(params, opt_state, batch)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5,
                                 atol=1e-6), final.params, params)
  assert not np.allclose(final.params['cls'][...], initial.params['cls'][...])


def test_resnet_stage_updates_are_the_undecayed_ones_times_their_scale():
  """SGD's first update is linear in the gradient: with layer_decay, each
  parameter moves by the undecayed run's move times decay^(2 - depth): the
  stem at depth 0, the stage 1, the head 2."""
  decay = 0.5
  scale = {'stem': decay ** 2, 'stem_bn': decay ** 2, 'stages': decay,
           'head': 1.0}
  _, initial, plain, _, _ = run_steps(tiny_config(), num_steps=1)
  _, _, decayed, _, _ = run_steps(tiny_config(layer_decay=decay),
                                  num_steps=1)
  before, moved, moved_decayed = (named(initial.params), named(plain.params),
                                  named(decayed.params))
  for name, value in before.items():
    np.testing.assert_allclose(
        moved_decayed[name] - value,
        scale[name.split('/')[0]] * (moved[name] - value),
        rtol=1e-4, atol=1e-7, err_msg=name)


def depths_of(model_name, **overrides):
  config = tiny_config(model=model_name, num_layers=0, image_size=224,
                       **overrides)
  model = nnx.eval_shape(lambda: models.create_model(
      config.model, 10, 3, rngs=nnx.Rngs(0), **models.options(config)))
  return layer_decay.layer_depths(model)


def test_resnet50_depths_are_stem_four_stages_and_head():
  depths = depths_of('ResNet50')
  by_top = {}
  for name, depth in depths.items():
    parts = name.split('/')
    top = '/'.join(parts[:2]) if parts[0] == 'stages' else parts[0]
    by_top.setdefault(top, set()).add(int(depth))
  assert by_top == {'stem': {0}, 'stem_bn': {0}, 'stages/0': {1},
                    'stages/1': {2}, 'stages/2': {3}, 'stages/3': {4},
                    'head': {5}}


def test_vit_b16_depths_and_the_startup_line():
  """MAE's numbering: embeddings 0, block i at i + 1 along the stack's
  layer axis, the rest at 13; the line names each group's scale."""
  depths = depths_of('ViT_B16', vit_pool='cls', vit_posemb='learn')
  np.testing.assert_array_equal(
      depths['encoder/layers/mlp_in/kernel'], np.arange(1, 13))
  assert {n: int(d) for n, d in depths.items() if d.ndim == 0} == {
      'cls': 0, 'posemb': 0, 'patch_embed/kernel': 0, 'patch_embed/bias': 0,
      'encoder_norm/scale': 13, 'encoder_norm/bias': 13, 'head/kernel': 13,
      'head/bias': 13}
  assert layer_decay.describe(depths, 0.65) == (
      'layer_decay=0.65: updates at depth d scaled by 0.65^(13 - d); depth 0 '
      'x0.0037 (cls, patch_embed, posemb); depths 1-12 x0.00569 to x0.65 '
      '(encoder); depth 13 x1 (encoder_norm, head).')


def test_lars_is_maes_with_each_stacked_layers_own_trust_ratio():
  """Two LARS steps of a scanned ViT against MAE's LARS written out per
  array and per block: on kernels (the arrays of more than one dimension)
  decay added and the trust ratio 0.001 |p| / |dp| (1 if either is 0),
  then momentum 0.9 and the learning rate; other arrays momentum alone."""
  weight_decay = 0.01
  config = tiny_config(optimizer='lars', weight_decay=weight_decay, **VIT)
  _, initial, final, _, batch = run_steps(config)
  unrolled, _, _, _ = initial_state_and_batch(
      tiny_config(scan_layers=False, **VIT), 1)

  def lars_direction(p, g):
    dp = g + weight_decay * p
    p_norm, dp_norm = np.linalg.norm(p), np.linalg.norm(dp)
    return dp * (0.001 * p_norm / dp_norm if p_norm > 0 and dp_norm > 0
                 else 1.0)

  params = named(initial.params)
  momentum = {name: np.zeros_like(value) for name, value in params.items()}
  for _ in range(2):
    current = jax.tree_util.tree_map_with_path(
        lambda path, _: params[trainable_lib.param_name(path)],
        initial.params)
    grads = named(cross_entropy_grad(unrolled, current, initial.model_state,
                                     batch))
    for name, g in grads.items():
      p = params[name]
      if not name.endswith('kernel'):
        dp = g
      elif name.startswith('encoder/'):
        dp = np.stack([lars_direction(p[i], g[i]) for i in range(2)])
      else:
        dp = lars_direction(p, g)
      momentum[name] = 0.9 * momentum[name] + dp
      params[name] = p - LEARNING_RATE * momentum[name]
  for name, value in named(final.params).items():
    np.testing.assert_allclose(value, params[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_feature_batch_norm_learns_the_frozen_features_statistics():
  """In a probe, the BatchNorm before the head keeps training its
  statistics (the others are frozen): after one step they are 0.9 x the
  initial ones + 0.1 x the batch's, over the features the network without
  it computes (read through a head that copies them)."""
  config = tiny_config(trainable=PROBE, feature_batch_norm=True)
  _, initial, final, _, batch = run_steps(config, num_steps=1)
  plain, plain_state, _, _ = initial_state_and_batch(
      tiny_config(trainable=PROBE), 1)
  width = initial.params['head']['kernel'].shape[0]
  params = jax.tree.map(lambda x: x, initial.params)
  params['head']['kernel'] = nnx.Param(jnp.eye(width, 10))
  params['head']['bias'] = nnx.Param(jnp.zeros(10))
  features = nnx.merge(plain, params, plain_state.model_state)(
      batch['image'], train=False)[:, :width]
  statistics = final.model_state['feature_norm']
  np.testing.assert_allclose(statistics['mean'][...],
                             0.1 * np.mean(features, 0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(statistics['var'][...],
                             0.9 + 0.1 * np.var(features, 0), rtol=1e-5)
  others = lambda state: {k: v for k, v in named(state).items()
                          if not k.startswith('feature_norm')}
  jax.tree.map(np.testing.assert_array_equal, others(initial.model_state),
               others(final.model_state))


# ------------------------------------------------- with the trainer's keys

# Frozen stem, decayed stages: both keys change what the step computes.
BOTH_KEYS = dict(trainable='stages/.*|head/.*', layer_decay=0.5)


def sharded_run(config, num_steps=2):
  """Initial and final state, and last metrics, of `num_steps` steps of
  `config.step_mode` over the eight devices, compiled as the trainer
  compiles them, on one batch of digits."""
  data = datasets.load_digits()
  mesh = sharding.create_mesh(config.mesh, config.step_mode)
  graphdef, state, state_sharding, tx = (
      run_state.create_sharded_train_state(
          config, data.info, lambda step: LEARNING_RATE, mesh,
          dtype=models.compute_dtype(config)))
  initial = jax.device_get((state.params, state.model_state))
  batch = jax.device_put({'image': data.train_images[:16],
                          'label': data.train_labels[:16]},
                         sharding.batch_sharding(mesh))
  step, *_ = compiling.compile_train_step(
      config.step_mode, mesh, functools.partial(
          update.train_step, **train.train_step_kwargs(
              config, graphdef, tx, lambda step: LEARNING_RATE)),
      state_sharding, state, batch)
  for _ in range(num_steps):
    state, metrics = step(state, batch)
  return initial, jax.device_get((state.params, state.model_state)), metrics


def assert_only_trained_moved(initial, final):
  """The stem's parameters and statistics as they were; stages and head
  moved."""
  before, after = named(initial[0]), named(final[0])
  moved = {n.split('/')[0] for n in before
           if not np.array_equal(before[n], after[n])}
  assert moved == {'stages', 'head'}
  jax.tree.map(np.testing.assert_array_equal, initial[1]['stem_bn'],
               final[1]['stem_bn'])


def test_pmap_step_with_frozen_and_decayed_layers_matches_the_jit_step():
  initial, jitted, _ = sharded_run(tiny_config(**BOTH_KEYS))
  _, pmapped, _ = sharded_run(tiny_config(step_mode='pmap', **BOTH_KEYS))
  assert_only_trained_moved(initial, jitted)
  assert_only_trained_moved(initial, pmapped)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5,
                                 atol=1e-6), pmapped, jitted)


def test_float16_loss_scaling_under_fsdp_with_frozen_and_decayed_layers():
  """With accumulation and the moving average too."""
  config = tiny_config(half_precision=True, half_precision_dtype='float16',
                       grad_accum_steps=2, ema_decay=0.5, **BOTH_KEYS)
  config.mesh.fsdp = 2
  initial, final, metrics = sharded_run(config)
  assert_only_trained_moved(initial, final)
  assert np.isfinite(metrics['loss']) and metrics['loss_scale'] > 1
