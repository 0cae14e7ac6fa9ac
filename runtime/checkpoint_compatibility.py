"""Whether a checkpoint fits a run: its saved config against the run's
(keys that define the network or the state's arrays refuse it, others are
logged: `runtime/network_keys.py`), its
class names against the data set's, its arrays' shapes against the state's.
"""

import json

from absl import logging
import jax

import models
from runtime import network_keys

# A key the saved config has beside the run's: what identifies the
# teacher's weights (`training/teacher.py`), which checkpoints leave out.
TEACHER_FILE_KEY = 'teacher_file'


class IncompatibleCheckpointError(ValueError):
  """The workdir holds checkpoints of a differently shaped model."""


def check_same_classes(saved: list[str] | None, names, step: int) -> None:
  """Refuses a data set whose classes are not the checkpoint's, index by
  index (a model would be trained or scored against the wrong labels)."""
  if not saved or names is None or list(saved) == list(names):
    return  # nothing to compare: no names saved, or none given
  if sorted(saved) == sorted(names):
    difference = 'the same names in another order'
  else:
    only_saved = sorted(set(saved) - set(names))
    only_new = sorted(set(names) - set(saved))
    difference = '; '.join(
        f'{what}: {", ".join(only[:10])}' + (
            f' and {len(only) - 10} more' if len(only) > 10 else '')
        for what, only in (('only in the checkpoint', only_saved),
                           ('only in the data set', only_new)) if only)
  raise IncompatibleCheckpointError(
      f'the checkpoint at step {step} was trained on other classes than '
      f'this data set has ({difference}); use the data set it was trained '
      'on, or a new --workdir (with --config.init_from to start from it)')


def as_json(config) -> dict:
  """The config as plain JSON values (tuples become lists, as when read)."""
  return json.loads(config.to_json())


def config_differences(saved: dict, new: dict) -> tuple[list, list]:
  """(keys that define the network of either config or the state's
  arrays, harmless keys) whose values differ between the `saved` config
  and the run's (`new`, as `as_json` gives it). Any other difference (steps,
  cadences, learning rate, ...) is harmless to a resumed run. A difference
  that changes shapes through a key missing from the table is still caught,
  by comparing the checkpoint's array shapes (`check_shapes`)."""
  differing = sorted(k for k in set(saved) | set(new)
                     if saved.get(k) != new.get(k) and k != TEACHER_FILE_KEY)
  defining = set(network_keys.STATE_KEYS).union(*(
      network_keys.network_keys(models.family(values.get('model')))
      for values in (saved, new)))
  shaped = [k for k in differing if k in defining and
            not network_keys.same_network(k, saved.get(k), new.get(k))]
  # Image folders moved or mounted elsewhere are the same data set when
  # their classes are (checked against the checkpoint's class names).
  if 'dataset' in shaped and all(
      str(d).startswith('folder:') for d in (saved.get('dataset'),
                                              new.get('dataset'))):
    shaped.remove('dataset')
  # Clipping adds a state to the optimizer, and the moving average a copy of
  # the weights, only when switched on or off.
  for key in ('grad_clip_norm', 'ema_decay'):
    if key in differing and (saved.get(key, 0) > 0) != (new.get(key, 0) > 0):
      shaped.append(key)
  return shaped, [k for k in differing if k not in shaped]


def _describe(keys, saved, new) -> str:
  return ', '.join(f'{k}: {saved.get(k)!r} -> {new.get(k)!r}' for k in keys)


def check_compatible(saved: dict | None, new: dict, step: int) -> None:
  """Refuses a run's config (`new`, as `as_json` gives it) of another
  network or other state shapes than the `saved` one; logs harmless
  differences."""
  if saved is None:
    logging.warning('Checkpoint %d has no saved config; not compared.', step)
    return
  shaped, harmless = config_differences(saved, new)
  if shaped:
    raise IncompatibleCheckpointError(
        f'the workdir holds checkpoints (step {step}) of another model: '
        f'{_describe(shaped, saved, new)}; use a new --workdir, or the '
        'saved values to resume (' + ' '.join(
            f'--config.{k}={saved.get(k)}' for k in shaped) + ')')
  if harmless:
    logging.info('Config differs from checkpoint %d in harmless keys: %s',
                 step, _describe(harmless, saved, new))


def check_shapes(metadata, step, target, saved_config, new: dict) -> None:
  """Refuses a checkpoint whose arrays (`metadata`) do not fit `target`,
  even when no key of the table differs (a key that changes shapes in a
  new way); `new` is the run's config, as `as_json` gives it."""
  saved = [(m.shape, m.dtype) for m in jax.tree.leaves(metadata)]
  wanted = [(t.shape, t.dtype) for t in jax.tree.leaves(target)]
  if sorted(map(str, saved)) != sorted(map(str, wanted)):
    differing = sorted(
        k for k in set(saved_config or {}) | set(new)
        if (saved_config or {}).get(k) != new.get(k))
    raise IncompatibleCheckpointError(
        f'the checkpoint at step {step} has other array shapes than this '
        f'config makes (differing keys: {", ".join(differing) or "none"}); '
        'use a new --workdir, or the config it was trained with')
