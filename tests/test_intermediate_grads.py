"""Intermediate-gradient summaries against an unrolled jax.grad reference,
and the trainer's summary tags. (Their heatmaps:
tests/test_gradient_heatmaps.py.)"""

import functools
import io
import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
import pytest

from training import compiling
from training import distillation
from training import intermediate_grads
from training import losses
from families import resnet
from families import swin
from families import vit
from training import nonfinite
from training import state as train_state
import train
from helpers import assert_trees_close
from helpers import read_events
from helpers import tiny_config

BATCH = 8
NUM_CLASSES = 10


def small_resnet(**stack_options):
  """Two stages, each a projecting block and a stack of two."""
  options = dict(remat_policy='none', scan_layers=True, scan_unroll=4)
  options.update(stack_options)
  return resnet.ResNet([3, 3], resnet.BasicBlock, NUM_CLASSES, in_channels=1,
                       width=4, small_input=True, stack_options=options,
                       rngs=nnx.Rngs(0))


def small_vit(**stack_options):
  return vit.ViT(NUM_CLASSES, patch_size=4, width=8, depth=3, num_heads=2,
                 mlp_dim=16, image_size=8, in_channels=1,
                 stack_options=stack_options, rngs=nnx.Rngs(0))


def small_swin(**stack_options):
  """Two stages of 4x4 and 2x2 maps in windows of 2: two (window, shifted
  window) pairs, then patch merging and one pair."""
  return swin.Swin((4, 2), (1, 2), NUM_CLASSES, embed_dim=4, window=2,
                   image_size=16, in_channels=1, stack_options=stack_options,
                   rngs=nnx.Rngs(0))


def randomized_state(make):
  """The graph definition of `make()` and a TrainState of random values in
  its layout. Drawn on the host: no initialiser runs or compiles, and no
  zero-initialised scale or head makes a block an identity or a gradient
  zero. (BatchNorm's running statistics are random too: training mode
  does not read them.)"""
  graphdef, params, model_state = nnx.split(nnx.eval_shape(make), nnx.Param,
                                            ...)
  rng = np.random.default_rng(1)
  params, model_state = jax.device_put(jax.tree.map(
      lambda s: 0.3 * rng.standard_normal(s.shape, s.dtype),
      (params, model_state)))
  state = train_state.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                 model_state=model_state, opt_state=(),
                                 nonfinite_streak=jnp.zeros((), jnp.int32))
  return graphdef, state


def a_batch(image_size=8):
  images = jax.random.normal(jax.random.key(2),
                             (BATCH, image_size, image_size, 1))
  labels = jnp.arange(BATCH) % NUM_CLASSES
  return {'image': images, 'label': labels}


def mean_loss(logits, labels):
  return jnp.mean(losses.cross_entropy(logits, labels))


def summarize(graphdef, state, batch, grad_accum_steps=1, trainable=''):
  return jax.jit(functools.partial(
      intermediate_grads.summary_step, graphdef=graphdef,
      inputs_fn=functools.partial(distillation.training_inputs,
                                  label_smoothing=0.0, mixup_alpha=0.0),
      dropout_seed=1, grad_accum_steps=grad_accum_steps,
      trainable=trainable))(state, batch)


def looped_layers(stack, x, eps, activations):
  """The stack's blocks one by one, each output plus its explicit zero."""
  graphdef, stacked = nnx.split(stack.layers)
  for i in range(stack.num_layers):
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked))
    x = block(x, train=True, dropout_key=jax.random.key(0)) + eps[i]
    activations.append(x)
  return x


def resnet_reference(model, images, eps, activations):
  x = nnx.relu(model.stem_bn(model.stem(images), use_running_average=False))
  x = x + eps['stem']
  activations.append(x)
  for i, stage in enumerate(model.stages):
    x = stage.first(x, train=True) + eps[f'stages.{i}.first']
    activations.append(x)
    x = looped_layers(stage.rest, x, eps[f'stages.{i}.rest'], activations)
  return model.head(jnp.mean(x, axis=(1, 2)))


def vit_reference(model, images, eps, activations):
  x = model.patch_embed(images)
  n, h, w, c = x.shape
  x = x.reshape(n, h * w, c) + model.posemb[...] + eps['stem']
  activations.append(x)
  x = looped_layers(model.encoder, x, eps['encoder'], activations)
  return model.head(jnp.mean(model.encoder_norm(x), axis=1))


