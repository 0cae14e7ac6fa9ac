"""Compile time, memory, step time and FLOPs of scanned stacks, as a table.

  python benchmarks/scan_remat.py --json=/tmp/scan_remat.json

For the default config's model (`SmallResNet`), ViT-S/16 and ResNet-50 at a
small image size, over depths and over the ways to run the stack:

  loop            a Python loop over the layers, no remat (unrolled)
  scan            nnx.scan over the layers, no remat, rolled
  remat_POLICY    scan(remat(block)) with that remat policy, rolled
  segments_K      an outer scan over K remat'ed segments of inner
                  scan(remat_full(block)) (`scan_segments=K`)
  remat_full_unroll  scan(remat_full(block)) with scan_unroll = depth (the
                  convolution models: XLA:CPU's workaround, see README)

it prints one markdown table and writes the rows as JSON: compile seconds
(lowering and compiling the train step; the fastest of `--compile_repeats`),
XLA's memory analysis of the compiled step (temp, argument and output
bytes), the median time of a step and the step's true FLOPs
(`training/flop_count.py`). `--modes` keeps only the named modes.

`--loop_efficiency` adds the trainer's own overhead for the default config
(needs CLU): the compiled step alone against the trainer's `steps_per_second`
on the digits and on `dataset='fake'`. `--throughput` adds images/s and MFU
of ResNet-50 and ViT-S/16 (`--throughput_models`: also ConvNeXt-T and
Swin-T) at ImageNet size on fake data.
"""

import glob
import json
import math
import os
import sys
import tempfile

from absl import app
from absl import flags
import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top,g-bad-import-order
from configs import default
from data import datasets
import input_pipeline
from layers import stacked
import models
from runtime import console
from runtime import sharding
import step_measurement
from training import throughput
import train
# pylint: enable=g-import-not-at-top,g-bad-import-order

flags.DEFINE_list('models', ['default', 'vit', 'resnet50'],
                  'Models of the sweep: default, vit, resnet50.')
flags.DEFINE_list('depths', ['6', '12', '24', '48'],
                  'Stack depths of the default model and of the ViT.')
flags.DEFINE_list('policies',
                  [p for p in stacked.REMAT_POLICIES if p != 'none'],
                  'Remat policies of the remat_POLICY rows (every one but '
                  '`none`, which is the `scan` row).')
flags.DEFINE_list('modes', [],
                  'Only these modes of the sweep (loop, scan, remat_POLICY, '
                  'segments, remat_full_unroll); empty: all.')
flags.DEFINE_integer('segments_depth', 64,
                     'An extra depth of the default model with its remat_full '
                     'and segments rows only (0: none).')
flags.DEFINE_integer('batch_size', 8, 'Batch of the ViT and ResNet-50 rows.')
flags.DEFINE_integer('default_batch_size', 64,
                     'Batch of the default model (its config\'s).')
flags.DEFINE_integer('time_rolled_conv_up_to', 12,
                     'Time the rolled scans of convolution models only up to '
                     'this depth (XLA:CPU runs them ~20x slower; deeper rows '
                     'get compile and memory only). -1: all.')
flags.DEFINE_integer('vit_image_size', 32, 'Image size of the ViT sweep.')
flags.DEFINE_integer('resnet_image_size', 32, 'Image size of ResNet-50.')
flags.DEFINE_integer('width', 32, 'Channels of the default model.')
flags.DEFINE_bool('half_precision', False, 'bfloat16 compute.')
flags.DEFINE_bool('loop_efficiency', False,
                  'Also the trainer vs the compiled step (needs CLU).')
flags.DEFINE_integer('loop_steps', 200, 'Trainer steps of each run.')
flags.DEFINE_bool('throughput', False,
                  'Also ResNet-50 and ViT-S/16 images/s and MFU.')
flags.DEFINE_list('throughput_models', ['resnet50', 'vit'],
                  'Models of --throughput (ViT-S/16 at its standard depth; '
                  'also convnext_t, swin_t).')
flags.DEFINE_integer('throughput_num_layers', 0,
                     'ViT depth of --throughput (0: standard).')
flags.DEFINE_integer('throughput_batch_size', 256, 'Batch of --throughput.')
flags.DEFINE_integer('throughput_image_size', 224, 'Image size of it.')
flags.DEFINE_list('throughput_policies', ['none', 'full'],
                  'Remat policies of the throughput rows.')
flags.DEFINE_string('json', '', 'Write the results here.')
FLAGS = flags.FLAGS

