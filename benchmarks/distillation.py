"""What a frozen teacher costs a train step: a ViT-S/16 student (DeiT-S's
config) without a teacher and with each teacher of --teachers, as a table.

  python benchmarks/distillation.py --image_size=64 --batch_size=16 \
      --teachers=ResNet50,RegNetY_16GF

Each teacher gets random weights of the data set's classes, written once to
a temporary workdir and read back as a run reads `teacher_init_from`.
GFLOPs count every layer (`training/flop_count.py`); the teacher's forward
GFLOPs are those of `distillation.teacher_logits` on the same batch, and
"added / forward" is the step's added FLOPs over them (1.0: the forward
alone, no backward). Memory is XLA's analysis of the compiled step per
device.
"""

import functools
import os
import sys
import tempfile
import time

from absl import app
from absl import flags
import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import deit_s16  # pylint: disable=g-import-not-at-top
from data import datasets
import input_pipeline
import models
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from runtime import console
from runtime import sharding
from training import compiling
from training import distillation
from training import optimizer
from training import run_state
from training import flop_count
from training import update
import train

flags.DEFINE_integer('image_size', 64, 'Image side (a multiple of 16).')
flags.DEFINE_integer('batch_size', 16, 'Global batch.')
flags.DEFINE_string('teachers', 'ResNet50', "','-separated model names.")
flags.DEFINE_integer('steps', 5, 'Timed steps per row.')
FLAGS = flags.FLAGS


def student_config(teacher: str, teacher_dir: str):
  config = deit_s16.get_config()
  config.update(dataset='fake', image_size=FLAGS.image_size,
                batch_size=FLAGS.batch_size, half_precision=False,
                repeated_augments=1, scan_unroll=1)
  if teacher:
    config.update(teacher_model=teacher, teacher_init_from=teacher_dir,
                  distillation_type='hard')
  return config


def write_teacher(name: str, directory: str, info) -> None:
  """A workdir with one checkpoint of `name`, randomly initialised."""
  config = student_config('', '')
  config.update(model=name, num_layers=0)
  _, state, _ = run_state.create_train_state(
      config, info, lambda step: 0.0,
      dtype=models.compute_dtype(config))
  manager = checkpointing.create_manager(directory, 1)
  checkpointing.save(manager, 0, state, compatibility.as_json(config),
                     info.class_names)
  manager.wait_until_finished()
  manager.close()


def measure(config, workdir: str) -> dict:
  """The step's compile seconds, median seconds, FLOPs and memory, and the
  teacher's forward FLOPs and bytes."""
  dataset = datasets.create_dataset(
      input_pipeline.DataSource.from_config(config))
  lr_fn = optimizer.learning_rate_schedule(config, 1000, 10)
  mesh = sharding.create_mesh(config.mesh, config.step_mode)
  run = run_state.create(config, dataset.info, mesh, workdir, lr_fn,
                         dtype=models.compute_dtype(config))
  graphdef, state, state_sharding = run.graphdef, run.state, run.sharding
  teacher = run.teacher
  batch = next(train.train_batches(config, dataset, mesh, 0))
  kwargs = train.train_step_kwargs(config, graphdef, run.tx, lr_fn,
                                   run.teacher_graphdef)
  flops = flop_count.true_step_flops(update.train_step, graphdef, kwargs, state, batch)
  compiled, executable, compile_seconds, _ = compiling.compile_train_step(
      config.step_mode, mesh, functools.partial(update.train_step, **kwargs),
      state_sharding, state, batch)
  for _ in range(2):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(FLAGS.steps):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  memory = executable.memory_analysis()
  row = dict(compile=compile_seconds, step=float(np.median(times)),
             flops=flops, argument=memory.argument_size_in_bytes,
             temp=memory.temp_size_in_bytes, teacher_flops=0.0,
             teacher_bytes=0,
             optimizer_bytes=sum(x.nbytes
                                 for x in jax.tree.leaves(state.opt_state)))
  if teacher is not None:
    unrolled = flop_count.unrolled_graphdef(teacher.graphdef, teacher.state)
    row['teacher_flops'] = float(jax.jit(functools.partial(
        distillation.teacher_logits, unrolled)).lower(
            teacher.state, batch['image']).cost_analysis()['flops'])
    row['teacher_bytes'] = sum(x.nbytes for x in jax.tree.leaves(
        teacher.state))
  return row


def main(_):
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  print(f'{jax.devices()[0].device_kind}, {jax.device_count()} device(s); '
        f'ViT_S16 student at {FLAGS.image_size} px, batch {FLAGS.batch_size}')
  print('| teacher | compile s | median step ms | step GFLOPs | teacher '
        'forward GFLOPs | added / forward | argument MiB | temp MiB | '
        'teacher MiB | optimizer state MiB |')
  print('| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |')
  with tempfile.TemporaryDirectory() as root:
    info = datasets.create_dataset(
        input_pipeline.DataSource.from_config(student_config('', ''))).info
    base = None
    for name in ['', *filter(None, FLAGS.teachers.split(','))]:
      teacher_dir = os.path.join(root, name or 'none')
      if name:
        write_teacher(name, teacher_dir, info)
      row = measure(student_config(name, teacher_dir),
                    os.path.join(root, f'run_{name or "none"}'))
      base = base or row
      ratio = ((row['flops'] - base['flops']) / row['teacher_flops']
               if row['teacher_flops'] else 0.0)
      print(f'| {name or "none"} | {row["compile"]:.1f} | '
            f'{1000 * row["step"]:.1f} | {row["flops"] / 1e9:.2f} | '
            f'{row["teacher_flops"] / 1e9:.2f} | {ratio:.3f} | '
            f'{row["argument"] / 2**20:.1f} | {row["temp"] / 2**20:.1f} | '
            f'{row["teacher_bytes"] / 2**20:.1f} | '
            f'{row["optimizer_bytes"] / 2**20:.1f} |', flush=True)


if __name__ == '__main__':
  app.run(main)
