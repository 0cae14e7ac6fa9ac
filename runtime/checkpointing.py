"""Orbax checkpoints of the train state and its config under `WORKDIR/checkpoints/`.

Saves are asynchronous: training goes on while a checkpoint is written. Orbax
writes each one into a temporary directory and renames it when it is
complete, so a process killed mid-save leaves only a temporary directory,
which a restart ignores (and removes). A complete checkpoint proven damaged
(a file missing or undecodable, `runtime/storage_faults.py`) is skipped at
restore with a warning and moved to `WORKDIR/corrupt_checkpoints/`, never
deleted; the run resumes from the newest readable one. A read that fails
for any other reason (the storage did not answer) is retried for a bounded
time, then the launch stops having moved nothing.

Each checkpoint also holds the config it was trained with, as JSON, so that a
run restarted in the same workdir with a config that changes the state's
shapes is refused before anything is overwritten, and the names of its
classes, index by index, so that predictions are named and a resumed or
evaluated run is refused when its data set numbers the classes otherwise.
"""

import dataclasses
import hashlib
from typing import Any

from absl import logging
import jax
import orbax.checkpoint as ocp

from runtime import array_writes
from runtime import checkpoint_compatibility as compatibility
from runtime import checkpoint_reads
from runtime import event_loops
from runtime import paths
from runtime import storage_faults

# WORKDIR/checkpoints/STEP/{state,config,classes}
CHECKPOINTS_DIR = 'checkpoints'
CORRUPT_DIR = 'corrupt_checkpoints'


# Orbax's reads of a damaged checkpoint leave TensorStore reads in flight
# on the loops it closes.
event_loops.install()


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
  array_writes.write_whole_in_one_process()
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


def open_manager(workdir: str, keep: int, *, retry_seconds: float,
                 stop_requested=lambda: None) -> ocp.CheckpointManager:
  """`create_manager`, whose listing of the checkpoints is retried after
  storage errors as a restore's reads are (`restore_latest`)."""
  what = f'the checkpoints in {paths.path(workdir) / CHECKPOINTS_DIR}'
  outcome = checkpoint_reads.agreed_read(
      lambda _: create_manager(workdir, keep), what, retry_seconds,
      stop_requested)
  if outcome.kind == storage_faults.DAMAGE:
    raise checkpoint_reads.RestoreError(
        f'{what} could not be listed ({outcome.message}); nothing was '
        'changed')
  return outcome.value


CLASSES_ITEM = 'classes'


def save(manager: ocp.CheckpointManager, step: int, state, config_json: dict,
         class_names=(), teacher_file: dict | None = None) -> None:
  """Saves `state` without its teacher (read again from its file at every
  start), the run's config (`config_json`: as
  `checkpoint_compatibility.as_json` gives it) with `teacher_file` recorded
  beside it, and the class names."""
  recorded = ({compatibility.TEACHER_FILE_KEY: teacher_file} if teacher_file
              else {})
  wait_until_saved(manager)  # the save before, which this one waits for
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(without_teacher(state)),
      config=ocp.args.JsonSave({**config_json, **recorded}),
      **{CLASSES_ITEM: ocp.args.JsonSave({'names': list(class_names)})}))


def wait_until_saved(manager: ocp.CheckpointManager, state=None) -> None:
  """Waits for the save under way, if any, saying every 20 s how far it is
  (to a bucket over a slow link a save takes minutes): of about the bytes
  of `state` that this process writes, when given."""
  total = None if state is None else sum(
      shard.data.nbytes for leaf in jax.tree.leaves(without_teacher(state))
      for shard in getattr(leaf, 'addressable_shards', ())
      if shard.replica_id == 0)
  storage_faults.wait_reporting(manager.is_saving_in_progress,
                                f'the checkpoint to {manager.directory}',
                                total)
  manager.wait_until_finished()


def without_teacher(state):
  """The part of a train state that checkpoints hold: all but the
  teacher."""
  if getattr(state, 'teacher', None) is None:
    return state
  return state.replace(teacher=None)


def checkpoint_dir(name, retry_seconds: float | None = None) -> str | None:
  """The newest finished checkpoint directory in `name`: a workdir, its
  checkpoints directory, or a checkpoint itself (local or gs://); None if
  there is none. Finished as orbax means it (the rename of a finished save
  on a disk, its commit marker in a bucket): never a save under way or cut,
  nor a step half set aside. Listed as a restore reads (`read_retried`); a
  checkpoint named itself that is not finished is a RestoreError."""
  step_dir, finished = checkpoint_reads.read_retried(
      lambda: _newest_finished(name), f'the checkpoints in {name}',
      retry_seconds)
  if step_dir is not None and not finished:
    raise checkpoint_reads.RestoreError(
        f'checkpoint {step_dir} is not finished (a save under way or cut '
        'short); pass its workdir, or a finished checkpoint')
  return step_dir


