"""The scanned stack against a Python loop over the same parameters."""

import contextlib
import io
import math
import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from families import vit
from layers import attention
from layers import drop
from layers import norms
from layers import stacked
from helpers import assert_trees_close
from helpers import build_model
from helpers import squared_logits_and_grads

# Tests share compiled programs (in memory): one worker runs them all.
pytestmark = pytest.mark.xdist_group('models')


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


def digits_like_batch():
  return jax.random.normal(jax.random.key(1), (4, 8, 8, 1))


def vit_batch():
  return jax.random.normal(jax.random.key(1), (2, 32, 32, 1))


def large_vit_batch():
  """81 tokens of 16x16 pixels per image: more than a head's channels."""
  return jax.random.normal(jax.random.key(1), (2, 144, 144, 1))


@pytest.mark.parametrize('make_config, batch', [
    (small_config, digits_like_batch),
    (lambda **kw: vit_config(dropout_rate=0.1, **kw), vit_batch),
    # Stochastic depth: the per-layer rates and keys enter the scan.
    (lambda **kw: small_config(drop_path_rate=0.5, **kw), digits_like_batch),
    (lambda **kw: vit_config(drop_path_rate=0.5, dropout_rate=0.1, **kw),
     vit_batch),
    # The attention logits recomputed in the backward pass.
    (lambda **kw: vit_config(image_size=144, **kw), large_vit_batch),
])
def test_scanned_stack_matches_python_loop_outputs_and_gradients(
    make_config, batch):
  x = batch()
  scanned = squared_logits_and_grads(
      make_config(scan_layers=True, scan_unroll=1), x)
  looped = squared_logits_and_grads(make_config(scan_layers=False), x)
  # Gradients of order 1: the loop sums in another order.
  assert_trees_close(scanned, looped, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('policy', sorted(stacked.REMAT_POLICIES))
def test_every_remat_policy_gives_the_gradients_of_no_remat(policy):
  x = digits_like_batch()
  reference = squared_logits_and_grads(small_config(remat_policy='none'), x)
  assert_trees_close(
      squared_logits_and_grads(small_config(remat_policy=policy), x),
      reference, rtol=1e-5, atol=1e-6)


def residuals_of_stack(config, x) -> list[tuple[str, str, tuple]]:
  """(dtype, memory, shape) of each array the backward pass keeps from the
  scanned stack, as `jax.ad_checkpoint.print_saved_residuals` lists them
  (one line per residual: dtype, memory, shape, origin). The stack is the
  model's only scan, so its residuals are the scan's outputs, whichever
  frame JAX names as their origin: the stack's call, or flax's scan wrapper
  where flax lives in a virtual environment, outside the standard library's
  folder that JAX skips."""
  model = build_model(config)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    model = nnx.merge(graphdef, params, rest, copy=True)
    return jnp.sum(model(x, train=True).astype(jnp.float32)**2)
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    jax.ad_checkpoint.print_saved_residuals(loss, params)
  residuals = []
  for line in printed.getvalue().splitlines():
    dtype, memory, shape, origin = re.fullmatch(
        r'(\w+)(<\w+>)?\[([\d,]*)\] (.*)', line).groups()
    if origin.startswith('output of scan from '):
      residuals.append((dtype, memory or '',
                        tuple(int(d) for d in shape.split(',') if d)))
  return residuals


def saved_by_stack(config, x) -> dict:
  """Elements the backward pass keeps from the scanned stack, on the device
  and in host memory (`residuals_of_stack`)."""
  saved = {'device': 0, 'host': 0}
  for _, memory, shape in residuals_of_stack(config, x):
    saved['host' if memory == '<host>' else 'device'] += math.prod(shape)
  return saved


def test_a_rolled_stack_keeps_its_inputs_convolution_outputs_and_statistics():
  """`none` in a rolled stack of basic ResNet blocks in bfloat16: per
  layer its input and its two convolutions' outputs, in bfloat16, and each
  BatchNorm's two batch sums (float32, one per channel), where JAX's
  differentiation alone (`everything`) keeps float32 copies of the
  BatchNorm inputs and ReLU masks besides."""
  depth, activation = 3, (4, 8, 8, 8)  # batch, height, width, channels
  rolled = dict(half_precision=True, scan_unroll=1)
  kept = residuals_of_stack(small_config(remat_policy='none', **rolled),
                            digits_like_batch())
  assert sorted(kept) == sorted([('bf16', '', (depth, *activation))] * 3 +
                                [('f32', '', (depth, 8))] * 4)
  kept = residuals_of_stack(small_config(remat_policy='everything', **rolled),
                            digits_like_batch())
  assert ('f32', '', (depth, *activation)) in kept


def expected_vit_residuals(depth, batch, tokens, width, heads, logits,
                           qkv=True):
  """What `none` keeps of a rolled ViT encoder in bfloat16: per layer its
  input, and of the products q, k, v (as their projection makes them;
  not when `qkv` is False), the attention's output, its projection and
  the MLP's first layer, and the attention logits when `logits` (float32,
  as the softmax takes them); of the reductions, in float32, the
  softmax's maximum and sum per query and each LayerNorm's mean and mean
  square per token."""
  head = width // heads
  return sorted(
      [('bf16', '', (depth, heads, head, batch, tokens))] * (3 if qkv else 0) +
      [('bf16', '', (depth, batch, heads, tokens, head)),
       ('bf16', '', (depth, batch, tokens, width)),
       ('bf16', '', (depth, batch, tokens, width)),
       ('bf16', '', (depth, batch, tokens, 4 * width))] +
      [('f32', '', (depth, batch, heads, tokens))] * 2 +
      [('f32', '', (depth, batch, tokens))] * 4 +
      ([('f32', '', (depth, batch, heads, tokens, tokens))] if logits
       else []))


def test_a_rolled_vit_stack_keeps_its_products_in_their_own_dtype():
  """`none` in a rolled ViT encoder in bfloat16 of 4 tokens (fewer than a
  head's 64 channels): every product, the attention logits too, and the
  reductions' statistics (`expected_vit_residuals`); nothing else."""
  config = vit_config(remat_policy='none', scan_unroll=1, half_precision=True)
  assert sorted(residuals_of_stack(config, vit_batch())) == (
      expected_vit_residuals(3, 2, 4, 192, 3, logits=True))


def test_a_rolled_vit_stack_recomputes_logits_when_tokens_outnumber_channels():
  """The same at 144 pixels, 81 tokens per image: the attention logits
  (3 x 81 x 81 per image) outnumber the queries (81 x 3 x 64), and the
  backward pass recomputes them from q and k instead of keeping them."""
  config = vit_config(remat_policy='none', scan_unroll=1, half_precision=True,
                      image_size=144)
  kept = residuals_of_stack(config, large_vit_batch())
  assert sorted(kept) == expected_vit_residuals(3, 2, 81, 192, 3,
                                                logits=False)


def test_recompute_qkv_keeps_what_none_keeps_but_the_attention_projections():
  """`recompute_qkv` in the rolled ViT encoder at 144 pixels: `none`'s
  residuals without q, k and v, and the same loss and gradients as `none`
  and as the unrolled stack."""
  options = dict(scan_unroll=1, half_precision=True, image_size=144)
  kept = residuals_of_stack(vit_config(remat_policy='recompute_qkv',
                                       **options), large_vit_batch())
  assert sorted(kept) == expected_vit_residuals(3, 2, 81, 192, 3,
                                                logits=False, qkv=False)
  x = vit_batch()
  reference = squared_logits_and_grads(vit_config(remat_policy='none'), x)
  for config in (vit_config(remat_policy='recompute_qkv'),
                 vit_config(remat_policy='recompute_qkv', scan_layers=False)):
    assert_trees_close(squared_logits_and_grads(config, x), reference,
                       rtol=1e-5, atol=1e-5)


def test_keep_erf_keeps_what_none_keeps_and_the_exact_gelus_erf():
  """`keep_erf` in a rolled ViT encoder with the exact GELU: `none`'s
  residuals and the output of the GELU's erfc, one per MLP unit; `none`
  recomputes it. The same loss and gradients as `none`, rolled and
  unrolled."""
  options = dict(scan_unroll=1, half_precision=True, vit_gelu='exact')
  depth, batch, tokens, width = 3, 2, 4, 192
  expected = expected_vit_residuals(depth, batch, tokens, width, 3,
                                    logits=True)
  assert sorted(residuals_of_stack(vit_config(remat_policy='none', **options),
                                   vit_batch())) == expected
  assert sorted(residuals_of_stack(
      vit_config(remat_policy='keep_erf', **options), vit_batch())) == sorted(
          expected + [('bf16', '', (depth, batch, tokens, 4 * width))])
  x = vit_batch()
  reference = squared_logits_and_grads(
      vit_config(remat_policy='none', vit_gelu='exact'), x)
  for config in (vit_config(remat_policy='keep_erf', vit_gelu='exact'),
                 vit_config(remat_policy='keep_erf', vit_gelu='exact',
                            scan_layers=False)):
    assert_trees_close(squared_logits_and_grads(config, x), reference,
                       rtol=1e-5, atol=1e-5)


def test_an_unrolled_stack_applies_remat_but_under_none_and_recompute_qkv():
  """Unrolled, XLA keeps what `none` and `recompute_qkv` keep (and lays
  q, k and v out for their readers): no remat; another policy remats."""
  remat = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.).eqns[0].primitive

  def remats(jaxpr) -> bool:
    return any(eqn.primitive is remat or
               any(remats(sub) for sub in jax.core.jaxprs_in_params(
                   eqn.params))
               for eqn in jaxpr.eqns)
  for policy in stacked.REMAT_POLICIES:
    model = build_model(vit_config(remat_policy=policy, scan_layers=False))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
      model = nnx.merge(graphdef, params, rest, copy=True)
      return jnp.sum(model(vit_batch(), train=True)**2)
    assert remats(jax.make_jaxpr(loss)(params).jaxpr) == (
        policy not in ('none', 'recompute_qkv')), policy


