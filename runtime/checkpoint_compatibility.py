"""Whether a checkpoint fits a run: its class names against the data
set's, its arrays' shapes against the state's; its saved config is compared
with the run's by the check the restore is given
(`training/config_compatibility.py`, which knows the models).
"""

import json

import jax


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
