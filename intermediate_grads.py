"""Intermediate-gradient summaries: where in the network the gradient lives.

The models mark points (`models.RecordsIntermediates.record`): each block's
output in every scanned stack, the stem's output and the logits. The summary
step views the model with those points on and runs it inside `nnx.capture`:
`Module.perturb` adds a zero at each point, whose gradient is the gradient
of the loss at that activation, and `Module.sow` keeps the activation's L2
norm. Inside a stack both come out stacked along the layer axis by
`nnx.scan`. The step is its own compiled function, run on its schedule only,
so the ordinary train step does not change.

TensorBoard tags (POINT is `stem`, `logits`, or `STACK/layer_NN` with STACK
the stack's path in the model, e.g. `stages.1.rest` or `encoder`):
`intermediate_grads/POINT/l2_norm` and `.../rms` (the gradient),
`intermediate_activations/POINT/l2_norm` and `.../rms` (the activation),
`intermediate_grads/NAME/histogram` (sampled gradient values, NAME a stack,
`stem` or `logits`), `intermediate_grads/STACK/heatmap` (log10 gradient
norm, layers by summaries) and `intermediate_grads/loss`.
"""

import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import models

GRADS = 'intermediate_grads'
ACTIVATIONS = 'intermediate_activations'
# Gradient values per histogram: a uniform sample of larger points.
HISTOGRAM_SAMPLES = 4096
HISTOGRAM_BUCKETS = 64
# The heatmap keeps a fixed size (CLU writers want the same image shape at
# every step): this many columns; when they are full, neighbouring columns
# are merged and each column then stands for twice as many summaries.
HEATMAP_COLUMNS = 128
HEATMAP_CELL_PIXELS = 4

_POINT_NAMES = {models.STEM_OUTPUT: 'stem', models.LOGITS: 'logits'}


def point_name(path) -> str:
  """A recorded point's name in the tags: the stack's path for a block
  output, `stem` or `logits` (after its module's path, if any) otherwise."""
  *module_path, name = (str(p) for p in path)
  if name == models.LAYER_OUTPUT:
    return '.'.join(module_path[:-1])  # drop the stack's `layers`
  return '.'.join([*module_path, _POINT_NAMES.get(name, name)])


def recorded_grads(model, inputs, loss_of_output, **call_kwargs):
  """The loss and, at every recorded point, the gradient of the loss and
  the activation's L2 norm, as two `{path: array}` dicts (stack points
  carry a leading layer axis)."""
  model = nnx.view(model, record_intermediates=True)

  def forward(model, perturbations):
    output, norms = nnx.capture(model, nnx.Intermediate, init=perturbations)(
        inputs, **call_kwargs)
    return loss_of_output(output), norms

  shapes = nnx.eval_shape(
      lambda m: nnx.capture(m, nnx.Perturbation)(inputs, **call_kwargs)[1],
      model)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  (loss, norms), grads = nnx.value_and_grad(
      forward, argnums=1, has_aux=True)(model, zeros)
  flat = lambda state: {path: v.get_value() for path, v in nnx.to_flat_state(
      state)}
  return loss, flat(grads), flat(norms)


def summary_step(state, batch, *, graphdef, inputs_fn, dropout_seed: int):
  """The summaries of one batch, with the train step's inputs, loss and
  dropout: `inputs_fn(batch, step_key)` gives the model's input images and
  the loss of its output (`train.training_inputs`).

  Returns `{'loss': scalar, POINT_NAME: {...}}`, each point with per-layer
  (or scalar) `grad_l2`, `grad_rms`, `act_l2`, `act_rms` and `grad_sample`
  (at most HISTOGRAM_SAMPLES gradient values).
  """
  step_key = jax.random.fold_in(jax.random.key(dropout_seed), state.step)
  images, loss_of_output = inputs_fn(batch, step_key)
  model = nnx.merge(graphdef, state.params, state.model_state, copy=True)
  loss, grads, act_norms = recorded_grads(
      model, images, loss_of_output, train=True, dropout_key=step_key)
  summary = {'loss': loss}
  for path, grad in grads.items():
    stacked = path[-1] == models.LAYER_OUTPUT
    grad = grad.astype(jnp.float32)
    # Reductions and per-axis indices only: no reshape of the batch axis,
    # which may be sharded (explicitly) over the mesh.
    axes = tuple(range(1 if stacked else 0, grad.ndim))
    grad_l2 = jnp.sqrt(jnp.sum(jnp.square(grad), axis=axes))
    act_l2 = act_norms[path]
    rms_scale = 1 / math.sqrt(math.prod(grad.shape[a] for a in axes))
    point = {'grad_l2': grad_l2, 'grad_rms': grad_l2 * rms_scale,
             'act_l2': act_l2, 'act_rms': act_l2 * rms_scale,
             'grad_sample': sample_values(grad, HISTOGRAM_SAMPLES)}
    summary[point_name(path)] = point
  return summary