def test_each_remat_policy_changes_what_the_stack_keeps():
  """In a rolled ViT encoder (matrix products with and without batch
  dimensions)."""
  saved = {policy: saved_by_stack(vit_config(remat_policy=policy,
                                             scan_unroll=1), vit_batch())
           for policy in stacked.REMAT_POLICIES}
  depth, (batch, tokens, width) = 3, (2, 4, 192)
  # Remat of the whole block keeps only each layer's input.
  assert saved['full'] == {'device': depth * batch * tokens * width,
                           'host': 0}
  device = {policy: s['device'] for policy, s in saved.items()}
  # `none` keeps every product's output (a ViT block has no convolution)
  # and the reductions' (the softmax's and the LayerNorms' statistics),
  # `everything` every residual the differentiation names as well.
  assert (device['full'] < device['dots_no_batch'] < device['dots'] <
          device['none'] < device['everything'])
  heads = 3
  assert device['none'] - device['dots'] == depth * batch * (
      4 * tokens + 2 * heads * tokens)
  # `recompute_qkv` keeps `none`'s but q, k and v.
  assert device['none'] - device['recompute_qkv'] == (
      depth * 3 * batch * tokens * width)
  # Offloading keeps on the device what full remat keeps; the products
  # without batch dimensions go to host memory instead.
  assert saved['offload_dots'] == {
      'device': device['full'],
      'host': device['dots_no_batch'] - device['full']}


