"""The BatchNorm of the convolution nets, frozen with its parameters, and
the optional BatchNorm between any model's pooled features and its head."""

from flax import nnx


def as_given(args, /, *, dtype=None, inexact=True):
  """A `promote_dtype` for nnx's norms that casts nothing: the statistics,
  scale and bias stay float32 and only the output takes the norm's
  `dtype`, as in Linen's norms (the Flax ImageNet example's)."""
  del dtype, inexact
  return args


class BatchNorm(nnx.BatchNorm):
  """nnx.BatchNorm computing as Linen's (`as_given`) that, once `frozen` is
  set, normalises with its running statistics and leaves them as they are
  in training too (timm's frozen BatchNorm): a layer whose scale and bias
  do not train keeps the statistics its weights were trained with.

  nnx's default casts the scale, bias and running statistics to `dtype`
  first: in bfloat16, XLA:TPU then sums the scale's and bias's gradients
  in passes of their own over each activation, and evaluation normalises
  by rounded statistics (docs/performance.md)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, promote_dtype=as_given, **kwargs)
    self.frozen = False

  def __call__(self, x, use_running_average=None, **kwargs):
    return super().__call__(
        x, use_running_average=True if self.frozen else use_running_average,
        **kwargs)


def feature_norm(features, enabled, dtype, rngs):
  """The BatchNorm without scale or bias between the pooled features and the
  head (`feature_batch_norm`), or None: MoCo v3's and MAE's linear probes
  normalise the frozen features so; the head can absorb it after training."""
  if not enabled:
    return None
  return BatchNorm(features, momentum=0.9, epsilon=1e-6, use_scale=False,
                   use_bias=False, dtype=dtype, rngs=rngs)

