"""The ImageNet recipes' configs: learning-rate schedules and their
scaling with the batch, ConvNeXt-T's and Swin-T's training commands value
by value, every config file validated and its model built."""

import glob
import math
import importlib
import os

from flax import nnx
import jax
import jax.numpy as jnp
import pytest

from checks import config_values
from runtime import config_error
from configs import convnext_t
from configs import deit_s16
from configs import imagenet
from configs import imagenet_vit
from configs import swin_t
import input_pipeline
import models
from training import optimizer
import train
from helpers import read_scalars
from helpers import tiny_config

# Tests share compiled programs (in memory): one worker runs them all.
pytestmark = pytest.mark.xdist_group('recipes')

IMAGENET_INFO = input_pipeline.DatasetInfo(1000, (224, 224, 3), 1_281_167,
                                           50_000)
# TFDS's train[:99%] of ImageNet.
IMAGENET_99_INFO = input_pipeline.DatasetInfo(1000, (224, 224, 3), 1_268_355,
                                              50_000)


@pytest.mark.parametrize('batch_size', [16, 32])
def test_learning_rate_follows_an_override_of_batch_size(tmp_path,
                                                         batch_size):
  config = tiny_config(learning_rate=0.1, learning_rate_base_batch_size=256,
                       batch_size=batch_size, warmup_epochs=0.0,
                       num_train_steps=1, log_every_steps=1,
                       eval_every_steps=1, checkpoint_every_steps=1,
                       steps_per_eval=1)
  train.train_and_evaluate(config, str(tmp_path))
  logged = read_scalars(str(tmp_path))['train_learning_rate'][1]
  assert logged == pytest.approx(0.1 * batch_size / 256, rel=1e-6)


