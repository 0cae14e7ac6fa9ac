"""FLOPs, step time, compile time and memory of the model families, as tables.

  python benchmarks/families.py

For each model of `--names` (`--breakdown_names` for the FLOPs by kind)
at `--image_size`, batch `--batch_size`, float32, on fake data:

- forward GFLOPs per image as XLA's cost analysis counts them, every layer
  of every scanned stack counted (`training/flop_count.py`), against the
  published multiply-adds (`model_table.PUBLISHED`) times two;
- the train step as the default config compiles it (`scan_unroll=64`:
  fully unrolled, XLA:CPU's workaround for convolutions in loops):
  compile seconds, temp memory, median step time, images/s
  (`step_measurement.measure`; its `--steps` and `--seconds` apply);
- what XLA counts: its FLOPs of the forward pass's
  operations summed by kind (each operation of the unrolled program lowered
  alone and counted by XLA), beside the multiply-adds of the convolutions
  and matrix products counted as the papers count them (every kernel tap,
  padding included);
- compile seconds and temp memory of the rolled train step
  (`scan_unroll=1`) of the models of `--depth_names`, whose stage 3 is
  3x as deep in the second of each pair.

`--steps` and `--seconds` are `step_measurement`'s flags.
This script shares its name with the `families` package: the repository
root comes first on the path, so `import families` finds the package, and
other scripts take their helpers from `model_table`, not from here.
"""

import collections
import math
import os
import sys
import time

from absl import app
from absl import flags
import jax
from jax.extend import core as jax_core
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top,g-bad-import-order
from configs import default
from flax import nnx
from layers import stacked
import model_table
from runtime import console
import step_measurement
from training import flop_count
# pylint: enable=g-import-not-at-top,g-bad-import-order

flags.DEFINE_list('names', ['ResNet50', 'ViT_S16', 'ConvNeXt_T', 'Swin_T',
                            'RegNetY_4GF', 'RegNetY_16GF'],
                  'Models of the FLOPs and step-time table.')
flags.DEFINE_list('breakdown_names', ['ResNet50', 'ViT_S16', 'ConvNeXt_T',
                                      'ConvNeXtV2_T', 'Swin_T', 'RegNetY_4GF',
                                      'RegNetY_16GF'],
                  'Models of the FLOPs-by-kind table (lowered only).')
flags.DEFINE_list('depth_names', ['ConvNeXt_T', 'ConvNeXt_S', 'Swin_T',
                                  'Swin_S'],
                  'Models of the compile-time-in-depth table.')
flags.DEFINE_list('untimed', [],
                  'Models of --names whose train step is compiled but not '
                  'timed (XLA:CPU runs grouped convolutions\' gradients '
                  'slowly).')
flags.DEFINE_integer('image_size', 224, 'Image size.')
flags.DEFINE_integer('batch_size', 8, 'Batch of the step-time table.')
FLAGS = flags.FLAGS


def step_config(name: str, scan_unroll: int):
  """The default config turned into model `name`'s train step."""
  config = default.get_config()
  config.model = name
  config.num_layers = 0
  config.image_size = FLAGS.image_size
  config.batch_size = FLAGS.batch_size
  config.scan_unroll = scan_unroll
  return config


def scanned_steps(name: str) -> int:
  """Steps of model `name`'s scanned stacks, all stages together."""
  graphdef, params, rest = model_table.abstract_model(name, FLAGS.image_size)
  model = nnx.merge(graphdef, params, rest)
  return sum(m.num_layers for _, m in nnx.iter_modules(model)
             if isinstance(m, stacked.StackedBlocks))


def _sub_jaxprs(eqn):
  """(jaxpr, times it runs) of each program inside `eqn`."""
  times = eqn.params.get('length', 1) if eqn.primitive.name == 'scan' else 1
  for value in eqn.params.values():
    if isinstance(value, jax_core.ClosedJaxpr):
      yield value.jaxpr, times
    elif isinstance(value, jax_core.Jaxpr):
      yield value, times


def _multiply_adds(eqn) -> int:
  """Multiply-adds of a convolution or matrix product, every kernel tap
  counted (padding included), as fvcore and the papers count them."""
  out = math.prod(eqn.outvars[0].aval.shape)
  if eqn.primitive.name == 'dot_general':
    (contracting, _), _ = eqn.params['dimension_numbers']
    lhs = eqn.invars[0].aval.shape
    return out * math.prod(lhs[d] for d in contracting)
  rhs_spec = eqn.params['dimension_numbers'].rhs_spec
  kernel = eqn.invars[1].aval.shape
  return out * math.prod(kernel[d] for d in rhs_spec[1:])


