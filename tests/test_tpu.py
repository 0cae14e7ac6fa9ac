"""Every command as users run it, on a TPU: `python3 -m pytest -m tpu` on a
TPU machine (one pytest process, no sockets; the CPU suite leaves these
out, and without a TPU they skip).

Each command is its own process, one at a time, as one program at a time
holds the chip; this process never opens it. `CHIP_TESTS_BACKEND=cpu`
runs them on the CPU instead (slowly), to check the tests themselves on a
machine without a TPU.
"""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import PIL.Image
import pytest

from helpers import REPO
from helpers import read_scalars

pytestmark = [pytest.mark.tpu, pytest.mark.xdist_group('tpu')]

# Overrides that shrink the ImageNet configs to a few steps of fake data
# that fit one chip; the model and its stack stay as shipped.
SHRUNK = ('--config.dataset=fake', '--config.batch_size=32',
          '--config.num_train_steps=3', '--config.log_every_steps=1',
          '--config.eval_every_steps=3', '--config.steps_per_eval=1',
          '--config.checkpoint_every_steps=3')
IMAGENET_CONFIGS = ('imagenet.py', 'imagenet_vit.py', 'deit_s16.py',
                    'convnext_t.py', 'swin_t.py', 'fake_data_benchmark.py')


def chip_environment() -> dict:
  """A user's shell: JAX picks the machine's accelerator (the suite's CPU
  settings removed), or the CPU where CHIP_TESTS_BACKEND=cpu says so."""
  env = {key: value for key, value in os.environ.items()
         if key not in ('JAX_PLATFORMS', 'XLA_FLAGS')}
  if os.environ.get('CHIP_TESTS_BACKEND') == 'cpu':
    env['JAX_PLATFORMS'] = 'cpu'
  return env


def command(*args, timeout=900, check=True) -> subprocess.CompletedProcess:
  """`python3 ARGS...` in the repository, as its own process on the chip."""
  result = subprocess.run([sys.executable, *args], cwd=REPO,
                          env=chip_environment(), capture_output=True,
                          text=True, timeout=timeout)
  if check:
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
  return result


def train(workdir, config='default.py', *overrides) -> str:
  """The console of `main.py --config=configs/CONFIG` in `workdir`."""
  result = command('main.py', f'--config=configs/{config}',
                   f'--workdir={workdir}', *overrides)
  console = result.stdout + result.stderr
  assert 'Traceback' not in console, console[-4000:]
  return console


@pytest.fixture(scope='module')
def backend():
  """The backend the commands get: 'tpu', or the module skips."""
  probe = command('-c', 'import jax; print(jax.default_backend())')
  name = probe.stdout.strip().splitlines()[-1]
  if name != 'tpu' and os.environ.get('CHIP_TESTS_BACKEND') != 'cpu':
    pytest.skip(f'no TPU on this machine (JAX runs on {name})')
  return name


@pytest.fixture(scope='module')
def quick_start(backend, tmp_path_factory):
  """The README's quick start trained on the chip: (workdir, console)."""
  workdir = tmp_path_factory.mktemp('quick_start')
  return workdir, train(workdir)


def test_quick_start_trains_to_its_accuracy_and_shows_throughput(
    backend, quick_start):
  workdir, console = quick_start
  assert max(read_scalars(str(workdir))['eval_accuracy'].values()) >= 0.97
  steps = re.findall(r'\[\d+\] train_loss=.*images/s, .* TFLOP/s/device'
                     r'(, MFU [\d.]+%)?, .* left', console)
  assert steps, console[-4000:]
  if backend == 'tpu':  # the peak of every TPU is known
    assert all(mfu for mfu in steps), console[-4000:]
  assert 'Started in ' in console


def stopped_at_its_first_logged_step(arguments) -> str:
  """The console (stderr) of `python3 ARGUMENTS...` sent SIGTERM once it
  logs a step; it must exit 0."""
  process = subprocess.Popen([sys.executable, *arguments], cwd=REPO,
                             env=chip_environment(), stderr=subprocess.PIPE,
                             text=True)
  console = []
  for line in process.stderr:
    console.append(line)
    if re.search(r'\[\d+\] train_loss=', line):
      process.send_signal(signal.SIGTERM)
      break
  console.append(process.stderr.read())
  assert process.wait(timeout=300) == 0, ''.join(console)[-4000:]
  return ''.join(console)


def test_sigterm_saves_and_the_same_command_resumes(backend, tmp_path):
  # Long enough that a fast chip is still training when the signal lands.
  arguments = ('main.py', '--config=configs/default.py',
               f'--workdir={tmp_path}', '--config.num_train_steps=1000000',
               '--config.log_every_steps=10')
  stopped_at_its_first_logged_step(arguments)
  saved = max(int(name) for name in os.listdir(tmp_path / 'checkpoints')
              if name.isdigit())
  assert saved >= 10
  console = stopped_at_its_first_logged_step(arguments)
  assert f'Starting at step {saved} of 1000000' in console, console[-4000:]


