"""Evaluators added from the command line as big_vision's users add them:
a config option naming the type (`--config=configs/default.py:knn`), then
its settings by key; the error of a setting of an evaluator not added
names that option."""

import re
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
      'evals.knn.k': 3, 'evals.fewshot.shots': '(1,2)'},
      config='configs/default.py:knn,fewshot')
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
  command = processes.main_command(
      tmp_path / 'run', {'evals.knn.type': 'knn'},
      config='configs/finetune.py:dinov2_b14')
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


def test_eval_mode_redirected_keeps_results_and_log_lines_apart(tmp_path):
  """`main.py --mode=eval > FILE 2>&1` of a `:knn` run on image folders:
  each result is a whole line, in its place among the log's lines (before
  the last, the compilation cache's), and the evaluator's splits are not called evaluation images
  of the training folder."""
  root, workdir = tmp_path / 'images', tmp_path / 'run'
  write_folders(root, extras=False)
  overrides = {'dataset': f'folder:{root}', 'batch_size': 8,
               'num_train_steps': 1, 'evals.knn.k': 3}
  command = processes.main_command(workdir, overrides,
                                   config='configs/default.py:knn')
  environment = processes.one_device_environment()
  subprocess.run(command, cwd=REPO, env=environment, check=True,
                 capture_output=True, timeout=300)
  with open(tmp_path / 'eval.txt', 'w') as output:
    subprocess.run([*command, '--mode=eval'], cwd=REPO, env=environment,
                   check=True, stdout=output, stderr=subprocess.STDOUT,
                   timeout=300)
  lines = (tmp_path / 'eval.txt').read_text().splitlines()
  results = [i for i, line in enumerate(lines) if 'Evaluated ' in line]
  assert len(results) == 2, lines
  for i in results:
    assert re.fullmatch(r'Evaluated \S+ \(step 1\)( knn)?: '
                        r'(\w+=[\d.e+-]+, )+\w+=[\d.e+-]+', lines[i]), lines[i]
  last_log_line, = [i for i, line in enumerate(lines)
                    if 'Compilation cache' in line]
  assert max(results) < last_log_line, lines
  assert not [line for line in lines if 'evaluation images in' in line and
              f'{root}/train' in line.split('evaluation images in')[1]]
  assert sum('An evaluator reads' in line for line in lines) == 2, lines
