"""predict.py on a trained workdir: the eval pipeline's top 5 for the same
images, JPEG and PNG files of any size, a file that is not an image, a
folder of images."""

import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from configs import imagenet
from data import datasets
import predict
import input_pipeline
from training import run_state
import train
from helpers import assert_refuses_a_file_that_is_not_an_image
from image_data import prepare_tiny_images
from processes import REPO
from processes import cpu_environment


@pytest.fixture(scope='module')
def tfds_run(tmp_path_factory):
  """(workdir, config, png directory) of a two-step run on a TFDS data set
  of PNG files of many sizes (labels 0-18, each image its own class). Its
  tests share one xdist group, so that one worker trains it."""
  data_dir, source = prepare_tiny_images(tmp_path_factory)
  config = imagenet.get_config()
  config.update(dataset='tiny_images', data_dir=data_dir, image_size=16,
                eval_split='', model='SmallResNet', num_layers=1, width=8,
                scan_unroll=8, half_precision=False, batch_size=8,
                num_train_steps=2, log_every_steps=1, eval_every_steps=2,
                checkpoint_every_steps=2)
  workdir = str(tmp_path_factory.mktemp('tfds_run'))
  train.train_and_evaluate(config, workdir)
  return workdir, config, source


def parse_line(line):
  path, *top = line.split(' ')
  return path, [(n, float(p)) for n, p in (t.rsplit(':', 1) for t in top)]


@pytest.mark.xdist_group('tfds_run')
def test_predict_gives_the_eval_pipelines_top5(tfds_run, tmp_path):
  """The test split's PNGs through predict, against the model applied to
  the eval pipeline's own batches of the same images."""
  workdir, config, source = tfds_run
  paths = [str(source / 'test' / f'{i}.png') for i in range(7)]
  lines = predict.predict(workdir, paths, batch_size=4)
  model = run_state.load_trained(workdir, default.get_config())[1].model()
  dataset = datasets.create_dataset(
      input_pipeline.DataSource.from_config(config))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
  batch_sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec('data'))
  expected, pipeline_images = {}, {}
  for batch in dataset.eval_batches(8, batch_sharding, jnp.float32):
    probabilities = np.asarray(jax.nn.softmax(model(batch['image'],
                                                    train=False)))
    for label, mask, image, p in zip(
        np.asarray(batch['label']), np.asarray(batch['mask']),
        np.asarray(batch['image']), probabilities):
      if mask:
        expected[int(label)], pipeline_images[int(label)] = p, image
  for i, path in enumerate(paths):  # the same pixels, bit for bit
    np.testing.assert_array_equal(
        datasets.eval_image_file(input_pipeline.DataSource.from_config(config),
                                 path, 3, np.float32),
        pipeline_images[i])
  assert len(lines) == 7
  for i, line in enumerate(lines):
    path, top = parse_line(line)
    assert path == paths[i]
    p = expected[i]  # test image i has label i
    assert [name for name, _ in top] == [
        str(k) for k in np.argsort(-p, kind='stable')[:5]]
    np.testing.assert_allclose([q for _, q in top],
                               np.sort(p)[::-1][:5], atol=6e-5)


@pytest.mark.xdist_group('tfds_run')
def test_predict_reads_jpeg_and_png_of_any_size(tfds_run, tmp_path):
  """In process: the command's printing of these lines is
  tests/test_console.py's."""
  import PIL.Image
  workdir, _, source = tfds_run
  jpeg = str(tmp_path / 'photo.jpg')
  PIL.Image.fromarray(np.random.default_rng(1).integers(
      0, 256, (300, 451, 3), np.uint8)).save(jpeg, quality=90)
  png = str(source / 'train' / '3.png')
  lines = predict.predict(workdir, [jpeg, png])
  assert [parse_line(line)[0] for line in lines] == [jpeg, png]
  for line in lines:
    top = parse_line(line)[1]
    probabilities = [p for _, p in top]
    assert len(top) == 5 and probabilities == sorted(probabilities,
                                                     reverse=True)
    assert {name for name, _ in top} <= {str(k) for k in range(19)}
    assert 0 < sum(probabilities) <= 1.0001
  # Each image is predicted on its own: in a batch with others or alone.
  assert lines[1] == predict.predict(workdir, [png])[0]
  assert_refuses_a_file_that_is_not_an_image(
      tmp_path, lambda bad: predict.predict(workdir, [png, bad]))


def predict_command(*args) -> subprocess.CompletedProcess:
  """predict.py as a user runs it."""
  return subprocess.run([sys.executable, 'predict.py', *args], cwd=REPO,
                        capture_output=True, text=True,
                        env=cpu_environment(1), timeout=600, check=False)


@pytest.mark.xdist_group('tfds_run')
def test_predict_takes_the_images_in_a_folder_and_its_subfolders(tfds_run,
                                                                 tmp_path):
  """A folder as a user names it: one line per image file below it, in
  sorted order, other files passed over; a folder without images is one
  line naming what to pass."""
  workdir, _, source = tfds_run
  photos = tmp_path / 'photos'
  (photos / 'holiday').mkdir(parents=True)
  files = [photos / 'b.png', photos / 'holiday' / 'a.PNG',
           photos / 'holiday' / 'c.png']
  for i, file in enumerate(files):
    shutil.copy(source / 'test' / f'{i}.png', file)
  (photos / 'notes.txt').write_text('not an image')
  result = predict_command(f'--workdir={workdir}', str(photos))
  assert result.returncode == 0, result.stderr[-3000:]
  expected = sorted(str(file) for file in files)
  assert result.stdout.splitlines() == predict.predict(workdir, expected)
  assert [parse_line(line)[0] for line in result.stdout.splitlines()] == (
      expected)
  empty = tmp_path / 'empty'
  (empty / 'more').mkdir(parents=True)
  (empty / 'more' / 'notes.txt').write_text('not an image')
  result = predict_command(f'--workdir={workdir}', str(files[0]), str(empty))
  assert (result.returncode, result.stdout) == (1, '')
  assert result.stderr == (
      f"Error: folder '{empty}' holds no images (.jpg, .jpeg, .png, .bmp, "
      '.gif, .webp), in it or its subfolders (1 other file); pass image '
      'files or a folder of them\n')