def test_resnet50_recipe_schedule_is_the_flax_examples():
  config = imagenet.get_config()
  config_values.validate_config(config)
  num_steps = optimizer.num_train_steps(config, IMAGENET_INFO)
  assert num_steps == 125_100  # 100 epochs of 1,251 steps, as published
  lr_fn = optimizer.learning_rate_schedule(
      config, num_steps, optimizer.steps_per_epoch(config, IMAGENET_INFO))
  assert float(lr_fn(5 * 1251)) == pytest.approx(0.4)  # 0.1 x 1024 / 256
  assert float(lr_fn(5 * 1251 // 2)) == pytest.approx(0.2, rel=1e-3)
  assert float(lr_fn(num_steps)) == pytest.approx(0.0, abs=1e-7)
  # Half the batch: half the rate, twice the steps, the same warmup epochs.
  config.batch_size = 512
  num_steps = optimizer.num_train_steps(config, IMAGENET_INFO)
  lr_fn = optimizer.learning_rate_schedule(
      config, num_steps, optimizer.steps_per_epoch(config, IMAGENET_INFO))
  assert float(lr_fn(5 * 2502)) == pytest.approx(0.2)


@pytest.mark.parametrize('batch_size', [1024, 512])
def test_vit_recipe_warms_up_10k_steps_at_an_unscaled_rate(batch_size):
  config = imagenet_vit.get_config()
  config.batch_size = batch_size
  config_values.validate_config(config)
  num_steps = optimizer.num_train_steps(config, IMAGENET_99_INFO)
  assert num_steps == 90 * (1_268_355 // batch_size)
  lr_fn = optimizer.learning_rate_schedule(
      config, num_steps, optimizer.steps_per_epoch(config, IMAGENET_99_INFO))
  assert float(lr_fn(10_000)) == pytest.approx(1e-3)
  assert float(lr_fn(5_000)) == pytest.approx(5e-4)
  assert float(lr_fn(num_steps)) == pytest.approx(0.0, abs=1e-9)


def test_min_learning_rate_is_the_cosines_floor_as_timm_computes_it():
  config = imagenet_vit.get_config()
  config.min_learning_rate = 1e-5
  config_values.validate_config(config)
  peak, warmup, num_steps = 1e-3, 10_000, 100_000
  lr_fn = optimizer.learning_rate_schedule(config, num_steps, 1)
  for step in (warmup, 30_000, 55_000, 80_000, num_steps):
    progress = (step - warmup) / (num_steps - warmup)
    # timm's CosineLRScheduler (cycle 1, no restarts).
    expected = 1e-5 + 0.5 * (peak - 1e-5) * (1 + math.cos(math.pi * progress))
    assert float(lr_fn(step)) == pytest.approx(expected, rel=1e-5)


def test_distilled_deit_recipe_schedule_is_deits_at_its_own_batch():
  config = deit_s16.get_config('distilled')
  lr_fn, num_steps, per_epoch = recipe_schedule(config)
  assert (num_steps, per_epoch) == (375_300, 1251)
  assert optimizer.schedule_adjustments(config, num_steps, per_epoch) == []
  # The values of the schedule before shrunk recipes were scaled, and
  # DeiT's: 1e-3 (5e-4 x 1024 / 512) after 5 epochs, cosine to 1e-5.
  before = {0: 0.0, 1000: 1.5987211e-4, 6255: 1e-3, 100_000: 8.5056911e-4,
            200_000: 4.6617797e-4, 375_299: 1e-5, 375_300: 1e-5}
  for step, rate in before.items():
    assert float(lr_fn(step)) == pytest.approx(rate, rel=1e-6, abs=1e-12)
    assert rate == pytest.approx(linear_warmup_then_cosine(
        step, peak=1e-3, floor=1e-5, warmup=6255, num_steps=num_steps),
                                 rel=1e-5, abs=1e-12)


def test_shrunk_distilled_recipe_scales_its_floor_and_shortens_its_warmup(
    caplog):
  config = deit_s16.get_config('distilled')
  config.batch_size, config.num_train_steps = 8, 20
  config_values.validate_config(config)
  with caplog.at_level('INFO'):
    num_steps, lr_fn = optimizer.logged_schedule(config, IMAGENET_INFO)
  # The peak and the floor both scaled by 8 / 512, as DeiT scales the rate;
  # the warmup 10% of the 20 steps, then a cosine to the floor.
  peak, floor = 5e-4 * 8 / 512, 1e-5 * 8 / 512
  assert num_steps == 20
  assert optimizer.min_learning_rate(config) == pytest.approx(floor)
  for step in range(21):
    assert float(lr_fn(step)) == pytest.approx(linear_warmup_then_cosine(
        step, peak=peak, floor=floor, warmup=2, num_steps=20), rel=1e-5)
  lines = caplog.text.splitlines()
  floor_lines = [line for line in lines if 'min_learning_rate 1e-05' in line]
  warmup_lines = [line for line in lines if 'warmup of' in line]
  assert len(floor_lines) == len(warmup_lines) == 1
  assert floor_lines[0].endswith(
      'min_learning_rate 1e-05 is not below the peak 7.8e-06 at batch 8: '
      'scaled with the batch as learning_rate is (x 8/512) to 1.6e-07.')
  assert warmup_lines[0].endswith(
      "warmup of 5 epochs (800,725 steps) is not shorter than the run's 20 "
      'steps: warmup shortened to 2 steps (10% of the run).')
  assert '; 2 warmup steps of 20.' in caplog.text


@pytest.mark.parametrize('batch_size, floor, bound', [
    (8, 5e-4, '0.0005'), (8, -1e-5, '0.0005'), (1024, -1e-5, '0.001')])
def test_a_floor_no_batch_scaling_can_put_below_the_peak_is_refused(
    batch_size, floor, bound):
  config = deit_s16.get_config()
  config.batch_size, config.min_learning_rate = batch_size, floor
  with pytest.raises(config_error.ConfigError,
                     match=rf'min_learning_rate {floor:g} must be in '
                     rf'\[0, {bound}\) at batch {batch_size}'):
    config_values.validate_config(config)


# ---------------------------------------------- ConvNeXt-T and Swin-T


def linear_warmup_then_cosine(step, *, peak, floor, warmup, num_steps,
                              warmup_start=0.0, warmup_end_step=None):
  """The anchors' per-step schedules, written from their formulas: linear
  from `warmup_start` to `peak` at `warmup_end_step` (ConvNeXt's
  `np.linspace` reaches it at warmup - 1; timm's CosineLRScheduler, Swin's,
  at warmup), then floor + (peak - floor) (1 + cos(pi t)) / 2 over the
  steps after the warmup."""
  if step < warmup:
    end = warmup if warmup_end_step is None else warmup_end_step
    return warmup_start + (peak - warmup_start) * step / end
  progress = (step - warmup) / (num_steps - warmup)
  return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def recipe_schedule(config):
  """(learning-rate function, steps, steps per epoch) of `config` on
  ImageNet, after its checks."""
  config_values.validate_config(config)
  per_epoch = optimizer.steps_per_epoch(config, IMAGENET_INFO)
  num_steps = optimizer.num_train_steps(config, IMAGENET_INFO)
  return (optimizer.learning_rate_schedule(config, num_steps, per_epoch),
          num_steps, per_epoch)


def assert_builds_at_224_with_params(config, millions):
  """The recipe's model, abstractly, at 224 px: 1000 logits, and timm's
  parameter count of the architecture (results/results-imagenet.csv, in
  millions to two decimals)."""
  model = nnx.eval_shape(lambda: models.create_model(
      config.model, 1000, 3, rngs=nnx.Rngs(0), **models.options(config)))
  logits = nnx.eval_shape(lambda m: m(jnp.zeros((1, 224, 224, 3)),
                                      train=False), model)
  assert logits.shape == (1, 1000)
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert round(count / 1e6, 2) == millions


def test_convnext_t_recipe_is_convnexts_training_command():
  """main.py's defaults and TRAINING.md's ConvNeXt-T command, value by
  value; the schedule against utils.cosine_scheduler's formula."""
  config = convnext_t.get_config()
  assert {k: config[k] for k in (
      'model', 'image_size', 'batch_size', 'grad_accum_steps', 'num_epochs',
      'optimizer', 'learning_rate', 'learning_rate_base_batch_size',
      'warmup_epochs', 'min_learning_rate', 'scale_min_learning_rate',
      'weight_decay', 'weight_decay_form', 'grad_clip_norm', 'drop_path_rate',
      'layer_scale_init', 'layer_decay', 'ema_decay', 'mixup_alpha',
      'cutmix_alpha', 'mixup_switch_prob', 'label_smoothing',
      'randaug_num_layers', 'randaug_magnitude', 'randaug_magnitude_std',
      'randaug_apply_prob', 'randaug_ops', 'random_erase_prob',
      'repeated_augments', 'crop_min_area', 'resize_method',
      'eval_resize_method', 'normalization')} == dict(
          model='ConvNeXt_T', image_size=224, batch_size=4 * 8 * 128 * 1,
          grad_accum_steps=1, num_epochs=300.0, optimizer='adamw',
          learning_rate=4e-3, learning_rate_base_batch_size=4096,
          warmup_epochs=20.0, min_learning_rate=1e-6,
          scale_min_learning_rate=False, weight_decay=0.05,
          weight_decay_form='pytorch', grad_clip_norm=0.0, drop_path_rate=0.1,
          layer_scale_init=1e-6, layer_decay=1.0, ema_decay=0.9999,
          mixup_alpha=0.8, cutmix_alpha=1.0, mixup_switch_prob=0.5,
          label_smoothing=0.1, randaug_num_layers=2, randaug_magnitude=9,
          randaug_magnitude_std=0.5, randaug_apply_prob=0.5,
          randaug_ops='timm_increasing', random_erase_prob=0.25,
          repeated_augments=1, crop_min_area=0.08, resize_method='bicubic',
          eval_resize_method='bicubic', normalization='imagenet')
  lr_fn, num_steps, per_epoch = recipe_schedule(config)
  # len(dataset_train) // total_batch_size steps an epoch, 300 epochs.
  assert (per_epoch, num_steps) == (312, 93_600)
  warmup = 20 * 312
  for step in (6_240, 20_000, 50_000, 80_000, 93_599):
    assert float(lr_fn(step)) == pytest.approx(linear_warmup_then_cosine(
        step, peak=4e-3, floor=1e-6, warmup=warmup, num_steps=num_steps),
                                                 rel=1e-5, abs=1e-9)
  for step in (0, 1_000, 3_120, 6_239):  # within one step's rise
    assert float(lr_fn(step)) == pytest.approx(linear_warmup_then_cosine(
        step, peak=4e-3, floor=1e-6, warmup=warmup, num_steps=num_steps,
        warmup_end_step=warmup - 1), abs=4e-3 / (warmup - 1))
  assert float(lr_fn(num_steps)) == pytest.approx(1e-6, rel=1e-4)
  # Another batch scales the peak from 4e-3 at 4096; the floor stays.
  config.batch_size = 2048
  lr_fn, num_steps, _ = recipe_schedule(config)
  assert float(lr_fn(20 * 625)) == pytest.approx(2e-3)
  assert float(lr_fn(num_steps)) == pytest.approx(1e-6, rel=1e-4)
  assert_builds_at_224_with_params(convnext_t.get_config(), 28.59)


def test_swin_t_recipe_is_swins_config_with_both_rates_scaled_by_batch():
  """config.py's defaults, swin_tiny_patch4_window7_224.yaml and
  get_started.md's command; BASE_LR and MIN_LR as main.py scales them
  (x batch / 512), the schedule against timm's CosineLRScheduler formula
  (warmup_prefix, from WARMUP_LR)."""
  config = swin_t.get_config()
  assert {k: config[k] for k in (
      'model', 'image_size', 'batch_size', 'grad_accum_steps', 'num_epochs',
      'optimizer', 'learning_rate', 'learning_rate_base_batch_size',
      'warmup_epochs', 'min_learning_rate', 'scale_min_learning_rate',
      'weight_decay', 'weight_decay_form', 'grad_clip_norm', 'drop_path_rate',
      'layer_decay', 'ema_decay', 'mixup_alpha', 'cutmix_alpha',
      'mixup_switch_prob', 'label_smoothing', 'randaug_num_layers',
      'randaug_magnitude', 'randaug_magnitude_std', 'randaug_apply_prob',
      'randaug_ops', 'random_erase_prob', 'repeated_augments',
      'crop_min_area', 'resize_method', 'eval_resize_method',
      'normalization')} == dict(
          model='Swin_T', image_size=224, batch_size=8 * 128,
          grad_accum_steps=1, num_epochs=300.0, optimizer='adamw',
          learning_rate=5e-4, learning_rate_base_batch_size=512,
          warmup_epochs=20.0, min_learning_rate=5e-6,
          scale_min_learning_rate=True, weight_decay=0.05,
          weight_decay_form='pytorch', grad_clip_norm=5.0, drop_path_rate=0.2,
          layer_decay=1.0, ema_decay=0.0, mixup_alpha=0.8, cutmix_alpha=1.0,
          mixup_switch_prob=0.5, label_smoothing=0.1, randaug_num_layers=2,
          randaug_magnitude=9, randaug_magnitude_std=0.5,
          randaug_apply_prob=0.5, randaug_ops='timm_increasing',
          random_erase_prob=0.25, repeated_augments=1, crop_min_area=0.08,
          resize_method='bicubic', eval_resize_method='bicubic',
          normalization='imagenet')
  for batch_size, per_epoch in ((1024, 1251), (512, 2502), (2048, 625)):
    config.batch_size = batch_size
    lr_fn, num_steps, steps = recipe_schedule(config)
    assert (steps, num_steps) == (per_epoch, 300 * per_epoch)
    scale = batch_size / 512
    peak, floor, warmup = 5e-4 * scale, 5e-6 * scale, 20 * per_epoch
    assert optimizer.min_learning_rate(config) == pytest.approx(floor)
    for step in (warmup, warmup + 50_000, num_steps // 2, num_steps - 1):
      assert float(lr_fn(step)) == pytest.approx(linear_warmup_then_cosine(
          step, peak=peak, floor=floor, warmup=warmup, num_steps=num_steps),
                                                   rel=1e-5, abs=1e-10)
    assert float(lr_fn(num_steps)) == pytest.approx(floor, rel=1e-4)
    # Swin warms up from WARMUP_LR 5e-7 per 512, this schedule from 0.
    warmup_lr = 5e-7 * scale
    for step in (0, warmup // 3, warmup - 1):
      assert float(lr_fn(step)) == pytest.approx(linear_warmup_then_cosine(
          step, peak=peak, floor=floor, warmup=warmup, num_steps=num_steps,
          warmup_start=warmup_lr), abs=warmup_lr * (1 - step / warmup) + 1e-10)
  assert_builds_at_224_with_params(swin_t.get_config(), 28.29)


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs',
    '*.py'))))
def test_only_swins_recipe_scales_its_floor_with_the_batch(path):
  """scale_min_learning_rate is off by default, so every other recipe's
  floor stays the absolute min_learning_rate at any batch."""
  name = os.path.basename(path)[:-3]
  if name in ('__init__', 'finetune'):
    return
  config = importlib.import_module(f'configs.{name}').get_config()
  assert config.scale_min_learning_rate == (name == 'swin_t')
  if name != 'swin_t':
    config.batch_size *= 2
    assert optimizer.min_learning_rate(config) == config.min_learning_rate


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs',
    '*.py'))))
def test_every_config_file_validates_and_builds_its_model(path):
  name = os.path.basename(path)[:-3]
  if name == '__init__':
    return
  config = importlib.import_module(f'configs.{name}').get_config()
  config_values.validate_config(config)
  info = (IMAGENET_INFO if config.dataset.startswith('imagenet') or
          config.dataset == 'fake' else input_pipeline.DatasetInfo(
              10, (config.image_size, config.image_size, 1), 1000, 100))
  model = nnx.eval_shape(lambda: models.create_model(
      config.model, info.num_classes, info.image_shape[-1], rngs=nnx.Rngs(0),
      **models.options(config)))
  assert (getattr(model, 'pre_logits', None) is not None) == (
      config.vit_pre_logits)