def _newest_finished(name) -> tuple[str | None, bool]:
  """(the checkpoint `name` is, or the newest finished one in it; whether
  it is finished)."""
  path = paths.path(name)
  if (path / 'state').is_dir():
    return str(path), ocp.path.step.is_path_finalized(path)
  directory = path / CHECKPOINTS_DIR
  if not directory.is_dir():
    directory = path
  if not directory.is_dir():
    return None, False
  steps = [int(entry.name) for entry in directory.iterdir()
           if entry.name.isdigit() and ocp.path.step.is_path_finalized(entry)]
  return (str(directory / str(max(steps))), True) if steps else (None, False)


def saved_config(step_dir) -> dict | None:
  """The config saved with the checkpoint in `step_dir`, as a dict; None
  when it has none."""
  path = paths.path(step_dir) / 'config'
  return checkpoint_reads.read_retried(
      lambda: _read_json(path) if path.is_dir() else None,
      f'the config of checkpoint {step_dir}')


def saved_state_metadata(step_dir):
  """The tree of the train state saved in `step_dir` (a step's directory),
  each array's metadata (shape, dtype) in its place; no array is read.
  Read as a restore reads (`read_retried`)."""
  def read_metadata():
    handler = ocp.StandardCheckpointHandler()
    try:
      return handler.metadata(paths.path(step_dir) / 'state')
    finally:
      handler.close()
  return checkpoint_reads.read_retried(
      read_metadata, f'the metadata of checkpoint {step_dir}')


def saved_param_shapes(step_dir) -> dict[str, tuple]:
  """{name: shape} of the parameters saved in the checkpoint in `step_dir`,
  named as the model's variables ('head.bias'), from its metadata: no
  array is read."""
  shapes = {}
  for keys, leaf in jax.tree_util.tree_flatten_with_path(
      saved_state_metadata(step_dir))[0]:
    names = [str(getattr(key, 'key', getattr(key, 'idx', key)))
             for key in keys]
    if names[0] == 'params':
      shapes['.'.join(names[1:-1] if names[-1] == 'value' else names[1:])] = (
          tuple(leaf.shape))
  return shapes


# The small files that tell one save of a step from another (orbax's
# metadata with its commit timestamps, its commit marker, the saved config),
# never the arrays.
IDENTITY_FILES = ('_CHECKPOINT_METADATA',
                  ocp.path.atomicity.COMMIT_SUCCESS_FILE, 'config/metadata')


def checkpoint_identity(step_dir) -> str:
  """The SHA-256 of the checkpoint in `step_dir`'s IDENTITY_FILES: the same
  for its copies, another for any other save, of any step or workdir."""
  def read_identity():
    digest = hashlib.sha256()
    for name in IDENTITY_FILES:
      file = paths.path(step_dir) / name
      if file.exists():
        digest.update(name.encode() + b'\0' + file.read_bytes() + b'\0')
    return digest.hexdigest()
  return checkpoint_reads.read_retried(read_identity, f'checkpoint {step_dir}')


def saved_class_names(step_dir) -> list[str] | None:
  """The class names saved with the checkpoint in `step_dir` (a step's
  directory); None or [] when it has none."""
  path = paths.path(step_dir) / CLASSES_ITEM
  return checkpoint_reads.read_retried(
      lambda: _read_json(path)['names'] if path.is_dir() else None,
      f'the class names of checkpoint {step_dir}')


@dataclasses.dataclass
class Restored:
  """What a launch starts from."""
  state: Any  # the restored train state, or the fresh one
  step: int | None  # the checkpoint's step; None when none was restored
  saved_config: dict | None  # that checkpoint's config


