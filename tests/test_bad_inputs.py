"""Bad inputs are refused before anything is written, each in one line that
names the fix: config values out of range, TFDS data sets that are not
prepared, workdirs that cannot be written, and mistakes in the config file
or its command-line overrides."""

import os
import subprocess
import sys

import numpy as np
import pytest

from checks import command_line
from runtime import config_error
import train
from helpers import REPO
from helpers import tiny_config


@pytest.mark.parametrize('overrides, message', [
    (dict(model='ViT_Ti16', image_size=20),
     'ViT_Ti16 cannot take image_size 20: it is cut into patches of 16; '
     'use a multiple of 16, at least 16'),
    (dict(num_train_steps=-5), 'num_train_steps > 0'),
    (dict(skip_nonfinite_steps=-1), 'skip_nonfinite_steps must be >= 0'),
    (dict(dataset='mnistt'),
     r"unknown dataset 'mnistt'; valid names: digits, fake, digits_0to4, "
     r'folder:PATH \(image folders\), or a TFDS data set \(close: mnist'),
    (dict(batch_size=2000),
     'digits: batch_size 2000 exceeds the 1437 training examples; use a '
     'batch_size of at most 1437'),
    (dict(label_smoothing=1.5), r'label_smoothing 1.5 must be in \[0, 1\)'),
    (dict(dropout_rate=1.0), r'dropout_rate 1.0 must be in \[0, 1\)'),
    (dict(min_learning_rate=0.2),
     r'min_learning_rate 0.2 must be in \[0, 0.1\) at batch 16: below the '
     r'peak learning rate 0.025, or below learning_rate 0.1 to be scaled '
     r'with the batch as the peak is'),
    (dict(min_learning_rate=0.2, learning_rate_base_batch_size=0),
     r'min_learning_rate 0.2 must be in \[0, the peak learning rate 0.1\)'),
    (dict(min_learning_rate=-1e-5),
     r'min_learning_rate -1e-05 must be in \[0, 0.1\) at batch 16'),
    (dict(min_learning_rate=0.2, scale_min_learning_rate=True),
     r'min_learning_rate 0.2 must be in \[0, learning_rate 0.1\) '
     r'\(scale_min_learning_rate scales both by the batch\)'),
    (dict(scale_min_learning_rate=True, learning_rate_base_batch_size=0),
     'scale_min_learning_rate scales min_learning_rate by batch_size / '
     'learning_rate_base_batch_size, which is 0; set '
     'learning_rate_base_batch_size > 0 or scale_min_learning_rate=False'),
    (dict(layer_decay=0.0),
     r'layer_decay 0.0 must be in \(0, 1\] \(1: off\)'),
    (dict(layer_decay=1.5),
     r'layer_decay 1.5 must be in \(0, 1\] \(1: off\)'),
    (dict(drop_path_rate=-0.1),
     r'drop_path_rate -0.1 must be in \[0, 1\) \(0: off\)'),
    (dict(weight_decay=-1e-4), 'weight_decay must be >= 0'),
    (dict(warmup_epochs=-1.0), 'warmup_epochs must be >= 0'),
    (dict(mixup_alpha=-0.2), 'mixup_alpha must be >= 0'),
    (dict(cutmix_alpha=-1.0), 'cutmix_alpha must be >= 0'),
    (dict(mixup_switch_prob=1.5),
     r'mixup_switch_prob 1.5 must be in \[0, 1\]'),
    (dict(crop_min_area=0.0), r'crop_min_area 0.0 must be in \(0, 1\]'),
    (dict(random_erase_prob=-0.25),
     r'random_erase_prob -0.25 must be in \[0, 1\] \(0: off\)'),
    (dict(repeated_augments=0),
     r'repeated_augments 0 must be a whole number in \[1, batch_size 16\]'),
    (dict(repeated_augments=32),
     r'repeated_augments 32 must be a whole number in \[1, batch_size 16\]'),
    (dict(scan_unroll=0), r'scan_unroll must be >= 1 \(layers per loop '
     r'iteration\)'),
    (dict(resize_method='cubic'),
     "unknown resize_method 'cubic'; valid names: bilinear, bicubic"),
    (dict(optimizer='adamw', weight_decay_form='torch'),
     "unknown weight_decay_form 'torch'; valid names: big_vision, pytorch"),
    (dict(normalization='unit'),
     "unknown normalization 'unit'; valid names: imagenet, minus_one_to_one"),
])
def test_more_bad_configs_are_refused_before_anything_is_written(
    tmp_path, overrides, message):
  with pytest.raises(config_error.ConfigError, match=message):
    train.train_and_evaluate(tiny_config(**overrides), str(tmp_path))
  assert os.listdir(tmp_path) == []


