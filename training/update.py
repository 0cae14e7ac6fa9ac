"""The train step: one optimizer update of the state."""

import functools

import jax
import jax.numpy as jnp
import optax

from training import gradients
from training import nonfinite
from training import state as train_state


def train_step(state: train_state.TrainState, batch, *, graphdef, tx,
               learning_rate_fn, label_smoothing: float, dropout_seed: int,
               mixing: dict | None = None, axis_name: str | None = None,
               skip_nonfinite_steps: int = 0, grad_accum_steps: int = 1,
               accum_unroll: int = 1, ema_decay: float = 0.0,
               trainable: str = '', distill: dict | None = None):
  """One optimizer update; returns the new state and scalar metrics.

  Under `jax.jit` the batch is the global batch. Under `jax.pmap` it is one
  device's share and `axis_name` names the device axis: gradients, metrics
  and BatchNorm statistics are averaged over it, so both give one result.
  `mixing` holds `losses.training_inputs`'s mixup and CutMix keywords
  (None: neither); accuracy counts the dominant label. A non-finite update
  is not applied (see `nonfinite.guard_update`).

  With `grad_accum_steps` = k > 1 the gradient is the mean of the gradients
  of k micro-batches (`accumulation.micro_batches`), computed one after the
  other by a scan whose body is one micro-batch's forward and backward
  pass (`gradients.micro_batch_grads`), so that a rolled scan holds one
  micro-batch's activations; `accum_unroll` micro-batches per loop
  iteration.
  Each micro-batch has its own mixup ratio and dropout masks; BatchNorm
  normalises with each micro-batch's statistics and updates its running
  averages once per micro-batch. The update, the step counter, the
  learning rate, the non-finite guard and the loss scale act once per step.

  With a moving average in the state, it follows the updated weights with
  `ema_decay` (`train_state.update_ema`); a skipped step leaves it too.

  Only the parameters `trainable` matches get gradients and updates (see
  `gradients.micro_batch_grads` and `optimizer.create_optimizer`); the logged
  gradient norm is theirs.

  With `distill` (`distillation_settings`), the state's frozen teacher
  runs on each micro-batch's images after mixing, in evaluation mode, and
  the loss is distilled from its logits (`distillation.training_inputs`).
  """
  step_key = jax.random.fold_in(jax.random.key(dropout_seed), state.step)
  means, model_state, grads_finite, loss_scale = gradients.mean_grads(
      state, batch, step_key, grad_accum_steps=grad_accum_steps,
      accum_unroll=accum_unroll, graphdef=graphdef,
      label_smoothing=label_smoothing, mixing=mixing or {},
      axis_name=axis_name, trainable=trainable, distill=distill)
  new_state, skipped = nonfinite.guard_update(
      state, train_state.apply_update(state, means['grads'], model_state,
                                      loss_scale, tx, ema_decay),
      grads_finite, means['loss'], means['grads'], skip_nonfinite_steps)
  mean_over_devices = (functools.partial(jax.lax.pmean, axis_name=axis_name)
                       if axis_name is not None else lambda x: x)
  metrics = {
      'loss': mean_over_devices(means['loss']),
      'accuracy': mean_over_devices(means['accuracy']),
      'learning_rate': learning_rate_fn(state.step),
      'grad_norm': optax.global_norm(means['grads']),
  }
  for term in ('base_loss', 'distillation_loss'):  # a distilled loss's
    if term in means:
      metrics[term] = mean_over_devices(means[term])
  if state.loss_scale is not None:
    metrics['loss_scale'] = state.loss_scale.scale
  if skip_nonfinite_steps > 0:
    metrics['skipped_steps'] = skipped.astype(jnp.float32)
  return new_state, metrics
