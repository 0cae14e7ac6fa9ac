"""Memory per chip of the shipped recipes compiled for TPU slices and GPUs
this machine does not have, as tables.

  PYTHONPATH=LIBTPU_DIR python3 benchmarks/accelerator_memory.py \
      --topologies=v5e:2x2,v5e:4x4 --largest_batch \
      --flax_example_dir=flax/examples/imagenet --json=/tmp/memory.json

(`pip install --target LIBTPU_DIR "libtpu==0.0.42.*"`, or installed
plainly; GPUs: `pip install "jax[cuda12]==0.10.2"`, then
`--topologies=h100,h100:8`.) Each config of `--configs` (';' between
them; `CONFIG[:OPTIONS][,KEY=VALUE...]`, the overrides as on a command
line) is compiled for each topology as `main.py --mode=compile` compiles
it (`train.compile_for_topology`: every program of the run; the rows give
the train step, the largest) in each variant:

  shipped      the config as it ships
  remat_NAME   remat_policy NAME, for each of --policies
  unrolled     scan_layers=False, remat_policy='none': the same network
               unrolled without remat, what the bounds compare against

One table per topology: the train step's peak and temporaries per chip at
the config's batch, the peak over the unrolled step's, the step's FLOPs
(every layer and the variant's recomputation counted) over those without
remat, compile seconds, and with `--largest_batch` the largest batch per
chip of the shipped config that fits. With `--flax_example_dir` (its
`examples/imagenet` folder of `git clone https://github.com/google/flax`),
the Flax ImageNet example's own ResNet-50 train step (Linen, unrolled, in
bfloat16) at the `imagenet` config's batch per chip, beside it.
"""

import functools
import json
import os
import sys
import time

from absl import app
from absl import flags
import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top,g-bad-import-order
import flax_example
from runtime import accelerators
from runtime import console
from checks import command_line
from checks import memory_budget
import train
import variants
# pylint: enable=g-import-not-at-top,g-bad-import-order

RECIPES = ('imagenet;imagenet_vit;deit_s16:distilled;convnext_t;swin_t;'
           'finetune:dinov2_b14;finetune:dinov2_b14,model=ViT_L14')
flags.DEFINE_string('configs', RECIPES, 'Configs to compile, \';\' between '
                    'them: CONFIG[:OPTIONS][,KEY=VALUE...].')
flags.DEFINE_list('topologies', ['v5e:2x2'], 'Topologies (runtime/'
                  'accelerators.py), e.g. v5e:4x4, v4:2x2x1, h100:8; local: '
                  'this machine\'s own devices.')
flags.DEFINE_list('kinds', [], 'Instead of --topologies: for each of these '
                  'accelerators (v5e, v4, v5p, h100, ...), each config on '
                  'the slice that gives it --per_chip images per chip.')
flags.DEFINE_integer('per_chip', 128, 'With --kinds: images per chip (the '
                     'batch per device of the recipes\' anchors).')
flags.DEFINE_integer('num_slices', 1, 'TPU slices of each topology.')
flags.DEFINE_list('policies', ['full'], 'remat_policy of the remat_NAME '
                  'rows.')
flags.DEFINE_bool('unrolled', True, 'Also the unrolled rows (and the '
                  'ratios against them).')
flags.DEFINE_bool('count_flops', True, 'Also the FLOPs columns (two '
                  'lowerings of the unrolled step per row).')
flags.DEFINE_bool('largest_batch', False, 'Also the largest batch per chip '
                  'of each shipped config that fits.')
flags.DEFINE_string('flax_example_dir', '', 'The Flax ImageNet example to '
                    'compile beside the imagenet config.')
flags.DEFINE_string('json', '', 'Write the rows here as well.')
FLAGS = flags.FLAGS

GIB = accelerators.GIB


def load_config(spec: str):
  """The config of `CONFIG[:OPTIONS][,KEY=VALUE...]`, overrides applied."""
  name, _, overrides = spec.partition(',')
  path, _, option = name.partition(':')
  config = command_line.load_config_file(f'configs/{path}.py', option)
  return next(variants.configs(config, overrides))[1]


def config_variants(config) -> dict:
  """{variant name: config} of the rows of one config."""
  rows = {'shipped': config}
  for policy in FLAGS.policies:
    if policy != config.remat_policy:
      rows[f'remat_{policy}'] = memory_budget.with_values(
          config, remat_policy=policy)
  if FLAGS.unrolled:
    rows['unrolled'] = memory_budget.with_values(
        config, scan_layers=False, remat_policy='none')
  return rows


def measure(spec: str, variant: str, config, topology) -> dict:
  """One row: the sizing of `config` on `topology`."""
  start = time.perf_counter()
  sizing = memory_budget.size(config, topology, train.compile_for_topology,
                              count_flops=FLAGS.count_flops)
  step = sizing.programs.get('train step', {})
  print(f'  {spec} {variant}: {time.perf_counter() - start:.0f} s',
        file=sys.stderr, flush=True)
  return dict(config=spec, variant=variant, topology=topology.name,
              num_slices=topology.num_slices, per_chip=sizing.per_chip,
              fits=sizing.fits, peak=sizing.needed,
              temporaries=step.get('temporaries'),
              compile_seconds=step.get('compile_seconds'),
              step_flops=sizing.step_flops,
              recomputed_flops=sizing.recomputed_flops)