def flops_by_kind(jaxpr, counts, multiply_adds, cache, times=1):
  """Adds XLA's FLOPs of each operation of `jaxpr` (lowered alone) to
  `counts` by kind, and the convolutions' and products' multiply-adds to
  `multiply_adds`."""
  for eqn in jaxpr.eqns:
    inner = list(_sub_jaxprs(eqn))
    for sub, sub_times in inner:
      flops_by_kind(sub, counts, multiply_adds, cache, times * sub_times)
    if inner:
      continue
    name = eqn.primitive.name
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
            for v in eqn.invars]
    key = (name, repr(args), repr(sorted(eqn.params.items())))
    if key not in cache:
      cache[key] = jax.jit(lambda *a, eqn=eqn: eqn.primitive.bind(
          *a, **eqn.params)).lower(*args).cost_analysis().get('flops', 0.0)
    counts[name] += times * cache[key]
    if name in ('conv_general_dilated', 'dot_general'):
      multiply_adds[0] += times * _multiply_adds(eqn)


def breakdown(name: str) -> dict:
  """XLA's forward FLOPs per image of model `name` by kind of operation,
  and the papers' count of its convolutions and products (2 per
  multiply-add)."""
  graphdef, params, rest = model_table.abstract_model(name, FLAGS.image_size)
  forward, params, rest = flop_count.counting_forward(graphdef, params, rest)
  images = jax.ShapeDtypeStruct(
      (FLAGS.batch_size, FLAGS.image_size, FLAGS.image_size, 3), jnp.float32)
  jaxpr = jax.make_jaxpr(forward)(params, rest, images).jaxpr
  counts, multiply_adds = collections.defaultdict(float), [0]
  flops_by_kind(jaxpr, counts, multiply_adds, {})
  per_image = {k: v / FLAGS.batch_size for k, v in counts.items()}
  per_image['full_count'] = 2 * multiply_adds[0] / FLAGS.batch_size
  return per_image


def flops_rows():
  """The FLOPs and step-time table."""
  print('\n| model | forward GFLOPs per image (XLA) | published GMACs x 2 '
        '| ratio | train step GFLOPs | compile s | temp MiB | step ms | '
        'images/s |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
  for name in FLAGS.names:
    gmacs = model_table.PUBLISHED[name][3]
    forward = model_table.forward_flops_per_image(
        name, FLAGS.image_size, FLAGS.batch_size) / 1e9
    ratio = forward / (2 * gmacs)
    row = step_measurement.measure(step_config(name, 64), 3, 1000,
                             timed=name not in FLAGS.untimed)
    step_ms, rate = ('-', '-') if row['step_s'] is None else (
        f"{1000 * row['step_s']:.0f}",
        f"{FLAGS.batch_size / row['step_s']:.2f}")
    print(f"| {name} | {forward:.3f} | {2 * gmacs:g} | {ratio:.3f} | "
          f"{row['flops'] / 1e9:.1f} | {row['compile_s']:.1f} | "
          f"{row['temp_bytes'] / 2**20:.0f} | "
          f"{step_ms} | {rate} |", flush=True)


def breakdown_rows(names):
  print('\nForward GFLOPs per image by kind of operation, as XLA counts '
        'them, and the convolutions and products counted as the papers '
        'count them (2 per multiply-add, padding included):\n')
  print('| model | convolutions | matrix products | erfc (exact GELU) | '
        'other (norms, activations, softmax, adds) | sum | sum less erfc / '
        'published | papers\' count of convolutions and products | '
        'published GMACs x 2 |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
  for name in names:
    parts = {k: v / 1e9 for k, v in breakdown(name).items()}
    papers = parts.pop('full_count')
    total = sum(parts.values())
    conv, dot, erfc = (parts.get(k, 0.0) for k in (
        'conv_general_dilated', 'dot_general', 'erfc'))
    published = 2 * model_table.PUBLISHED[name][3]
    print(f'| {name} | {conv:.3f} | {dot:.3f} | {erfc:.3f} | '
          f'{total - conv - dot - erfc:.3f} | {total:.3f} | '
          f'{(total - erfc) / published:.3f} | {papers:.3f} | '
          f'{published:g} |', flush=True)


def depth_rows():
  print('\nThe rolled train step (scan_unroll=1, remat full), compiled '
        'only:\n')
  print('| model | scanned steps | compile s | temp MiB |')
  print('| --- | ---: | ---: | ---: |')
  for name in FLAGS.depth_names:
    row = step_measurement.measure(step_config(name, 1), 3, 1000,
                                   timed=False)
    print(f"| {name} | {scanned_steps(name)} | {row['compile_s']:.1f} | "
          f"{row['temp_bytes'] / 2**20:.0f} |", flush=True)


def main(_):
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  started = time.perf_counter()
  device = jax.devices()[0]
  print(f'{device.device_kind} ({device.platform}), {os.cpu_count()} CPU '
        f'cores, jax {jax.__version__}, batch {FLAGS.batch_size}, '
        f'{FLAGS.image_size} px, float32; load average at the start '
        f'{" ".join(f"{x:.2f}" for x in os.getloadavg())}')
  flops_rows()
  breakdown_rows(FLAGS.breakdown_names)
  depth_rows()
  print(f'\nload average at the end '
        f'{" ".join(f"{x:.2f}" for x in os.getloadavg())}; '
        f'{time.perf_counter() - started:.0f} s in all')


if __name__ == '__main__':
  app.run(main)
