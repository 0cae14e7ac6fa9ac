"""What several test modules share: small configs, references computed
outside the trainer, readers of what a run wrote, and tree comparisons."""

import contextlib
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import types

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.backend.event_processing import event_file_loader
from tensorboard.compat.proto import event_pb2
from tensorboard.util import tensor_util
import tensorflow as tf

from configs import default
from data import datasets
import input_pipeline
import models
import processes
from processes import REPO
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from training import optimizer
from training import run_state
from weights import pretrained

# ------------------------------------------------------------------ configs


def default_config(**overrides):
  """The default config with `overrides`."""
  config = default.get_config()
  config.update(overrides)
  return config


def tiny_config(**overrides):
  """The default config shrunk to a two-layer ResNet of width 8 on digits:
  8 steps of batch 16, logging every 2, evaluating and saving every 4."""
  config = default.get_config()
  config.num_layers = 2
  config.width = 8
  config.batch_size = 16
  config.num_train_steps = 8
  config.log_every_steps = 2
  config.eval_every_steps = 4
  config.checkpoint_every_steps = 4
  config.update(overrides)
  return config


# A ViT small enough for a CPU. Rolled scans: ViT blocks run fast rolled on
# CPU, and compile far faster.
VIT = dict(model='ViT_Ti16', num_layers=2, image_size=32, scan_unroll=1)

LEARNING_RATE = 0.1  # the constant rate of `initial_state_and_batch`


def initial_state_and_batch(config, batch_size):
  """Graph definition, initial state and optimizer (at LEARNING_RATE) of
  `config`, and a batch of `batch_size` examples: digits for the small
  ResNet, random images for a ViT."""
  if config.model == 'SmallResNet':
    data = datasets.load_digits()
    info = data.info
    batch = {'image': data.train_images[:batch_size],
             'label': data.train_labels[:batch_size]}
  else:
    size = config.image_size
    info = input_pipeline.DatasetInfo(10, (size, size, 3), 1000, 100)
    rng = np.random.default_rng(0)
    batch = {'image': rng.normal(size=(batch_size, size, size, 3)).astype(
        np.float32), 'label': rng.integers(0, 10, batch_size)}
  batch = jax.tree.map(jnp.asarray, batch)
  graphdef, state, tx = run_state.create_train_state(
      config, info, lambda step: LEARNING_RATE,
      dtype=models.compute_dtype(config))
  return graphdef, state, tx, batch


# ---------------------------------------------- references outside train.py


def is_kernel(path) -> bool:
  """Convolution and dense weight matrices: the parameters both recipes
  decay (the Flax example: ndim > 1 in an unstacked model; big_vision:
  names ending in /kernel)."""
  return 'kernel' in [getattr(key, 'key', None) for key in path]


def as_numpy(tree):
  """`tree` with NumPy arrays: references computed by hand in NumPy, where
  JAX, op by op, would compile a program per operation and shape."""
  return jax.tree.map(np.asarray, tree)


def cross_entropy_and_grads(graphdef, state, batch, penalty=0.0):
  """(Cross-entropy (plus penalty x 0.5 |kernels|^2) of a plain forward
  pass, the BatchNorm statistics it leaves), and its gradient."""
  return _cross_entropy_and_grads(graphdef, state.params, state.model_state,
                                  batch, penalty)


# Compiled once per model and batch shape, not once per call.
@functools.partial(jax.jit, static_argnums=0)
def _cross_entropy_and_grads(graphdef, params, model_state, batch, penalty):
  def loss_fn(params):
    model = nnx.merge(graphdef, params, model_state, copy=True)
    logits = model(batch['image'], train=True)
    log_p = jax.nn.log_softmax(logits)
    xent = -jnp.mean(jnp.take_along_axis(log_p, batch['label'][:, None], 1))
    l2 = sum(jnp.sum(x**2) for path, x in
             jax.tree_util.tree_leaves_with_path(params) if is_kernel(path))
    return xent + penalty * 0.5 * l2, nnx.state(model, nnx.Not(nnx.Param))
  return jax.value_and_grad(loss_fn, has_aux=True)(params)


def build_model(config, in_channels=1, num_classes=10):
  """A fresh model of `config` in its compute dtype (seed 0)."""
  return models.create_model(config.model, num_classes, in_channels,
                             dtype=models.compute_dtype(config),
                             rngs=nnx.Rngs(0), **models.options(config))


