"""The non-finite guard: a step that produces NaNs or infinities is not
applied, and too many in a row stop the run with the last good checkpoint
named."""

import jax
import jax.numpy as jnp

from runtime import mixed_precision


class NonFiniteError(RuntimeError):
  """Training produced non-finite values; the message names the step and the
  last good checkpoint."""


def all_finite(tree) -> jax.Array:
  """True when every floating-point value in `tree` is finite."""
  return jnp.all(jnp.stack([
      jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
      if jnp.issubdtype(x.dtype, jnp.inexact)]))


def guard_nonfinite(state, new_state, loss_and_grads,
                    max_skips: int) -> tuple:
  """`new_state`, unless the step produced non-finite values; and whether
  this step was skipped.

  A non-finite step keeps the old parameters, statistics and optimizer state
  (so no checkpoint ever holds NaNs) and extends `nonfinite_streak`. Once
  the streak exceeds `max_skips` the state freezes: later steps change
  nothing, not even the step counter, until the host stops the run at its
  next synchronisation (`stop_if_nonfinite`). So the hot loop needs no
  host round trip per step, and the frozen state is exactly the one the
  offending step started from.
  """
  finite = all_finite((loss_and_grads, new_state.params,
                       new_state.model_state))
  frozen = state.nonfinite_streak > max_skips
  apply = finite & ~frozen
  keep_old = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(apply, n, o), new, old)
  guarded = new_state.replace(
      params=keep_old(new_state.params, state.params),
      model_state=keep_old(new_state.model_state, state.model_state),
      opt_state=keep_old(new_state.opt_state, state.opt_state),
      step=jnp.where(frozen, state.step, new_state.step),
      nonfinite_streak=jnp.where(
          frozen, state.nonfinite_streak,
          jnp.where(finite, 0, state.nonfinite_streak + 1)))
  return guarded, ~finite & ~frozen


def guard_update(state, new_state, grads_finite, loss, grads,
                 skip_nonfinite_steps: int):
  """`new_state` unless the step was not finite (then `state`'s values; see
  `guard_nonfinite`); and whether the step was skipped."""
  # float16: overflowing gradients are the loss scale's business (skip the
  # update, halve the scale); only a non-finite loss counts as divergence.
  new_state = mixed_precision.skip_nonfinite(grads_finite, new_state, state)
  checked = (loss, grads) if state.loss_scale is None else loss
  return guard_nonfinite(state, new_state, checked, skip_nonfinite_steps)


def stop_if_nonfinite(state, skip_nonfinite_steps: int, manager, writer,
                      before_stopping=None) -> None:
  """Raises NonFiniteError if the train step froze the state (see
  `guard_nonfinite`), after finishing pending saves and writes.

  Called only on steps that synchronise with the host anyway. The frozen
  `state` is the one the offending step started from, except that its
  `step` already counts the offending step: its batch is the training batch
  at index `state.step - 1` (0-based) of the data order.
  `before_stopping(state)` runs first (the intermediate-gradient summaries
  of that batch).
  """
  streak = int(state.nonfinite_streak)
  if streak <= skip_nonfinite_steps:
    return
  if before_stopping is not None:
    before_stopping(state)
  manager.wait_until_finished()
  writer.flush()
  good = manager.latest_step()
  where = (f'step {good} in {manager.directory} (untouched)' if good is not None
           else 'none was saved')
  raise NonFiniteError(
      f'non-finite loss or gradients at step {int(state.step)} ({streak} such '
      f'steps in a row, skip_nonfinite_steps={skip_nonfinite_steps}); '
      f'last good checkpoint: {where}. Lower learning_rate, set '
      'grad_clip_norm, or raise skip_nonfinite_steps to skip such steps.')
