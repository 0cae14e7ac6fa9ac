"""Evaluators added from the command line as big_vision's users add them:
a config option naming the type (`--config=configs/default.py:knn`), then
its settings by key; the error of a setting of an evaluator not added
names that option."""

import subprocess

from helpers import REPO
from helpers import read_scalars
from image_data import write_folders
import processes


def test_knn_and_fewshot_options_evaluate_the_runs_own_folders(tmp_path):
  """`:knn,fewshot` on image folders, two settings set by key: both
  evaluators run on the run's own folders (`datasets.data`, following
  `--config.dataset`) at the last step, on the console and TensorBoard."""
  root, workdir = tmp_path / 'images', tmp_path / 'run'
  write_folders(root, extras=False)
  command = processes.main_command(workdir, {
      'dataset': f'folder:{root}', 'batch_size': 8, 'num_train_steps': 2,
      'evals.knn.k': 3, 'evals.fewshot.shots': '(1,2)'})
  command[2] = '--config=configs/default.py:knn,fewshot'
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          timeout=300,
                          env=processes.one_device_environment())
  assert result.returncode == 0, result.stderr[-3000:]
  scalars = read_scalars(str(workdir))
  for tag in ('knn_data_top1', 'knn_data_top5', 'fewshot_data_1shot',
              'fewshot_data_2shot'):
    assert set(scalars[tag]) == {2}, (tag, scalars[tag])
  assert 0 <= scalars['knn_data_top1'][2] <= 1
  assert 'fewshot_data_25shot' not in scalars


def test_a_setting_of_an_evaluator_not_added_names_the_option(tmp_path):
  command = processes.main_command(tmp_path / 'run',
                                   {'evals.knn.type': 'knn'})
  command[2] = '--config=configs/finetune.py:dinov2_b14'
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
      "Error: --config.evals.knn.type: configs/finetune.py:dinov2_b14 has no "
      "evaluator 'knn'; add one with "
      '--config=configs/finetune.py:dinov2_b14,knn (an option per type: '
      'classification, fewshot, knn), then set its settings by key, e.g. '
      '--config.evals.knn.every_steps=100')
  assert not (tmp_path / 'run').exists()
