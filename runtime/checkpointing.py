"""Orbax checkpoints of the train state and its config under `WORKDIR/checkpoints/`.

Saves are asynchronous: training goes on while a checkpoint is written. Orbax
writes each one into a temporary directory and renames it when it is
complete, so a process killed mid-save leaves only a temporary directory,
which a restart ignores (and removes). A checkpoint that is complete but
unreadable (truncated or damaged files) is skipped at restore with a warning
and moved to `WORKDIR/corrupt_checkpoints/`, never deleted; the run resumes
from the newest readable one.

Each checkpoint also holds the config it was trained with, as JSON, so that a
run restarted in the same workdir with a config that changes the state's
shapes is refused before anything is overwritten, and the names of its
classes, index by index, so that predictions are named and a resumed or
evaluated run is refused when its data set numbers the classes otherwise.
"""

import hashlib
import json

from absl import logging
import jax
import orbax.checkpoint as ocp

from runtime import paths

# WORKDIR/checkpoints/STEP/{state,config,classes}
CHECKPOINTS_DIR = 'checkpoints'
CORRUPT_DIR = 'corrupt_checkpoints'

# Keys whose change alters the shapes or structure of the train state. Any
# other difference (steps, cadences, learning rate, ...) is harmless to a
# resumed run and only logged. A difference that changes shapes through a key
# missing here is still caught, by comparing the checkpoint's array shapes.
SHAPE_KEYS = ('dataset', 'image_size', 'model', 'num_layers', 'width',
              'vit_pool', 'vit_posemb', 'vit_distillation_token',
              'feature_batch_norm', 'optimizer')
# A key the saved config has beside the run's: what identifies the
# teacher's weights (`training/teacher.py`), which checkpoints leave out.
TEACHER_FILE_KEY = 'teacher_file'


class IncompatibleCheckpointError(ValueError):
  """The workdir holds checkpoints of a differently shaped model."""


class _Manager(ocp.CheckpointManager):
  """Orbax's manager, except that it never asks JAX's preemption sync point.

  JAX takes the step of the latest `reached_preemption_sync_point` call as
  the process's position when a preemption notice comes, and the processes
  stop at one step past the furthest position. The training loop asks once
  per step, from the main thread (`preemption.StopRequest`). Orbax asks too:
  in `should_save` and, on process 0, from the thread that finalises a save,
  with that save's (older) step. Taken then, process 0's position is behind
  its loop, the agreed step can be one its loop has passed, and it would
  train on while the others stop and save, each waiting for the other. The
  loop saves at the agreed step itself, so orbax needs no answer of its own.
  """

  def reached_preemption(self, step: int) -> bool:
    del step
    return False


def create_manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  """A manager that keeps the newest `keep` checkpoints, saving async."""
  directory = paths.path(workdir) / CHECKPOINTS_DIR
  # Leftovers of a killed save exist only in a directory that exists: a new
  # run skips orbax's background clean-up (which races with TFDS's mocked
  # file system in the tests).
  leftovers_possible = directory.exists()
  return _Manager(
      directory,
      options=ocp.CheckpointManagerOptions(
          max_to_keep=keep, create=True,
          cleanup_tmp_directories=leftovers_possible),
      item_handlers={'state': ocp.StandardCheckpointHandler(),
                     'config': ocp.JsonCheckpointHandler(),
                     CLASSES_ITEM: ocp.JsonCheckpointHandler()})


CLASSES_ITEM = 'classes'


def save(manager: ocp.CheckpointManager, step: int, state, config,
         class_names=(), teacher_file: dict | None = None) -> None:
  """Saves `state` without its teacher (read again from its file at every
  start), the config with `teacher_file` recorded beside it, and the class
  names."""
  recorded = {TEACHER_FILE_KEY: teacher_file} if teacher_file else {}
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(without_teacher(state)),
      config=ocp.args.JsonSave({**_as_json(config), **recorded}),
      **{CLASSES_ITEM: ocp.args.JsonSave({'names': list(class_names)})}))


def without_teacher(state):
  """The part of a train state that checkpoints hold: all but the
  teacher."""
  if getattr(state, 'teacher', None) is None:
    return state
  return state.replace(teacher=None)


def checkpoint_dir(name) -> str | None:
  """The newest checkpoint directory in `name`: a workdir, its checkpoints
  directory, or a checkpoint itself (local or gs://); None if there is
  none."""
  path = paths.path(name)
  if (path / 'state').is_dir():
    return str(path)
  directory = path / CHECKPOINTS_DIR
  if not directory.is_dir():
    directory = path
  if not directory.is_dir():
    return None
  steps = [int(entry.name) for entry in directory.iterdir()
           if entry.name.isdigit() and (entry / 'state').is_dir()]
  return str(directory / str(max(steps))) if steps else None


def saved_config(step_dir) -> dict | None:
  """The config saved with the checkpoint in `step_dir`, as a dict; None
  when it has none."""
  path = paths.path(step_dir) / 'config'
  if not path.is_dir():
    return None
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
    return reader.restore(path)


# The small files that tell one save of a step from another (orbax's
# metadata with its commit timestamps, its commit marker, the saved config),
# never the arrays.
IDENTITY_FILES = ('_CHECKPOINT_METADATA',
                  ocp.path.atomicity.COMMIT_SUCCESS_FILE, 'config/metadata')