def swin_reference(model, images, eps, activations):
  x = model.patch_embed_norm(model.patch_embed(images)) + eps['stem']
  activations.append(x)
  for i, stage in enumerate(model.stages):
    if stage.downsample is not None:
      x = stage.downsample(stage.downsample_norm(swin.merge_patches(x)))
    graphdef, pairs = nnx.split(stage.blocks.layers)
    firsts, seconds = [], []
    for j in range(stage.blocks.num_layers):
      pair = nnx.merge(graphdef, jax.tree.map(lambda a, j=j: a[j], pairs))
      x = pair.first(x, train=True) + eps[f'stages.{i}.blocks.first'][j]
      firsts.append(x)
      x = pair.second(x, train=True) + eps[f'stages.{i}.blocks'][j]
      seconds.append(x)
    activations.extend(firsts + seconds)  # in the order of eps's points
  return model.head(jnp.mean(model.head_norm(x), axis=(1, 2)))


def reference_summaries(forward, graphdef, state, batch, eps):
  """Per-point gradient and activation norms from jax.grad with respect to
  explicit additive zeros `eps`, in an unrolled Python loop."""
  def loss_fn(eps):
    model = nnx.merge(graphdef, state.params, state.model_state, copy=True)
    activations = []
    logits = forward(model, batch['image'], eps, activations)
    logits = logits + eps['logits']
    activations.append(logits)
    return mean_loss(logits, batch['label']), activations

  grads, activations = jax.jit(jax.grad(loss_fn, has_aux=True))(eps)
  # The forward appended activations in the order of eps's points.
  norms, i = {}, 0
  for name in eps:
    count = len(eps[name]) if isinstance(eps[name], list) else 1
    acts = activations[i:i + count]
    i += count
    grad = grads[name] if isinstance(grads[name], list) else [grads[name]]
    norms[name] = (np.array([np.linalg.norm(g) for g in grad]),
                   np.array([np.linalg.norm(a) for a in acts]),
                   grad[0].size)
  return norms


def zeros_like_points(summary, shapes):
  return {name: ([jnp.zeros(shapes[name])] * len(summary[name]['grad_l2'])
                 if np.ndim(summary[name]['grad_l2']) else
                 jnp.zeros(shapes[name])) for name in shapes}


@pytest.mark.parametrize('family, variants', [
    ('resnet', [dict(scan_layers=False)]),
    ('vit', [dict(scan_layers=False, remat_policy='dots')]),
    ('swin', [dict(scan_layers=False)]),
])
def test_layer_gradient_norms_match_an_unrolled_reference(family, variants):
  """Also the same summaries with the stacks looped in Python (and under
  a remat policy: the scanned models rematerialise nothing). Every block
  has its point: a Swin's window blocks as well as its pairs."""
  image_size = 8
  if family == 'swin':
    make, forward, image_size = small_swin, swin_reference, 16
    shapes = {'stem': (BATCH, 4, 4, 4),
              'stages.0.blocks.first': (BATCH, 4, 4, 4),
              'stages.0.blocks': (BATCH, 4, 4, 4),
              'stages.1.blocks.first': (BATCH, 2, 2, 8),
              'stages.1.blocks': (BATCH, 2, 2, 8)}
  elif family == 'resnet':
    make, forward = small_resnet, resnet_reference
    # In the forward pass's order: each stage's first block, then its stack.
    shapes = {'stem': (BATCH, 8, 8, 4), 'stages.0.first': (BATCH, 8, 8, 4),
              'stages.0.rest': (BATCH, 8, 8, 4),
              'stages.1.first': (BATCH, 4, 4, 8),
              'stages.1.rest': (BATCH, 4, 4, 8)}
  else:
    make, forward = small_vit, vit_reference
    shapes = {'stem': (BATCH, 4, 8), 'encoder': (BATCH, 4, 8)}
  shapes['logits'] = (BATCH, NUM_CLASSES)
  graphdef, state = randomized_state(make)
  batch = a_batch(image_size)
  summary = summarize(graphdef, state, batch)
  assert set(summary) == {'loss', *shapes}
  eps = zeros_like_points(summary, shapes)
  reference = reference_summaries(forward, graphdef, state, batch, eps)
  for name, (grad_l2, act_l2, size) in reference.items():
    point = summary[name]
    # Unstacked: the stem, the logits and a ResNet stage's first block.
    assert np.ndim(point['grad_l2']) == (
        name not in ('stem', 'logits') and family != 'resnet' or
        name.endswith('.rest'))
    np.testing.assert_allclose(np.reshape(point['grad_l2'], -1), grad_l2,
                               rtol=1e-5)
    np.testing.assert_allclose(np.reshape(point['act_l2'], -1), act_l2,
                               rtol=1e-5)
    np.testing.assert_allclose(point['grad_rms'],
                               point['grad_l2'] / np.sqrt(size), rtol=1e-6)
  assert np.all(np.concatenate([v[0] for v in reference.values()]) > 0)
  for options in variants:
    other = nnx.graphdef(nnx.eval_shape(lambda: make(**options)))
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5,
                                   atol=1e-7),
                 summarize(other, state, batch), summary)


