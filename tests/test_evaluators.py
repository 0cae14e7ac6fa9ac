"""The evaluators of `config.evals`: classification over other data sets
(class maps, ReaL labels), few-shot linear probes (over several seeds),
their schedule and tags (their checks: test_evaluator_checks.py; k-NN:
test_knn.py). References: hand-counted label sets, numpy.linalg.solve of the
regularised normal equations, the main evaluation itself, and the model
applied here image by image."""

import contextlib
import json
import logging
import os
import shutil

from flax import nnx
import ml_collections
import numpy as np
import pytest

from data import datasets
from data import folder_listing
from evaluators import eval_splits
from evaluators import evaluator_checks
from evaluators import fewshot
from evaluators import real_labels
from evaluators import registry
import input_pipeline
import models
import train
from training import run_state
from helpers import digits_run_context
from helpers import read_scalars
from helpers import tiny_config
from image_data import write_class_folders

# Eleven classes: folders named 0..10 sort as 0, 1, 10, 2, ...
NUM_CLASSES = 11
WNIDS = tuple(f'n{i:02d}' for i in range(NUM_CLASSES))


def evaluator(**settings) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(settings)


# ------------------------------------------------------------------ ReaL


def test_real_counts_a_prediction_in_its_images_set_and_leaves_out_empty_sets():
  # real.json's five images: sets {1, 3}, {}, {2}, {0, 4}, {4}.
  table = real_labels.label_table([[1, 3], [], [2], [0, 4], [4]], 5)
  # Rows of two batches: image (row), top-5 predictions, mask.
  rows = np.array([0, 1, 2, 3, 4, 0])
  top5 = np.array([[3, 0, 1, 2, 4],   # image 0: top-1 3 in {1, 3}
                   [0, 1, 2, 3, 4],   # image 1: empty set, left out
                   [0, 1, 2, 3, 4],   # image 2: 2 in top-5 only
                   [1, 2, 3, 0, 4],   # image 3: 0 in top-5 only
                   [1, 2, 3, 0, 4],   # image 4: 4 is the fifth
                   [3, 0, 1, 2, 4]])  # padding (masked out)
  mask = np.array([True] * 5 + [False])
  assert real_labels.counts(top5, rows, mask, table) == {
      'correct': 1, 'correct_top5': 4, 'examples': 4}


def test_real_rows_follow_the_file_names_not_the_class_folders():
  files = ['v/b/ILSVRC2012_val_00000003.JPEG', 'v/a/ILSVRC2012_val_00000002.JPEG',
           'v/a/ILSVRC2012_val_00000004.JPEG', 'v/c/ILSVRC2012_val_00000001.JPEG']
  np.testing.assert_array_equal(real_labels.file_name_rows(files),
                                [2, 1, 3, 0])


# -------------------------------------------------------------- few-shot


@pytest.mark.parametrize('num_points, dim', [(40, 9), (9, 40)])
def test_fewshot_solve_is_the_regularised_least_squares_solution(num_points,
                                                                 dim):
  """Both branches of the eigendecomposition (N >= D and D > N) give the
  solution of (X^T X + l2 I) W = X^T Y."""
  rng = np.random.default_rng(num_points)
  x = rng.normal(size=(num_points, dim))
  y = rng.normal(size=(num_points, 4))
  l2 = 3.0
  expected = np.linalg.solve(x.T @ x + l2 * np.eye(dim), x.T @ y)
  np.testing.assert_allclose(fewshot.solve(x, y, l2), expected, rtol=1e-9,
                             atol=1e-11)


def test_fewshot_probe_scores_as_big_visions_and_draws_shots_per_class():
  """Overlapping classes, features of unequal scales: a probe that does
  not standardise, regularises otherwise or is no least-squares probe
  scores other than big_vision's."""
  rng = np.random.default_rng(0)
  centres = rng.normal(size=(6, 32)) * 0.5
  feature_scales = np.exp(rng.normal(size=32))
  train_y = np.repeat(np.arange(6), 30)
  test_y = np.repeat(np.arange(6), 50)
  train_x = (centres[train_y] + rng.normal(size=(len(train_y), 32))
             ) * feature_scales
  test_x = (centres[test_y] + rng.normal(size=(len(test_y), 32))
            ) * feature_scales
  chosen = fewshot.shot_indices(train_y, 6, 5, seed=0)
  assert np.array_equal(np.bincount(train_y[chosen]), [5] * 6)
  assert np.array_equal(chosen, fewshot.shot_indices(train_y, 6, 5, seed=0))
  for shots in (1, 5):
    chosen = fewshot.shot_indices(train_y, 6, shots, seed=0)
    accuracy = fewshot.probe_accuracy(train_x[chosen], train_y[chosen],
                                      test_x, test_y, 6, 2.0**10)
    assert 0 < accuracy < 1
    assert accuracy == reference_probe(train_x[chosen], train_y[chosen],
                                       test_x, test_y, 6, 2.0**10)


