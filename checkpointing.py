"""Orbax checkpoints of the train state under `WORKDIR/checkpoints/`."""

import os

import jax
import orbax.checkpoint as ocp


def create_manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  """A manager that keeps the newest `keep` checkpoints, saving async."""
  if '://' not in workdir:  # keep gs:// and other remote paths as they are
    workdir = os.path.abspath(workdir)
  return ocp.CheckpointManager(
      os.path.join(workdir, 'checkpoints'),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
      item_names=('state',))


def save(manager: ocp.CheckpointManager, step: int, state) -> None:
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state)))


def restore_latest(manager: ocp.CheckpointManager, state):
  """The newest checkpoint restored onto `state`'s structure and shardings,
  or `state` itself when there is none."""
  step = manager.latest_step()
  if step is None:
    return state
  target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target)))
  return restored.state
