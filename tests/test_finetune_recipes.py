"""configs/finetune.py: its presets build their published models with
their conventions and rates, MAE's fine-tuning and linear-probe recipes
value by value, and a fine-tuned run starts below a fresh one."""

import logging

import jax.numpy as jnp
import pytest
from flax import nnx

from checks import config_values
from configs import default
from configs import finetune
import models
from training import optimizer
import train
from helpers import read_scalars


# Per transfer preset: the conventions of its published weights and its
# learning rate per 256 examples.
TRANSFER_PRESETS = {
    'resnet50': (dict(model='ResNet50', resnet_padding='symmetric'), 0.01),
    'vit_s16': (dict(model='ViT_S16', vit_pool='cls', vit_posemb='learn',
                     vit_gelu='exact'), 0.003),
    'convnext_t': (dict(model='ConvNeXt_T', layer_scale_init=1e-6), 0.003),
    'swin_t': (dict(model='Swin_T'), 0.003),
    'regnety_040': (dict(model='RegNetY_4GF'), 0.01),
    'dinov2_b14': (dict(model='ViT_B14', vit_pool='cls', vit_posemb='learn',
                        vit_gelu='exact', vit_layer_scale=True,
                        layer_scale_init=1e-5), 0.003),
    'clip_b16': (dict(model='ViT_B16', vit_pool='cls', vit_posemb='learn',
                      vit_gelu='quick', vit_norm_pre=True,
                      vit_norm_eps=1e-5), 0.003),
    'siglip_b16': (dict(model='ViT_B16', vit_pool='map', vit_posemb='learn',
                        vit_gelu='exact'), 0.003),
}