def restore_latest(manager: ocp.CheckpointManager, state, config_json: dict,
                   class_names=None, *, check_config=None,
                   retry_seconds: float = checkpoint_reads.RETRY_SECONDS,
                   stop_requested=lambda: None) -> Restored:
  """The newest checkpoint restored onto `state`'s structure and shardings
  (its teacher, if any, kept as it is), or `state` itself when there is
  none.

  A checkpoint proven damaged (`runtime/storage_faults.py`) on any process,
  with no process seeing an outage, is set aside and the next older one
  tried; every process acts on the same shared outcome. Storage errors are
  retried with backoff for `retry_seconds`, then RestoreError (as when
  `stop_requested()` names a signal meanwhile): nothing is moved or
  deleted. Raises IncompatibleCheckpointError, naming the differences,
  when the newest checkpoint's arrays have other shapes than `state`'s
  (the keys that differ from the run's `config_json`,
  `checkpoint_compatibility.as_json`, named), when it was trained on other
  classes than `class_names` (None: not compared), or when
  `check_config(saved config or None, step)` raises it (None: the configs
  are not compared; `training/config_compatibility.py` compares them).
  """
  for step in sorted(manager.all_steps(), reverse=True):
    outcome = _restore(manager.directory / str(step), state, config_json,
                       class_names, check_config, retry_seconds,
                       stop_requested)
    if outcome.kind == storage_faults.DAMAGE:
      _set_aside(manager, step, outcome.message)
      continue
    logging.info('Restored checkpoint at step %d.', step)
    return outcome.value
  return Restored(state, None, None)


def restore_checkpoint(step_dir, state, config_json: dict, class_names=None,
                       *, check_config=None,
                       retry_seconds: float | None = None,
                       unread: tuple[str, ...] = ()) -> Restored:
  """The checkpoint in `step_dir` (a step's directory) restored onto
  `state`'s structure and shardings (its teacher, if any, kept), read as
  `restore_latest` reads one, but nothing is ever moved: a damaged
  checkpoint is a RestoreError. The fields of the train state in `unread`
  (e.g. 'opt_state') are not read: None in the state returned."""
  outcome = _restore(paths.path(step_dir), state, config_json, class_names,
                     check_config, checkpoint_reads.bound(retry_seconds),
                     lambda: None, unread)
  if outcome.kind == storage_faults.DAMAGE:
    raise checkpoint_reads.RestoreError(
        f'checkpoint {step_dir} is damaged ({outcome.message}); nothing was '
        'changed; resume training in its workdir to set it aside, or pass an '
        'older checkpoint')
  return outcome.value


def _restore(step_dir, state, config_json, class_names, check_config,
             retry_seconds, stop_requested,
             unread=()) -> checkpoint_reads.Outcome:
  """The agreed outcome of reading the checkpoint in `step_dir` onto
  `state` (but its fields in `unread`): 'ok' with its `Restored`, or
  DAMAGE."""
  step = int(step_dir.name)
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                        without_teacher(state))
  outcome = checkpoint_reads.agreed_read(
      lambda progress: _read_step(step_dir, step, target, config_json,
                                  class_names, check_config, unread,
                                  progress),
      f'checkpoint {step} in {step_dir.parent}', retry_seconds,
      stop_requested)
  if outcome.kind == storage_faults.DAMAGE:
    return outcome
  saved_config, restored = outcome.value
  if getattr(state, 'teacher', None) is not None:
    restored = restored.replace(teacher=state.teacher)
  outcome.value = Restored(restored, step, saved_config)
  return outcome


def _read_step(step_dir, step: int, target, config_json, class_names,
               check_config, unread, progress: storage_faults.Progress):
  """(saved config, restored state) of the checkpoint in `step_dir`, after
  refusing one of another model or other classes; the fields of `target`
  in `unread` are not read (None). Sets `progress.total` to the size of
  its files."""
  progress.total = paths.size_below(step_dir)
  saved_config = (_read_json(step_dir / 'config')
                  if (step_dir / 'config').is_dir() else None)
  if check_config is not None:
    check_config(saved_config, step)
  compatibility.check_same_classes(saved_class_names(step_dir), class_names,
                                   step)
  # The PyTree handler the standard one wraps, which skips the leaves
  # marked PLACEHOLDER.
  handler = ocp.PyTreeCheckpointHandler()
  try:
    compatibility.check_shapes(handler.metadata(step_dir / 'state'), step,
                               target, saved_config, config_json)
    read = target.replace(**{field: jax.tree.map(
        lambda _: ocp.PLACEHOLDER, getattr(target, field))
                             for field in unread})
    restored = handler.restore(step_dir / 'state', args=ocp.args.PyTreeRestore(
        read, restore_args=jax.tree.map(
            lambda leaf: ocp.RestoreArgs() if leaf is ocp.PLACEHOLDER
            else ocp.ArrayRestoreArgs(sharding=leaf.sharding), read)))
    return saved_config, restored.replace(**dict.fromkeys(unread))
  finally:
    handler.close()


def _read_json(path) -> dict:
  """A JSON item of a checkpoint, read by this process alone (no barrier:
  processes agree on outcomes through `process_agreement`)."""
  handler = ocp.JsonCheckpointHandler()
  try:
    return handler.restore(path)
  finally:
    handler.close()


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
