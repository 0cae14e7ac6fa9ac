"""Weighted k-nearest-neighbour classification on frozen features (DINO,
Caron et al. 2021, `eval_knn.py`; DINOv2's `dinov2/eval/knn.py`).

For each data set: the model's pooled pre-logit features of its training
split (`features`, where the few-shot probes take them), extracted over the
mesh, L2-normalised and laid out on the mesh in chunks of rows, each
chunk's rows split over every device. Then one compiled step per test
batch: the batch's features L2-normalised; their cosine similarities to
the training examples, chunk by chunk, a running top-k merged with each
chunk's; the k most similar training examples (DINO: 20) each voting for
its class with weight exp(similarity / temperature) (DINO: 0.07; DINOv2's
softmax over the k divides an example's votes by one positive number and
ranks the classes alike); the classes ranked by their summed votes. Top-1
and top-5 accuracy (top-min(5, k), as DINO counts) over the test split,
each example once: the padding of the last batch is masked out.

Memory: the training features (N, D) in float32 on the mesh, split over
the devices; on each host, while they are placed there, one buffer of
them (each batch's rows written to their place as they come); a step
holds (batch, chunk) similarities, the chunks at most TRAIN_CHUNK_ROWS
rows (a fixed bound).

Tags: knn_<dataset>_top1, knn_<dataset>_top5 (knn_ema_* of a moving
average).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from evaluators import base
from evaluators import common
from evaluators import eval_splits
from runtime import sharding

# Training examples per chunk: a step's similarities are (batch, chunk)
# float32s, 64 MiB for a global batch of 1,024.
TRAIN_CHUNK_ROWS = 16_384
# torch.nn.functional.normalize's bound on the norm, as DINO normalises.
NORM_EPSILON = 1e-12


def l2_normalised(x):
  """Each row of `x` over its L2 norm (at least NORM_EPSILON)."""
  norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
  return x / jnp.maximum(norm, NORM_EPSILON)


def normalised_features(features_fn):
  """`features_fn(state, images)` in float32, each row L2-normalised."""
  return lambda state, images: l2_normalised(
      features_fn(state, images).astype(jnp.float32))


def nearest(query, features, labels, k: int):
  """The `k` largest similarities of each row of `query` to the training
  `features` (chunks, rows, D), and those examples' `labels` (chunks,
  rows; -1 marks padding, never chosen): a running top-k over the chunks.
  Ties go to the earlier training example."""
  batch = query.shape[0]

  def merge(best, chunk):
    chunk_features, chunk_labels = chunk
    sims = jnp.matmul(query, chunk_features.T,
                      precision=jax.lax.Precision.HIGHEST)
    sims = jnp.where(chunk_labels >= 0, sims, -jnp.inf)
    sims = jnp.concatenate([best[0], sims], axis=1)
    candidates = jnp.concatenate(
        [best[1], jnp.broadcast_to(chunk_labels, sims.shape[:1] +
                                   chunk_labels.shape)], axis=1)
    top, where = jax.lax.top_k(sims, k)
    return (top, jnp.take_along_axis(candidates, where, axis=1)), None

  start = (jnp.full((batch, k), -jnp.inf, jnp.float32),
           jnp.full((batch, k), -1, jnp.int32))
  found, _ = jax.lax.scan(merge, start, (features, labels))
  return found


def class_votes(sims, labels, temperature: float, num_classes: int):
  """(batch, classes): the sum over the neighbours of each class of
  exp(similarity / temperature) (DINO's weights)."""
  weights = jnp.exp(sims / temperature)  # padding: exp(-inf) = 0
  return jnp.einsum('bk,bkc->bc', weights,
                    jax.nn.one_hot(labels, num_classes, dtype=jnp.float32))


def vote_step(state_and_bank, batch, *, features_fn, k: int,
              temperature: float, num_classes: int):
  """Sums of top-1 and top-5 correct k-NN predictions over the unmasked
  examples of `batch`, against the training features and labels of
  `bank` (`Evaluator.bank`)."""
  state, bank = state_and_bank
  query = normalised_features(features_fn)(state, batch['image'])
  sims, labels = nearest(query, bank['features'], bank['labels'], k)
  votes = class_votes(sims, labels, temperature, num_classes)
  _, ranked = jax.lax.top_k(votes, min(5, k, num_classes))
  mask = batch['mask'].astype(jnp.float32)
  truth = batch['label'][:, None]
  return {'top1': jnp.sum((ranked[:, 0] == truth[:, 0]) * mask),
          'top5': jnp.sum(jnp.any(ranked == truth, axis=-1) * mask),
          'examples': jnp.sum(mask)}


class Evaluator(base.Evaluator):
  """k-NN accuracies of a train state on `splits` ({name: (training
  split, test split, classes)}); the training features in chunks of at
  most `chunk_rows` rows."""

  KIND = 'knn'

  def __init__(self, splits: dict, k: int, temperature: float, mesh,
               graphdef, state, state_sharding, *, batch_size: int, dtype,
               chunk_rows: int = TRAIN_CHUNK_ROWS):
    super().__init__(mesh, batch_size=batch_size, dtype=dtype)
    self._splits, self._k, self._temperature = splits, k, temperature
    self._state_sharding, self._chunk_rows = state_sharding, chunk_rows
    self._features_fn = common.apply_fn(graphdef, 'features')
    self._features_step = self.compile(
        functools.partial(common.features_step,
                          features_fn=normalised_features(self._features_fn)),
        state, state_sharding, next(iter(splits.values()))[0])
    # Compiled at the first run, when the training features' shapes are
    # known.
    self._vote_steps = {}

  def bank(self, state, train) -> dict:
    """The training split's features, L2-normalised by the features step,
    and their labels, padded to whole chunks (label -1) and placed on the
    mesh: {'features': (chunks, rows, D), 'labels': (chunks, rows)}, rows
    split over the devices. Each batch's rows go straight to their place
    (by the examples' positions) in the one host buffer that is placed on
    the mesh: the host holds the features once."""
    count = train.info.num_eval_examples
    devices = self._mesh.devices.size
    rows = -(-min(self._chunk_rows, count) // devices) * devices
    chunks = -(-count // rows)
    features, labels = None, np.full(chunks * rows, -1, np.int32)
    for outputs in common.step_outputs(self._features_step, state,
                                       self.batches(train)):
      outputs = jax.device_get(outputs)
      mask = outputs['mask'].astype(bool)
      if features is None:
        features = np.zeros((chunks * rows, outputs['features'].shape[1]),
                            np.float32)
      features[outputs['index'][mask]] = outputs['features'][mask]
      labels[outputs['index'][mask]] = outputs['label'][mask]
    arrays = {'features': features.reshape(chunks, rows, -1),
              'labels': labels.reshape(chunks, rows)}
    return {key: jax.make_array_from_callback(
        value.shape, self.bank_sharding()[key],
        lambda index, value=value: value[index])
            for key, value in arrays.items()}

  def bank_sharding(self) -> dict:
    return {'features': NamedSharding(self._mesh,
                                      P(None, sharding.MESH_AXES, None)),
            'labels': NamedSharding(self._mesh, P(None, sharding.MESH_AXES))}

  def _vote_step(self, key: str, state, bank):
    if key not in self._vote_steps:
      _, test, num_classes = self._splits[key]
      self._vote_steps[key] = self.compile(
          functools.partial(vote_step, features_fn=self._features_fn,
                            k=self._k, temperature=self._temperature,
                            num_classes=num_classes),
          (state, bank), (self._state_sharding, self.bank_sharding()), test)
    return self._vote_steps[key]

  def _metrics(self, state, ema: bool) -> dict:
    prefix = self.prefix(ema)
    metrics = {}
    for key, (train, test, _) in self._splits.items():
      bank = self.bank(state, train)
      totals = self.totals(self._vote_step(key, state, bank),
                           (state, bank), test)
      examples = max(float(totals['examples']), 1.0)
      metrics[f'{prefix}{key}_top1'] = float(totals['top1']) / examples
      metrics[f'{prefix}{key}_top5'] = float(totals['top5']) / examples
    return metrics


def create(name: str, settings: dict, context) -> Evaluator:
  """k-NN evaluator `name` (`registry.create`) of `settings`' data sets
  (`eval_splits.train_and_test_splits`)."""
  return Evaluator(
      eval_splits.train_and_test_splits(name, settings['datasets'], context),
      settings['k'], settings['temperature'], context.mesh, context.graphdef,
      context.state, context.state_sharding, batch_size=context.batch_size,
      dtype=context.dtype)
