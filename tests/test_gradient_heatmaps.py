"""The per-layer gradient heatmaps: the rows of each stack's blocks, a fixed
image size as columns merge, colours that rise with the value and mark
non-finite cells, and matplotlib imported only to draw them."""

import subprocess
import sys

import matplotlib
import numpy as np
import pytest

from training import intermediate_grads
import processes


def test_heatmap_rows_are_each_stages_blocks_in_order():
  """A ResNet stage: its first block, then its stack; a Swin stage: each
  pair's window block, then its shifted one."""
  point = lambda *norms: {'grad_l2': np.asarray(norms if len(norms) > 1
                                                else norms[0])}
  summary = {'stages.0.first': point(1.0), 'stages.0.rest': point(2.0, 3.0),
             'encoder': point(4.0, 5.0),
             'stages.1.blocks.first': point(6.0, 8.0),
             'stages.1.blocks': point(7.0, 9.0)}
  rows = lambda name: intermediate_grads.heatmap_rows(name, summary)
  title, norms = rows('stages.0.rest')
  assert title == 'stages.0' and norms.tolist() == [1.0, 2.0, 3.0]
  title, norms = rows('encoder')
  assert title == 'encoder' and norms.tolist() == [4.0, 5.0]
  title, norms = rows('stages.1.blocks')
  assert title == 'stages.1.blocks' and norms.tolist() == [6.0, 7.0, 8.0, 9.0]
  assert rows('stages.1.blocks.first') is None


def test_heatmap_keeps_its_size_and_merges_columns_when_full():
  columns = intermediate_grads.HEATMAP_COLUMNS
  heatmap = intermediate_grads.Heatmap('stack', num_layers=2)
  sizes = {heatmap_image_shape(2, 1)}
  for t in range(2 * columns + 1):
    heatmap.add(10 * (t + 1), np.array([t, -t], float))
  # 2C+1 summaries: merged twice, each column now averages 4 summaries and
  # is labelled with the step of the last of them.
  assert heatmap.per_column == 4
  values, steps = heatmap.values_and_steps()
  np.testing.assert_array_equal(
      values[0, :heatmap.filled],
      np.arange(4 * heatmap.filled).reshape(-1, 4).mean(axis=1))
  np.testing.assert_array_equal(steps, [*range(40, 40 * heatmap.filled + 1, 40),
                                        10 * (2 * columns + 1)])
  assert len(heatmap.pending) == 1 and values[0, -1] == 2 * columns
  sizes.add(heatmap.image().shape)
  sizes.add(heatmap_image_shape(64, columns))
  width, height = intermediate_grads.HEATMAP_PIXELS
  assert sizes == {(height, width, 3)}


def heatmap_image_shape(num_layers, num_columns):
  values = np.random.default_rng(0).standard_normal((num_layers, num_columns))
  return intermediate_grads.figure_pixels(intermediate_grads.heatmap_figure(
      'stack', values, np.arange(1, num_columns + 1))).shape


def cell_colors(figure, pixels, num_layers, num_columns):
  """The RGB colour drawn at the centre of each cell, (layers, columns, 3)."""
  axes = figure.axes[0]
  centres = axes.transData.transform(
      [(c, r) for r in range(num_layers) for c in range(num_columns)])
  x = centres[:, 0].round().astype(int)
  y = (pixels.shape[0] - centres[:, 1]).round().astype(int)  # rows from top
  return pixels[y, x].reshape(num_layers, num_columns, 3)


def test_heatmap_colours_rise_with_the_value_and_mark_non_finite_cells():
  """Each cell's colour, read back from the drawn figure, is the colour
  map's at the cell's place between the smallest and largest finite
  value; non-finite cells are red, a colour the map does not hold."""
  num_layers, num_columns = 5, 7
  values = np.random.default_rng(0).permutation(
      np.linspace(-6.0, 1.0, num_layers * num_columns)).reshape(
          num_layers, num_columns)
  values[1, 3], values[4, 0], values[2, 6] = np.nan, np.inf, -np.inf
  figure = intermediate_grads.heatmap_figure(
      'encoder', values, np.arange(100, 100 * (num_columns + 1), 100))
  pixels = intermediate_grads.figure_pixels(figure)
  colors = cell_colors(figure, pixels, num_layers, num_columns).astype(float)

  colormap = matplotlib.colormaps[intermediate_grads.HEATMAP_COLORMAP]
  table = colormap(np.arange(colormap.N))[:, :3] * 255  # its N colours
  distances = np.linalg.norm(colors[..., None, :] - table, axis=-1)
  index = distances.argmin(axis=-1)
  assert distances.min(axis=-1)[np.isfinite(values)].max() < 1.5
  finite = np.isfinite(values)
  low, high = values[finite].min(), values[finite].max()
  expected = np.minimum((values[finite] - low) / (high - low) * colormap.N,
                        colormap.N - 1).astype(int)
  np.testing.assert_allclose(index[finite], expected, atol=1)
  order = np.argsort(values[finite])
  assert np.all(np.diff(index[finite][order]) >= 0)
  np.testing.assert_array_equal(
      colors[~finite], np.broadcast_to(
          np.multiply(intermediate_grads.NONFINITE_COLOR, 255),
          colors[~finite].shape))
  assert distances[~finite].min() > 100  # far from every colour of the map

  # Labelled: title, both axes, a colour bar whose scale is the values'.
  image_axes, colorbar_axes = figure.axes
  assert 'encoder' in image_axes.get_title()
  assert image_axes.get_xlabel() == 'training step'
  assert [t.get_text() for t in image_axes.get_xticklabels()] == [
      '100', '300', '500', '700']
  assert 'encoder' in image_axes.get_ylabel()
  assert 'log10' in colorbar_axes.get_ylabel()
  assert colorbar_axes.get_ylim() == pytest.approx((low, high))
  assert [t.get_text() for t in figure.legends[0].get_texts()] == [
      'not finite']


def test_a_launch_imports_matplotlib_only_when_it_draws_a_heatmap():
  """Importing matplotlib costs every launch about 0.4 s of CPU: the
  trainer's modules leave it to the drawing."""
  check = ('import sys, main; from training import intermediate_grads; '
           "assert 'matplotlib' not in sys.modules; "
           "intermediate_grads.heatmap_figure('s', np.zeros((2, 2)), "
           "np.arange(2)); assert 'matplotlib' in sys.modules")
  subprocess.run([sys.executable, '-c', 'import numpy as np; ' + check],
                 cwd=processes.REPO, env=processes.one_device_environment(),
                 check=True, timeout=300)
