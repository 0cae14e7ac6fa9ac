"""Intermediate-gradient summaries: where in the network the gradient lives.

The models mark points (`stacked.RecordsIntermediates.record`): each block's
output in every scanned stack, the stem's output and the logits. The summary
step views the model with those points on and runs it inside `nnx.capture`:
`Module.perturb` adds a zero at each point, whose gradient is the gradient
of the loss at that activation, and `Module.sow` keeps the activation's L2
norm. Inside a stack both come out stacked along the layer axis by
`nnx.scan`. The step is its own compiled function, run on its schedule only,
so the ordinary train step does not change.

TensorBoard tags (POINT is `stem`, `logits`, `stages.N.first` (a ResNet
stage's first, projecting block, outside its stack) or `STACK/layer_NN`
with STACK the stack's path in the model, e.g. `stages.1.rest` or
`encoder`, and NN the layer's index zero-padded to two digits or more):
`intermediate_grads/POINT/l2_norm` and `.../rms` (the gradient),
`intermediate_activations/POINT/l2_norm` and `.../rms` (the activation),
`intermediate_grads/NAME/histogram` (sampled gradient values, NAME a stack,
`stem` or `logits`), `intermediate_grads/STACK/heatmap` (a figure of the
log10 gradient norm, layers by steps, with a colour bar; a ResNet stage's
first block is its top row) and
`intermediate_grads/loss`.
"""

import functools
import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from runtime import sharding
from training import accumulation
from training import compiling
from training import distillation
from training import trainable as trainable_lib
from layers import stacked

GRADS = 'intermediate_grads'
ACTIVATIONS = 'intermediate_activations'
# Gradient values per histogram: a uniform sample of larger points.
HISTOGRAM_SAMPLES = 4096
HISTOGRAM_BUCKETS = 64
# The heatmap figure keeps one size (CLU writers want the same image shape
# at every step), near the width of TensorBoard's image cards (335 px and
# up), so that its text stays legible where it is shown scaled down. Its
# columns stop at this many: when they are full, neighbouring columns are
# merged and each column then stands for twice as many summaries.
HEATMAP_PIXELS = (480, 320)  # width, height
HEATMAP_DPI = 100
HEATMAP_COLUMNS = 128
HEATMAP_COLORMAP = 'viridis'
NONFINITE_COLOR = (1.0, 0.0, 0.0)  # red: not in the colour map

_POINT_NAMES = {stacked.STEM_OUTPUT: 'stem', stacked.LOGITS: 'logits',
                stacked.FIRST_BLOCK_OUTPUT: 'first'}


def point_name(path) -> str:
  """A recorded point's name in the tags: the stack's path for a block
  output (with the block's part of a stacked step, e.g. a Swin pair's
  `first`), `stem` or `logits` (after its module's path, if any)
  otherwise."""
  *module_path, name = (str(p) for p in path)
  if name == stacked.LAYER_OUTPUT:
    # The stack's `layers` is the scan's, not a part of the network.
    return '.'.join(p for p in module_path if p != 'layers')
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


