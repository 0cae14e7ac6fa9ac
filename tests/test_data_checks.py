"""Every data set a run reads, checked before anything is written
(checks/data_checks.py); a folder run's input pipeline stopped before the
process exits (input_pipeline.stop)."""

import gc
import json
import subprocess
import sys
import time
import types

import ml_collections
import pytest

import train
from runtime import config_error
from helpers import LOG_LINE
from helpers import REPO
from helpers import tiny_config
from image_data import write_class_folders


def test_the_imagenet_evaluators_missing_data_is_one_line_of_all_of_it(
    tmp_path):
  """configs/imagenet.py:real_v2,fewshot on a machine without its data:
  one launch names every data set, its key and how to prepare it."""
  empty, workdir = tmp_path / 'tfds', tmp_path / 'workdir'
  empty.mkdir()
  v2, imagenet = tmp_path / 'imagenetv2', tmp_path / 'imagenet'
  real = tmp_path / 'real.json'
  result = subprocess.run(
      [sys.executable, 'main.py', '--config=configs/imagenet.py:real_v2,fewshot',
       f'--workdir={workdir}', f'--config.data_dir={empty}',
       f'--config.evals.v2.dataset=folder:{v2}',
       f'--config.evals.real.dataset=folder:{imagenet}',
       f'--config.evals.real.real_labels_file={real}'],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines()
            if line.startswith('Error:')]
  assert len(errors) == 1, result.stderr[-3000:]
  items = errors[0].removeprefix('Error: 10 data sets are missing: ').split(
      '; ')
  tfds = [('dataset imagenet2012:5.*.*', 'put ILSVRC2012_img_train.tar and '
           'ILSVRC2012_img_val.tar (from image-net.org) in a directory '
           'MANUAL_DIR and run `tfds build imagenet2012 '
           f'--data_dir={empty} --manual_dir=MANUAL_DIR`')]
  for key, name in [('caltech', 'caltech101'), ('cars', 'cars196:2.1.0'),
                    ('cifar100', 'cifar100'), ('dtd', 'dtd'),
                    ('pets', 'oxford_iiit_pet'), ('uc_merced', 'uc_merced')]:
    tfds.append((f'evals.fewshot.datasets.{key} {name}',
                 f'run `tfds build {name} --data_dir={empty}`'))
  expected = [f'{subject} is not prepared in {empty}: {command}'
              for subject, command in tfds] + [
      f"evals.real.dataset folder:{imagenet}: folder '{imagenet}/val' does "
      f'not exist: put the images there, one folder per class '
      f'({imagenet}/val/<class>/), or set --config.evals.real.dataset to the '
      'folder:PATH where they are',
      f"evals.v2.dataset folder:{v2}: folder '{v2}' does not exist: put the "
      f'images there, one folder per class ({v2}/<class>/), or set '
      '--config.evals.v2.dataset to the folder:PATH where they are',
      f"evals.real.real_labels_file '{real}' is not a file: download "
      'real.json of github.com/google-research/reassessed-imagenet there']
  assert items[:-1] == expected[:-1]
  assert items[-1].startswith(expected[-1] + '. Prepare each (see '
                              'docs/data.md), point config.data_dir')
  assert not workdir.exists()


def test_an_image_size_the_digits_do_not_have_is_one_line(tmp_path):
  """The digits are 8x8 images: another image_size is refused before the
  model is built (it failed deep inside the first step)."""
  workdir = tmp_path / 'workdir'
  result = subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py',
       f'--workdir={workdir}', '--config.model=ViT_B16',
       '--config.image_size=32'],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines()
            if line.startswith('Error:')]
  assert errors == [
      "Error: dataset 'digits' holds 8x8 images, not image_size 32: set "
      '--config.image_size=8, or train on image folders or a TFDS data '
      'set'], result.stderr[-3000:]
  assert not workdir.exists()