def test_fewshot_shots_beyond_a_class_take_all_of_its_examples():
  """Classes of 3, 30, 1 and 7 examples, 5 shots: the short classes give
  all they have, the others 5 of theirs, each class drawn from its own
  examples only."""
  labels = np.random.default_rng(1).permutation(np.repeat(np.arange(4),
                                                          [3, 30, 1, 7]))
  chosen = fewshot.shot_indices(labels, 4, 5, seed=3)
  assert len(set(chosen.tolist())) == len(chosen) == 3 + 5 + 1 + 5
  for c, count in enumerate([3, 30, 1, 7]):
    own = set(np.flatnonzero(labels == c).tolist())
    picked = set(chosen[labels[chosen] == c].tolist())
    assert picked == own if count <= 5 else (len(picked) == 5 and
                                             picked < own)


def test_fewshot_refuses_a_class_without_training_examples():
  with pytest.raises(ValueError) as error:
    evaluator_checks.training_class_counts('probe', 'pets',
                                           np.array([0, 2, 0, 2]), 4)
  assert str(error.value) == (
      'evals.probe: class 1 of pets has no training example (2 of its 4 '
      'classes have none); use a training split that holds every class')


def reference_probe(train_x, train_y, test_x, test_y, num_classes, l2):
  """big_vision's probe, written out: standardise, bias 100, solve the
  normal equations, argmax."""
  mean, std = train_x.mean(0), train_x.std(0) + 1e-5
  def prepare(x):
    return np.concatenate([(x - mean) / std, np.full((len(x), 1), 100.0)], 1)
  x = prepare(train_x)
  y = 2.0 * np.eye(num_classes)[train_y] - 1.0
  w = np.linalg.solve(x.T @ x + l2 * np.eye(x.shape[1]), x.T @ y)
  return np.mean(np.argmax(prepare(test_x) @ w, 1) == test_y)


# ------------------------------------------------ a run with evaluators


@pytest.fixture(scope='module')
def digits_run(tmp_path_factory):
  """A tiny run with a moving average, a copy of its validation set and a
  few-shot probe on the digits: (workdir, config, final state)."""
  workdir = str(tmp_path_factory.mktemp('digits_run'))
  config = tiny_config(ema_decay=0.5)
  config.evals.copy = evaluator(type='classification', dataset='digits')
  config.evals.probe = evaluator(type='fewshot', datasets={'digits': 'digits'},
                                 shots=(1, 10), every_steps=8)
  return workdir, config, train.train_and_evaluate(config, workdir)


@pytest.mark.xdist_group('evaluators_digits')
def test_a_copy_of_the_validation_set_gives_exactly_the_main_evaluation(
    digits_run):
  workdir, _, _ = digits_run
  scalars = read_scalars(workdir)
  for kind in ('eval_', 'eval_ema_'):
    for metric in ('accuracy', 'top5_accuracy', 'loss'):
      main = scalars[f'{kind}{metric}']
      assert sorted(main) == [4, 8]
      assert scalars[f'{kind}copy_{metric}'] == main, (kind, metric)
  assert scalars['eval_copy_examples'] == {4: 360.0, 8: 360.0}


@pytest.mark.xdist_group('evaluators_digits')
def test_fewshot_in_a_run_is_the_reference_probe_of_the_models_features(
    digits_run):
  """Its own schedule (every 8 steps: the last one only); the probe of the
  final weights' features, computed here, with and without EMA."""
  workdir, config, state = digits_run
  scalars = read_scalars(workdir)
  digits = datasets.load_digits()
  for ema, kind in ((False, 'fewshot_'), (True, 'fewshot_ema_')):
    weights = state.ema if ema else dict(params=state.params,
                                         model_state=state.model_state)
    model = nnx.merge(graphdef_of(config, digits.info), weights['params'],
                      weights['model_state'])
    train_x = np.asarray(model.features(digits.train_images), np.float64)
    test_x = np.asarray(model.features(digits.eval_images), np.float64)
    for shots in (1, 10):
      chosen = fewshot.shot_indices(digits.train_labels, 10, shots, 0)
      expected = reference_probe(train_x[chosen], digits.train_labels[chosen],
                                 test_x, digits.eval_labels, 10, 2.0**10)
      logged = scalars[f'{kind}digits_{shots}shot']
      assert sorted(logged) == [8]
      assert logged[8] == pytest.approx(expected, abs=1.01 / 360)
      assert scalars[f'{kind}mean_{shots}shot'] == logged