def largest_row(spec: str, config, topology) -> dict:
  sizing = memory_budget.size(config, topology, train.compile_for_topology)
  largest = memory_budget.largest_batch(sizing, train.compile_for_topology)
  return dict(config=spec, variant='largest', topology=topology.name,
              num_slices=topology.num_slices,
              per_chip=largest.per_chip if largest.fits else 0,
              fits=largest.fits, peak=largest.needed)


def flax_example_row(config, topology) -> dict:
  """The Flax example's own train step (its `train_step` under
  `jax.shard_map` over every chip, as its `jax.pmap` runs it), in
  bfloat16, at `config`'s batch, on `topology`."""
  example, example_config = flax_example.load(FLAGS.flax_example_dir)
  model = example.models.ResNet50(num_classes=1000, dtype=jnp.bfloat16)
  schedule = example.create_learning_rate_fn(example_config, 0.1, 1000)
  state = jax.eval_shape(lambda: example.create_train_state(
      jax.random.key(0), example_config, model, config.image_size, schedule))
  mesh = Mesh(np.array(topology.devices), ('batch',))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P('batch'))
  place = lambda tree, where: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree)
  batch = place({
      'image': jax.ShapeDtypeStruct((config.batch_size, config.image_size,
                                     config.image_size, 3), jnp.bfloat16),
      'label': jax.ShapeDtypeStruct((config.batch_size,), jnp.int32)}, split)
  step = jax.shard_map(
      functools.partial(example.train_step, learning_rate_fn=schedule),
      mesh=mesh, in_specs=(P(), P('batch')), out_specs=(P(), P()),
      check_vma=False)
  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0,)).lower(
      place(state, replicated), batch).compile()
  memory = accelerators.memory_in_use(compiled)
  return dict(config='Flax example ResNet-50', variant='Linen, unrolled',
              topology=topology.name, num_slices=topology.num_slices,
              per_chip=config.batch_size // len(topology.devices),
              fits=memory['peak'] <= topology.memory_bytes,
              peak=memory['peak'], temporaries=memory['temporaries'],
              compile_seconds=time.perf_counter() - start)


def table(rows: list) -> list[str]:
  """One markdown table of one topology's rows."""
  unrolled = {row['config']: row['peak'] for row in rows
              if row['variant'] == 'unrolled' and row['fits']}
  lines = ['| config | slice | variant | per chip | peak GiB | '
           'temporaries GiB | peak / unrolled | FLOPs / no remat | '
           'compile s |',
           '| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |']
  for row in rows:
    head = f'| {row["config"]} | {_slice(row)} |'
    if row['variant'] == 'largest':
      lines.append(f'{head} largest batch that fits | {row["per_chip"]} | '
                   f'{_gib(row["peak"])} | | | | |')
    elif not row['fits']:
      lines.append(f'{head} {row["variant"]} | {row["per_chip"]} | does not '
                   f'fit: {_gib(row["peak"])} | | | | |')
    else:
      ratio = (f'{row["peak"] / unrolled[row["config"]]:.3f}'
               if row['config'] in unrolled else '')
      flops = (f'{row["recomputed_flops"] / row["step_flops"]:.3f}'
               if row.get('step_flops') else '')
      lines.append(
          f'{head} {row["variant"]} | {row["per_chip"]} | '
          f'{_gib(row["peak"])} | {_gib(row["temporaries"])} | {ratio} | '
          f'{flops} | {row["compile_seconds"]:.1f} |')
  return lines


def _slice(row) -> str:
  slices = row.get('num_slices', 1)
  return row['topology'] + (f' x {slices}' if slices > 1 else '')


def _gib(value) -> str:
  return '?' if value is None else f'{value / GIB:.2f}'


def jobs(specs: list[str]) -> dict:
  """{table title: [(config spec, config, topology name)]}: per topology
  of --topologies, or per kind of --kinds with each config on its own
  slice."""
  configs = {spec: load_config(spec) for spec in specs}
  if FLAGS.kinds:
    return {f'{kind}, {FLAGS.per_chip} images per chip': [
        (spec, config, accelerators.slice_of(
            kind, config.batch_size // FLAGS.per_chip))
        for spec, config in configs.items()] for kind in FLAGS.kinds}
  return {name: [(spec, config, name) for spec, config in configs.items()]
          for name in FLAGS.topologies}


def main(argv):
  del argv
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  if 'local' not in FLAGS.topologies:
    jax.config.update('jax_platforms', 'cpu')  # compile-only devices
  os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  all_rows = []
  for title, group in jobs([s for s in FLAGS.configs.split(';') if s]).items():
    rows = []
    for spec, config, name in group:
      topology = (accelerators.this_machine() if name == 'local' else
                  accelerators.topology(name, FLAGS.num_slices))
      measurements = [functools.partial(measure, spec, variant, varied)
                      for variant, varied in config_variants(config).items()]
      if FLAGS.largest_batch:
        measurements.append(functools.partial(largest_row, spec, config))
      if FLAGS.flax_example_dir and spec.split(',')[0] == 'imagenet':
        measurements.append(functools.partial(flax_example_row, config))
      for measurement in measurements:
        rows.append(measurement(topology))
        save(all_rows + rows)  # an interrupted sweep keeps its rows
    print(f'\n{title}; jax {jax.__version__}\n')
    print('\n'.join(table(rows)), flush=True)
    all_rows += rows


def save(rows: list) -> None:
  """Writes `rows` to --json, if given."""
  if FLAGS.json:
    with open(FLAGS.json, 'w') as f:
      json.dump(rows, f, indent=1)


if __name__ == '__main__':
  app.run(main)
