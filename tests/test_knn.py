"""The k-NN evaluator (evaluators/knn.py): DINO's weighted vote of the 20
nearest training examples, against a k-NN written here in NumPy, in a run's
evaluators and in `--mode=eval` started as a user starts it."""

import os
import subprocess
import sys
import textwrap
import tracemalloc

from flax import nnx
import jax
import numpy as np
import pytest

from data import datasets
from evaluators import eval_splits
from evaluators import knn
import models
from training import run_state
from helpers import digits_run_context
from helpers import REPO
from helpers import read_scalars
from helpers import tiny_config
from helpers import write_checkpoint

K, TEMPERATURE = 20, 0.07


def reference_knn(train_x, train_y, test_x, test_y, num_classes, k=K,
                  temperature=TEMPERATURE):
  """(top-1, top-5) accuracy of DINO's weighted k-NN, written out: cosine
  similarities of L2-normalised features, the k most similar training
  examples (the earlier on ties), votes exp(sim / T) summed by class, the
  first min(5, k) classes."""
  def normalised(x):
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
  sims = normalised(test_x) @ normalised(train_x).T
  nearest = np.argsort(-sims, axis=1, kind='stable')[:, :k]
  votes = np.zeros((len(test_x), num_classes))
  np.add.at(votes, (np.arange(len(test_x))[:, None], train_y[nearest]),
            np.exp(np.take_along_axis(sims, nearest, axis=1) / temperature))
  ranked = np.argsort(-votes, axis=1, kind='stable')[:, :min(5, k)]
  return (np.mean(ranked[:, 0] == test_y),
          np.mean(np.any(ranked == test_y[:, None], axis=1)))


def digits_features(graphdef, params, model_state):
  """The model's features of the digits' training and test images,
  computed here in one go, each split one program on one device (the
  run's state is replicated over every device: a program of it would
  compute the whole split on each)."""
  features = jax.jit(lambda params, model_state, images: nnx.merge(
      graphdef, params, model_state).features(images, train=False))
  params, model_state = jax.device_get((params, model_state))
  digits = datasets.load_digits()
  return [np.asarray(features(params, model_state, images), np.float64)
          for images in (digits.train_images, digits.eval_images)]


def test_knn_is_dinos_weighted_vote_in_chunks_each_test_image_once():
  """Training features in 23 chunks of 64 rows (the last padded), the 360
  test images in batches of 48 (the last half padding), on 8 devices."""
  context, graphdef, state = digits_run_context(tiny_config())
  digits = datasets.load_digits()
  splits = eval_splits.train_and_test_splits(
      'knn', {'digits': 'digits'}, context)
  evaluator = knn.Evaluator(splits, K, TEMPERATURE, context.mesh, graphdef,
                            state, context.state_sharding, batch_size=48,
                            dtype=np.float32, chunk_rows=64)
  metrics = evaluator.run(state)
  train_x, test_x = digits_features(graphdef, state.params, state.model_state)
  top1, top5 = reference_knn(train_x, digits.train_labels, test_x,
                             digits.eval_labels, 10)
  assert sorted(metrics) == ['knn_digits_top1', 'knn_digits_top5']
  assert 0.2 < top1 < top5 < 1  # the features tell the digits apart, a bit
  assert metrics['knn_digits_top1'] == pytest.approx(top1, abs=1e-6)
  assert metrics['knn_digits_top5'] == pytest.approx(top5, abs=1e-6)


def test_the_host_holds_the_training_features_once():
  """Placing the training features on the mesh allocates one buffer of
  them on the host (NumPy's allocations, traced), not copies: at
  ImageNet's scale each copy is gigabytes. The bank holds the training
  examples' normalised features in their split's order."""
  context, graphdef, state = digits_run_context(tiny_config(width=128))
  splits = eval_splits.train_and_test_splits(
      'knn', {'digits': 'digits'}, context)
  evaluator = knn.Evaluator(splits, K, TEMPERATURE, context.mesh, graphdef,
                            state, context.state_sharding, batch_size=48,
                            dtype=np.float32, chunk_rows=64)
  train = splits['digits'][0]
  tracemalloc.start()
  bank = evaluator.bank(state, train)
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  features = np.asarray(bank['features']).reshape(
      -1, bank['features'].shape[-1])
  count = train.info.num_eval_examples
  train_x, _ = digits_features(graphdef, state.params, state.model_state)
  assert features.shape[1] >= 128
  np.testing.assert_allclose(
      features[:count],
      train_x / np.linalg.norm(train_x, axis=1, keepdims=True),
      rtol=0, atol=1e-6)
  assert not features[count:].any()
  assert peak < 1.5 * features.nbytes, (peak, features.nbytes)


USER_CONFIG = '''
import ml_collections

from configs import default


def get_config():
  config = default.get_config()
  config.num_layers = 2
  config.width = 8
  config.batch_size = 16
  config.evals.knn = ml_collections.ConfigDict(dict(
      type='knn', datasets={'digits': 'digits'}))
  return config
'''


def test_knn_in_eval_mode_as_a_user_runs_it(tmp_path):
  """`python main.py --config=MY_CONFIG.py --workdir=DIR --mode=eval` of a
  checkpoint at step 3: the k-NN tags at step 3 in DIR's event files and
  on the console, the NumPy k-NN of the checkpoint's features."""
  workdir = tmp_path / 'run'
  config = tiny_config()
  digits = datasets.load_digits()
  state = write_checkpoint(workdir, config, digits.info, step=3, noise=0.3)
  (tmp_path / 'my_config.py').write_text(textwrap.dedent(USER_CONFIG))
  result = subprocess.run(
      [sys.executable, 'main.py', f'--config={tmp_path / "my_config.py"}',
       f'--workdir={workdir}', '--mode=eval'],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert result.returncode == 0, result.stderr[-3000:]
  graphdef = run_state.create_train_state(
      config, digits.info, lambda step: 0.0,
      dtype=models.compute_dtype(config))[0]
  train_x, test_x = digits_features(graphdef, state.params, state.model_state)
  top1, top5 = reference_knn(train_x, digits.train_labels, test_x,
                             digits.eval_labels, 10)
  scalars = read_scalars(str(workdir))
  assert scalars['knn_digits_top1'][3] == pytest.approx(top1, abs=1e-6)
  assert scalars['knn_digits_top5'][3] == pytest.approx(top5, abs=1e-6)
  assert f'(step 3) knn: knn_digits_top1={top1:.6g}, knn_digits_top5=' in (
      result.stdout)