def checkpoint_identity(step_dir) -> str:
  """The SHA-256 of the checkpoint in `step_dir`'s IDENTITY_FILES: the same
  for its copies, another for any other save, of any step or workdir."""
  digest = hashlib.sha256()
  for name in IDENTITY_FILES:
    file = paths.path(step_dir) / name
    if file.exists():
      digest.update(name.encode() + b'\0' + file.read_bytes() + b'\0')
  return digest.hexdigest()


def saved_class_names(step_dir) -> list[str] | None:
  """The class names saved with the checkpoint in `step_dir` (a step's
  directory); None or [] when it has none."""
  path = paths.path(step_dir) / CLASSES_ITEM
  if not path.is_dir():
    return None
  with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
    return reader.restore(path)['names']


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


def _as_json(config) -> dict:
  """The config as plain JSON values (tuples become lists, as when read)."""
  return json.loads(config.to_json())


def restore_latest(manager: ocp.CheckpointManager, state, config,
                   class_names=None):
  """The newest readable checkpoint restored onto `state`'s structure and
  shardings (its teacher, if any, kept as it is), or `state` itself when
  there is none.

  Raises IncompatibleCheckpointError, naming the differences, when the
  newest checkpoint was trained with a config of other shapes or on other
  classes than `class_names` (None: not compared).
  """
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                        without_teacher(state))
  for step in sorted(manager.all_steps(), reverse=True):
    saved_config = _read_config(manager, step)
    if saved_config is not _UNREADABLE:
      check_compatible(saved_config, config, step)
      try:
        check_same_classes(saved_class_names(manager.directory / str(step)),
                           class_names, step)
        _check_shapes(manager, step, target, saved_config, config)
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target))).state
        logging.info('Restored checkpoint at step %d.', step)
        if getattr(state, 'teacher', None) is not None:
          restored = restored.replace(teacher=state.teacher)
        return restored
      except IncompatibleCheckpointError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        # Orbax and TensorStore report damaged files with many exception
        # types (JSON, OUT_OF_RANGE, DATA_LOSS, ...).
        _set_aside(manager, step, e)
    else:
      _set_aside(manager, step, 'its config could not be read')
  return state


_UNREADABLE = object()


def _read_config(manager, step):
  """The config saved with `step`: a dict, None if the checkpoint has none,
  or _UNREADABLE."""
  if not (manager.directory / str(step) / 'config').is_dir():
    return None
  try:
    return manager.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore())).config
  except Exception:  # pylint: disable=broad-except
    return _UNREADABLE


def config_differences(saved: dict, config) -> tuple[list, list]:
  """(shape-changing keys, harmless keys) whose values differ."""
  new = _as_json(config)
  differing = sorted(k for k in set(saved) | set(new)
                     if saved.get(k) != new.get(k) and k != TEACHER_FILE_KEY)
  shaped = [k for k in differing if k in SHAPE_KEYS]
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


def check_compatible(saved: dict | None, config, step: int) -> None:
  """Refuses a config that changes shapes; logs harmless differences."""
  if saved is None:
    logging.warning('Checkpoint %d has no saved config; not compared.', step)
    return
  shaped, harmless = config_differences(saved, config)
  new = _as_json(config)
  if shaped:
    raise IncompatibleCheckpointError(
        f'the workdir holds checkpoints (step {step}) of another model: '
        f'{_describe(shaped, saved, new)}; use a new --workdir, or the '
        'saved values to resume')
  if harmless:
    logging.info('Config differs from checkpoint %d in harmless keys: %s',
                 step, _describe(harmless, saved, new))


def _check_shapes(manager, step, target, saved_config, config) -> None:
  """Refuses a checkpoint whose arrays do not fit `target`, even when no
  key of SHAPE_KEYS differs (a key that changes shapes in a new way)."""
  metadata = manager.item_metadata(step)['state']
  saved = [(m.shape, m.dtype) for m in jax.tree.leaves(metadata)]
  wanted = [(t.shape, t.dtype) for t in jax.tree.leaves(target)]
  if sorted(map(str, saved)) != sorted(map(str, wanted)):
    differing = sorted(
        k for k in set(saved_config or {}) | set(_as_json(config))
        if (saved_config or {}).get(k) != _as_json(config).get(k))
    raise IncompatibleCheckpointError(
        f'the checkpoint at step {step} has other array shapes than this '
        f'config makes (differing keys: {", ".join(differing) or "none"}); '
        'use a new --workdir, or the config it was trained with')


def _set_aside(manager, step: int, error) -> None:
  """Moves an unreadable checkpoint out of the manager's way, loudly.

  In a bucket the move is a copy, then a delete that starts with orbax's
  commit file: killed midway, the checkpoint is either still whole where it
  was, or whole in `corrupt_checkpoints` with an uncommitted remainder that
  orbax ignores (and removes at the next start).
  """
  source = manager.directory / str(step)
  corrupt_dir = manager.directory.parent / CORRUPT_DIR
  destination = corrupt_dir / str(step)
  suffix = 1
  while destination.exists():
    destination = corrupt_dir / f'{step}-{suffix}'
    suffix += 1
  if jax.process_index() == 0:
    paths.move_tree(source, destination,
                    delete_first=ocp.path.atomicity.COMMIT_SUCCESS_FILE)
  # Orbax's barrier: on the coordination service in a multi-process run
  # (main.py), not a device collective.
  ocp.multihost.sync_global_processes(f'set aside checkpoint {step}')
  manager.reload()
  logging.warning(
      'Checkpoint at step %d is unreadable (%s); moved it to %s and trying '
      'the next older one.', step, str(error).splitlines()[0][:300],
      destination)