def test_eval_mode_and_predict_on_the_quick_start(quick_start, tmp_path):
  workdir = quick_start[0]
  evaluated = command('main.py', '--config=configs/default.py',
                      f'--workdir={workdir}', '--mode=eval')
  assert 'eval_accuracy=' in evaluated.stdout + evaluated.stderr
  image = str(tmp_path / 'digit.png')
  PIL.Image.fromarray(np.full((8, 8), 255, np.uint8)).save(image)
  predicted = command('predict.py', f'--workdir={workdir}', image)
  assert re.fullmatch(rf'{re.escape(image)}( \d:[\d.]+){{5}}',
                      predicted.stdout.strip()), predicted.stdout


@pytest.fixture(scope='module')
def vit_run(backend, tmp_path_factory):
  """configs/deit_s16.py shrunk: a ViT-S/16 that timm's format takes."""
  workdir = tmp_path_factory.mktemp('deit_s16')
  train(workdir, 'deit_s16.py', *SHRUNK)
  return workdir


@pytest.mark.parametrize('file_format', ['project', 'timm', 'onnx',
                                         'serving'])
def test_export_every_format(vit_run, tmp_path, file_format):
  if file_format == 'onnx':
    pytest.importorskip('jax2onnx')
  output = tmp_path / {'project': 'model.safetensors',
                       'timm': 'model.safetensors', 'onnx': 'model.onnx',
                       'serving': 'serving'}[file_format]
  command('export.py', f'--workdir={vit_run}', f'--output={output}',
          f'--format={file_format}')
  assert output.exists()


@pytest.mark.parametrize('config', IMAGENET_CONFIGS)
def test_every_imagenet_config_shrunk_trains_evaluates_and_saves(
    backend, tmp_path, config):
  console = train(tmp_path, config, *SHRUNK)
  assert os.path.isdir(tmp_path / 'checkpoints' / '3'), console[-4000:]
  assert 'eval_accuracy' in read_scalars(str(tmp_path))


def test_image_folders_train(backend, tmp_path):
  # Imported here: the module also defines a TFDS data set, which no other
  # test of the chip needs (nor TFDS in this process).
  import image_data  # pylint: disable=g-import-not-at-top
  root = tmp_path / 'folders'
  image_data.write_folders(root)
  train(tmp_path / 'run', 'default.py', f'--config.dataset=folder:{root}',
        '--config.image_size=32', '--config.batch_size=8',
        '--config.num_train_steps=4',
        '--config.eval_every_steps=4', '--config.log_every_steps=2')
  assert os.path.isdir(tmp_path / 'run' / 'checkpoints' / '4')


def test_knn_fewshot_and_intermediate_gradients(backend, tmp_path):
  train(tmp_path, 'default.py:knn,fewshot', '--config.num_train_steps=4',
        '--config.eval_every_steps=4', '--config.log_every_steps=2',
        '--config.intermediate_grads_every_steps=2')
  tags = set(read_scalars(str(tmp_path)))
  assert {'knn_data_top1', 'knn_data_top5'} <= tags, sorted(tags)
  assert any(tag.startswith('fewshot_data_') for tag in tags), sorted(tags)
  assert any(tag.startswith('intermediate_grads/') for tag in tags), (
      sorted(tags))


def test_compile_mode_runs_on_the_chip_machine(backend):
  result = command('main.py', '--config=configs/default.py', '--mode=compile',
                   '--topology=v5e:2x2')
  assert 'fits' in result.stdout + result.stderr


# Scanned and unrolled stacks of the same parameters, on the chip, in float32
# at full matrix precision (a TPU's default multiplies float32 in bfloat16
# passes): the loss and every gradient of a ResNet and a ViT agree.
_AGREEMENT = '''
import json, sys
sys.path.insert(0, 'tests'); sys.path.insert(0, '.')
import jax
jax.config.update('jax_default_matmul_precision', 'highest')
import helpers
worst = {}
for name, overrides, shape in (
    ('resnet', {}, (4, 8, 8, 1)),
    ('vit', dict(helpers.VIT, scan_unroll=1), (4, 32, 32, 1))):
  x = jax.random.normal(jax.random.key(0), shape)
  runs = [helpers.squared_logits_and_grads(
      helpers.tiny_config(scan_layers=scan, **overrides), x)
      for scan in (True, False)]
  (loss_a, grads_a, _), (loss_b, grads_b, _) = runs
  worst[name] = {
      'loss': abs(float(loss_a) - float(loss_b)) / abs(float(loss_b)),
      'grads': helpers.max_difference(grads_a, grads_b)}
print(json.dumps({'backend': jax.default_backend(), 'worst': worst}))
'''


def test_scanned_and_unrolled_stacks_agree_on_the_chip(backend):
  result = command('-c', _AGREEMENT)
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report['backend'] == backend
  for name, worst in report['worst'].items():
    assert worst['loss'] < 1e-4, (name, worst)
    assert worst['grads'] < 1e-3, (name, worst)