def sample_values(x, num: int):
  """All of `x` flattened if it has at most `num` values, else `num` drawn
  uniformly (with replacement), replicated over the mesh."""
  if x.size <= num:
    index = jnp.unravel_index(jnp.arange(x.size), x.shape)
  else:  # independent uniform indices per axis: uniform over elements
    keys = jax.random.split(jax.random.key(0), x.ndim)
    index = tuple(jax.random.randint(k, (num,), 0, n)
                  for k, n in zip(keys, x.shape))
  return x.at[index].get(
      out_sharding=jax.typeof(x).sharding.update(spec=jax.P()))


class Heatmap:
  """log10 gradient norm per layer (rows) over the run's summaries
  (columns), at a fixed image size."""

  def __init__(self, num_layers: int):
    self.columns = np.full((num_layers, HEATMAP_COLUMNS), np.nan)
    self.filled = 0  # complete columns
    self.per_column = 1  # summaries each column averages
    self.pending = []  # summaries of the column being filled

  def add(self, log_norms: np.ndarray) -> None:
    self.pending.append(log_norms)
    if len(self.pending) < self.per_column:
      return
    self.columns[:, self.filled] = np.mean(self.pending, axis=0)
    self.filled, self.pending = self.filled + 1, []
    if self.filled == HEATMAP_COLUMNS:  # merge neighbours: half as many
      merged = self.columns.reshape(len(self.columns), -1, 2).mean(axis=2)
      self.columns[:] = np.nan
      self.columns[:, :HEATMAP_COLUMNS // 2] = merged
      self.filled, self.per_column = HEATMAP_COLUMNS // 2, 2 * self.per_column

  def image(self) -> np.ndarray:
    """uint8 RGB, (layers, HEATMAP_COLUMNS) cells of HEATMAP_CELL_PIXELS."""
    values = self.columns.copy()
    if self.pending:
      values[:, self.filled] = np.mean(self.pending, axis=0)
    used = np.zeros(values.shape, bool)
    used[:, :self.filled + bool(self.pending)] = True
    return np.kron(heatmap_colors(values, used),
                   np.ones((HEATMAP_CELL_PIXELS, HEATMAP_CELL_PIXELS, 1),
                           np.uint8))


# Anchors of the viridis colour map (dark purple = smallest, yellow =
# largest); cells between them are interpolated linearly.
_COLORMAP = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140],
                      [94, 201, 98], [253, 231, 37]], np.float64)
NONFINITE_COLOR = (255, 0, 0)


def heatmap_colors(values: np.ndarray, used: np.ndarray) -> np.ndarray:
  """(rows, cols, 3) uint8: finite values on viridis between their min and
  max, non-finite ones red, unused cells black."""
  finite = used & np.isfinite(values)
  colors = np.zeros((*values.shape, 3), np.uint8)
  if finite.any():
    low, high = values[finite].min(), values[finite].max()
    position = (values[finite] - low) / max(high - low, 1e-12) * (
        len(_COLORMAP) - 1)
    colors[finite] = np.stack(
        [np.interp(position, np.arange(len(_COLORMAP)), _COLORMAP[:, c])
         for c in range(3)], axis=-1).round().astype(np.uint8)
  colors[used & ~np.isfinite(values)] = NONFINITE_COLOR
  return colors


class Summaries:
  """Runs the compiled summary step and writes what it returns."""

  def __init__(self, compiled_summary_step, writer, every_steps: int):
    self.compiled_summary_step = compiled_summary_step
    self.writer = writer
    self.every_steps = every_steps
    self.heatmaps = {}
    self.last_written_step = None

  def write_if_due(self, step: int, state, batch) -> None:
    if step % self.every_steps == 0:
      self.write(step, state, batch)

  def write(self, step: int, state, batch) -> None:
    """Summaries of `batch` under `state`, once per step at most."""
    if step == self.last_written_step:
      return
    self.last_written_step = step
    summary = jax.device_get(self.compiled_summary_step(state, batch))
    scalars = {f'{GRADS}/loss': summary.pop('loss')}
    histograms, images = {}, {}
    for name, point in summary.items():
      stacked = np.ndim(point['grad_l2']) == 1
      if stacked:
        num_layers = len(point['grad_l2'])
        digits = len(str(num_layers - 1))
        layer_names = [f'{name}/layer_{i:0{digits}d}'
                       for i in range(num_layers)]
      else:
        layer_names = [name]
      for prefix, of in ((GRADS, 'grad'), (ACTIVATIONS, 'act')):
        for measure, tag in (('l2', 'l2_norm'), ('rms', 'rms')):
          values = np.reshape(point[f'{of}_{measure}'], -1)
          scalars.update({f'{prefix}/{layer}/{tag}': value
                          for layer, value in zip(layer_names, values)})
      sample = point['grad_sample']
      if np.isfinite(sample).any():  # a histogram needs finite values
        histograms[f'{GRADS}/{name}/histogram'] = sample[np.isfinite(sample)]
      if stacked:
        heatmap = self.heatmaps.setdefault(name, Heatmap(num_layers))
        with np.errstate(divide='ignore', invalid='ignore'):
          heatmap.add(np.log10(point['grad_l2']))
        images[f'{GRADS}/{name}/heatmap'] = heatmap.image()
    self.writer.write_scalars(step, scalars)
    self.writer.write_histograms(
        step, histograms, {tag: HISTOGRAM_BUCKETS for tag in histograms})
    self.writer.write_images(step, images)
    self.writer.flush()
