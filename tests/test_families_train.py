"""A ConvNeXt through the whole trainer, as a user runs it (its own
`main.py` process, four CPU devices): one run with the options that touch
a model's structure together (FSDP, gradient accumulation, stochastic
depth, layer decay, frozen parameters, EMA, intermediate-gradient
summaries), on synthetic 32 px images, of the family's smallest member
(ConvNeXt-Atto: the stages, stacks and layer-decay groups of every
ConvNeXt, at an eighth of ConvNeXt-T's parameters). The models'
numerics are tested against references in their own files; here, that the
trainer's parts find every block. RegNetY (grouped convolutions: 2x the
ConvNeXt's time on XLA:CPU) and Swin (224 px only) would take minutes
each here; their blocks' summaries, layer decay and stacks are tested in
tests/test_regnet.py, tests/test_swin.py and tests/test_intermediate_grads.py,
the FSDP rule that RegNetY needs in tests/test_parallel.py.
"""

import os
import re

import numpy as np
import pytest

from configs import default
from data import datasets
import input_pipeline
import models
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpointing
from runtime import sharding
from training import optimizer
from training import run_state
import train

import processes
from helpers import flat_params
from helpers import read_scalars

pytestmark = pytest.mark.xdist_group('families_train')
NUM_STEPS = 2
# (model, image size, blocks over all stages (the published depths),
# the head's layer-decay depth).
FAMILIES = [
    ('ConvNeXt_Atto', 32, 2 + 2 + 6 + 2, 13),
]
# Every parameter but the stem's.
TRAINABLE = 'stages/.*|head.*|feature_norm/.*'


@pytest.mark.parametrize('model, image_size, num_blocks, top', FAMILIES)
def test_family_trains_with_fsdp_accumulation_layer_decay_ema_and_summaries(
    model, image_size, num_blocks, top, tmp_path):
  run = dict(
      model=model, image_size=image_size, dataset='fake', batch_size=16,
      grad_accum_steps=2, num_train_steps=NUM_STEPS, log_every_steps=1,
      eval_every_steps=NUM_STEPS, steps_per_eval=1,
      checkpoint_every_steps=1, optimizer='adamw',
      learning_rate=1e-3, warmup_epochs=0.0,
      drop_path_rate=0.1, layer_decay=0.8, trainable=TRAINABLE,
      ema_decay=0.9, intermediate_grads_every_steps=2,
      # Rolled stacks and micro-batch loop: one block of each stage to
      # compile, not every block of both micro-batches. The same layers,
      # summaries and checkpoint layout either way; at 32 px the slower
      # convolution gradients of a rolled loop on XLA:CPU cost less than
      # the unrolled compiles did.
      scan_unroll=1)
  # Compiled as every test's programs are (tests/processes.py): at
  # ConvNeXt-Atto's size the slower steps of XLA:CPU's level 0 cost less
  # than level 1's compiles (ConvNeXt-T's steps did not).
  [log] = processes.run(
      [processes.main_command(tmp_path, run, '--config.mesh.fsdp=2')],
      [processes.cpu_environment(4)])

  scalars = read_scalars(tmp_path)
  losses = [scalars['train_loss'][step] for step in range(1, NUM_STEPS + 1)]
  assert np.all(np.isfinite(losses))
  for tag in ('eval_accuracy', 'eval_ema_accuracy', 'eval_ema_loss'):
    assert NUM_STEPS in scalars[tag], tag
  # Every block's output has its gradient summary: a stack's layers, a
  # stage's first block outside its stack, a Swin pair's window block.
  block_points = {
      tag for tag in scalars
      if re.fullmatch(r'intermediate_grads/stages\.\d+\.[\w.]+'
                      r'(/layer_\d+)?/l2_norm', tag)}
  assert len(block_points) == num_blocks, sorted(block_points)
  assert all(scalars[tag][2] > 0 for tag in block_points)
  # The startup line lists the family's own layer numbering.
  assert f'layer_decay=0.8: updates at depth d scaled by 0.8^({top} - d)' in (
      log)
  # The second step left the frozen parameters as the first left them, bit
  # for bit, and moved every trained array (by 1e-5 or more: stage 0's
  # blocks learn at 0.8^12 of the rate).
  config = default.get_config()
  config.update(run)
  config.mesh.fsdp = 2
  info = datasets.create_dataset(
      input_pipeline.DataSource.from_config(config)).info
  _, target, _, _ = run_state.create_sharded_train_state(
      config, info, optimizer.logged_schedule(config, info)[1],
      sharding.create_mesh(config.mesh, config.step_mode), abstract=True,
      dtype=models.compute_dtype(config))
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['1', '2']
  first, last = (flat_params(checkpointing.restore_checkpoint(
      tmp_path / 'checkpoints' / str(step), target,
      compatibility.as_json(config),
      unread=('opt_state',)).state.params) for step in (1, NUM_STEPS))
  frozen = [name for name in first if not re.fullmatch(TRAINABLE, name)]
  assert frozen
  for name, value in first.items():
    if name in frozen:
      np.testing.assert_array_equal(last[name], value, err_msg=name)
    else:
      assert np.max(np.abs(last[name] - value)) > 1e-6, name
