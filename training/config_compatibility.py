"""Whether a checkpoint's saved config builds the run's network: keys that
define the network of either config (by its model's family,
`runtime/network_keys.py`) or the state's arrays refuse it; other
differences are logged. The restore calls `check_compatible` with each
checkpoint's config before it reads the arrays.
"""

from absl import logging

import models
from runtime import checkpoint_compatibility as compatibility
from runtime import network_keys


def config_differences(saved: dict, new: dict) -> tuple[list, list]:
  """(keys that define the network of either config or the state's
  arrays, harmless keys) whose values differ between the `saved` config
  and the run's (`new`, as `compatibility.as_json` gives it). Any other
  difference (steps, cadences, learning rate, ...) is harmless to a resumed
  run. A difference that changes shapes through a key missing from the
  table is still caught, by comparing the checkpoint's array shapes
  (`compatibility.check_shapes`)."""
  differing = sorted(k for k in set(saved) | set(new)
                     if saved.get(k) != new.get(k)
                     and k != compatibility.TEACHER_FILE_KEY)
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
  """Refuses a run's config (`new`, as `compatibility.as_json` gives it)
  of another network or other state shapes than the `saved` one of the
  checkpoint at `step`; logs harmless differences."""
  if saved is None:
    logging.warning('Checkpoint %d has no saved config; not compared.', step)
    return
  shaped, harmless = config_differences(saved, new)
  if shaped:
    raise compatibility.IncompatibleCheckpointError(
        f'the workdir holds checkpoints (step {step}) of another model: '
        f'{_describe(shaped, saved, new)}; use a new --workdir, or the '
        'saved values to resume (' + ' '.join(
            f'--config.{k}={saved.get(k)}' for k in shaped) + ')')
  if harmless:
    logging.info('Config differs from checkpoint %d in harmless keys: %s',
                 step, _describe(harmless, saved, new))