def squared_logits_and_grads(config, x, train=True, in_channels=1):
  """Sum of squared logits, its parameter gradients and the new
  non-parameter state of a fresh model (its head random: the ViT's starts
  at zero, which would keep every gradient from the encoder)."""
  model = build_model(config, in_channels)
  model.head.kernel.value = 0.1 * jax.random.normal(
      jax.random.key(2), model.head.kernel.value.shape)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  (loss, new_rest), grads = _squared_logits_and_grads(graphdef, train, params,
                                                      rest, x)
  return loss, grads, new_rest


# Compiled once per model and input shape, not once per call.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _squared_logits_and_grads(graphdef, train, params, rest, x):
  def loss_fn(params):
    model = nnx.merge(graphdef, params, rest, copy=True)
    logits = model(x, train=train, dropout_key=jax.random.key(7))
    return jnp.sum(logits**2), nnx.state(model, nnx.Not(nnx.Param))
  return jax.value_and_grad(loss_fn, has_aux=True)(params)


def random_arrays(shapes, rng, spread):
  """The arrays of `shapes` (nnx variables' arrays or their shapes) drawn
  in NumPy from `rng`: BatchNorm variances in [0.5, 1.5), scales about 1,
  the rest about 0, each with standard deviation `spread(name, shape)`."""
  def draw(path, shape):
    name = str(getattr(path[-2], 'key', path[-2]))  # the variable's name
    if name == 'var':
      drawn = 0.5 + rng.random(shape.shape)
    else:
      drawn = (name == 'scale') + spread(name, shape.shape) * (
          rng.standard_normal(shape.shape))
    # Cast and placed without JAX, which compiles a conversion or a copy
    # program per shape.
    return jax.device_put(drawn.astype(shape.dtype))
  return jax.tree.map_with_path(draw, shapes)


def random_model(build):
  """The model `build()` makes, at random parameters and statistics drawn
  in NumPy (seed 0, `random_arrays` of spread 0.1). Built abstractly:
  compiling the initialisers of every tiny variant a test builds would
  cost more than the test."""
  graphdef, state = nnx.split(nnx.eval_shape(build))
  return nnx.merge(graphdef, random_arrays(
      state, np.random.default_rng(0), lambda name, shape: 0.1))


def training_loss_and_grads(model, x):
  """Sum of squared logits of `model` as it is, in training (drop path on,
  BatchNorm on batch statistics), and its parameter gradients."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  (loss, _), grads = _squared_logits_and_grads(graphdef, True, params, rest,
                                               x)
  return loss, grads


# ---------------------------------------------------------- comparing trees


def assert_trees_close(a, b, *, rtol, atol):
  """Every leaf of `a` close to `b`'s, compared in float32 (bfloat16 leaves
  too)."""
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol,
      atol=atol), a, b)


def assert_same_state(a, b):
  """Two train states bit for bit: step, parameters, statistics and
  optimizer state."""
  jax.tree.map(np.testing.assert_array_equal,
               (a.step, a.params, a.model_state, a.opt_state),
               (b.step, b.params, b.model_state, b.opt_state))


def max_difference(a, b) -> float:
  """The largest absolute difference between the leaves of two trees."""
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# About one float32 ulp of these parameters (|p| < 1): over a few steps the
# rounding floor itself is a single ulp, and another ulp is still rounding.
ULP = 1e-7


def assert_within_rounding(resumed, reference, other_topology) -> None:
  """`resumed` (a run moved to another topology midway) is as close to the
  uninterrupted `reference` as rounding allows: twice the parameter
  difference between `reference` and the whole run on the other topology,
  plus an ulp."""
  floor = max_difference(other_topology.params, reference.params)
  difference = max_difference(resumed.params, reference.params)
  assert difference <= 2 * floor + ULP, (difference, floor)


# ------------------------------------------------- what a run left behind


def read_events(workdir) -> dict:
  """{tag: {step: array}}: every tensor summary in `workdir`'s event files
  (scalars, histograms, images)."""
  found = {}
  for path in glob.glob(os.path.join(workdir, 'events.out.tfevents.*')):
    accumulator = event_accumulator.EventAccumulator(
        path, size_guidance={event_accumulator.TENSORS: 0})
    accumulator.Reload()
    for tag in accumulator.Tags()['tensors']:
      for event in accumulator.Tensors(tag):
        found.setdefault(tag, {})[event.step] = tensor_util.make_ndarray(
            event.tensor_proto)
  return found


def read_scalars(workdir) -> dict:
  """{tag: {step: float}} of the scalar summaries in `workdir`."""
  return {tag: {step: float(value) for step, value in steps.items()}
          for tag, steps in read_events(workdir).items()
          if all(v.shape == () and v.dtype.kind == 'f'
                 for v in steps.values())}


def events(workdir) -> dict:
  """{tag: [(step, value), ...]} of the scalars over all event files,
  duplicates kept (a resumed run logs some steps twice)."""
  found = {}
  for path in sorted(glob.glob(os.path.join(workdir, '*tfevents*'))):
    for record in event_file_loader.RawEventFileLoader(path).Load():
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        array = tensor_util.make_ndarray(value.tensor)
        if array.shape == ():
          found.setdefault(value.tag, []).append((event.step, float(array)))
  return {tag: sorted(pairs) for tag, pairs in found.items()}


# Logged from the values of the run, not its timing.
DETERMINISTIC_TAGS = ('train_loss', 'train_accuracy', 'train_learning_rate',
                      'train_grad_norm', 'eval_loss', 'eval_accuracy',
                      'eval_examples')


def restore_final(workdir, config):
  """The newest checkpoint in `workdir`, restored onto `config`'s state."""
  info = datasets.load_digits().info
  _, state, _ = run_state.create_train_state(
      config, info, optimizer.learning_rate_schedule(config, 1, 1),
      dtype=models.compute_dtype(config))
  manager = checkpointing.create_manager(workdir, 3)
  restored = checkpointing.restore_latest(
      manager, state, compatibility.as_json(config)).state
  manager.close()
  return restored


