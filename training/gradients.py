"""The gradient of one train step: each micro-batch's forward and backward
pass (only the trained parameters differentiated), accumulated over the
step's micro-batches (see `training/update.py`)."""

import functools

from flax import nnx
import jax
import jax.numpy as jnp

from runtime import mixed_precision
from training import accumulation
from training import distillation
from training import trainable as trainable_lib


def sync_batch_norm(model: nnx.Module, axis_name: str) -> None:
  """Makes every BatchNorm of `model` average its batch statistics over
  the devices of `axis_name`, as one BatchNorm over the global batch does."""
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.BatchNorm):
      module.axis_name = axis_name


def micro_batch_loss(params, model_state, images, loss_of_output,
                     dropout_key, *, graphdef, axis_name: str | None,
                     trainable: str = ''):
  """The loss of one micro-batch's model output, with its terms (see
  `distillation.training_inputs`), the logits and the model's updated
  statistics as auxiliary outputs. BatchNorms with frozen parameters
  normalise with their running statistics and keep them."""
  model = nnx.merge(graphdef, params, model_state, copy=True)
  trainable_lib.freeze_batch_norms(model, trainable)
  if axis_name is not None:
    sync_batch_norm(model, axis_name)
  logits = model(images, train=True, dropout_key=dropout_key)
  loss, terms = loss_of_output(logits)
  return loss, (terms, logits, nnx.state(model, nnx.Not(nnx.Param)))


def micro_batch_grads(carry, micro, *, state, graphdef, label_smoothing: float,
                      mixing: dict, axis_name: str | None, trainable: str,
                      distill: dict):
  """The accumulation scan's body: one micro-batch's forward and backward
  pass, its gradients, loss (and its terms) and accuracy added to the
  running sums.

  The gradient is taken of the parameters that `trainable` matches alone
  (`trainable_lib.split`), so that XLA drops the backward pass below the
  lowest of them; the frozen ones' gradients are zeros. With a teacher
  (`distill`: `distillation.training_inputs`'s keywords), the loss is
  distilled from its logits of this micro-batch's images."""
  model_state, sums, finite, loss_scale = carry
  micro_batch, micro_key = micro
  # The same mixup ratio and CutMix box on every device: made from the
  # micro-batch's key.
  images, loss_of_output, accuracy_labels = distillation.training_inputs(
      micro_batch, micro_key, state.teacher, label_smoothing=label_smoothing,
      **mixing, **distill)
  dropout_key = micro_key
  if axis_name is not None:  # a distinct dropout mask on every device
    dropout_key = jax.random.fold_in(dropout_key,
                                     jax.lax.axis_index(axis_name))
  trained, frozen, merge = trainable_lib.split(state.params, trainable)
  loss_fn = lambda trained: micro_batch_loss(
      merge(trained, frozen), model_state, images, loss_of_output,
      dropout_key, graphdef=graphdef, axis_name=axis_name,
      trainable=trainable)
  # Every micro-batch is scaled by the step's loss scale; the scale's next
  # value is the one of the first micro-batch with non-finite gradients,
  # or, if there is none, of any (they agree).
  next_scale, micro_finite, (loss, (terms, logits, model_state)), grads = (
      mixed_precision.value_and_grad(loss_fn, state.loss_scale, axis_name)(
          trained))
  grads = merge(grads, [jnp.zeros_like(x) for x in frozen])
  if state.loss_scale is not None:
    loss_scale = jax.tree.map(lambda kept, new: jnp.where(finite, new, kept),
                              loss_scale, next_scale)
    finite = finite & micro_finite
  accuracy = jnp.mean(
      jnp.argmax(distillation.prediction(logits), -1) == accuracy_labels)
  sums = jax.tree.map(jnp.add, sums, {'grads': grads, 'loss': loss,
                                      'accuracy': accuracy, **terms})
  return (model_state, sums, finite, loss_scale), None


def mean_grads(state, batch, step_key, *, grad_accum_steps: int,
               accum_unroll: int, distill: dict | None = None,
               **micro_kwargs):
  """The gradients, loss (with a teacher, its terms 'base_loss' and
  'distillation_loss' too) and accuracy averaged over the micro-batches
  (see `train_step`), with the updated statistics, whether the gradients
  are finite (None without a loss scale) and the next loss scale."""
  scalars = ['loss', 'accuracy']
  if distill and distill['distillation_type'] != 'none':
    scalars += ['base_loss', 'distillation_loss']
  zeros = {'grads': jax.tree.map(jnp.zeros_like, state.params),
           **{name: jnp.zeros((), jnp.float32) for name in scalars}}
  (model_state, sums, finite, loss_scale), _ = accumulation.scan(
      functools.partial(micro_batch_grads, state=state,
                        distill=distill or {}, **micro_kwargs),
      (state.model_state, zeros, jnp.array(True), state.loss_scale),
      batch, step_key, grad_accum_steps, accum_unroll)
  means = jax.tree.map(lambda total: total / grad_accum_steps, sums)
  if state.loss_scale is None:
    finite = None
  return means, model_state, finite, loss_scale
