"""`export.py --format=serving` and `predict.py --model`: the exported
programs answer as predict.py does with the workdir (same top-5 classes,
probabilities within 1e-5), the SavedModel in a process that has only
TensorFlow, and every bad output, run or source is one line."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import PIL.Image
import pytest

from data import datasets
import export
import exported_runs
from exporting import serving
import input_pipeline
import predict
from processes import REPO
from processes import cpu_environment
from helpers import assert_refuses_a_file_that_is_not_an_image
from helpers import tiny_config
from helpers import write_checkpoint
from image_data import image_pixels
from image_data import save_image

# One worker exports the run once for every test of it.
pytestmark = pytest.mark.xdist_group('export_serving')

IMAGE_SIZE = 16
# A name with a space: predict prints it with an underscore, the
# SavedModel returns it as saved.
CLASSES = ('tabby cat', 'dog', 'fox', 'owl', 'yak', 'emu')
SIDE = serving.input_size(IMAGE_SIZE)  # model.jax_exported's images: 19 px
# Every format and size the SavedModel is checked on: (file, height, width,
# Pillow mode).
IMAGES = (('square.png', SIDE, SIDE, 'RGB'), ('photo.JPEG', 30, 45, 'RGB'),
          ('grey.png', 23, 17, 'L'), ('tall.bmp', 40, 20, 'RGB'),
          ('alpha.webp', 21, 33, 'RGBA'), ('small.gif', 12, 14, 'RGB'),
          ('square_grey.png', SIDE, SIDE, 'L'))


def run_command(script, *args, **options) -> subprocess.CompletedProcess:
  """A project command (export.py, predict.py) as a user runs it."""
  return subprocess.run([sys.executable, script, *args], cwd=REPO,
                        capture_output=True, text=True, env=cpu_environment(1),
                        timeout=600, check=False, **options)


@pytest.fixture(scope='module')
def served(tmp_path_factory):
  """(workdir, export directory, image paths) of a checkpoint of a small
  ResNet on ImageNet-style preprocessing (6 classes, 16 px, random
  weights), exported by export.py, and image files of many formats."""
  directory = tmp_path_factory.mktemp('served')
  workdir, output = str(directory / 'run'), str(directory / 'export')
  config = tiny_config(dataset='fake', image_size=IMAGE_SIZE, num_layers=1)
  info = input_pipeline.DatasetInfo(len(CLASSES),
                                    (IMAGE_SIZE, IMAGE_SIZE, 3), 8, 8,
                                    CLASSES)
  # Noisy weights: probabilities spread over the classes, none tied.
  write_checkpoint(workdir, config, info, noise=0.3)
  result = run_command('export.py', f'--workdir={workdir}',
                       f'--output={output}', '--format=serving')
  assert result.returncode == 0, result.stderr[-3000:]
  # Its one line, no conversion or TensorFlow notices around it.
  assert re.fullmatch(rf'Wrote \d+ arrays \([\d,]+ numbers\) to '
                      rf'{re.escape(output)}\n', result.stdout + result.stderr)
  rng = np.random.default_rng(0)
  paths = []
  for name, height, width, mode in IMAGES:
    paths.append(str(directory / name))
    save_image(paths[-1], image_pixels(rng, height, width), mode)
  return workdir, output, paths


def test_serving_export_holds_its_programs_labels_and_contract(served):
  _, output, _ = served
  assert sorted(os.listdir(output)) == sorted([
      serving.SAVED_MODEL, serving.JAX_EXPORTED, serving.LABELS,
      serving.CONTRACT])
  # Written beside it under a hidden name, renamed when complete.
  assert not [name for name in os.listdir(os.path.dirname(output))
              if name.startswith('.')]
  with open(os.path.join(output, serving.LABELS)) as f:
    assert json.load(f) == list(CLASSES)
  with open(os.path.join(output, serving.CONTRACT)) as f:
    contract = json.load(f)
  assert contract['top_k'] == 5 and contract['num_classes'] == 6
  assert contract['jax_exported']['input'] == f'uint8 [batch, {SIDE}, {SIDE}, 3]'
  assert contract['preprocessing']['image_size'] == IMAGE_SIZE


# Run by `python -I` outside the repository: this project is not on
# sys.path, and nothing but TensorFlow (and what it imports) is loaded.
ISOLATED_CLIENT = '''
import json, sys
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures['serving_default']
files = [open(path, 'rb').read() for path in sys.argv[2:]]
out = serve(images=tf.constant(files))
print(json.dumps({
    'classes': [[c.decode() for c in row] for row in out['classes'].numpy()],
    'indices': out['indices'].numpy().tolist(),
    'probabilities': out['probabilities'].numpy().tolist(),
    'files': [getattr(module, '__file__', None) or ''
              for module in list(sys.modules.values())],
    'path': sys.path}))
'''


def test_saved_model_answers_as_predict_in_a_process_without_the_project(
    served, tmp_path):
  workdir, output, paths = served
  names, expected = predict.classify_with_run(workdir, paths, batch_size=4)
  environment = {k: v for k, v in cpu_environment(1).items()
                 if k != 'PYTHONPATH'}
  result = subprocess.run(
      [sys.executable, '-I', '-c', ISOLATED_CLIENT,
       os.path.join(output, serving.SAVED_MODEL), *paths], cwd=tmp_path,
      capture_output=True, text=True, env=environment, timeout=300,
      check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  answer = json.loads(result.stdout.splitlines()[-1])
  assert REPO not in answer['path'] and '' not in answer['path']
  assert not [file for file in answer['files']
              if os.path.abspath(file).startswith(REPO + os.sep)]
  for (indices, probabilities), classes, served_indices, served_p in zip(
      expected, answer['classes'], answer['indices'],
      answer['probabilities']):
    assert served_indices == indices.tolist()
    assert classes == [names[i] for i in indices]
    np.testing.assert_allclose(served_p, probabilities, rtol=0, atol=1e-5)


def test_jax_exported_answers_as_predict_on_images_of_its_input_size(
    served):
  """Pixels decoded by Pillow (lossless PNGs of side S), any batch size."""
  workdir, output, paths = served
  square = [path for path in paths if 'square' in path]
  _, expected = predict.classify_with_run(workdir, square, batch_size=4)
  with open(os.path.join(output, serving.JAX_EXPORTED), 'rb') as f:
    exported = jax.export.deserialize(f.read())
  assert exported.platforms == ('cpu', 'cuda', 'tpu')
  pixels = np.stack([np.asarray(PIL.Image.open(path).convert('RGB'))
                     for path in square])
  for batch in (pixels, pixels[1:]):
    indices, probabilities = map(np.asarray, exported.call(batch))
    for i, (want_indices, want_p) in enumerate(expected[-len(batch):]):
      assert indices[i].tolist() == want_indices.tolist()
      np.testing.assert_allclose(probabilities[i], want_p, rtol=0, atol=1e-5)


def test_predict_with_model_prints_the_lines_of_predict_with_workdir(served):
  workdir, output, paths = served
  result = run_command('predict.py', f'--model={output}', '--batch_size=3',
                       *paths)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == predict.predict(workdir, paths)
  assert result.stderr == ''
  assert 'tabby_cat:' in result.stdout


def test_predict_names_the_fix_for_a_wrong_source(served, tmp_path):
  workdir, output, paths = served
  for kwargs, message in (
      (dict(workdir=workdir, model=output), 'not both'),
      (dict(workdir=None), 'one of them'),
      (dict(workdir=None, model=workdir), (
          r"--model='.*' is not a serving export \(no serving.json\); write "
          'one with export.py --format=serving')),
      (dict(workdir=None, model=output, ema=True), '--ema reads a workdir')):
    with pytest.raises(ValueError, match=message):
      predict.predict(paths=paths[:1], **kwargs)
  assert_refuses_a_file_that_is_not_an_image(
      tmp_path, lambda bad: predict.predict(None, [paths[0], bad],
                                            model=output))
  with pytest.raises(ValueError, match='not found'):
    predict.predict(None, [str(tmp_path / 'absent.png')], model=output)


def test_predict_with_model_names_a_bad_image_or_program_in_one_line(
    served, tmp_path, monkeypatch):
  """predict.py --model's errors are its one line (TensorFlow's runtime
  logs none of its own): a file that is not an image, and an export whose
  program TensorFlow's XlaCallModule cannot deserialize (here
  `lax.top_k`'s StableHLO composite, newer than it reads), named as such,
  not blamed on the image."""
  workdir, exported, paths = served
  notes = tmp_path / 'notes.txt'
  notes.write_text('not pixels')
  result = run_command('predict.py', f'--model={exported}', paths[0],
                       str(notes))
  assert result.returncode == 1
  assert re.fullmatch(
      rf"Error: image '{re.escape(str(notes))}': not an image TensorFlow "
      r'decodes \(JPEG, PNG, BMP, GIF, WebP\): Unknown image file format[^\n]*'
      r'\n', result.stderr), result.stderr[-3000:]

  def top_k_classes(graphdef, state, images, top_k):
    probabilities = jax.nn.softmax(
        serving.run_state.eval_logits(graphdef, state, images))
    values, indices = jax.lax.top_k(probabilities, top_k)
    return indices.astype(np.int32), values
  monkeypatch.setattr(serving, 'top_classes', top_k_classes)
  output = str(tmp_path / 'export')
  export.export(workdir, output, file_format='serving')
  result = run_command('predict.py', f'--model={output}', paths[1])
  assert result.returncode == 1
  assert re.fullmatch(
      rf"Error: --model='{re.escape(output)}' fails in TensorFlow [\d.]+ "
      rf"on '{re.escape(paths[1])}', an image it decodes: .*failed to "
      r'deserialize .*; a jax newer than this TensorFlow reads exported it: '
      r'serve it with a newer TensorFlow, or export it with an older jax\n',
      result.stderr), result.stderr[-3000:]


def test_serving_export_refuses_bad_outputs_and_runs_writing_nothing(
    served, tmp_path):
  workdir = served[0]
  taken = tmp_path / 'taken'
  taken.mkdir()
  for output, overwrite, message in (
      (str(taken), False,
       'exists; pass --overwrite to replace it, or name a new directory$'),
      (str(taken), True, (r'exists and is not a serving export \(no '
                          'serving.json\); --overwrite replaces only an '
                          'export: name a new directory$')),
      (str(tmp_path / 'absent' / 'export'), False, 'does not exist; create it'),
      (str(tmp_path / 'model.safetensors'), False, 'writes a directory'),
      ('gs://bucket/export', False, 'writes a local directory')):
    with pytest.raises(ValueError, match=f"^--output='{output}': .*{message}"):
      export.export(workdir, output, file_format='serving',
                    overwrite=overwrite)
  digits = str(tmp_path / 'digits_run')
  write_checkpoint(digits, tiny_config(num_layers=1),
                   datasets.load_digits().info)
  with pytest.raises(ValueError, match=(
      r"^--format=serving: the digits' evaluation preprocessing .* runs in "
      'Pillow, not in TensorFlow; export it with --format=project')):
    export.export(digits, str(tmp_path / 'digits_export'),
                  file_format='serving')
  # A resize that changes even an image of the model's size: the crop
  # model.jax_exported takes would need it.
  assert 'gaussian' in serving.problem(tiny_config(
      dataset='fake', eval_resize_method='gaussian'))
  assert serving.problem(tiny_config(dataset='fake',
                                     eval_resize_method='lanczos3')) is None
  assert sorted(os.listdir(tmp_path)) == ['digits_run', 'taken']
  assert os.listdir(taken) == []


def test_overwrite_replaces_a_serving_export_whole(served, tmp_path):
  workdir, output, paths = served
  replaced = tmp_path / 'export'
  shutil.copytree(output, replaced)
  (replaced / 'stale.txt').write_text('from an earlier export')
  export.export(workdir, str(replaced), file_format='serving',
                overwrite=True)
  assert sorted(os.listdir(replaced)) == sorted(os.listdir(output))
  assert os.listdir(tmp_path) == ['export']
  assert (predict.predict(None, paths[:2], model=str(replaced)) ==
          predict.predict(None, paths[:2], model=output))


# Each family at a small size, as the other export formats check them; the
# ResNet a ResNet-50, as timm's and ONNX's files are checked on one.
FAMILY_RUNS = {**exported_runs.RUNS,
               'resnet': dict(model='ResNet50', image_size=32)}


@pytest.mark.parametrize('family', list(FAMILY_RUNS))
def test_every_familys_serving_programs_answer_as_predict(family, tmp_path):
  """Each family's export (random weights and statistics): its SavedModel
  answers as predict.py on image files of other sizes; its jax.export
  program takes pixels of its input size. Both serialize the same model
  function (jax2tf's native serialization is jax.export), so the family's
  model runs here through TensorFlow; the jax.export program itself, whose
  compile bakes every weight in as a constant (seconds per full-size
  family), answers as predict.py in the small run's tests above."""
  config = exported_runs.run_config(**FAMILY_RUNS[family])
  workdir, output = str(tmp_path / 'run'), str(tmp_path / 'export')
  exported_runs.write_run(workdir, config)
  absl_level = logging.getLogger('absl').level
  export.export(workdir, output, file_format='serving')
  # The process logs on as before (TensorFlow's save resets absl's level).
  assert logging.getLogger('absl').level == absl_level
  side = serving.input_size(config.image_size)
  rng = np.random.default_rng(0)
  paths = []
  for name, height, width in (('a.png', side, side), ('b.JPEG', 45, 60),
                              ('c.png', side, side)):
    paths.append(str(tmp_path / name))
    save_image(paths[-1], image_pixels(rng, height, width), 'RGB')
  names, expected = predict.classify_with_run(workdir, paths, batch_size=3)
  assert names == list(exported_runs.CLASSES)
  classify, _ = serving.load(output)
  for (indices, probabilities), (want_indices, want_p) in zip(
      zip(*classify(paths)), expected):
    assert indices.tolist() == want_indices.tolist()
    np.testing.assert_allclose(probabilities, want_p, rtol=0, atol=1e-5)
  with open(os.path.join(output, serving.JAX_EXPORTED), 'rb') as f:
    program = jax.export.deserialize(f.read())
  [pixels] = program.in_avals
  assert (str(pixels.shape), pixels.dtype) == (
      f'(batch, {side}, {side}, 3)', np.uint8)
  assert [(str(out.shape), out.dtype) for out in program.out_avals] == [
      ('(batch, 5)', np.int32), ('(batch, 5)', np.float32)]