def test_only_the_data_sets_that_are_missing_are_listed(tmp_path):
  """Folders that are there pass; each missing split and file is named."""
  folders = tmp_path / 'folders'
  for split in ('train', 'val'):
    write_class_folders(str(folders / split), ['a', 'b'], 1, 0)
  labels = tmp_path / 'real.json'
  labels.write_text(json.dumps([[0], [1]]))
  config = tiny_config()
  config.evals = ml_collections.ConfigDict({
      'present': dict(type='classification', dataset=f'folder:{folders}',
                      split='val', labels='real',
                      real_labels_file=str(labels)),
      'absent': dict(type='classification', dataset=f'folder:{folders}',
                     split='test', labels='real',
                     real_labels_file=str(tmp_path / 'none.json')),
      'probe': dict(type='fewshot', datasets={
          'here': f'folder:{folders}', 'digits': 'digits',
          'gone': (f'folder:{folders}', 'train', 'holdout')})})
  workdir = tmp_path / 'workdir'
  with pytest.raises(config_error.ConfigError) as error:
    train.train_and_evaluate(config, str(workdir))
  assert str(error.value).split('. Prepare each')[0] == (
      f'3 data sets are missing: evals.absent.dataset folder:{folders}: '
      f"folder '{folders}/test' does not exist: put the images there, one "
      f'folder per class ({folders}/test/<class>/), or set '
      '--config.evals.absent.dataset to the folder:PATH where they are; '
      f'evals.probe.datasets.gone folder:{folders}: folder '
      f"'{folders}/holdout' does not exist: put the images there, one folder "
      f'per class ({folders}/holdout/<class>/), or set '
      '--config.evals.probe.datasets.gone to the folder:PATH where they are; '
      f"evals.absent.real_labels_file '{tmp_path}/none.json' is not a file: "
      'download real.json of github.com/google-research/reassessed-imagenet '
      'there')
  assert not workdir.exists()


# Folder runs of a tiny model: 3 classes of 20 training and 4 evaluation
# images, batch 8 (a multiple of the 8 devices of the tests' processes).
FOLDER_RUN = dict(image_size=16, batch_size=8, num_layers=2, width=8,
                  num_train_steps=4, log_every_steps=2, eval_every_steps=4,
                  checkpoint_every_steps=4)


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp('folders')
  for split, count in (('train', 20), ('val', 4)):
    write_class_folders(str(root / split), ['a', 'b', 'c'], count, 0)
  return root


def test_a_failed_run_leaves_no_input_pipeline_running(tmp_path, folders):
  """An error after the training batches started (a ReaL file of the wrong
  length, found as its evaluator opens) has stopped them, as training's end
  does: while the error is held (main.py exits holding it, and so every
  frame of its traceback), no generator of the pipeline runs."""
  labels = tmp_path / 'real.json'
  labels.write_text(json.dumps([[0]]))
  config = tiny_config(dataset=f'folder:{folders}', **FOLDER_RUN)
  config.evals.real = ml_collections.ConfigDict(dict(
      type='classification', dataset=f'folder:{folders}', split='val',
      labels='real', real_labels_file=str(labels)))
  with pytest.raises(config_error.ConfigError,
                     match='has 1 label sets') as error:
    train.train_and_evaluate(config, str(tmp_path / 'workdir'))
  running = [obj.gi_code.co_name for obj in gc.get_objects()
             if isinstance(obj, types.GeneratorType) and
             obj.gi_code.co_filename.startswith(REPO) and
             obj.gi_frame is not None]
  assert not running
  assert error.tb is not None  # held until here


def run_timed(command: list[str]) -> tuple[int, list[str], float]:
  """(exit status, stderr lines, seconds from the last line to the exit)
  of `command` run in the repository."""
  process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
  lines, last = [], time.monotonic()
  for line in process.stderr:
    lines.append(line.rstrip('\n'))
    last = time.monotonic()
  process.wait(timeout=300)
  return process.returncode, lines, time.monotonic() - last


def folder_command(workdir, folders, *overrides,
                   config='configs/default.py') -> list[str]:
  """main.py training `config` on `folders` as FOLDER_RUN, with
  `overrides`."""
  return [sys.executable, 'main.py', f'--config={config}',
          f'--workdir={workdir}', f'--config.dataset=folder:{folders}',
          *(f'--config.{k}={v}' for k, v in FOLDER_RUN.items()), *overrides]


def test_a_folder_run_that_fails_after_its_batches_started_exits_promptly(
    tmp_path, folders):
  """It prints its one Error line last, without TensorFlow's
  FAILED_PRECONDITION about the generator, and exits within seconds (a
  folder run that ends well: tests/test_run_end.py)."""
  labels = tmp_path / 'real.json'
  labels.write_text(json.dumps([[0]]))
  code, lines, seconds = run_timed(folder_command(
      tmp_path / 'failed', folders, '--config.model=SmallResNet',
      '--config.half_precision=False',
      f'--config.evals.v2.dataset=folder:{folders}/val',
      f'--config.evals.real.dataset=folder:{folders}',
      f'--config.evals.real.real_labels_file={labels}',
      config='configs/imagenet.py:real_v2'))
  assert code == 1
  last_log = max(i for i, line in enumerate(lines) if LOG_LINE.fullmatch(line))
  assert lines[last_log + 1:] == [
      f'Error: evals.real: {labels} has 1 label sets for the 12 images of '
      'the split; use the real.json of this validation set (50,000 for '
      'ImageNet)'], '\n'.join(lines[-20:])
  assert not [line for line in lines if 'FAILED_PRECONDITION' in line]
  assert seconds < 8, seconds