# What each model of the sweep is: config overrides and the data it sees.
MODELS = {
    'default': dict(model='SmallResNet', image_size=8, channels=1,
                    num_classes=10),
    'vit': dict(model='ViT_S16', channels=3, num_classes=1000),
    # The patch-14 backbones (DINOv2, CLIP) at their own widths.
    'vit_b14': dict(model='ViT_B14', channels=3, num_classes=1000),
    'vit_l14': dict(model='ViT_L14', channels=3, num_classes=1000),
    'resnet50': dict(model='ResNet50', channels=3, num_classes=1000),
    # --throughput only: their stage depths are fixed.
    'convnext_t': dict(model='ConvNeXt_T', channels=3, num_classes=1000),
    'swin_t': dict(model='Swin_T', channels=3, num_classes=1000),
}
SWEEP_MODELS = ('default', 'vit', 'vit_b14', 'vit_l14', 'resnet50')
CONV_MODELS = ('default', 'resnet50')


def segments_for(depth: int) -> int:
  """The divisor of `depth` nearest below sqrt(depth) (the sqrt(L) split)."""
  return max(k for k in range(1, math.isqrt(depth) + 1) if depth % k == 0)


def modes(model: str, depth: int, policies) -> dict:
  """{mode name: stack config overrides} of one (model, depth) of the sweep."""
  rows = {'loop': dict(scan_layers=False, remat_policy='none'),
          'scan': dict(remat_policy='none')}
  for policy in policies:
    rows[f'remat_{policy}'] = dict(remat_policy=policy)
  if model != 'resnet50':  # its stages' stacks (2, 3, 5, 2) share no divisor
    k = segments_for(depth)
    if k > 1:
      rows[f'segments_{k}'] = dict(remat_policy='full', scan_segments=k)
  if model in CONV_MODELS:
    rows['remat_full_unroll'] = dict(remat_policy='full',
                                     scan_unroll=max(depth, 6))
  return rows


def make_config(model: str, depth: int, batch_size: int, image_size: int,
                half_precision: bool, **stack):
  """The default config turned into one row of the sweep."""
  config = default.get_config()
  spec = MODELS[model]
  config.model = spec['model']
  config.image_size = spec.get('image_size', image_size)
  config.num_layers = depth if model != 'resnet50' else 0
  config.width = FLAGS.width if model == 'default' else config.width
  config.batch_size = batch_size
  config.half_precision = half_precision
  config.scan_layers = True
  config.scan_unroll = 1
  config.update(stack)
  return config


def batch_size_of(model: str) -> int:
  return FLAGS.default_batch_size if model == 'default' else FLAGS.batch_size


def timed(model: str, depth: int, config) -> bool:
  """Whether to time this row's step (see --time_rolled_conv_up_to)."""
  rolled = config.scan_layers and config.scan_unroll < depth
  return (model not in CONV_MODELS or not rolled or
          FLAGS.time_rolled_conv_up_to < 0 or
          depth <= FLAGS.time_rolled_conv_up_to)


def selected(mode: str) -> bool:
  """Whether --modes keeps `mode` (segments_K is kept by 'segments')."""
  return not FLAGS.modes or mode in FLAGS.modes or (
      mode.startswith('segments_') and 'segments' in FLAGS.modes)


def sweep_rows(policies):
  """(model, depth, mode, config) of every row of the table, in order."""
  for model in FLAGS.models:
    if model not in SWEEP_MODELS:
      raise app.UsageError(f'unknown model {model!r}; valid names: '
                           f'{", ".join(SWEEP_MODELS)}')
    depths = [50] if model == 'resnet50' else [int(d) for d in FLAGS.depths]
    image_size = (FLAGS.vit_image_size if model.startswith('vit')
                  else FLAGS.resnet_image_size)
    for depth in depths:
      for mode, stack in modes(model, depth, policies).items():
        yield model, depth, mode, make_config(
            model, depth, batch_size_of(model), image_size,
            FLAGS.half_precision, **stack)
  if 'default' in FLAGS.models and FLAGS.segments_depth:
    depth = FLAGS.segments_depth
    k = segments_for(depth)
    for mode, stack in {'remat_full': dict(remat_policy='full'),
                        f'segments_{k}': dict(remat_policy='full',
                                              scan_segments=k)}.items():
      yield 'default', depth, mode, make_config(
          'default', depth, batch_size_of('default'), 8,
          FLAGS.half_precision, **stack)


