"""Knowledge distillation: the losses against a teacher's logits, and the
loss of a train step that runs the teacher on the student's own inputs.

`soft` and `hard` are DeiT's (`losses.py`, `DistillationLoss`), `kl` is
big_vision's (`evaluators/proj/distill/distance.py`, `dist(kind='kl')`, as
`trainers/proj/distill/distill.py` averages it over the batch). A step's
loss is `(1 - alpha) x base + alpha x distillation` (`total_loss`); the
train step logs both terms beside it (`train_base_loss`,
`train_distillation_loss`). A model with
DeiT's distillation token gives two heads' logits in training: the base
loss goes on the class head, the distillation loss on the distillation
head; without a teacher both on their mean (timm's
`VisionTransformerDistilled`). The teacher itself is `training/teacher.py`.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import optax

from layers import classifier
from training import losses

DISTILLATION_TYPES = ('none', 'soft', 'hard', 'kl')


def soft_loss(student_logits, teacher_logits, tau: float):
  """DeiT's soft distillation: KL(teacher || student) of the softmaxes at
  temperature tau, summed over the batch and the classes, times tau^2 over
  the number of logits (PyTorch's `kl_div(..., reduction='sum')` x T^2 /
  `numel`, as DeiT writes it)."""
  log_student = jax.nn.log_softmax(student_logits / tau, axis=-1)
  log_teacher = jax.nn.log_softmax(teacher_logits / tau, axis=-1)
  total = jnp.sum(jnp.exp(log_teacher) * (log_teacher - log_student))
  return total * tau * tau / student_logits.size


def hard_loss(student_logits, teacher_logits):
  """DeiT's hard distillation: cross-entropy against the teacher's top-1
  class, averaged over the batch."""
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
      student_logits, jnp.argmax(teacher_logits, axis=-1)))


def kl_loss(student_logits, teacher_logits, tau: float):
  """big_vision's `kl` distance: tau^2 x KL(softmax(teacher / tau) ||
  softmax(student / tau)) per example, averaged over the batch."""
  log_student = jax.nn.log_softmax(student_logits / tau, axis=-1)
  log_teacher = jax.nn.log_softmax(teacher_logits / tau, axis=-1)
  per_example = jnp.sum(jnp.exp(log_teacher) * (log_teacher - log_student),
                        axis=-1)
  return tau * tau * jnp.mean(per_example)


def distillation_loss(kind: str, student_logits, teacher_logits,
                      tau: float):
  """The distillation loss `kind` (not 'none') of a batch's logits, the
  teacher's held constant."""
  teacher_logits = jax.lax.stop_gradient(
      teacher_logits.astype(jnp.float32))
  student_logits = student_logits.astype(jnp.float32)
  if kind == 'soft':
    return soft_loss(student_logits, teacher_logits, tau)
  if kind == 'hard':
    return hard_loss(student_logits, teacher_logits)
  if kind == 'kl':
    return kl_loss(student_logits, teacher_logits, tau)
  raise ValueError(f'unknown distillation_type {kind!r}; valid names: '
                   f'{", ".join(DISTILLATION_TYPES)}')


def total_loss(base_loss, distillation_loss, alpha: float):
  """DeiT's `base_loss * (1 - alpha) + distillation_loss * alpha`."""
  return base_loss * (1.0 - alpha) + distillation_loss * alpha


def class_and_distillation_logits(output):
  """(class head's logits, distillation head's logits) of a model's output:
  the two heads of a model with a distillation token in training, else its
  one head's logits twice."""
  if isinstance(output, tuple):
    return output
  return output, output


def prediction(output):
  """The logits a model's output predicts with: the mean of the two heads
  of a distillation token, else themselves."""
  if not isinstance(output, tuple):
    return output
  return classifier.mean_of_heads(*output)


def teacher_logits(teacher_graphdef, teacher_state, images):
  """The frozen teacher's float32 logits of `images`: evaluation mode
  (BatchNorm's running statistics, no dropout), no gradient."""
  model = nnx.merge(teacher_graphdef, jax.lax.stop_gradient(teacher_state))
  return jax.lax.stop_gradient(
      model(images, train=False).astype(jnp.float32))


def training_inputs(batch, step_key, teacher_state, *, label_smoothing: float,
                    teacher_graphdef=None, distillation_type: str = 'none',
                    distillation_alpha: float = 0.5,
                    distillation_tau: float = 1.0, **mixing):
  """`losses.training_inputs` with the teacher's loss: the images, the
  loss of the model's output (a function giving the loss and, distilled,
  {'base_loss', 'distillation_loss'}: its two terms; else {}) and the
  labels accuracy counts.

  The teacher (when `teacher_graphdef` is set) sees exactly the images the
  student does, after mixup or CutMix; its logits are computed here, once,
  outside the student's differentiated function.
  """
  images, base_loss, labels = losses.training_inputs(
      batch, step_key, label_smoothing=label_smoothing, **mixing)
  if teacher_graphdef is None or distillation_type == 'none':
    return images, lambda output: (base_loss(prediction(output)), {}), labels
  targets = teacher_logits(teacher_graphdef, teacher_state, images)
  return images, distilled_loss(base_loss, targets, distillation_type,
                                distillation_alpha, distillation_tau), labels


def distilled_loss(base_loss, targets, kind: str, alpha: float, tau: float):
  """The loss of a model's output given the teacher's logits `targets`:
  `base_loss` of the class head combined with the distillation loss of the
  distillation head (one head: both of it), and those two terms."""
  def loss_of_output(output):
    class_logits, distillation_logits = class_and_distillation_logits(output)
    terms = {'base_loss': base_loss(class_logits),
             'distillation_loss': distillation_loss(
                 kind, distillation_logits, targets, tau)}
    return total_loss(terms['base_loss'], terms['distillation_loss'],
                      alpha), terms
  return loss_of_output


def agreement_sums(student_logits, teacher_top1, mask):
  """Evaluation sums: the student's top-1 agreement with the teacher's
  top-1 classes `teacher_top1`, over the unmasked examples."""
  return {'teacher_agreement': jnp.sum(
      (jnp.argmax(student_logits, axis=-1) == teacher_top1) * mask)}


def agreement_metrics(totals: dict, examples: float, prefix: str) -> dict:
  """`{prefix}teacher_agreement` of the summed `agreement_sums`; {}
  without them."""
  if 'teacher_agreement' not in totals:
    return {}
  return {f'{prefix}teacher_agreement': totals['teacher_agreement'] / examples}
