"""A ConvNeXt through the whole trainer, as a user runs it: one run with
the options that touch a model's structure together (FSDP, gradient
accumulation, stochastic depth, layer decay, frozen parameters, EMA,
intermediate-gradient summaries), on synthetic 32 px images. The models'
numerics are tested against references in their own files; here, that the
trainer's parts find every block. RegNetY (grouped convolutions: 2x the
ConvNeXt's time on XLA:CPU) and Swin (224 px only) would take minutes
each here; their blocks' summaries, layer decay and stacks are tested in
tests/test_regnet.py, tests/test_swin.py and tests/test_intermediate_grads.py,
the FSDP rule that RegNetY needs in tests/test_parallel.py.
"""

import logging
import re

import numpy as np
import pytest

from data import datasets
from runtime import sharding
from training import state as train_state
import train

from helpers import flat_params
from helpers import read_scalars
from helpers import tiny_config

pytestmark = pytest.mark.xdist_group('families_train')
NUM_STEPS = 2
# (model, image size, blocks over all stages (the published depths),
# the head's layer-decay depth).
FAMILIES = [
    ('ConvNeXt_T', 32, 3 + 3 + 9 + 3, 13),
]
# Every parameter but the stem's.
TRAINABLE = 'stages/.*|head.*|feature_norm/.*'


@pytest.mark.parametrize('model, image_size, num_blocks, top', FAMILIES)
def test_family_trains_with_fsdp_accumulation_layer_decay_ema_and_summaries(
    model, image_size, num_blocks, top, tmp_path, caplog):
  caplog.set_level(logging.INFO)
  config = tiny_config(
      model=model, image_size=image_size, dataset='fake', batch_size=16,
      grad_accum_steps=2, num_train_steps=NUM_STEPS, log_every_steps=1,
      eval_every_steps=NUM_STEPS, steps_per_eval=1,
      checkpoint_every_steps=NUM_STEPS, optimizer='adamw',
      learning_rate=1e-3, warmup_epochs=0.0,
      drop_path_rate=0.1, layer_decay=0.8, trainable=TRAINABLE,
      ema_decay=0.9, intermediate_grads_every_steps=2,
      # Rolled stacks and micro-batch loop: one block of each stage to
      # compile, not every block of both micro-batches. The same layers,
      # summaries and checkpoint layout either way; at 32 px the slower
      # convolution gradients of a rolled loop on XLA:CPU cost less than
      # the unrolled compiles did.
      scan_unroll=1)
  config.mesh.fsdp = 2
  final = train.train_and_evaluate(config, str(tmp_path))

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
      caplog.text)
  # The frozen parameters kept their initial values, bit for bit: the
  # initial state made as the run made it, sharded by the same program
  # (which the run's compilation cache holds).
  info = datasets.create_dataset(config).info
  _, initial, _, _ = train_state.create_sharded_train_state(
      config, info, train.create_schedule(config, info)[1],
      sharding.create_mesh(config.mesh, config.step_mode))
  frozen = {name: value for name, value in flat_params(initial.params).items()
            if not re.fullmatch(TRAINABLE, name)}
  assert frozen
  trained = flat_params(final.params)
  for name, value in frozen.items():
    np.testing.assert_array_equal(trained[name], value, err_msg=name)