def summary_step(state, batch, *, graphdef, inputs_fn, dropout_seed: int,
                 grad_accum_steps: int = 1, accum_unroll: int = 1,
                 trainable: str = ''):
  """The summaries of one batch, with the train step's inputs, loss and
  dropout: `inputs_fn(batch, key, teacher)` gives the model's input images
  and the loss of its output (`distillation.training_inputs`, distilled
  from the state's teacher when there is one). With `grad_accum_steps` > 1,
  of the train step's micro-batches one after the other (with their keys),
  combined into the summaries of the update's whole batch: the loss is
  their mean, so each micro-batch's gradients count 1 / k. BatchNorms that
  `trainable` freezes normalise with their running statistics, as in the
  train step.

  Returns `{'loss': scalar, POINT_NAME: {...}}`, each point with per-layer
  (or scalar) `grad_l2`, `grad_rms`, `act_l2`, `act_rms` and `grad_sample`
  (at most HISTOGRAM_SAMPLES gradient values).
  """
  step_key = jax.random.fold_in(jax.random.key(dropout_seed), state.step)
  samples = max(HISTOGRAM_SAMPLES // grad_accum_steps, 1)

  def micro_summary(sums, micro):
    """Sums of squares over this micro-batch, and a sample of gradients."""
    micro_batch, key = micro
    images, loss_and_terms, _ = inputs_fn(micro_batch, key, state.teacher)
    loss_of_output = lambda output: loss_and_terms(output)[0]
    model = nnx.merge(graphdef, state.params, state.model_state, copy=True)
    trainable_lib.freeze_batch_norms(model, trainable)
    loss, grads, act_norms = recorded_grads(
        model, images, loss_of_output, train=True, dropout_key=key)
    squares, sample = {}, {}
    for path, grad in grads.items():
      # The whole batch's loss weighs this micro-batch's by 1 / k.
      grad = grad.astype(jnp.float32) / grad_accum_steps
      # Reductions and per-axis indices only: no reshape of the batch axis,
      # which may be sharded (explicitly) over the mesh.
      axes = tuple(range(1 if path[-1] == stacked.LAYER_OUTPUT else 0,
                         grad.ndim))
      size = math.prod(grad.shape[a] for a in axes)
      grad_squares = jnp.sum(jnp.square(grad), axis=axes)
      act_squares = jnp.square(act_norms[path])
      squares[path] = {'grad': grad_squares, 'act': act_squares,
                       'grad_mean': grad_squares / size,
                       'act_mean': act_squares / size}
      sample[path] = sample_values(grad, samples)
    # A list, not a dict: the paths are tuples, which do not sort beside
    # a name.
    terms = [loss, squares]
    if sums is not None:
      terms = jax.tree.map(jnp.add, sums, terms)
    return terms, sample

  first_micro_batch = jax.tree.map(
      lambda x: x[0], accumulation.micro_batches(batch, grad_accum_steps))
  zeros = jax.tree.map(
      lambda s: jnp.zeros(s.shape, s.dtype),
      jax.eval_shape(
          lambda: micro_summary(None, (first_micro_batch, step_key))[0]))
  (loss, sums), samples = accumulation.scan(
      micro_summary, zeros, batch, step_key, grad_accum_steps, accum_unroll)
  summary = {'loss': loss / grad_accum_steps}
  for path, squares in sums.items():
    summary[point_name(path)] = {
        'grad_l2': jnp.sqrt(squares['grad']),
        'grad_rms': jnp.sqrt(squares['grad_mean'] / grad_accum_steps),
        'act_l2': jnp.sqrt(squares['act']),
        'act_rms': jnp.sqrt(squares['act_mean'] / grad_accum_steps),
        'grad_sample': samples[path].reshape(-1)}
  return summary


def layer_name(index: int, num_layers: int) -> str:
  """`layer_NN`: the index zero-padded to two digits, or more for deeper
  stacks, so that tags sort in layer order."""
  return f'layer_{index:0{max(2, len(str(num_layers - 1)))}d}'


def heatmap_rows(stack: str, summary: dict) -> tuple[str, np.ndarray] | None:
  """The heatmap's title and per-row gradient norms of a stack, its rows the
  stage's blocks in order: a ResNet stage's stack `stages.N.rest` is
  preceded by the stage's first block (`stages.N.first`); a Swin stage's
  stack of pairs `stages.N.blocks` interleaves each pair's window block
  (`stages.N.blocks.first`, stacked too) with its shifted one. None for
  such a stacked `first`: its rows are in its stack's heatmap."""
  own = np.reshape(summary[stack]['grad_l2'], -1)
  parent = stack.removesuffix('.first')
  if parent != stack and parent in summary:
    return None
  pair_first = summary.get(f'{stack}.first')
  if pair_first is not None:
    return stack, np.stack([np.reshape(pair_first['grad_l2'], -1), own],
                           axis=1).reshape(-1)
  stage, _, _ = stack.rpartition('.')
  first_block = summary.get(f'{stage}.first')
  if not stage or first_block is None:
    return stack, own
  return stage, np.concatenate([np.reshape(first_block['grad_l2'], 1), own])


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
  (columns), kept to at most HEATMAP_COLUMNS columns."""

  def __init__(self, name: str, num_layers: int):
    self.name = name
    self.columns = np.full((num_layers, HEATMAP_COLUMNS), np.nan)
    self.last_steps = np.zeros(HEATMAP_COLUMNS, int)  # of each column
    self.filled = 0  # complete columns
    self.per_column = 1  # summaries each column averages
    self.pending = []  # (step, log norms) of the column being filled

  def add(self, step: int, log_norms: np.ndarray) -> None:
    self.pending.append((step, log_norms))
    if len(self.pending) < self.per_column:
      return
    self.columns[:, self.filled], self.last_steps[self.filled] = (
        self._pending_column())
    self.filled, self.pending = self.filled + 1, []
    if self.filled == HEATMAP_COLUMNS:  # merge neighbours: half as many
      merged = self.columns.reshape(len(self.columns), -1, 2).mean(axis=2)
      self.columns[:] = np.nan
      self.columns[:, :HEATMAP_COLUMNS // 2] = merged
      self.last_steps[:HEATMAP_COLUMNS // 2] = self.last_steps[1::2]
      self.filled, self.per_column = HEATMAP_COLUMNS // 2, 2 * self.per_column

  def _pending_column(self):
    """The mean of the pending summaries and the step of the last one."""
    return (np.mean([norms for _, norms in self.pending], axis=0),
            self.pending[-1][0])

  def values_and_steps(self) -> tuple[np.ndarray, np.ndarray]:
    """(layers, columns) log10 norms so far and each column's last step."""
    values = self.columns[:, :self.filled]
    steps = self.last_steps[:self.filled]
    if self.pending:
      column, step = self._pending_column()
      values = np.concatenate([values, column[:, None]], axis=1)
      steps = np.append(steps, step)
    return values, steps

  def image(self) -> np.ndarray:
    """The figure as uint8 RGB pixels, HEATMAP_PIXELS in size."""
    return figure_pixels(heatmap_figure(self.name, *self.values_and_steps()))


# matplotlib is imported where a figure is drawn: importing it takes about
# 0.4 s of CPU, which every launch would pay, and only runs that write
# intermediate-gradient summaries draw.


def heatmap_figure(name: str, values: np.ndarray, steps: np.ndarray):
  """`values` (layers, columns) as a labelled matplotlib Figure: a row per
  layer of stack `name` (the first on top), a column per summary (its last
  step on the step axis), a colour bar, non-finite cells in
  NONFINITE_COLOR."""
  # pylint: disable=g-import-not-at-top
  import matplotlib
  from matplotlib import figure as figure_lib
  from matplotlib import patches
  from matplotlib import ticker
  # pylint: enable=g-import-not-at-top
  width, height = HEATMAP_PIXELS
  figure = figure_lib.Figure(figsize=(width / HEATMAP_DPI,
                                      height / HEATMAP_DPI),
                             dpi=HEATMAP_DPI, layout='constrained')
  axes = figure.add_subplot()
  colormap = matplotlib.colormaps[HEATMAP_COLORMAP].with_extremes(
      bad=NONFINITE_COLOR)
  cells = axes.imshow(np.ma.masked_invalid(values), cmap=colormap,
                      aspect='auto', interpolation='nearest')
  axes.set_title(f'{name}: gradient at each block output')
  axes.set_ylabel(f'{name} layer')
  axes.set_xlabel('training step')
  axes.yaxis.set_major_locator(ticker.MaxNLocator(nbins=6, integer=True))
  # Labelled columns: the first, the last and a few evenly between.
  labelled = np.unique(np.linspace(0, len(steps) - 1, 4).round().astype(int))
  axes.set_xticks(labelled, [str(steps[c]) for c in labelled])
  figure.colorbar(cells, ax=axes, label='log10 of gradient L2 norm')
  if not np.isfinite(values).all():
    figure.legend(handles=[patches.Patch(color=NONFINITE_COLOR,
                                         label='not finite')],
                  loc='outside lower right')
  return figure


def figure_pixels(figure) -> np.ndarray:
  """A matplotlib Figure drawn by its Agg renderer, as uint8 RGB pixels."""
  # pylint: disable-next=g-import-not-at-top
  from matplotlib.backends import backend_agg
  canvas = backend_agg.FigureCanvasAgg(figure)
  canvas.draw()
  return np.asarray(canvas.buffer_rgba())[..., :3].copy()


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
        layer_names = [f'{name}/{layer_name(i, num_layers)}'
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
      rows = heatmap_rows(name, summary) if stacked else None
      if rows:
        title, norms = rows
        heatmap = self.heatmaps.setdefault(name, Heatmap(title, len(norms)))
        with np.errstate(divide='ignore', invalid='ignore'):
          heatmap.add(step, np.log10(norms))
        images[f'{GRADS}/{name}/heatmap'] = heatmap.image()
    self.writer.write_scalars(step, scalars)
    self.writer.write_histograms(
        step, histograms, {tag: HISTOGRAM_BUCKETS for tag in histograms})
    self.writer.write_images(step, images)
    self.writer.flush()


def compiled_summaries(step_kwargs: dict, every_steps: int, state, batch,
                       state_sharding, batch_sharding, writer) -> Summaries:
  """The summary step compiled beside the train step whose keywords are
  `step_kwargs` (the same inputs, loss, dropout and micro-batches), with
  its writer."""
  compiled, _ = compiling.compile_step(
      functools.partial(
          summary_step, graphdef=step_kwargs['graphdef'],
          inputs_fn=functools.partial(
              distillation.training_inputs,
              label_smoothing=step_kwargs['label_smoothing'],
              **step_kwargs['mixing'], **step_kwargs['distill']),
          **{key: step_kwargs[key] for key in (
              'dropout_seed', 'grad_accum_steps', 'accum_unroll',
              'trainable')}),
      state_sharding, batch_sharding, state, batch,
      out_shardings=sharding.replicated(batch_sharding.mesh),
      donate_state=False)
  return Summaries(compiled, writer, every_steps)