def _ms(seconds) -> str:
  return '-' if seconds is None else f'{1000 * seconds:.1f}'


def _mib(num_bytes: int) -> str:
  return f'{num_bytes / 2**20:.1f}'


def print_header():
  print('| model | depth | mode | compile s | temp MiB | argument MiB | '
        'output MiB | step ms | GFLOP/step |')
  print('| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |')


def print_row(row):
  print(f"| {row['model']} | {row['depth']} | {row['mode']} | "
        f"{row['compile_s']:.2f} | {_mib(row['temp_bytes'])} | "
        f"{_mib(row['argument_bytes'])} | {_mib(row['output_bytes'])} | "
        f"{_ms(row['step_s'])} | {row['flops'] / 1e9:.3f} |",
        flush=True)


def goals(rows) -> list:
  """The README's goals, as (goal, measured ratio, met) from the rows."""
  def find(model, depth, mode_prefix):
    for row in rows:
      if (row['model'], row['depth']) == (model, depth) and row[
          'mode'].startswith(mode_prefix):
        return row
    return None

  results = []
  def add(name, numerator, denominator, key, limit):
    if numerator and denominator and numerator.get(key) and denominator.get(
        key):
      ratio = numerator[key] / denominator[key]
      results.append({'goal': name, 'ratio': ratio, 'limit': limit,
                      'met': ratio <= limit})

  depths = sorted(int(d) for d in FLAGS.depths)
  low, high = depths[0], depths[-1]
  for mode in ('scan', 'remat_full'):
    add(f'default {mode}: compile s at depth {high} / depth {low}',
        find('default', high, mode), find('default', low, mode),
        'compile_s', 1.25)
    add(f'vit {mode}: compile s at depth {high} / depth {low}',
        find('vit', high, mode), find('vit', low, mode), 'compile_s', 1.25)
  add(f'default loop: compile s at depth {high} / depth {low} (grows)',
      find('default', high, 'loop'), find('default', low, 'loop'),
      'compile_s', math.inf)
  add(f'default: temp bytes remat_full / loop at depth {high}',
      find('default', high, 'remat_full'), find('default', high, 'loop'),
      'temp_bytes', 1 / 8)
  add(f'default: temp bytes segments / loop at depth {high}',
      find('default', high, 'segments'), find('default', high, 'loop'),
      'temp_bytes', 1 / 8)
  add(f'vit: temp bytes remat_full / loop at depth {high}',
      find('vit', high, 'remat_full'), find('vit', high, 'loop'),
      'temp_bytes', 1 / 8)
  seg = FLAGS.segments_depth
  add(f'default: temp bytes segments / remat_full at depth {seg}',
      find('default', seg, 'segments'), find('default', seg, 'remat_full'),
      'temp_bytes', 0.6)
  for depth in depths:
    add(f'vit: step time remat_full / loop at depth {depth}',
        find('vit', depth, 'remat_full'), find('vit', depth, 'loop'),
        'step_s', 1.35)
  return results


def print_goals(results):
  print('\n| goal | measured | limit | met |')
  print('| --- | ---: | ---: | --- |')
  for r in results:
    print(f"| {r['goal']} | {r['ratio']:.3f} | {r['limit']:.3f} | "
          f"{'yes' if r['met'] else 'NO'} |")


def trainer_steps_per_second(config) -> float:
  """Median logged `steps_per_second` of a fresh trainer run of `config`."""
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=g-import-not-at-top
  from tensorboard.util import tensor_util  # pylint: disable=g-import-not-at-top
  with tempfile.TemporaryDirectory() as workdir:
    train.train_and_evaluate(config, workdir)
    values = []
    for path in glob.glob(os.path.join(workdir, 'events.out.tfevents.*')):
      events = event_accumulator.EventAccumulator(
          path, size_guidance={event_accumulator.TENSORS: 0})
      events.Reload()
      values += [float(tensor_util.make_ndarray(e.tensor_proto))
                 for e in events.Tensors('steps_per_second')]
  return float(np.median(values))


