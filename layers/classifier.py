"""The head every family ends with: pooled features, the optional feature
BatchNorm, a linear classifier, float32 logits recorded for the
intermediate gradients."""

import jax.numpy as jnp

from layers import stacked


def mean_of_heads(class_logits, distillation_logits):
  """What a model with DeiT's distillation token predicts with: the mean
  of its class head's and its distillation head's logits (DeiT's and
  timm's `VisionTransformerDistilled` evaluation)."""
  return (class_logits + distillation_logits) / 2


class Classifier(stacked.RecordsIntermediates):
  """A model of `features(x, train=..., dropout_key=...)` (N, D) feeding
  its `head` through its `feature_norm` (None: none)."""

  def __call__(self, x, *, train: bool, dropout_key=None):
    return self.record(self, stacked.LOGITS, self.classify(
        self.head, self.features(x, train=train, dropout_key=dropout_key),
        train))

  def classify(self, head, features, train: bool):
    """`head`'s float32 logits of the pooled `features`."""
    if self.feature_norm is not None:
      features = self.feature_norm(features, use_running_average=not train)
    return head(features).astype(jnp.float32)
