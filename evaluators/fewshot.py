"""Few-shot linear probes (big_vision's `evaluators/fewshot_lsr.py`).

For each data set: the model's pooled pre-logit features (`features` of
every family) of its training and test splits, extracted over the mesh and
gathered onto every process; then, on the host, for each shot count k and
each of `num_seeds` seeds (`seed`, `seed` + 1, ...), k training examples
per class drawn with that seed (all of a class's when it has fewer, as
big_vision draws them), a regularised
least-squares fit of their features to the classes' one-hot labels in
{-1, 1}, and the fit's top-1 accuracy on the test split. As big_vision
solves it (`_precompute_cache`, `_eig_fewshot_acc_fn`): features
standardised with the shots' mean and deviation (+1e-5), a constant feature
of 100 as the bias (so large that it is almost unregularised), and the
solution of (X^T X + l2 I) W = X^T Y through the eigendecomposition of
X^T X (N >= D) or of X X^T, as W = X^T (X X^T + l2 I)^-1 Y (D > N). The
host solves in float32, as big_vision does on its CPU.

Tags: fewshot_<dataset>_<k>shot (the mean over the seeds; big_vision's
`num_seeds` writes one curve per seed, averaged afterwards), with several
seeds fewshot_<dataset>_<k>shot_seed<s> too, and fewshot_mean_<k>shot over
the data sets (fewshot_ema_* of a moving average); `evaluator_checks.check_tags`
refuses evaluators that would write one tag twice.
"""

import functools

from absl import logging
import numpy as np

from evaluators import base
from evaluators import common
from evaluators import eval_splits
from evaluators import evaluator_checks

# big_vision's BIAS_CONSTANT: the bias feature's value.
BIAS_CONSTANT = 100.0


def standardised(x: np.ndarray, mean: np.ndarray,
                 std: np.ndarray) -> np.ndarray:
  """(x - mean) / std, with the bias feature appended."""
  x = (x - mean) / std
  return np.pad(x, ((0, 0), (0, 1)), constant_values=BIAS_CONSTANT)


def solve(x: np.ndarray, targets: np.ndarray, l2_reg: float) -> np.ndarray:
  """W of (x^T x + l2_reg I) W = x^T targets, by the eigendecomposition of
  x^T x when x has at least as many rows as columns, else of x x^T."""
  num_points, dim = x.shape
  if num_points >= dim:
    eigs, q = np.linalg.eigh(x.T @ x)
    lhs, rhs = q, q.T @ (x.T @ targets)
  else:
    eigs, q = np.linalg.eigh(x @ x.T)
    lhs, rhs = x.T @ q, q.T @ targets
  return (lhs / (eigs + l2_reg)[None, :]) @ rhs


def probe_accuracy(train_x, train_y, test_x, test_y, num_classes: int,
                   l2_reg: float) -> float:
  """Top-1 accuracy on (test_x, test_y) of the least-squares probe fitted
  to (train_x, train_y)."""
  train_x = np.asarray(train_x, np.float32)
  mean = train_x.mean(axis=0, keepdims=True)
  std = train_x.std(axis=0, keepdims=True) + np.float32(1e-5)
  targets = 2.0 * np.eye(num_classes, dtype=np.float32)[train_y] - 1.0
  w = solve(standardised(train_x, mean, std), targets, np.float32(l2_reg))
  scores = standardised(np.asarray(test_x, np.float32), mean, std) @ w
  return float(np.mean(np.argmax(scores, axis=1) == test_y))


def shot_indices(labels: np.ndarray, num_classes: int, shots: int,
                 seed: int) -> np.ndarray:
  """`shots` training examples of each class, drawn as big_vision draws
  them: a permutation of each class's examples seeded by `seed`; all of
  them for a class with fewer."""
  rng = np.random.default_rng(seed)
  per_class = [rng.permutation(np.flatnonzero(labels == c))
               for c in range(num_classes)]
  return np.concatenate([indices[:shots] for indices in per_class])


class Evaluator(base.Evaluator):
  """Few-shot accuracies of a train state on `splits` ({name: (training
  split, test split, classes)}, each split an evaluation data set), by one
  features step compiled here for the first split's batches (every split
  has the same image shape); the shots drawn with `num_seeds` seeds from
  `seed` on."""

  KIND = 'fewshot'

  def __init__(self, name: str, splits: dict, shots, l2_reg: float,
               seed: int, mesh, graphdef, state, state_sharding, *,
               batch_size: int, dtype, num_seeds: int = 1):
    super().__init__(mesh, batch_size=batch_size, dtype=dtype)
    self._name, self._splits = name, splits
    self._shots, self._l2_reg = tuple(shots), l2_reg
    self._seeds = tuple(range(seed, seed + num_seeds))
    self._step = self.compile(
        functools.partial(common.features_step, features_fn=common.apply_fn(
            graphdef, 'features')),
        state, state_sharding, next(iter(splits.values()))[0])

  def features(self, state, split) -> tuple[np.ndarray, np.ndarray]:
    """(features, labels) of every example of `split`, in its order: the
    same on any number of processes."""
    found = self.examples(self._step, state, split)
    return found['features'], found['label']

  def _metrics(self, state, ema: bool) -> dict:
    prefix = self.prefix(ema)
    metrics = {}
    for key, (train, test, num_classes) in self._splits.items():
      train_x, train_y = self.features(state, train)
      test_x, test_y = self.features(state, test)
      for shots in self._shots:
        by_seed = {}
        for seed in self._seeds:
          chosen = shot_indices(train_y, num_classes, shots, seed)
          by_seed[seed] = probe_accuracy(
              train_x[chosen], train_y[chosen], test_x, test_y, num_classes,
              self._l2_reg)
        metrics[f'{prefix}{key}_{shots}shot'] = float(np.mean(
            list(by_seed.values())))
        if len(self._seeds) > 1:
          metrics.update({f'{prefix}{key}_{shots}shot_seed{seed}': accuracy
                          for seed, accuracy in by_seed.items()})
    for shots in self._shots:
      metrics[f'{prefix}mean_{shots}shot'] = float(np.mean(
          [metrics[f'{prefix}{key}_{shots}shot'] for key in self._splits]))
    return metrics


def log_short_classes(name: str, key: str, counts: np.ndarray,
                      shots) -> None:
  """One line when shot counts exceed some class's training examples of
  few-shot data set `key` (`counts` by class): those classes' shots are all
  their examples, as in big_vision."""
  larger = [k for k in shots if k > counts.min()]
  if larger:
    logging.info(
        'evals.%s: %d of the %d classes of %s have fewer than %d training '
        'examples (the fewest %d); their %s-shot probes take all of them',
        name, np.sum(counts < max(larger)), counts.size, key, max(larger),
        counts.min(), ', '.join(map(str, larger)))


def create(name: str, settings: dict, context) -> Evaluator:
  """Few-shot evaluator `name` (`registry.create`) of `settings`' data
  sets (`eval_splits.train_and_test_splits`); refuses a class without
  training examples."""
  splits = eval_splits.train_and_test_splits(name, settings['datasets'],
                                             context)
  for key, (train, _, num_classes) in splits.items():
    log_short_classes(name, key, evaluator_checks.training_class_counts(
        name, key, train.eval_split_labels(), num_classes), settings['shots'])
  return Evaluator(name, splits, settings['shots'], settings['l2_reg'],
                   settings['seed'], context.mesh, context.graphdef,
                   context.state, context.state_sharding,
                   batch_size=context.batch_size, dtype=context.dtype,
                   num_seeds=settings['num_seeds'])