def test_accumulating_steps_summarize_the_whole_batch_of_the_update():
  """A ViT (no BatchNorm): four micro-batches give the whole batch's
  norms and, these points being small enough to be sampled whole, the
  same histogram values."""
  graphdef, state = randomized_state(small_vit)
  batch = a_batch()
  whole = summarize(graphdef, state, batch)
  accumulated = summarize(graphdef, state, batch, grad_accum_steps=4)
  assert accumulated.keys() == whole.keys()
  assert float(accumulated['loss']) == pytest.approx(float(whole['loss']),
                                                     rel=1e-6)
  for name in set(whole) - {'loss'}:
    for key in ('grad_l2', 'grad_rms', 'act_l2', 'act_rms'):
      np.testing.assert_allclose(accumulated[name][key], whole[name][key],
                                 rtol=1e-5, err_msg=f'{name} {key}')
    np.testing.assert_allclose(
        np.sort(accumulated[name]['grad_sample']),
        np.sort(whole[name]['grad_sample']), rtol=1e-5, atol=1e-9)


def test_summaries_of_a_probe_normalise_with_the_running_statistics():
  """With every BatchNorm frozen (`trainable` matches the head alone), the
  summary step's forward pass is the train step's: running statistics,
  here the evaluation pass's loss; with all trained, the batch's."""
  graphdef, state = randomized_state(small_resnet)
  # Positive running variances: the frozen BatchNorms divide by them.
  state = state.replace(model_state=jax.tree.map(jnp.abs, state.model_state))
  batch = a_batch()
  evaluated = float(mean_loss(nnx.merge(graphdef, state.params,
                                        state.model_state)(
                                            batch['image'], train=False),
                              batch['label']))
  probe = summarize(graphdef, state, batch, trainable='head/.*')
  assert float(probe['loss']) == pytest.approx(evaluated, rel=1e-6)
  assert float(summarize(graphdef, state, batch)['loss']) != pytest.approx(
      evaluated, rel=1e-3)


def test_recording_leaves_output_and_parameter_gradients_unchanged():
  graphdef, state = randomized_state(small_vit)
  batch = a_batch()

  def loss_and_param_grads(record):
    def loss_fn(params):
      model = nnx.merge(graphdef, params, state.model_state, copy=True)
      if not record:
        return mean_loss(model(batch['image'], train=True),
                               batch['label'])
      recorded = nnx.view(model, record_intermediates=True)
      _, zeros = nnx.capture(recorded, nnx.Perturbation)(batch['image'],
                                                         train=True)
      logits, _ = nnx.capture(recorded, nnx.Intermediate, init=zeros)(
          batch['image'], train=True)
      assert not nnx.state(model, nnx.Perturbation)  # nothing left behind
      return mean_loss(logits, batch['label'])
    return jax.jit(jax.value_and_grad(loss_fn))(state.params)

  (plain_loss, plain), (recorded_loss, recorded) = (
      loss_and_param_grads(False), loss_and_param_grads(True))
  assert recorded_loss == plain_loss
  # The zero perturbations change how XLA fuses the backward pass, hence
  # the rounding of its sums: up to 4e-9 where the largest gradient is
  # 0.14. Gradients scaled by 1 + 1e-5 fail this.
  assert_trees_close(recorded, plain, rtol=1e-6, atol=1e-7)


def decode_image(value) -> np.ndarray:
  """An image summary's tensor: [width, height, PNG bytes]."""
  return np.asarray(Image.open(io.BytesIO(value[2])))