@pytest.mark.xdist_group('evaluators_digits')
def test_the_tags_the_collision_check_knows_are_the_tags_a_run_writes(
    digits_run):
  workdir, config, _ = digits_run
  written = {tag for tag in read_scalars(workdir)
             if tag.startswith(('eval_', 'fewshot_'))}
  known = set(evaluator_checks.metric_tags(
      'eval_', evaluator_checks.CLASSIFICATION_METRICS))
  for name, settings in config.evals.items():
    known |= {tag for tag, _ in evaluator_checks.evaluator_tags(
        name, evaluator_checks.evaluator_settings(name, settings))}
  assert written == known


def graphdef_of(config, info):
  """The graph definition of `config`'s model for data set `info`."""
  return run_state.create_train_state(
      config, info, lambda step: 0.0,
      dtype=models.compute_dtype(config))[0]


# ------------------------------------------------ folders: maps and ReaL


@pytest.fixture(scope='module')
def folder_run(tmp_path_factory):
  """Two steps on image folders of 11 WordNet-named classes, evaluated also
  on its validation images arranged by class index (ImageNet-v2's layout)
  and by class name (WordNet ids), and with ReaL label sets."""
  root = tmp_path_factory.mktemp('folders')
  write_class_folders(str(root / 'images' / 'train'), WNIDS, 2, seed=0)
  val = write_class_folders(str(root / 'images' / 'val'), WNIDS, 2, seed=1)
  for label, name in enumerate(WNIDS):
    for layout, folder in (('by_index', str(label)), ('by_name', name)):
      os.makedirs(root / layout / folder)
      for path in val[name]:
        shutil.copy(path, root / layout / folder)
  files = sorted(os.path.basename(p) for group in val.values() for p in group)
  rng = np.random.default_rng(2)
  sets = [sorted(set(rng.integers(0, NUM_CLASSES, rng.integers(0, 3)).tolist()))
          for _ in files]
  with open(root / 'real.json', 'w') as f:
    json.dump(sets, f)
  config = tiny_config(dataset=f'folder:{root / "images"}', image_size=8,
                       batch_size=8, num_train_steps=2, eval_every_steps=2,
                       checkpoint_every_steps=2)
  config.evals.v2 = evaluator(type='classification',
                              dataset=f'folder:{root / "by_index"}',
                              class_map='index')
  config.evals.names = evaluator(type='classification',
                                 dataset=f'folder:{root / "images"}',
                                 split='val', class_map='name')
  config.evals.real = evaluator(type='classification',
                                dataset=f'folder:{root / "by_name"}',
                                labels='real',
                                real_labels_file=str(root / 'real.json'))
  # train/ and val/ (no test/), 2 training images a class: 3 shots take
  # both.
  config.evals.probe = evaluator(type='fewshot', shots=(1, 3),
                                 datasets={'f': f'folder:{root / "images"}'})
  workdir = str(root / 'run')
  with absl_lines() as lines:
    state = train.train_and_evaluate(config, workdir)
  return (config, state, read_scalars(workdir), val, dict(zip(files, sets)),
          lines)


@contextlib.contextmanager
def absl_lines():
  """The messages absl logs at INFO and above meanwhile."""
  lines = []
  handler = logging.Handler(logging.INFO)
  handler.emit = lambda record: lines.append(record.getMessage())
  logger = logging.getLogger('absl')
  saved = logger.level
  logger.setLevel(logging.INFO)
  logger.addHandler(handler)
  try:
    yield lines
  finally:
    logger.removeHandler(handler)
    logger.setLevel(saved)


@pytest.mark.xdist_group('evaluators_folders')
def test_class_maps_by_index_and_by_name_give_the_main_accuracy(folder_run):
  _, _, scalars, _, _, _ = folder_run
  for name in ('v2', 'names'):
    for metric in ('accuracy', 'top5_accuracy', 'examples'):
      assert scalars[f'eval_{name}_{metric}'] == scalars[f'eval_{metric}']
    # The same images summed in another order (folders listed by index or
    # by name): the loss within float32 rounding.
    [(step, loss)] = scalars[f'eval_{name}_loss'].items()
    assert loss == pytest.approx(scalars['eval_loss'][step], rel=1e-6)


def test_class_maps_label_each_folder_as_its_training_class(tmp_path):
  write_class_folders(str(tmp_path / 'i'), [str(i) for i in range(11)], 1, 0)
  listing = folder_listing.list_split(str(tmp_path / 'i'))
  assert listing.classes[:3] == ['0', '1', '10']  # sorted as strings
  labels = eval_splits.model_labels(listing, 'index', WNIDS)
  assert [int(os.path.basename(os.path.dirname(f))) for f in listing.files
          ] == labels.tolist()
  write_class_folders(str(tmp_path / 'n'), ['n07', 'n03'], 1, 0)
  listing = folder_listing.list_split(str(tmp_path / 'n'))
  assert eval_splits.model_labels(listing, 'name', WNIDS).tolist() == [
      3, 7]


