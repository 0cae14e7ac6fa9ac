"""The training loss: cross-entropy against smoothed labels, mixup and
CutMix."""

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


def cutmix_box(key, alpha: float, height: int, width: int):
  """timm's CutMix box (`rand_bbox`): side ratio sqrt(1 - lam) of the image
  for lam ~ Beta(alpha, alpha), centred on a uniform pixel, clipped to the
  image. Returns the box as a (height, width) mask and the ratio of the
  image left outside it (lam corrected to the clipped box's true area)."""
  lam_key, y_key, x_key = jax.random.split(key, 3)
  cut = jnp.sqrt(1.0 - jax.random.beta(lam_key, alpha, alpha))
  cut_h = (height * cut).astype(jnp.int32)
  cut_w = (width * cut).astype(jnp.int32)
  cy = jax.random.randint(y_key, (), 0, height)
  cx = jax.random.randint(x_key, (), 0, width)
  y0, y1 = (jnp.clip(cy - cut_h // 2, 0, height),
            jnp.clip(cy + cut_h // 2, 0, height))
  x0, x1 = (jnp.clip(cx - cut_w // 2, 0, width),
            jnp.clip(cx + cut_w // 2, 0, width))
  ys, xs = jnp.arange(height)[:, None], jnp.arange(width)[None, :]
  box = (ys >= y0) & (ys < y1) & (xs >= x0) & (xs < x1)
  return box, 1.0 - jnp.mean(box.astype(jnp.float32))


def cut(x, box):
  """Each image of the batch x with `box` pasted from the one before it
  (the first from the last), the partner `mix` takes."""
  return jnp.where(box[None, :, :, None], jnp.roll(x, 1, axis=0), x)


def training_inputs(batch, step_key, *, label_smoothing: float,
                    mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0,
                    mixup_switch_prob: float = 0.5):
  """What a train step feeds the model, its loss of the model's output and
  the labels its accuracy counts.

  With `mixup_alpha` > 0 the images and the smoothed labels are mixed (see
  `mix`) with a ratio drawn from `step_key`; with `cutmix_alpha` > 0 a
  CutMix box is pasted instead and the labels weighted by its area; with
  both, CutMix with probability `mixup_switch_prob`, else mixup (timm's
  `Mixup` per batch). Accuracy counts the dominant label: the image's own,
  or its partner's when the box covers more than half.
  """
  ratio = mixup_ratio(jax.random.fold_in(step_key, 1), mixup_alpha)
  images = mix(batch['image'], ratio)
  if cutmix_alpha > 0:
    _, height, width, _ = batch['image'].shape
    box, box_ratio = cutmix_box(jax.random.fold_in(step_key, 2), cutmix_alpha,
                                height, width)
    cut_images = cut(batch['image'], box)
    if ratio is None:
      images, ratio = cut_images, box_ratio
    else:
      use_cutmix = jax.random.bernoulli(jax.random.fold_in(step_key, 3),
                                        mixup_switch_prob)
      images = jnp.where(use_cutmix, cut_images, images)
      ratio = jnp.where(use_cutmix, box_ratio, ratio)
  labels = batch['label']
  if ratio is not None:
    labels = jnp.where(ratio >= 0.5, labels, jnp.roll(labels, 1))

  def loss_of_output(logits):
    return jnp.mean(cross_entropy(logits, batch['label'], label_smoothing,
                                  ratio))
  return images, loss_of_output, labels