def test_scan_unroll_does_not_change_results():
  x = digits_like_batch()
  assert_trees_close(
      squared_logits_and_grads(small_config(scan_unroll=2), x),
      squared_logits_and_grads(small_config(scan_unroll=1), x), rtol=1e-5,
      atol=1e-6)


def test_stack_parameters_and_batch_stats_have_a_leading_layer_axis():
  model = build_model(small_config(num_layers=5))
  stack = model.stages[0].rest.layers
  assert stack.conv1.kernel.shape == (5, 3, 3, 8, 8)
  assert stack.bn1.mean.shape == (5, 8)
  # Independent initialisation per layer.
  kernels = np.asarray(stack.conv1.kernel[...]).reshape(5, -1)
  assert len({k.tobytes() for k in kernels}) == 5


def test_batch_norm_statistics_update_per_layer_in_training_only():
  x = digits_like_batch()
  _, _, trained = squared_logits_and_grads(small_config(), x, train=True)
  means = np.asarray(trained['stages'][0]['rest']['layers']['bn1']['mean'])
  assert np.all(np.abs(means) > 0)  # initialised at zero, all updated
  assert not np.allclose(means[0], means[1])  # each layer its own
  _, _, evaluated = squared_logits_and_grads(small_config(), x, train=False)
  np.testing.assert_array_equal(
      evaluated['stages'][0]['rest']['layers']['bn1']['mean'], 0.0)


