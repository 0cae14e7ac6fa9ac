"""Layer scale (CaiT's): a learned factor per channel on a residual
branch, applied by the branch's last linear layer."""

from flax import nnx


def scaled_linear(layer: nnx.Linear, x, scale):
  """`layer(x) * scale` (a factor per output feature), computed as the
  layer with its kernel and bias scaled: the same values, but the backward
  pass keeps no copy of the layer's output for the scale's gradient (the
  kernel's gradient carries it): one activation per block fewer."""
  kernel, bias = layer.kernel[...] * scale, layer.bias[...] * scale
  x, kernel, bias = layer.promote_dtype((x, kernel, bias), dtype=layer.dtype)
  return layer.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                           precision=layer.precision) + bias