def program_text(compiled) -> str:
  """The optimised HLO's operations, without source locations (the tables
  of files and stack frames, each op's metadata): where a program was
  traced from is not what it computes."""
  text = re.sub(r'\n(FileNames|FunctionNames|FileLocations|StackFrames)\n'
                r'(.+\n)*', '\n', compiled.as_text())
  return re.sub(r', metadata=\{[^}]*\}', '', text)


def compiled_texts(monkeypatch):
  """Records the optimised HLO of every step the trainer compiles."""
  texts = []
  lower_and_compile = compiling.lower_and_compile

  def recording_lower_and_compile(*args):
    compiled, seconds, lowered = lower_and_compile(*args)
    texts.append(program_text(compiled))
    return compiled, seconds, lowered

  monkeypatch.setattr(compiling, 'lower_and_compile',
                      recording_lower_and_compile)
  return texts


@pytest.mark.slow
def test_trainer_writes_a_tag_per_layer_keeps_its_train_step_and_stops_on_nan(
    tmp_path, monkeypatch):
  """Two runs, summaries off and on (every step), bfloat16, of a learning
  rate so large that the loss is NaN at step 3."""
  texts = compiled_texts(monkeypatch)
  errors = {}
  for every_steps in (0, 1):  # one call site: the same source locations
    config = tiny_config(num_layers=3, num_train_steps=4, learning_rate=1e6,
                         warmup_epochs=0.0, steps_per_eval=1,
                         half_precision=True,
                         intermediate_grads_every_steps=every_steps)
    try:
      train.train_and_evaluate(config, str(tmp_path / str(every_steps)))
    except nonfinite.NonFiniteError as e:
      errors[every_steps] = str(e)
    if not every_steps:
      off_texts = list(texts)
  # Both runs stop at the first non-finite step, the same one.
  assert list(errors) == [0, 1]
  for error in errors.values():
    assert error.startswith('non-finite loss or gradients at step 3')
  # Compiled: the train and eval steps, and (on) the summary step, each on
  # a thread of its own (in any order). The train and eval steps are the
  # same programs with summaries on, byte for byte.
  on_texts = texts[len(off_texts):]
  assert len(off_texts) == 2 and len(on_texts) == 3
  assert sorted(text for text in on_texts if text in off_texts) == sorted(
      off_texts)

  assert not any(tag.startswith('intermediate')
                 for tag in read_events(str(tmp_path / '0')))
  events = read_events(str(tmp_path / '1'))
  stack = 'stages.0.rest'  # SmallResNet: one stage, its stack of 3 blocks
  points = ['stem', 'logits', 'stages.0.first'] + [
      f'{stack}/layer_{i:02d}' for i in range(3)]
  scalar_tags = {f'{prefix}/{point}/{measure}'
                 for prefix in ('intermediate_grads', 'intermediate_activations')
                 for point in points for measure in ('l2_norm', 'rms')}
  scalar_tags.add('intermediate_grads/loss')
  histograms = {f'intermediate_grads/{name}/histogram'
                for name in ('stem', 'logits', 'stages.0.first', stack)}
  heatmap_tag = f'intermediate_grads/{stack}/heatmap'
  assert ({t for t in events if t.startswith('intermediate')} ==
          scalar_tags | histograms | {heatmap_tag})
  for tag in scalar_tags | {heatmap_tag}:  # step 3: the NaN step
    assert sorted(events[tag]) == [1, 2, 3], tag
  for tag in scalar_tags:
    assert np.isfinite(events[tag][1]) and events[tag][1] > 0, tag
  assert np.isnan(events['intermediate_grads/loss'][3])
  for tag in histograms:  # NaNs are left out of histograms
    assert 1 in events[tag], tag

  width, height = intermediate_grads.HEATMAP_PIXELS
  red = np.multiply(intermediate_grads.NONFINITE_COLOR, 255)
  layer_norms = [events['intermediate_grads/stages.0.first/l2_norm']] + [
      events[f'intermediate_grads/{stack}/layer_{i:02d}/l2_norm']
      for i in range(3)]
  for step, value in events[heatmap_tag].items():
    image = decode_image(value)
    assert image.shape[:2] == (height, width)
    # Cells are marked red once a summary so far had a non-finite norm.
    with np.errstate(divide='ignore'):
      any_nonfinite = not all(
          np.isfinite(np.log10(norms[s]))
          for norms in layer_norms for s in norms if s <= step)
    red_cells = np.all(image[..., :3] == red, axis=-1).any()
    assert red_cells == any_nonfinite, step
  assert np.isnan(layer_norms[0][3])