@pytest.mark.xdist_group('evaluators_folders')
def test_real_accuracy_counts_the_models_predictions_in_each_images_set(
    folder_run):
  """The model applied here to each image, counted as timm counts."""
  config, state, scalars, val, real, _ = folder_run
  model = folder_model(config, state)
  top1 = top5 = counted = 0
  for files in val.values():
    for path in files:
      labels = real[os.path.basename(path)]
      if not labels:
        continue
      logits = np.asarray(model(eval_image(config, path)[None],
                                train=False))[0]
      ranked = np.argsort(-logits)[:5]
      counted += 1
      top1 += ranked[0] in labels
      top5 += any(p in labels for p in ranked)
  assert counted < NUM_CLASSES * 2  # some sets are empty
  assert 0 < top1 < top5  # the counts tell top-1 and top-5 apart
  assert scalars['eval_real_examples'] == {2: float(counted)}
  assert scalars['eval_real_accuracy'][2] == pytest.approx(top1 / counted)
  assert scalars['eval_real_top5_accuracy'][2] == pytest.approx(
      top5 / counted)
  assert 'eval_real_loss' not in scalars


def folder_model(config, state):
  info = input_pipeline.DatasetInfo(NUM_CLASSES, (8, 8, 3), 22, 22)
  return nnx.merge(graphdef_of(config, info), state.params,
                   state.model_state)


def eval_image(config, path: str) -> np.ndarray:
  """The image file at `path` as the evaluations see it."""
  from data import image_preprocessing  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as f:
    return image_preprocessing.eval_image_file(
        f.read(), input_pipeline.Preprocessing.from_config(config), 3,
        np.float32)


@pytest.mark.xdist_group('evaluators_folders')
def test_fewshot_on_folders_tests_on_val_and_takes_a_short_class_whole(
    folder_run):
  """The probe of the model's features of every image, computed here:
  3 shots of 2-image classes are all training images (said in one log
  line), 1 shot is big_vision's draw; the test split is val/."""
  config, state, scalars, val, _, lines = folder_run
  model = folder_model(config, state)
  root = config.dataset[len('folder:'):]
  train_listing = folder_listing.list_split(os.path.join(root, 'train'))
  def features(files):
    return np.asarray(model.features(
        np.stack([eval_image(config, path) for path in files]), train=False),
        np.float64)
  train_x = features(train_listing.files)
  train_y = train_listing.labels
  test_files = [path for files in val.values() for path in files]
  test_x = features(test_files)
  test_y = np.repeat(np.arange(NUM_CLASSES), 2)
  for shots, chosen in ((3, np.arange(len(train_y))),
                        (1, fewshot.shot_indices(train_y, NUM_CLASSES, 1, 0))):
    expected = reference_probe(train_x[chosen], train_y[chosen], test_x,
                               test_y, NUM_CLASSES, 2.0**10)
    assert scalars[f'fewshot_f_{shots}shot'][2] == pytest.approx(
        expected, abs=1.01 / len(test_y))
  assert [line for line in lines if line.startswith('evals.probe:')] == [
      'evals.probe: 11 of the 11 classes of f have fewer than 3 training '
      'examples (the fewest 2); their 3-shot probes take all of them']


def test_fewshot_over_seeds_is_the_mean_of_single_seed_probes():
  """num_seeds=3 from seed 4: one tag per seed, each the probe of that
  seed alone, and the data set's tag their mean (fewshot_mean_* over one
  data set the same); the features are extracted once for all seeds."""
  context, _, state = digits_run_context(tiny_config())
  probe = dict(type='fewshot', datasets={'d': 'digits'}, shots=(1, 5))
  evals = {'seeds': dict(probe, seed=4, num_seeds=3),
           **{f'seed{seed}': dict(probe, seed=seed) for seed in (4, 5, 6)}}
  metrics = {name: scheduled.evaluator.run(state) for name, scheduled in
             registry.create_all(evals, context).items()}
  settings = evaluator_checks.evaluator_settings('seeds', evals['seeds'])
  assert set(metrics['seeds']) == {
      tag for tag, _ in evaluator_checks.evaluator_tags('seeds', settings)
      if not tag.startswith('fewshot_ema_')}
  for shots in (1, 5):
    single = [metrics[f'seed{seed}'][f'fewshot_d_{shots}shot']
              for seed in (4, 5, 6)]
    assert [metrics['seeds'][f'fewshot_d_{shots}shot_seed{seed}']
            for seed in (4, 5, 6)] == single
    if shots == 1:  # one image a class: each seed's draw scores its own
      assert len(set(single)) > 1
    assert metrics['seeds'][f'fewshot_d_{shots}shot'] == pytest.approx(
        np.mean(single), abs=1e-12)
    assert (metrics['seeds'][f'fewshot_mean_{shots}shot'] ==
            metrics['seeds'][f'fewshot_d_{shots}shot'])
