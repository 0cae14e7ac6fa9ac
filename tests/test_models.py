"""The scanned stack against a Python loop over the same parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
import models


def small_config(**overrides):
  config = default.get_config()
  config.num_layers = 3
  config.width = 8
  config.update(overrides)
  return config


def vit_config(**overrides):
  config = small_config(model='ViT_Ti16', image_size=32, num_layers=3)
  config.update(overrides)
  return config


def build(config, in_channels=1, num_classes=10):
  return models.create_model(config, num_classes, in_channels,
                             rngs=nnx.Rngs(0))


def loss_and_grads(config, x, train=True, in_channels=1):
  """Loss, parameter gradients and new non-parameter state of a fresh model."""
  model = build(config, in_channels)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params):
    model = nnx.merge(graphdef, params, rest, copy=True)
    logits = model(x, train=train, dropout_key=jax.random.key(7))
    return jnp.sum(logits**2), nnx.state(model, nnx.Not(nnx.Param))

  (loss, new_rest), grads = jax.jit(
      jax.value_and_grad(loss_fn, has_aux=True))(params)
  return loss, grads, new_rest


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol,
      atol=atol), a, b)


def digits_like_batch():
  return jax.random.normal(jax.random.key(1), (4, 8, 8, 1))


def vit_batch():
  return jax.random.normal(jax.random.key(1), (2, 32, 32, 1))


@pytest.mark.parametrize('make_config, batch', [
    (small_config, digits_like_batch),
    (lambda **kw: vit_config(dropout_rate=0.1, **kw), vit_batch),
])
def test_scanned_stack_matches_python_loop_outputs_and_gradients(
    make_config, batch):
  x = batch()
  scanned = loss_and_grads(make_config(scan_layers=True, scan_unroll=1), x)
  looped = loss_and_grads(make_config(scan_layers=False), x)
  assert_trees_close(scanned, looped)


@pytest.mark.parametrize('policy', sorted(models.REMAT_POLICIES))
def test_every_remat_policy_gives_the_gradients_of_no_remat(policy):
  x = digits_like_batch()
  reference = loss_and_grads(small_config(remat_policy='none'), x)
  assert_trees_close(loss_and_grads(small_config(remat_policy=policy), x),
                     reference)


def test_scan_unroll_does_not_change_results():
  x = digits_like_batch()
  assert_trees_close(loss_and_grads(small_config(scan_unroll=2), x),
                     loss_and_grads(small_config(scan_unroll=1), x))


def test_stack_parameters_and_batch_stats_have_a_leading_layer_axis():
  model = build(small_config(num_layers=5))
  stack = model.stages[0].rest.layers
  assert stack.conv1.kernel.shape == (5, 3, 3, 8, 8)
  assert stack.bn1.mean.shape == (5, 8)
  # Independent initialisation per layer.
  kernels = np.asarray(stack.conv1.kernel[...]).reshape(5, -1)
  assert len({k.tobytes() for k in kernels}) == 5


def test_batch_norm_statistics_update_per_layer_in_training_only():
  x = digits_like_batch()
  _, _, trained = loss_and_grads(small_config(), x, train=True)
  means = np.asarray(trained['stages'][0]['rest']['layers']['bn1']['mean'])
  assert np.all(np.abs(means) > 0)  # initialised at zero, all updated
  assert not np.allclose(means[0], means[1])  # each layer its own
  _, _, evaluated = loss_and_grads(small_config(), x, train=False)
  np.testing.assert_array_equal(
      evaluated['stages'][0]['rest']['layers']['bn1']['mean'], 0.0)


def test_eval_uses_running_statistics():
  """In eval a single example's output does not depend on the batch."""
  model = build(small_config())
  x = digits_like_batch()
  full = model(x, train=False)
  single = model(x[:1], train=False)
  np.testing.assert_allclose(full[:1], single, rtol=1e-5, atol=1e-6)