def loop_efficiency() -> dict:
  """The default config's compiled step alone vs the trainer around it."""
  config = default.get_config()
  config.num_train_steps = FLAGS.loop_steps
  config.log_every_steps = max(FLAGS.loop_steps // 4, 1)
  config.eval_every_steps = config.checkpoint_every_steps = FLAGS.loop_steps
  dataset = datasets.create_dataset(
      input_pipeline.DataSource.from_config(config))
  mesh = sharding.create_mesh(config.mesh, config.step_mode)
  batch = next(dataset.train_batches(
      config.batch_size, 0, 0,
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data')),
      models.compute_dtype(config)))
  compiled = step_measurement.measure(config, 1, 10, batch=batch,
                                      info=dataset.info)
  real = trainer_steps_per_second(config)
  fake_config = config.copy_and_resolve_references()
  fake_config.dataset = 'fake'
  fake_config.steps_per_eval = 1
  fake = trainer_steps_per_second(fake_config)
  return {'compiled_step_s': compiled['step_s'],
          'trainer_steps_per_second': real,
          'trainer_fake_steps_per_second': fake,
          'loop_efficiency': real * compiled['step_s'],
          'real_over_fake': real / fake}


def throughput_rows() -> list:
  """Images/s and MFU of ResNet-50 and ViT-S/16 on fake ImageNet batches."""
  rows = []
  for model in FLAGS.throughput_models:
    for policy in FLAGS.throughput_policies:
      config = make_config(model, FLAGS.throughput_num_layers,
                           FLAGS.throughput_batch_size,
                           FLAGS.throughput_image_size, FLAGS.half_precision,
                           remat_policy=policy)
      row = step_measurement.measure(config, 3, 1000)
      rates = throughput.throughput_metrics(
          1 / row['step_s'], config.batch_size, row['flops'], jax.devices())
      rows.append({'model': config.model, 'remat_policy': policy,
                   'batch_size': config.batch_size,
                   'image_size': config.image_size, **row, **rates})
      print(f"| {config.model} | {policy} | {config.batch_size} | "
            f"{config.image_size} | {row['compile_s']:.1f} | "
            f"{1000 * row['step_s']:.1f} | "
            f"{rates['examples_per_second']:.0f} | "
            f"{rates['flops_per_second'] / 1e12:.2f} | "
            f"{rates.get('mfu', float('nan')):.3f} |", flush=True)
  return rows


def main(argv):
  del argv
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  device = jax.devices()[0]
  results = {'device_kind': device.device_kind, 'platform': device.platform,
             'device_count': jax.device_count(), 'jax': jax.__version__,
             'half_precision': FLAGS.half_precision, 'rows': []}
  print(f'{device.device_kind} ({device.platform}), {jax.device_count()} '
        f'device(s), jax {jax.__version__}, batch {FLAGS.default_batch_size} '
        f'(default model), {FLAGS.batch_size} (others), '
        f'{"bfloat16" if FLAGS.half_precision else "float32"}\n')

  def save():
    if FLAGS.json:
      with open(FLAGS.json, 'w') as f:
        json.dump(results, f, indent=1)

  flops_cache = {}
  print_header()
  for model, depth, mode, config in sweep_rows(FLAGS.policies):
    if not selected(mode):
      continue
    spec = MODELS[model]
    row = {'model': model, 'depth': depth, 'mode': mode,
           'batch_size': config.batch_size}
    try:
      row.update(step_measurement.measure(
          config, spec['channels'], spec['num_classes'], flops_cache,
          timed=timed(model, depth, config)))
      print_row(row)
    except Exception as e:  # pylint: disable=broad-except
      # One mode a backend cannot run (say, host offloading) is a result
      # of the sweep, not the end of it.
      row['error'] = f'{type(e).__name__}: {str(e).splitlines()[0][:200]}'
      print(f"| {model} | {depth} | {mode} | {row['error']} |", flush=True)
    results['rows'].append(row)
    save()
  results['goals'] = goals(results['rows'])
  print_goals(results['goals'])
  save()

  if FLAGS.throughput:
    print('\n| model | remat | batch | image | compile s | step ms | '
          'images/s | TFLOP/s | MFU |')
    print('| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
    results['throughput'] = throughput_rows()
    save()

  if FLAGS.loop_efficiency:
    results['loop_efficiency'] = efficiency = loop_efficiency()
    print(f"\ndefault config: compiled step "
          f"{1000 * efficiency['compiled_step_s']:.2f} ms; trainer "
          f"{efficiency['trainer_steps_per_second']:.1f} steps/s on digits, "
          f"{efficiency['trainer_fake_steps_per_second']:.1f} on fake; loop "
          f"efficiency {efficiency['loop_efficiency']:.3f} (goal >= 0.95), "
          f"digits / fake {efficiency['real_over_fake']:.3f} (goal >= 0.9)")
    save()


if __name__ == '__main__':
  app.run(main)
