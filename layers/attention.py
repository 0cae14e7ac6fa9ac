"""Multi-head dot-product attention, its logits in float32 or in the
compute dtype.

The parameters are `nnx.MultiHeadAttention`'s (query, key and value
kernels (width, heads, head_dim), the output's (heads, head_dim, width), a
bias beside each), so checkpoints and timm's converted files load into
either. With `float32_logits` the results are also theirs
(`jax.nn.dot_product_attention`'s: the logits and the softmax in float32);
without, the logits and the softmax are computed in the compute dtype, as
MaxText's `float32_logits=False` does: in bfloat16, a ViT-S/16 train step
on a TPU v5e ran 17% faster (docs/performance.md), the logits (heads x
tokens x tokens per image) being the step's largest elementwise work.
"""

from flax import nnx
import jax
import jax.numpy as jnp


class MultiHeadAttention(nnx.Module):
  """`num_heads` heads of scaled dot-product attention over `width`
  channels: queries from `x`, keys and values from `context` (`x` itself
  when None)."""

  def __init__(self, width: int, num_heads: int, *, dtype,
               float32_logits: bool = True, rngs: nnx.Rngs):
    if width % num_heads:
      raise ValueError(f'attention width {width} is not divisible by its '
                       f'{num_heads} heads')
    head_dim = width // num_heads
    project = lambda: nnx.LinearGeneral(
        width, (num_heads, head_dim), dtype=dtype,
        kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs)
    self.query, self.key, self.value = project(), project(), project()
    self.out = nnx.LinearGeneral(
        (num_heads, head_dim), width, axis=(-2, -1), dtype=dtype,
        kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs)
    self.dtype = dtype
    self.logits_dtype = jnp.float32 if float32_logits else dtype

  def __call__(self, x, context=None):
    context = x if context is None else context
    q = self._heads(self.query, x)
    k = self._heads(self.key, context)
    v = self._heads(self.value, context)
    # In float32 as `jax.nn.dot_product_attention` computes them: the
    # bfloat16 products accumulated in float32 (its explicit algorithm keeps
    # the backward pass's products in the same types).
    precision = (jax.lax.DotAlgorithmPreset.BF16_BF16_F32
                 if q.dtype == jnp.bfloat16 and
                 self.logits_dtype == jnp.float32 else None)
    logits = jnp.einsum('bhqd,bhkd->bhqk', q, k, precision=precision,
                        preferred_element_type=self.logits_dtype)
    weights = jax.nn.softmax(logits * q.shape[-1] ** -0.5).astype(v.dtype)
    y = jnp.einsum('bhqk,bhkd->bhqd', weights, v)
    return (jnp.einsum('bhqd,hdc->bqc', y,
                       self.out.kernel[...].astype(self.dtype)) +
            self.out.bias[...].astype(self.dtype))

  def _heads(self, linear: nnx.LinearGeneral, x):
    """`linear`'s projection of `x` (batch, tokens, width) as (batch,
    heads, tokens, head_dim), the layout the batched products read."""
    y = jnp.einsum('bnc,chd->bhnd', x.astype(self.dtype),
                   linear.kernel[...].astype(self.dtype))
    return y + linear.bias[...].astype(self.dtype)[:, None, :]
