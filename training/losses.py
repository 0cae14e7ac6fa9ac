"""The training loss: cross-entropy against smoothed labels, and mixup."""

import jax
import jax.numpy as jnp
import optax


def mixup_ratio(key, alpha: float):
  """big_vision's mixup ratio r ~ Beta(alpha, alpha), taken >= 1/2 so that
  each example's own label dominates; None (no mixup) when alpha is 0."""
  if alpha <= 0:
    return None
  ratio = jax.random.beta(key, alpha, alpha)
  return jnp.maximum(ratio, 1.0 - ratio)


def mix(x, ratio):
  """Each example of the batch x mixed with the one before it (the first
  with the last): ratio x x + (1 - ratio) x rolled x; x itself if no ratio."""
  if ratio is None:
    return x
  mixed = (ratio * x.astype(jnp.float32) +
           (1.0 - ratio) * jnp.roll(x, 1, axis=0).astype(jnp.float32))
  return mixed.astype(x.dtype)


def cross_entropy(logits, labels, label_smoothing=0.0, mix_ratio=None):
  """Softmax cross-entropy against the (smoothed, mixed) one-hot labels."""
  targets = optax.smooth_labels(
      jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
  return optax.softmax_cross_entropy(logits, mix(targets, mix_ratio))


def training_inputs(batch, step_key, *, label_smoothing: float,
                    mixup_alpha: float):
  """What a train step feeds the model, and its loss of the model's output:
  the images and the mean cross-entropy against the smoothed labels, both
  mixed (see `mix`) with a ratio drawn from `step_key` when mixup_alpha > 0.
  """
  ratio = mixup_ratio(jax.random.fold_in(step_key, 1), mixup_alpha)

  def loss_of_output(logits):
    return jnp.mean(cross_entropy(logits, batch['label'], label_smoothing,
                                  ratio))
  return mix(batch['image'], ratio), loss_of_output