def write_checkpoint(workdir, config, info, step: int = 0, noise=0.0):
  """A workdir holding one checkpoint, at `step`, of `config`'s freshly
  initialised state on the data set of `info` (a teacher for distillation),
  `noise` x normal noise added to every parameter (a zero head predicts
  nothing); returns the state."""
  _, state, _ = run_state.create_train_state(
      config, info, lambda step: 0.0,
      dtype=models.compute_dtype(config))
  @jax.jit  # one program: op by op, each parameter's shape would compile
  def noisy(params):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(config.seed), len(leaves))
    return jax.tree.unflatten(tree, [
        x + noise * jax.random.normal(key, x.shape, x.dtype)
        for x, key in zip(leaves, keys)])
  state = state.replace(params=noisy(state.params))
  manager = checkpointing.create_manager(str(workdir), 1)
  checkpointing.save(manager, step, state, compatibility.as_json(config),
                     info.class_names)
  manager.wait_until_finished()
  manager.close()
  return state


def copy_checkpoint(workdir, step: int, destination) -> None:
  """`destination` becomes a workdir holding only `workdir`'s checkpoint at
  `step`, as if the run had been killed right after saving it."""
  shutil.copytree(os.path.join(workdir, 'checkpoints'),
                  os.path.join(destination, 'checkpoints'),
                  ignore=lambda _, names: [n for n in names if n.isdigit()
                                           and int(n) != step])


# ------------------------------------------------------------- the console


def console_of(workdir, *overrides,
               compile_flags: str = processes.COMPILE_FLAGS) -> list[str]:
  """The console lines (stdout and stderr) of the quick-start command with
  `overrides`, on one CPU device, as a user runs it, compiled with XLA's
  `compile_flags`."""
  env = processes.one_device_environment(compile_flags)
  result = subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py',
       f'--workdir={workdir}', *overrides],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return (result.stdout + result.stderr).splitlines()


# absl's Python log line: level, date, time, thread, file:line] message.
LOG_LINE = re.compile(r'([IWEF])\d{4} [\d:.]+ +\d+ ([\w.]+):\d+\] (.*)')
PROJECT_FILES = {name for folder in ('.', 'data', 'runtime', 'training',
                                      'weights')
                 for name in os.listdir(os.path.join(REPO, folder))
                 if name.endswith('.py')}
# CLU's metric writer.
CLU_FILES = {'logging_writer.py'}


def foreign_lines(lines: list[str]) -> list[str]:
  """Lines other than warnings, errors and INFO lines of the project or
  CLU."""
  def ours(line):
    parsed = LOG_LINE.fullmatch(line)
    return parsed and (parsed[1] != 'I' or
                       parsed[2] in PROJECT_FILES | CLU_FILES)
  return [line for line in lines if not ours(line)]


# ---------------------------------------------------- compilation cache


@contextlib.contextmanager
def cache_directory(directory):
  """JAX's compilation cache directory set to `directory` in this process
  (for what reads the setting: nothing compiles meanwhile)."""
  suites_cache = jax.config.jax_compilation_cache_dir
  jax.config.update('jax_compilation_cache_dir', directory)
  try:
    yield
  finally:
    jax.config.update('jax_compilation_cache_dir', suites_cache)


def counter(flops: float):
  """A count of `flops` FLOPs and the list of its calls."""
  calls = []
  return (lambda: calls.append(flops) or flops), calls


# ------------------------------------------------------------- input data