def test_missing_tfds_data_set_and_a_data_dir_of_another_one(tmp_path):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  empty, other = str(tmp_path / 'empty'), str(tmp_path / 'other')
  workdir = str(tmp_path / 'workdir')
  with pytest.raises(config_error.ConfigError, match=(
      f'dataset mnist is not prepared in {empty}: run '
      f'`tfds build mnist --data_dir={empty}`')):
    train.train_and_evaluate(tiny_config(dataset='mnist', data_dir=empty),
                             workdir)
  assert not os.path.exists(empty) and not os.path.exists(workdir)

  # A real prepared TFDS data set, of another name.
  tfds.dataset_builders.store_as_tfds_dataset(
      name='tiny_digits', version='1.0.0', data_dir=other,
      features=tfds.features.FeaturesDict({
          'image': tfds.features.Image(shape=(8, 8, 1)),
          'label': tfds.features.ClassLabel(num_classes=10)}),
      split_datasets={'train': tf.data.Dataset.from_tensor_slices({
          'image': np.zeros((4, 8, 8, 1), np.uint8),
          'label': np.arange(4)})})
  with pytest.raises(config_error.ConfigError, match=(
      f'dataset mnist is not prepared in {other} \\(which holds '
      f'tiny_digits\\): run `tfds build mnist --data_dir={other}`')):
    train.train_and_evaluate(tiny_config(dataset='mnist', data_dir=other),
                             workdir)
  assert not os.path.exists(workdir)


def test_bad_workdirs_are_refused_before_anything_is_written(tmp_path):
  a_file = tmp_path / 'a_file'
  a_file.write_text('not a directory')
  for workdir in (a_file, a_file / 'sub'):
    with pytest.raises(config_error.ConfigError, match=(
        f'{a_file} is a file, not a directory; pass a directory path')):
      train.train_and_evaluate(tiny_config(), str(workdir))
  if os.geteuid() == 0:  # permission bits do not bind root; sysfs does
    unwritable = '/sys/trainer-workdir'
  else:
    locked = tmp_path / 'locked'
    locked.mkdir(mode=0o555)
    unwritable = str(locked / 'run')
  with pytest.raises(config_error.ConfigError, match='is not writable'):
    train.train_and_evaluate(tiny_config(), unwritable)
  assert a_file.read_text() == 'not a directory'
  assert sorted(os.listdir(tmp_path)) in (['a_file'], ['a_file', 'locked'])


@pytest.mark.parametrize('argv, message', [
    (['--config=configs/nope.py'],
     "config file 'configs/nope.py' not found; pass an existing file"),
    (['--config=tests/conftest.py'],
     "config file 'tests/conftest.py' has no get_config(); define"),
    (['--config=configs/finetune.py:vit_b16'],
     'configs/finetune.py:vit_b16: unknown preset or option vit_b16; valid: '
     'one preset of resnet50, vit_s16, vit_b16_mae, convnext_t, swin_t, '
     'regnety_040, dinov2_b14, clip_b16, siglip_b16, then optionally '
     'linear_probe'),
    (['--config=configs/default.py', '--config.lerning_rate=0.1'],
     "--config.lerning_rate: configs/default.py has no key 'lerning_rate'; "
     'close keys: learning_rate'),
    (['--config', 'configs/default.py', '--config.mdoel=ViT_S16'],
     "has no key 'mdoel'; close keys: model"),
    (['--config=configs/default.py', '--heartbeat_timeout_seconds=0'],
     'flag --heartbeat_timeout_seconds=0: 0 is not a positive integer'),
])
def test_config_file_and_override_mistakes_are_one_line(argv, message,
                                                        monkeypatch):
  """main.py's real flag parsing (absl and config_flags), in process."""
  import main  # pylint: disable=g-import-not-at-top  (defines the flags)
  del main
  monkeypatch.chdir(REPO)
  with pytest.raises(SystemExit) as exit_:
    command_line.parse_flags(['main.py', '--workdir=unused'] + argv)
  assert exit_.value.code.startswith('Error: ')
  assert message in exit_.value.code and '\n' not in exit_.value.code


@pytest.mark.slow
def test_command_line_mistake_exits_nonzero_with_one_line(tmp_path):
  workdir = tmp_path / 'run'
  result = subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py',
       f'--workdir={workdir}', '--config.lerning_rate=0.1'], cwd=REPO,
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      "Error: --config.lerning_rate: configs/default.py has no key "
      "'lerning_rate'; close keys: learning_rate, min_learning_rate, "
      "scale_min_learning_rate")
  assert not workdir.exists()