def test_eval_uses_running_statistics():
  """In eval a single example's output does not depend on the batch."""
  model = build_model(small_config())
  x = digits_like_batch()
  full = model(x, train=False)
  single = model(x[:1], train=False)
  np.testing.assert_allclose(full[:1], single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('make_config, batch, scanned', [
    (lambda **kw: small_config(drop_path_rate=0.5, remat_policy='full',
                               **kw), digits_like_batch, {}),
    (lambda **kw: vit_config(drop_path_rate=0.5, num_layers=4,
                             remat_policy='dots', **kw), vit_batch,
     dict(scan_segments=2)),
])
def test_drop_path_under_remat_and_scan_segments_matches_the_python_loop(
    make_config, batch, scanned):
  x = batch()
  assert_trees_close(
      squared_logits_and_grads(make_config(scan_unroll=1, **scanned), x),
      squared_logits_and_grads(make_config(scan_layers=False), x), rtol=1e-5,
      atol=1e-5)


def test_drop_path_is_off_in_evaluation_and_changes_training():
  x = vit_batch()
  on, off = vit_config(drop_path_rate=0.5), vit_config()
  np.testing.assert_array_equal(build_model(on)(x, train=False),
                                build_model(off)(x, train=False))
  trained_on = squared_logits_and_grads(on, x)
  trained_off = squared_logits_and_grads(off, x)
  assert trained_off[0] > 0
  assert not np.allclose(trained_on[0], trained_off[0])


def test_drop_path_rates_rise_linearly_over_all_of_a_resnets_blocks():
  assert drop.drop_path_rates(0.2, 5) == pytest.approx(
      [0.0, 0.05, 0.1, 0.15, 0.2])
  assert drop.drop_path_rates(0.2, 1) == [0.0]
  # ResNet-18's 8 blocks: stage 2's first block is block 2, its stack
  # holds block 3.
  model = nnx.eval_shape(lambda: build_model(small_config(
      model='ResNet18', drop_path_rate=0.7), in_channels=3))
  rates = drop.drop_path_rates(0.7, 8)
  assert model.stages[1].first_drop_path_rate == rates[2]
  assert model.stages[1].rest.drop_path_rates == tuple(rates[3:4])
  assert model.stages[3].rest.drop_path_rates == (0.7,)


class _DropPathProbe(nnx.Module):
  """Doubles the carry and adds whether this layer kept each example (its
  residual branch of ones, dropped or scaled by 1 / (1 - rate))."""

  def __init__(self, rngs):
    self.unused = nnx.Param(jnp.zeros(()))

  def __call__(self, x, *, train, dropout_key=None, drop_path_rate=None):
    branch = drop.drop_path(jnp.ones_like(x), drop_path_rate, dropout_key,
                              0, train)
    return 2 * x + branch * (1 - drop_path_rate)


def test_drop_path_drops_each_layers_share_of_examples_and_scales_the_rest():
  rates = drop.drop_path_rates(0.4, 5)
  stack = stacked.StackedBlocks(_DropPathProbe, 5, drop_path_rates=rates,
                               rngs=nnx.Rngs(0))
  examples = 20_000
  out = np.asarray(stack(jnp.zeros((examples, 1)), train=True,
                         dropout_key=jax.random.key(5)))[:, 0]
  # Digit i of the output is layer i's kept bit, unless rounding of the
  # scaled branch says otherwise: each digit is 0 or 1 exactly.
  code = np.round(out).astype(int)
  np.testing.assert_allclose(out, code, atol=1e-4)
  kept = np.array([(code >> (4 - i)) & 1 for i in range(5)])
  standard_error = np.sqrt(0.25 / examples)
  np.testing.assert_allclose(1 - kept.mean(axis=1), rates,
                             atol=4 * standard_error)
  # Independent draws: layers 3 and 4 drop different examples.
  assert not np.array_equal(kept[3], kept[4])
  branch = drop.drop_path(jnp.ones((examples, 1)), jnp.float32(0.25),
                            jax.random.key(0), 0, train=True)
  assert np.unique(np.asarray(branch)).tolist() == pytest.approx(
      [0.0, 1 / 0.75])


class _DropoutProbe(nnx.Module):
  """Doubles the carry and adds this layer's dropout mask (0 or 2)."""

  def __init__(self, rngs):
    self.dropout = nnx.Dropout(0.5)
    self.unused = nnx.Param(jnp.zeros(()))

  def __call__(self, x, *, train, dropout_key=None, drop_path_rate=None):
    del drop_path_rate  # off
    mask = self.dropout(jnp.ones_like(x), deterministic=not train,
                        rngs=dropout_key)
    return 2 * x + mask


@pytest.mark.parametrize('scan_layers', [True, False])
def test_dropout_draws_a_distinct_mask_in_every_layer(scan_layers):
  num_layers = 4
  stack = stacked.StackedBlocks(_DropoutProbe, num_layers,
                               scan_layers=scan_layers, rngs=nnx.Rngs(0))
  out = stack(jnp.zeros((64,)), train=True, dropout_key=jax.random.key(3))
  # The output is a binary number whose digit i is layer i's mask bit.
  code = np.asarray(out).astype(int) // 2
  masks = np.array([(code >> (num_layers - 1 - i)) & 1
                    for i in range(num_layers)])
  assert len({m.tobytes() for m in masks}) == num_layers
  assert 0.2 < masks.mean() < 0.8
  stack_other = stacked.StackedBlocks(_DropoutProbe, num_layers,
                                     scan_layers=not scan_layers,
                                     rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(
      out, stack_other(jnp.zeros((64,)), train=True,
                       dropout_key=jax.random.key(3)))
  # Without training no unit is dropped: every mask is all ones.
  np.testing.assert_array_equal(
      stack(jnp.zeros((64,)), train=False), 2**num_layers - 1)


def weighted_layers(model) -> int:
  """Convolutions and dense layers on the main path (not the projection
  shortcuts), each layer of a stack counted."""
  count = 0
  for path, kernel in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = [str(p) for p in path]
    if names[-1] == 'kernel' and 'proj' not in names:
      count += kernel.shape[0] if 'rest' in names else 1
  return count


# torchvision's ResNet-18 ... 152 and timm's ResNet-200 (224 px, 1000
# classes; ResNet v1.5 moves a stride, not a parameter).
@pytest.mark.parametrize('name, params', [
    ('ResNet18', 11_689_512), ('ResNet34', 21_797_672),
    ('ResNet50', 25_557_032), ('ResNet101', 44_549_160),
    ('ResNet152', 60_192_808), ('ResNet200', 64_673_832)])
def test_resnet_has_the_published_depth_and_parameter_count(name, params):
  model = nnx.eval_shape(lambda: build_model(small_config(model=name),
                                       in_channels=3, num_classes=1000))
  assert weighted_layers(model) == int(name.removeprefix('ResNet'))
  count = sum(np.prod(x.shape)
              for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert count == params


# Published sizes (224 px, 1000 classes); the class token gets no position
# embedding here, one width fewer than timm's count.
@pytest.mark.parametrize('name, params_millions', [
    ('ViT_Ti16', 5.72), ('ViT_S16', 22.05), ('ViT_B16', 86.57)])
def test_vit_sizes(name, params_millions):
  config = small_config(model=name, image_size=224, num_layers=0,
                        vit_posemb='learn', vit_pool='cls')
  model = nnx.eval_shape(lambda: build_model(config, in_channels=3,
                                       num_classes=1000))
  count = sum(np.prod(x.shape)
              for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert abs(count / 1e6 - params_millions) < 0.01


def test_vit_num_layers_sets_the_depth_of_its_encoder():
  """Each layer more adds one encoder block of ViT-Ti/16 (width 192, MLP
  768): LayerNorms 2 x 2w, query/key/value/output projections 4(w^2 + w),
  MLP 2wm + m + w."""
  w, m = 192, 768
  block_params = 4 * w + 4 * (w * w + w) + 2 * w * m + m + w
  counts = {}
  for depth in (2, 3, 5):
    model = nnx.eval_shape(lambda: build_model(vit_config(num_layers=depth)))
    params = nnx.state(model, nnx.Param)
    counts[depth] = sum(np.prod(x.shape) for x in jax.tree.leaves(params))
    assert {x.shape[0] for x in jax.tree.leaves(params['encoder'])} == {depth}
  assert counts[3] - counts[2] == block_params
  assert counts[5] - counts[3] == 2 * block_params


def plain_vit_forward(model, images, patch_size):
  """A ViT with a class token and a learned position embedding, written
  out: patches flattened and projected, the position embedding added to
  the patches only, the class token put first, the encoder blocks one by
  one, the class token's output normalised into the head."""
  n, h, w, c = images.shape
  p = patch_size
  patches = images.reshape(n, h // p, p, w // p, p, c).transpose(
      0, 1, 3, 2, 4, 5).reshape(n, (h // p) * (w // p), p * p * c)
  embed = model.patch_embed
  x = patches @ embed.kernel[...].reshape(p * p * c, -1) + embed.bias[...]
  x = x + model.posemb[...]
  class_token = jnp.broadcast_to(model.cls[...], (n, 1, x.shape[-1]))
  x = jnp.concatenate([class_token, x], axis=1)
  graphdef, stacked = nnx.split(model.encoder.layers)
  for i in range(model.encoder.num_layers):
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
    x = block(x, train=False)
  return model.head(model.encoder_norm(x[:, 0]))


def test_vit_with_class_token_and_learned_position_embedding_matches_plain():
  """Outputs and every parameter's gradient, at random parameters (the
  class token and the head start at zero)."""
  model = vit.ViT(10, patch_size=4, width=8, depth=3, num_heads=2,
                  mlp_dim=16, image_size=8, in_channels=3, pool='cls',
                  posemb='learn', stack_options=dict(scan_unroll=1),
                  rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rng = np.random.default_rng(0)
  params = jax.tree.map(
      lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape), a.dtype),
      params)
  images = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))

  def loss_of(forward):
    def loss(params):
      model = nnx.merge(graphdef, params, rest, copy=True)
      return jnp.sum(forward(model) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)

  scanned = loss_of(lambda model: model(images, train=False))
  plain = loss_of(lambda model: plain_vit_forward(model, images, 4))
  assert_trees_close(scanned, plain, rtol=1e-5, atol=1e-6)
  _, grads = plain
  assert np.abs(grads['cls'][...]).min() > 0
  assert np.abs(grads['posemb'][...]).min() > 0


def attention_pair(dtype):
  """layers/attention.py's attention and flax's nnx.MultiHeadAttention
  (the reference: `jax.nn.dot_product_attention`), from the same seed,
  every bias set non-zero in both."""
  ours = attention.MultiHeadAttention(64, 4, dtype=dtype, rngs=nnx.Rngs(0))
  flax = nnx.MultiHeadAttention(
      num_heads=4, in_features=64, decode=False, dtype=dtype,
      kernel_init=nnx.initializers.xavier_uniform(), rngs=nnx.Rngs(0))
  for i, name in enumerate(('query', 'key', 'value', 'out')):
    bias = jax.random.normal(jax.random.key(i), getattr(ours, name).bias.shape)
    getattr(ours, name).bias[...] = getattr(flax, name).bias[...] = bias
  return ours, flax


def test_attention_matches_flax_multi_head_attention():
  """The same parameters from the same seed, and in float32 the same
  outputs and parameter gradients, for self-attention and for one probe
  attending to tokens (the MAP head)."""
  ours, flax = attention_pair(jnp.float32)
  assert_trees_close(nnx.state(ours), nnx.state(flax), rtol=0, atol=0)
  tokens = jax.random.normal(jax.random.key(7), (2, 17, 64))
  probe = jax.random.normal(jax.random.key(8), (2, 1, 64))

  def loss_and_grads(module, call):
    graphdef, params = nnx.split(module)
    return jax.value_and_grad(lambda p: jnp.sum(
        call(nnx.merge(graphdef, p)) ** 2))(params)

  for call_ours, call_flax in (
      (lambda m: m(tokens), lambda m: m(tokens)),
      (lambda m: m(probe, tokens), lambda m: m(probe, tokens, tokens))):
    assert_trees_close(loss_and_grads(ours, call_ours),
                       loss_and_grads(flax, call_flax), rtol=1e-5, atol=1e-4)


def test_batch_norm_in_bfloat16_computes_as_linens_batch_norm():
  """In bfloat16, the outputs in training and evaluation, the statistics
  and the float32 gradients of scale, bias and input of flax.linen's
  BatchNorm (the Flax ImageNet example's): statistics, scale and bias
  stay float32 (nnx's own default rounds them to bfloat16 first)."""
  import flax.linen  # pylint: disable=g-import-not-at-top
  x = jax.random.normal(jax.random.key(0), (4, 5, 5, 8), jnp.bfloat16) * 3
  params = {'scale': jax.random.uniform(jax.random.key(1), (8,)) + 0.5,
            'bias': jax.random.normal(jax.random.key(2), (8,))}
  stats = {'mean': jax.random.normal(jax.random.key(3), (8,)),
           'var': jax.random.uniform(jax.random.key(4), (8,)) + 0.5}
  ours = norms.BatchNorm(8, momentum=0.9, epsilon=1e-5, dtype=jnp.bfloat16,
                         rngs=nnx.Rngs(0))
  graphdef, _ = nnx.split(ours)
  theirs = flax.linen.BatchNorm(momentum=0.9, epsilon=1e-5,
                                dtype=jnp.bfloat16)

  def ours_fn(p, x, train):
    module = nnx.merge(graphdef, nnx.State({**p, **stats}))
    y = module(x, use_running_average=not train)
    return y, {k: getattr(module, k)[...] for k in stats}

  def theirs_fn(p, x, train):
    y, updates = theirs.apply({'params': p, 'batch_stats': stats}, x,
                              use_running_average=not train,
                              mutable=['batch_stats'])
    return y, updates['batch_stats']

  for train in (True, False):
    (y_ours, new_ours), (y_theirs, new_theirs) = (
        fn(params, x, train) for fn in (ours_fn, theirs_fn))
    assert y_ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y_ours, np.float32),
                                  np.asarray(y_theirs, np.float32))
    assert_trees_close(new_ours, dict(new_theirs), rtol=0, atol=0)
    grads = [jax.grad(lambda p, x: jnp.sum(
        fn(p, x, train)[0].astype(jnp.float32) ** 2), argnums=(0, 1))(
            params, x) for fn in (ours_fn, theirs_fn)]
    assert grads[0][0]['scale'].dtype == jnp.float32
    assert_trees_close(grads[0], grads[1], rtol=0, atol=0)


def logits_dtypes(module, x) -> set:
  """The dtypes in which `module(x)` computes the attention logits
  (batch, heads, tokens, tokens) and the softmax's exponentials."""
  logits = (x.shape[0], 4, x.shape[1], x.shape[1])
  return {var.aval.dtype.name for eqn in jax.make_jaxpr(module)(x).eqns
          if eqn.primitive in (jax.lax.dot_general_p, jax.lax.exp_p)
          for var in eqn.outvars if var.aval.shape == logits}


def test_vit_float32_logits_false_computes_the_softmax_in_bfloat16():
  """In bfloat16 the logits and the softmax are float32 as flax's are, or
  bfloat16 with `float32_logits=False`, whose outputs stay within
  bfloat16's rounding of flax's."""
  tokens = jax.random.normal(jax.random.key(7), (2, 17, 64), jnp.bfloat16)
  ours, flax = attention_pair(jnp.bfloat16)
  assert logits_dtypes(ours, tokens) == {'float32'}
  assert_trees_close(ours(tokens), flax(tokens), rtol=0, atol=0.02)
  half = attention.MultiHeadAttention(64, 4, dtype=jnp.bfloat16,
                                      float32_logits=False, rngs=nnx.Rngs(0))
  nnx.update(half, nnx.state(ours))
  assert logits_dtypes(half, tokens) == {'bfloat16'}
  assert_trees_close(half(tokens), flax(tokens), rtol=0, atol=0.1)


def test_unknown_model_error_lists_valid_names():
  with pytest.raises(ValueError, match='ResNet50.*ViT_S16.*SmallResNet'):
    build_model(small_config(model='ResNet51'))


def test_unknown_remat_policy_error_lists_valid_names():
  with pytest.raises(ValueError,
                     match=', '.join(stacked.REMAT_POLICIES) + '$'):
    build_model(small_config(remat_policy='some'))


def test_vit_rejects_image_size_not_divisible_by_patch():
  with pytest.raises(ValueError, match='cut into patches of 16'):
    build_model(vit_config(image_size=40))