SIZE = 16  # the image size of the input tests
PREPROCESSING = input_pipeline.Preprocessing(SIZE)
MEAN, STDDEV = (np.array(v, np.float32)
                for v in input_pipeline.NORMALIZATIONS['imagenet'])


def batch_sharding(num_devices):
  """Batches split over the first `num_devices` devices."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), ('data',))
  return NamedSharding(mesh, P('data'))


def host_batches(iterator, count):
  """The next `count` batches of `iterator` as numpy arrays, floating ones
  in float32 (bfloat16 images compare as numbers)."""
  def on_host(x):
    x = np.asarray(x)
    return x.astype(np.float32) if jnp.issubdtype(x.dtype,
                                                  jnp.floating) else x
  return [jax.tree.map(on_host, next(iterator)) for _ in range(count)]


def reference_eval_image(pixels: np.ndarray, method='bicubic', mean=MEAN,
                         stddev=STDDEV) -> np.ndarray:
  """Central square of 224/256 of the shorter side, resized, normalised."""
  height, width = pixels.shape[:2]
  side = int(224 / 256 * min(height, width))
  top, left = (height - side + 1) // 2, (width - side + 1) // 2
  crop = pixels[top:top + side, left:left + side].astype(np.float32)
  resized = tf.image.resize(crop, (SIZE, SIZE), method=method).numpy()
  return (resized - mean) / stddev


def masked_examples(batches):
  """Host copies of the unmasked images and labels of eval batches."""
  images, labels = [], []
  for batch in batches:
    mask = np.asarray(batch['mask'])
    images.append(np.asarray(batch['image'], np.float32)[mask])
    labels.append(np.asarray(batch['label'])[mask])
  return np.concatenate(images), np.concatenate(labels)


# ------------------------------------------------------ published files

def images(size: int, seed: int = 1, count: int = 2) -> np.ndarray:
  """`count` random NHWC images of `size` pixels square, 3 channels: what
  the tests of published and exported files run both networks on."""
  return np.asarray(jax.random.normal(jax.random.key(seed),
                                      (count, size, size, 3)))


def torch_logits(torch, model, x):
  """A PyTorch `model`'s logits on the NHWC images `x` (it reads NCHW)."""
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(x)).permute(0, 3, 1, 2)).numpy()


# One compiled forward pass per model structure, for every file it reads:
# op by op, a model's forward compiles each of its operations.
evaluation_logits = nnx.jit(lambda model, x: model(x, train=False))


def loaded_logits(model, config, path, x, init_format='auto'):
  """`model`'s logits on `x` after reading the weights in `path` as a run
  of `config` does."""
  pretrained.load_into_model(model, models.settings(config), path,
                             init_format)
  return np.asarray(evaluation_logits(model, x))


def flat_params(state) -> dict:
  """{'/'-joined path: array} of each parameter (`nnx.Param`) of `state`."""
  return {'/'.join(map(str, path)): np.asarray(variable.get_value())
          for path, variable in nnx.to_flat_state(state)
          if isinstance(variable, nnx.Param)}


def import_timm():
  """timm itself, the reference for its files. Its torchvision import loads
  `torchvision._meta_registrations`, which needs the CUDA build's operators;
  the CPU torch the tests install has none, and timm's models use none."""
  sys.modules.setdefault('torchvision._meta_registrations',
                         types.ModuleType('torchvision._meta_registrations'))
  import timm  # pylint: disable=g-import-not-at-top
  return timm


def digits_run_context(config):
  """(registry context, graphdef, initial state) of a run of `config` on the
  digits, on its mesh: what an evaluator is built from."""
  from runtime import sharding  # pylint: disable=g-import-not-at-top
  import train  # pylint: disable=g-import-not-at-top
  info = datasets.load_digits().info
  mesh = sharding.create_mesh(config.mesh, config.step_mode)
  graphdef, state, state_sharding, _ = run_state.create_sharded_train_state(
      config, info, 0.0, mesh, dtype=models.compute_dtype(config))
  return (train.evaluator_context(
      config, info, mesh, graphdef, state, state_sharding,
      models.compute_dtype(config)), graphdef, state)


def assert_refuses_a_file_that_is_not_an_image(tmp_path, classify) -> None:
  """`classify(path)` of a text file raises the one line that names the
  file and the formats TensorFlow decodes."""
  not_an_image = str(tmp_path / 'notes.txt')
  with open(not_an_image, 'w') as f:
    f.write('not pixels')
  with pytest.raises(ValueError, match=(
      f"^image '{not_an_image}': not an image TensorFlow decodes \\(JPEG, "
      r'PNG, BMP, GIF, WebP\): Unknown image file format')):
    classify(not_an_image)