class _DropoutProbe(nnx.Module):
  """Doubles the carry and adds this layer's dropout mask (0 or 2)."""

  def __init__(self, rngs):
    self.dropout = nnx.Dropout(0.5)
    self.unused = nnx.Param(jnp.zeros(()))

  def __call__(self, x, *, train, dropout_key=None):
    mask = self.dropout(jnp.ones_like(x), deterministic=not train,
                        rngs=dropout_key)
    return 2 * x + mask


@pytest.mark.parametrize('scan_layers', [True, False])
def test_dropout_draws_a_distinct_mask_in_every_layer(scan_layers):
  num_layers = 4
  stack = models.StackedBlocks(_DropoutProbe, num_layers,
                               scan_layers=scan_layers, rngs=nnx.Rngs(0))
  out = stack(jnp.zeros((64,)), train=True, dropout_key=jax.random.key(3))
  # The output is a binary number whose digit i is layer i's mask bit.
  code = np.asarray(out).astype(int) // 2
  masks = np.array([(code >> (num_layers - 1 - i)) & 1
                    for i in range(num_layers)])
  assert len({m.tobytes() for m in masks}) == num_layers
  assert 0.2 < masks.mean() < 0.8
  stack_other = models.StackedBlocks(_DropoutProbe, num_layers,
                                     scan_layers=not scan_layers,
                                     rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(
      out, stack_other(jnp.zeros((64,)), train=True,
                       dropout_key=jax.random.key(3)))
  # Without training no unit is dropped: every mask is all ones.
  np.testing.assert_array_equal(
      stack(jnp.zeros((64,)), train=False), 2**num_layers - 1)


@pytest.mark.parametrize('name, depths', [
    ('ResNet18', [1, 1, 1, 1]), ('ResNet50', [2, 3, 5, 2]),
    ('ResNet101', [2, 3, 22, 2]), ('ResNet200', [2, 23, 35, 2])])
def test_resnet_stages_are_a_first_block_and_a_stack_of_the_rest(name,
                                                                 depths):
  model = nnx.eval_shape(lambda: build(small_config(model=name),
                                       in_channels=3, num_classes=1000))
  assert [s.rest.num_layers for s in model.stages] == depths


def test_resnet50_has_the_published_parameter_count():
  model = nnx.eval_shape(lambda: build(small_config(model='ResNet50'),
                                       in_channels=3, num_classes=1000))
  params = nnx.state(model, nnx.Param)
  count = sum(np.prod(x.shape) for x in jax.tree.leaves(params))
  assert count == 25_557_032  # torchvision / Flax example ResNet-50


# Published sizes (224 px, 1000 classes); the class token gets no position
# embedding here, one width fewer than timm's count.
@pytest.mark.parametrize('name, params_millions', [
    ('ViT_Ti16', 5.72), ('ViT_S16', 22.05), ('ViT_B16', 86.57)])
def test_vit_sizes(name, params_millions):
  config = small_config(model=name, image_size=224, num_layers=0,
                        vit_posemb='learn', vit_pool='cls')
  model = nnx.eval_shape(lambda: build(config, in_channels=3,
                                       num_classes=1000))
  count = sum(np.prod(x.shape)
              for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert abs(count / 1e6 - params_millions) < 0.01


def test_vit_honours_num_layers():
  model = nnx.eval_shape(lambda: build(vit_config(num_layers=5)))
  assert model.encoder.num_layers == 5


def test_unknown_model_error_lists_valid_names():
  with pytest.raises(ValueError, match='ResNet50.*ViT_S16.*SmallResNet'):
    build(small_config(model='ResNet51'))


def test_unknown_remat_policy_error_lists_valid_names():
  with pytest.raises(ValueError,
                     match=', '.join(models.REMAT_POLICIES) + '$'):
    build(small_config(remat_policy='some'))


def test_vit_rejects_image_size_not_divisible_by_patch():
  with pytest.raises(ValueError, match='patch size 16'):
    build(vit_config(image_size=40))
