"""ReaL labels: ImageNet's validation images relabelled by Beyer et al.
(2020, "Are we done with ImageNet?"), each with a set of correct classes.

`real.json` holds one list of class indices per validation image, in the
order of the images' file names (ILSVRC2012_val_00000001.JPEG first). A
prediction counts when it is in its image's set; images with an empty set
are left out, as timm's `RealLabelsImagenet` counts
(timm/data/real_labels.py, `add_result`). The loss is not defined for a set
of labels, so this evaluator reports accuracy, top-5 accuracy and the
images counted.
"""

import functools
import json
import os

import jax
import numpy as np

from evaluators import base
from evaluators import common
from evaluators import evaluator_checks
from runtime import paths


def file_name_rows(files: list[str]) -> np.ndarray:
  """The row of real.json of each of `files`: the position of its file name
  among all the split's file names, sorted (the class folders play no
  part)."""
  names = [os.path.basename(path) for path in files]
  rows = np.empty(len(names), np.int32)
  rows[np.argsort(names, kind='stable')] = np.arange(len(names))
  return rows


def label_table(label_sets: list, num_classes: int) -> np.ndarray:
  """(images, classes) booleans: True where the class is in the image's
  set."""
  table = np.zeros((len(label_sets), num_classes), bool)
  for row, labels in enumerate(label_sets):
    table[row, labels] = True
  return table


def counts(top5: np.ndarray, rows: np.ndarray, mask: np.ndarray,
           table: np.ndarray) -> dict:
  """Top-1 and top-5 predictions in their image's set, and the images
  counted: unmasked, with a non-empty set (`rows` index `table`)."""
  counted = mask & table[rows].any(axis=-1)
  hits = table[rows[:, None], top5]  # (examples, 5)
  return {'correct': int(np.sum(hits[:, 0] & counted)),
          'correct_top5': int(np.sum(hits.any(axis=-1) & counted)),
          'examples': int(np.sum(counted))}


def predict_step(state, batch, *, apply_fn):
  """The top-5 classes of each example, with its position and mask."""
  logits = apply_fn(state, batch['image'])
  _, top5 = jax.lax.top_k(logits, min(5, logits.shape[-1]))
  return {'top5': top5, 'index': batch['index'], 'mask': batch['mask']}


class Evaluator(base.Evaluator):
  """ReaL accuracy of a train state over image folders whose files' names
  order real.json (eval_NAME_accuracy, eval_NAME_top5_accuracy,
  eval_NAME_examples). The top-5 predictions are gathered onto every
  process and counted on the host, each image once."""

  SAME_FOR_MOVING_AVERAGE = ('examples',)

  def __init__(self, name: str, dataset, table: np.ndarray, rows, mesh,
               graphdef, state, state_sharding, *, batch_size: int, dtype):
    super().__init__(mesh, batch_size=batch_size, dtype=dtype, tag_name=name)
    self._dataset, self._table, self._rows = dataset, table, rows
    self._step = self.compile(
        functools.partial(predict_step, apply_fn=common.apply_fn(graphdef)),
        state, state_sharding, dataset)

  def _metrics(self, state, ema: bool) -> dict:
    predicted = self.examples(self._step, state, self._dataset)
    totals = counts(predicted['top5'], self._rows[predicted['index']],
                    np.ones(len(predicted['index']), bool), self._table)
    examples = max(totals['examples'], 1)
    prefix = self.prefix(ema)
    return {f'{prefix}accuracy': totals['correct'] / examples,
            f'{prefix}top5_accuracy': totals['correct_top5'] / examples,
            f'{prefix}examples': float(totals['examples'])}


def create(name: str, path: str, data, context) -> Evaluator:
  """The ReaL evaluator `name` of the images of `data` (a
  `folder_pipeline.FolderSplit`) and the label sets in real.json at
  `path` (local or gs://)."""
  label_sets = json.loads(paths.path(path).read_text())
  num_classes = len(context.class_names)
  files = data.files()
  evaluator_checks.check_real_labels(name, path, label_sets, len(files),
                                  num_classes)
  return Evaluator(
      name, data, label_table(label_sets, num_classes),
      file_name_rows(files), context.mesh, context.graphdef, context.state,
      context.state_sharding, batch_size=context.batch_size,
      dtype=context.dtype)
