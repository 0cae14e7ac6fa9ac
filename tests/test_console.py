"""What `main.py`, `predict.py` and `export.py` print: their own lines, the
libraries' warnings only."""

import collections
import logging
import os
import re
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest

from runtime import console
import processes
from helpers import LOG_LINE
from helpers import REPO
from helpers import foreign_lines


def kind_of(source: str, message: str) -> str:
  """What a console line tells a person, by its source and wording."""
  kinds = [
      ('main.py', r'JAX [\d.]+ on \w+: process 0 of 1; its devices',
       'devices'),
      ('train.py', r'Mesh ', 'mesh'),
      ('optimizer.py', r'Peak learning rate [\d.e-]+ \(learning_rate ', 'schedule'),
      ('train.py', r'Starting at step \d+ of \d+; TensorBoard logs in \S+, '
       r'checkpoints in \S+/checkpoints\.$', 'start'),
      ('logging_writer.py', r'\[Hyperparameters\]', 'hparams'),
      ('logging_writer.py', r'\[\d+\] compile_seconds=', 'compile'),
      ('reporting.py', r'Started in [\d.]+ s: imports [\d.]+ s, ', 'startup'),
      ('logging_writer.py', r'\[1\] startup_seconds=[\d.]+$',
       'startup seconds'),
      ('train.py', r"Goodput [\d.]+% of [\d.]+ s since the run's first "
       r'launch \(1 launches\); badput: ', 'goodput'),
      ('reporting.py', r'\[\d+\] train_loss=[\d.e-]+, [\d.]+ steps/s, '
       r'[\d,]+ images/s, [\d.e+-]+ TFLOP/s/device, '
       r'\d+:\d\d:\d\d left$', 'train metrics'),
      ('logging_writer.py', r'\[\d+\] eval_accuracy=', 'eval metrics'),
      ('main.py', r'Compilation cache \S+: \d+ programs loaded, \d+ '
       r'compiled; step_flops: [01] read back, [01] counted\.$', 'cache'),
  ]
  for kind_source, pattern, kind in kinds:
    if source == kind_source and re.match(pattern, message):
      return kind
  return f'other: {source}] {message[:200]}'


@pytest.mark.xdist_group('quick_start')
def test_console_shows_the_run_and_no_library_info_lines(quick_start):
  """The quick start: 330 steps logged every 50, each in one short line,
  an evaluation and a checkpoint save at the end (orbax logs dozens of
  INFO lines for each save)."""
  workdir, lines = quick_start
  assert not foreign_lines(lines)
  parsed = [LOG_LINE.fullmatch(line) for line in lines]
  kinds = collections.Counter(kind_of(*p.groups()[1:]) for p in parsed)
  assert kinds == collections.Counter({
      'devices': 1, 'mesh': 1, 'schedule': 1, 'start': 1,
      'compile': 1, 'startup': 1, 'startup seconds': 1, 'goodput': 1,
      'train metrics': 7, 'eval metrics': 1, 'cache': 1}), lines
  # TensorBoard's scalars (goodput, badput by cause, throughput) stay off
  # the console but for the run's last line of goodput.
  assert [line for line in lines if 'badput' in line or
          'per_second' in line] == [lines[-2]], lines
  assert any(f'Starting at step 0 of 330; TensorBoard logs in {workdir}, '
             f'checkpoints in {workdir}/checkpoints.' in line
             for line in lines)
  assert os.listdir(workdir / 'checkpoints') == ['330']


def record_from(path: str, level: int) -> logging.LogRecord:
  return logging.LogRecord('absl', level, path, 1, 'message', None, None)


def test_console_keeps_every_warning_and_only_the_projects_info_lines():
  libraries = os.path.dirname(os.path.dirname(logging.__file__))
  orbax = os.path.join(libraries, 'orbax', 'checkpoint', 'checkpoint_manager.py')
  jax_probe = os.path.join(libraries, 'jax', '_src', 'xla_bridge.py')
  clu_writer = os.path.join(libraries, 'clu', 'metric_writers', 'logging_writer.py')
  project = os.path.join(REPO, 'train.py')
  for path in (orbax, jax_probe, clu_writer, project):
    assert console.shown_on_console(record_from(path, logging.WARNING))
    assert console.shown_on_console(record_from(path, logging.ERROR))
  for path, shown in ((orbax, False), (jax_probe, False), (clu_writer, True),
                      (project, True)):
    assert console.shown_on_console(record_from(path, logging.INFO)) == shown
  # A file of the project's own name elsewhere is not the project's, nor
  # is a package installed in a virtual environment inside the checkout.
  assert not console.shown_on_console(record_from(
      os.path.join(libraries, 'somelib', 'train.py'), logging.INFO))
  assert not console.shown_on_console(record_from(os.path.join(
      REPO, '.venv', 'lib', 'python3.11', 'site-packages', 'flax', 'core.py'),
      logging.INFO))
  assert console.shown_on_console(record_from(
      os.path.join(REPO, 'evaluators', 'classification.py'), logging.INFO))


def test_console_leaves_every_histogram_bin_and_the_config_to_tensorboard():
  clu_writer = os.path.join(os.path.dirname(os.path.dirname(
      logging.__file__)), 'clu', 'metric_writers', 'logging_writer.py')
  def shown(message):
    record = logging.LogRecord('absl', logging.INFO, clu_writer, 1, message,
                               None, None)
    return console.shown_on_console(record)
  assert not shown('[Hyperparameters]%s %s')
  assert not shown('[%d]%s Histogram for %r = {%s}')
  assert shown('[%d]%s %s')  # the metrics


@pytest.mark.xdist_group('quick_start')
def test_predict_and_export_print_only_their_results(quick_start, tmp_path):
  """No orbax INFO lines, backend probing, oneDNN notice or missing-metadata
  warning around what the two commands are for."""
  workdir = quick_start[0]
  # A PNG and a JPEG of another size: one line each, in the order given.
  image = str(tmp_path / 'digit.png')
  PIL.Image.fromarray(np.full((8, 8), 255, np.uint8)).save(image)
  photo = str(tmp_path / 'photo.jpg')
  PIL.Image.fromarray(np.random.default_rng(1).integers(
      0, 256, (30, 45, 3), np.uint8)).save(photo, quality=90)
  output = str(tmp_path / 'model.safetensors')
  env = processes.one_device_environment()
  for command, patterns in (
      (['predict.py', f'--workdir={workdir}', image, photo],
       [rf'{re.escape(path)}( \d:[\d.]+){{5}}' for path in (image, photo)]),
      (['export.py', f'--workdir={workdir}', f'--output={output}'],
       [rf'Wrote \d+ arrays \([\d,]+ numbers\) to {re.escape(output)}'])):
    result = subprocess.run([sys.executable, *command], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (result.stdout + result.stderr).splitlines()
    assert len(lines) == len(patterns) and all(
        re.fullmatch(pattern, line)
        for pattern, line in zip(patterns, lines)), lines