@pytest.mark.parametrize('preset', sorted(TRANSFER_PRESETS))
def test_finetune_config_presets_build_their_published_models(preset):
  conventions, learning_rate = TRANSFER_PRESETS[preset]
  config = finetune.get_config(preset)
  config_values.validate_config(config)
  assert {key: config[key] for key in conventions} == conventions
  assert (config.dataset, config.image_size, config.optimizer,
          config.batch_size, config.num_train_steps, config.warmup_steps,
          config.weight_decay, config.grad_clip_norm) == (
              'oxford_flowers102:2.*.*', 224, 'sgd', 512, 500, 50, 0.0, 1.0)
  assert optimizer.peak_learning_rate(config) == pytest.approx(
      learning_rate * 512 / 256)
  # The model at 224 px with Flowers' 102 classes, abstractly.
  model = nnx.eval_shape(lambda: models.create_model(
      config.model, 102, 3, rngs=nnx.Rngs(0), **models.options(config)))
  logits = nnx.eval_shape(lambda m: m(jnp.zeros((1, 224, 224, 3)),
                                      train=False), model)
  assert logits.shape == (1, 102)
  names = {'/'.join(str(k) for k in path)
           for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert any(name.endswith('layer_scale') for name in names) == (
      preset == 'convnext_t')


def test_finetune_config_refuses_unknown_and_repeated_presets():
  for options, what in [('vit_b16', 'unknown preset or option vit_b16'),
                        ('linear_probes', 'unknown preset or option '
                         'linear_probes'),
                        ('resnet50,vit_s16',
                         r'more than one preset \(resnet50,vit_s16\)')]:
    with pytest.raises(ValueError, match=(
        f'{what}; valid: one preset of resnet50, vit_s16, vit_b16_mae, '
        'convnext_t, swin_t, regnety_040, dinov2_b14, clip_b16, siglip_b16, '
        'then optionally linear_probe')):
      finetune.get_config(options)


def test_finetune_mae_options_are_maes_recipes():
  """FINETUNE.md's ViT-B command and main_finetune.py's defaults; its linear
  probe command and main_linprobe.py's, value by value."""
  tuned = finetune.get_config('vit_b16_mae')
  config_values.validate_config(tuned)
  assert {k: tuned[k] for k in (
      'model', 'vit_pool', 'vit_posemb', 'vit_gelu', 'dataset', 'batch_size',
      'num_epochs', 'warmup_epochs', 'optimizer', 'weight_decay',
      'weight_decay_form', 'layer_decay', 'drop_path_rate',
      'random_erase_prob', 'mixup_alpha', 'cutmix_alpha', 'mixup_switch_prob',
      'label_smoothing', 'min_learning_rate', 'randaug_num_layers',
      'randaug_magnitude', 'randaug_magnitude_std', 'randaug_ops',
      'repeated_augments', 'ema_decay', 'grad_clip_norm', 'trainable')} == dict(
          model='ViT_B16', vit_pool='cls', vit_posemb='learn', vit_gelu='exact',
          dataset='imagenet2012:5.*.*', batch_size=1024, num_epochs=100.0,
          warmup_epochs=5.0, optimizer='adamw', weight_decay=0.05,
          weight_decay_form='pytorch', layer_decay=0.65, drop_path_rate=0.1,
          random_erase_prob=0.25, mixup_alpha=0.8, cutmix_alpha=1.0,
          mixup_switch_prob=0.5, label_smoothing=0.1, min_learning_rate=1e-6,
          randaug_num_layers=2, randaug_magnitude=9, randaug_magnitude_std=0.5,
          randaug_ops='timm_increasing', repeated_augments=1, ema_decay=0.0,
          grad_clip_norm=0.0, trainable='')
  assert optimizer.peak_learning_rate(tuned) == pytest.approx(5e-4 * 4)

  probe = finetune.get_config('vit_b16_mae,linear_probe')
  config_values.validate_config(probe)
  assert {k: probe[k] for k in (
      'model', 'vit_pool', 'trainable', 'feature_batch_norm', 'optimizer',
      'weight_decay', 'layer_decay', 'batch_size', 'num_epochs',
      'warmup_epochs', 'min_learning_rate', 'drop_path_rate',
      'label_smoothing', 'mixup_alpha', 'cutmix_alpha', 'randaug_num_layers',
      'random_erase_prob', 'crop_min_area')} == dict(
          model='ViT_B16', vit_pool='cls', trainable='head/.*',
          feature_batch_norm=True, optimizer='lars', weight_decay=0.0,
          layer_decay=1.0, batch_size=16384, num_epochs=90.0,
          warmup_epochs=10.0, min_learning_rate=0.0, drop_path_rate=0.0,
          label_smoothing=0.0, mixup_alpha=0.0, cutmix_alpha=0.0,
          randaug_num_layers=0, random_erase_prob=0.0, crop_min_area=0.08)
  assert optimizer.peak_learning_rate(probe) == pytest.approx(0.1 * 64)
  flowers_probe = finetune.get_config('linear_probe')
  assert (flowers_probe.model, flowers_probe.trainable,
          flowers_probe.dataset, flowers_probe.num_train_steps) == (
              'ResNet50', 'head/.*', 'oxford_flowers102:2.*.*', 500)


@pytest.mark.slow
@pytest.mark.xdist_group('quick_start')
def test_finetuning_from_a_checkpoint_starts_below_a_fresh_run(quick_start,
                                                               tmp_path,
                                                               caplog):
  """From the quick start's model of the ten digits, fine-tune
  configs/finetune.py's recipe (shrunk to that model) on the digits 0-4
  with a new head: its first logged loss is below a fresh start's."""
  caplog.set_level(logging.INFO)
  pretrained_model = default.get_config()

  def finetune_run(name, init_from):
    config = finetune.get_config()
    config.update(
        dataset='digits_0to4', image_size=8, model='SmallResNet',
        width=pretrained_model.width, num_layers=pretrained_model.num_layers,
        resnet_padding='same', scan_unroll=64, half_precision=False,
        remat_policy='full', batch_size=64, num_train_steps=10,
        warmup_steps=0, log_every_steps=5, eval_every_steps=10,
        checkpoint_every_steps=10, init_from=init_from)
    workdir = str(tmp_path / name)
    train.train_and_evaluate(config, workdir)
    return read_scalars(workdir)

  tuned = finetune_run('tuned', str(quick_start[0]))
  assert ('head re-initialised to zeros: the file has 10 classes, the '
          'model 5') in caplog.text
  fresh = finetune_run('fresh', '')
  assert tuned['train_loss'][5] < fresh['train_loss'][5]
  assert tuned['eval_accuracy'][10] > fresh['eval_accuracy'][10]
