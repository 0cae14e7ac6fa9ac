"""The recipes' train and eval steps against hand-written references:
SGD's and AdamW's updates, mixup and CutMix (as timm draws them), top-1
and top-5 over the unmasked examples."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from evaluators import classification
from evaluators import common
from data import datasets
import models
from training import losses
from training import optimizer
from training import run_state
from training import update
from helpers import as_numpy
from helpers import assert_trees_close
from helpers import cross_entropy_and_grads
from helpers import is_kernel
from helpers import tiny_config

# Tests share compiled programs (in memory): one worker runs them all.
pytestmark = pytest.mark.xdist_group('recipes')


def digits_batches(count, size=16):
  data = datasets.load_digits()
  return data.info, [{'image': jnp.asarray(data.train_images[i * size:
                                                             (i + 1) * size]),
                      'label': jnp.asarray(data.train_labels[i * size:
                                                             (i + 1) * size])}
                     for i in range(count)]


def run_steps(config, lr_fn, batches):
  info = digits_batches(0)[0]
  graphdef, state, tx = run_state.create_train_state(
      config, info, lr_fn, dtype=models.compute_dtype(config))
  step = jax.jit(lambda s, b: update.train_step(
      s, b, graphdef=graphdef, tx=tx, learning_rate_fn=lr_fn,
      label_smoothing=0.0, dropout_seed=1))
  states, metrics = [state], []
  for batch in batches:
    state, m = step(state, batch)
    states.append(state)
    metrics.append(m)
  return graphdef, states, metrics


def test_sgd_step_is_the_flax_examples_l2_penalty_and_nesterov_update():
  weight_decay, lr = 0.01, 0.05
  config = tiny_config(weight_decay=weight_decay)
  _, batches = digits_batches(2)
  graphdef, states, _ = run_steps(config, lambda step: lr, batches)
  # By hand: gradient of loss + 0.5 wd |w|^2; Nesterov with momentum 0.9.
  params, momentum = as_numpy(states[0].params), None
  for state, batch in zip(states[:2], batches):
    _, grads = cross_entropy_and_grads(
        graphdef, state.replace(params=params), batch, penalty=weight_decay)
    grads = as_numpy(grads)
    momentum = grads if momentum is None else jax.tree.map(
        lambda m, g: 0.9 * m + g, momentum, grads)
    params = jax.tree.map(lambda p, g, m: p - lr * (g + 0.9 * m), params,
                          grads, momentum)
  assert_trees_close(states[2].params, params, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize('learning_rate, form', [
    (1e-3, 'big_vision'), (4e-3, 'big_vision'), (4e-3, 'pytorch')])
def test_adamw_step_is_the_clipped_decoupled_update_of_its_form(
    learning_rate, form):
  weight_decay, clip = 0.05, 0.01
  config = tiny_config(optimizer='adamw', learning_rate=learning_rate,
                       learning_rate_base_batch_size=0,
                       weight_decay=weight_decay, grad_clip_norm=clip,
                       warmup_steps=2, weight_decay_form=form)
  # big_vision: decay x lr(t) / peak; PyTorch's AdamW: decay x lr(t).
  decay = weight_decay / learning_rate if form == 'big_vision' else (
      weight_decay)
  # Warmup: lr 0 at the first step, half the peak at the second.
  lr_fn = optimizer.learning_rate_schedule(config, num_steps=10,
                                           steps_per_epoch=10)
  _, batches = digits_batches(2)
  graphdef, states, metrics = run_steps(config, lr_fn, batches)
  # By hand: clip by global norm, Adam (0.9, 0.999, 1e-8), then
  # -(lr(t) adam + lr(t) / peak x wd x kernel).
  params = as_numpy(states[0].params)
  first = second = None
  for t, (state, batch) in enumerate(zip(states[:2], batches), start=1):
    _, grads = cross_entropy_and_grads(
        graphdef, state.replace(params=params), batch)
    grads = as_numpy(grads)
    norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads)))
    assert norm > 10 * clip  # clipping is active
    assert float(metrics[t - 1]['grad_norm']) == pytest.approx(norm, rel=1e-4)
    grads = jax.tree.map(lambda g: g * clip / norm, grads)
    first = jax.tree.map(lambda g: 0.1 * g, grads) if first is None else (
        jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, first, grads))
    second = jax.tree.map(lambda g: 0.001 * g**2, grads) if second is None else (
        jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g**2, second, grads))
    lr = float(lr_fn(t - 1))
    params = jax.tree_util.tree_map_with_path(
        lambda path, p, m, v: p - lr * (
            (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8) +
            (decay * p if is_kernel(path) else 0.0)),
        params, first, second)
  assert_trees_close(states[2].params, params, rtol=1e-4, atol=1e-8)
  # The first step, at learning rate 0, changes nothing, decay included.
  assert float(lr_fn(0)) == 0.0
  assert_trees_close(states[1].params, states[0].params, rtol=0, atol=0)


def test_mixup_mixes_images_and_labels_with_one_dominant_ratio():
  _, [batch] = digits_batches(1)
  key = jax.random.key(3)
  images, loss_of_output, _ = losses.training_inputs(
      batch, key, label_smoothing=0.0, mixup_alpha=0.2)
  x = np.asarray(batch['image'])
  rolled = np.roll(x, 1, axis=0)
  differ = np.abs(x - rolled) > 0.5
  ratio = (np.asarray(images) - rolled)[differ] / (x - rolled)[differ]
  assert ratio.std() < 1e-5 and 0.5 <= ratio.mean() <= 1.0
  ratio = float(ratio.mean())
  logits = jax.random.normal(jax.random.key(4), (16, 10))
  targets = (ratio * jax.nn.one_hot(batch['label'], 10) +
             (1 - ratio) * jax.nn.one_hot(np.roll(batch['label'], 1), 10))
  expected = -np.mean(np.sum(targets * jax.nn.log_softmax(logits), -1))
  assert float(loss_of_output(logits)) == pytest.approx(expected, rel=1e-5)


def test_mixup_ratios_follow_the_folded_beta_distribution():
  batch = {'image': jnp.ones((2, 1)), 'label': jnp.zeros((2,), jnp.int32)}
  batch['image'] = batch['image'].at[1].set(0.0)

  @jax.jit
  def ratio_of(key):  # image 0 is 1, its predecessor 0: it becomes r
    return losses.training_inputs(batch, key, label_smoothing=0.0,
                                  mixup_alpha=0.2)[0][0, 0]
  ratios = np.array([ratio_of(jax.random.key(i)) for i in range(2000)])
  beta = np.random.default_rng(0).beta(0.2, 0.2, 100_000)
  statistic = scipy.stats.ks_2samp(ratios, np.maximum(beta, 1 - beta))[0]
  assert statistic < 0.05, statistic


@pytest.mark.parametrize('mixing', [
    dict(mixup_alpha=0.2),
    dict(mixup_alpha=0.8, cutmix_alpha=1.0, mixup_switch_prob=1.0)])
def test_train_step_with_mixup_or_cutmix_learns_the_mixed_batch(mixing):
  config = tiny_config(**mixing)
  info, [batch] = digits_batches(1)
  lr_fn = lambda step: 0.01
  graphdef, state, tx = run_state.create_train_state(
      config, info, lr_fn, dtype=models.compute_dtype(config))
  _, metrics = jax.jit(lambda s, b: update.train_step(
      s, b, graphdef=graphdef, tx=tx, learning_rate_fn=lr_fn,
      label_smoothing=0.0, dropout_seed=5, mixing=mixing))(state, batch)
  step_key = jax.random.fold_in(jax.random.key(5), 0)
  images, loss_of_output, labels = losses.training_inputs(
      batch, step_key, label_smoothing=0.0, **mixing)
  model = nnx.merge(graphdef, state.params, state.model_state, copy=True)
  logits = model(images, train=True)
  assert float(metrics['loss']) == pytest.approx(
      float(loss_of_output(logits)), rel=1e-5)
  assert float(metrics['accuracy']) == pytest.approx(
      float(np.mean(np.argmax(logits, -1) == labels)))


def numbered_batch(size=16, height=8, width=8):
  """Image i all i: every pixel of a cut or mixed image tells its source."""
  return {'image': jnp.broadcast_to(
      jnp.arange(size, dtype=jnp.float32)[:, None, None, None],
      (size, height, width, 1)),
          'label': jnp.arange(size, dtype=jnp.int32) % 10}


@functools.partial(jax.jit, static_argnames=('mixing',))
def _mixed(batch, key, logits, mixing):
  images, loss_of_output, labels = losses.training_inputs(
      batch, key, label_smoothing=0.0, **dict(mixing))
  return images, loss_of_output(logits), labels


def test_cutmix_pastes_one_box_from_the_partner_and_weights_labels_by_its_area():
  batch = numbered_batch()
  own = np.asarray(batch['image'])
  partner = np.roll(own, 1, axis=0)
  logits = jax.random.normal(jax.random.key(4), (16, 10))
  areas = []
  for seed in range(20):
    images, loss, labels = map(np.asarray, _mixed(
        batch, jax.random.key(seed), logits, (('cutmix_alpha', 1.0),)))
    from_partner = images == partner
    assert np.all(from_partner | (images == own))
    box = from_partner[0, :, :, 0]
    assert np.all(from_partner[..., 0] == box)  # one box for the batch
    rows, cols = np.flatnonzero(box.any(1)), np.flatnonzero(box.any(0))
    if box.any():  # a rectangle
      assert box[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1].all()
      assert box.sum() == len(rows) * len(cols)
    lam = 1 - box.mean()
    areas.append(box.mean())
    targets = (lam * jax.nn.one_hot(batch['label'], 10) +
               (1 - lam) * jax.nn.one_hot(np.roll(batch['label'], 1), 10))
    expected = -np.mean(np.sum(targets * jax.nn.log_softmax(logits), -1))
    assert loss == pytest.approx(expected, rel=1e-5)
    dominant = batch['label'] if lam >= 0.5 else np.roll(batch['label'], 1)
    np.testing.assert_array_equal(labels, dominant)
  assert 0 < np.mean(areas) < 1 and len(set(areas)) > 5


def timm_box_areas(alpha, size, count, rng):
  """The area share of timm's `rand_bbox` (margin 0), in NumPy."""
  areas = []
  for _ in range(count):
    cut = np.sqrt(1 - rng.beta(alpha, alpha))
    cut_h = cut_w = int(size * cut)
    cy, cx = rng.integers(0, size), rng.integers(0, size)
    y0, y1 = np.clip([cy - cut_h // 2, cy + cut_h // 2], 0, size)
    x0, x1 = np.clip([cx - cut_w // 2, cx + cut_w // 2], 0, size)
    areas.append((y1 - y0) * (x1 - x0) / size**2)
  return np.array(areas)


def test_cutmix_box_areas_follow_timms_rand_bbox():
  @jax.jit
  def area(key):
    return 1 - losses.cutmix_box(key, 1.0, 32, 32)[1]
  areas = np.asarray(jax.vmap(area)(jax.random.split(jax.random.key(0),
                                                     3000)))
  reference = timm_box_areas(1.0, 32, 20_000, np.random.default_rng(0))
  statistic = scipy.stats.ks_2samp(areas, reference)[0]
  assert statistic < 0.04, statistic


@pytest.mark.parametrize('switch_prob', [0.0, 0.3, 1.0])
def test_mixup_switch_prob_is_the_share_of_cutmix_batches(switch_prob):
  batch = numbered_batch()
  own = np.asarray(batch['image'])
  partner = np.roll(own, 1, axis=0)
  mixing = (('mixup_alpha', 0.8), ('cutmix_alpha', 1.0),
            ('mixup_switch_prob', switch_prob))
  logits = jnp.zeros((16, 10))
  cutmix = []
  for seed in range(200):
    images = np.asarray(_mixed(batch, jax.random.key(seed), logits,
                               mixing)[0])
    # CutMix copies pixels; mixup blends every pixel of every image.
    cutmix.append(bool(np.all((images == own) | (images == partner))))
  assert np.mean(cutmix) == pytest.approx(switch_prob, abs=0.1)


def test_eval_counts_top1_and_top5_exactly_over_unmasked_examples():
  config = tiny_config()
  info, [batch] = digits_batches(1)
  graphdef, state, _ = run_state.create_train_state(
      config, info, lambda step: 0.0,
      dtype=models.compute_dtype(config))
  # Random parameters, so that the logits rank the classes at random.
  params = jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(p.size), p.shape),
      state.params)
  state = state.replace(params=params)
  mask = np.arange(16) % 3 != 0
  sums = classification.eval_step(
      state, {**batch, 'mask': jnp.asarray(mask)},
      apply_fn=common.apply_fn(graphdef))
  model = nnx.merge(graphdef, params, state.model_state)
  logits = np.asarray(model(batch['image'], train=False))
  ranks = np.argsort(-logits, axis=-1)
  labels = np.asarray(batch['label'])
  top1 = ranks[:, 0] == labels
  top5 = (ranks[:, :5] == labels[:, None]).any(-1)
  assert top5[mask].sum() > top1[mask].sum()  # the test can tell them apart
  assert float(sums['correct']) == top1[mask].sum()
  assert float(sums['correct_top5']) == top5[mask].sum()
  assert float(sums['examples']) == mask.sum()
