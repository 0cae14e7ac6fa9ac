"""Evaluators added from the command line as big_vision's users add them:
a config option naming the type (`--config=configs/default.py:knn`), then
its settings by key; the error of a setting of an evaluator not added
names that option."""

import re
import subprocess

import pytest

from helpers import REPO
from helpers import read_scalars
from image_data import write_folders
import processes


# The tests of one run share a worker.
shares_the_run = pytest.mark.xdist_group('evaluator_options')


@pytest.fixture(scope='module')
def options_run(tmp_path_factory):
  """(command, folders, workdir) of `:knn,fewshot` trained on image
  folders for two steps, two settings set by key."""
  directory = tmp_path_factory.mktemp('options')
  root, workdir = directory / 'images', directory / 'run'
  write_folders(root, extras=False)
  command = processes.main_command(workdir, {
      'dataset': f'folder:{root}', 'batch_size': 8, 'num_train_steps': 2,
      'evals.knn.k': 3, 'evals.fewshot.shots': '(1,2)'},
      config='configs/default.py:knn,fewshot')
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          timeout=300,
                          env=processes.one_device_environment())
  assert result.returncode == 0, result.stderr[-3000:]
  return command, root, workdir


@shares_the_run
def test_knn_and_fewshot_options_evaluate_the_runs_own_folders(options_run):
  """Both evaluators run on the run's own folders (`datasets.data`,
  following `--config.dataset`) at the last step, on the console and
  TensorBoard."""
  _, _, workdir = options_run
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


@shares_the_run
def test_eval_mode_redirected_keeps_results_and_log_lines_apart(
    options_run, tmp_path):
  """`main.py --mode=eval > FILE 2>&1` of that run: each result is a whole
  line, in its place among the log's lines (before the last, the
  compilation cache's), and the evaluators' splits are not called
  evaluation images of the training folder."""
  command, root, _ = options_run
  with open(tmp_path / 'eval.txt', 'w') as output:
    subprocess.run([*command, '--mode=eval'], cwd=REPO,
                   env=processes.one_device_environment(), check=True,
                   stdout=output, stderr=subprocess.STDOUT, timeout=300)
  lines = (tmp_path / 'eval.txt').read_text().splitlines()
  results = [i for i, line in enumerate(lines) if 'Evaluated ' in line]
  assert len(results) == 3, lines
  for i in results:
    assert re.fullmatch(r'Evaluated \S+ \(step 2\)( knn| fewshot)?: '
                        r'(\w+=[\d.e+-]+, )+\w+=[\d.e+-]+', lines[i]), lines[i]
  last_log_line, = [i for i, line in enumerate(lines)
                    if 'Compilation cache' in line]
  assert max(results) < last_log_line, lines
  assert not [line for line in lines if 'evaluation images in' in line and
              f'{root}/train' in line.split('evaluation images in')[1]]
  # Each evaluator's training and test splits.
  assert sum('An evaluator reads' in line for line in lines) == 4, lines
