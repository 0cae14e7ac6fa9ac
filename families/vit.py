"""The Vision Transformer family: patchify, position embedding, one
`StackedBlocks` encoder."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import classifier
from layers import drop
from layers import norms
from layers import stacked


# The ViT MLP's GELU: 'tanh' is the approximation (Flax's default, big_vision);
# 'exact' uses erf (PyTorch's nn.GELU, timm).
VIT_GELUS = ('tanh', 'exact')


def sincos_2d_position_embedding(height, width, dim, temperature=10_000.):
  """Fixed 2-D sine-cosine position embedding (MoCo v3 / big_vision)."""
  if dim % 4:
    raise ValueError(f'ViT width {dim} must be divisible by 4 for sincos2d')
  y, x = np.mgrid[:height, :width]
  omega = 1.0 / temperature**(np.arange(dim // 4) / (dim // 4 - 1))
  y = y.reshape(-1)[:, None] * omega[None]
  x = x.reshape(-1)[:, None] * omega[None]
  pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
  return jnp.asarray(pe[None], jnp.float32)


def image_size_problem(image_size: int, patch_size: int) -> str | None:
  """Why a ViT of `patch_size` patches cannot take images of `image_size`
  pixels square, naming the sizes it can; None when it can. The patches
  are an unpadded strided convolution: a size they do not divide drops its
  last rows and columns unseen."""
  if image_size >= patch_size and image_size % patch_size == 0:
    return None
  return (f'it is cut into patches of {patch_size}; use a multiple of '
          f'{patch_size}, at least {patch_size}')


class EncoderBlock(nnx.Module):
  """Pre-LN Transformer block: attention and MLP, each with a residual."""

  def __init__(self, width, num_heads, mlp_dim, dropout_rate=0.0, *,
               gelu='tanh', dtype=jnp.float32, rngs: nnx.Rngs):
    if gelu not in VIT_GELUS:
      raise ValueError(f'unknown vit_gelu {gelu!r}; valid names: '
                       f'{", ".join(VIT_GELUS)}')
    self.gelu_approximate = gelu == 'tanh'
    self.ln1 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=num_heads, in_features=width, decode=False, dtype=dtype,
        kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs)
    self.ln2 = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    self.mlp_in = nnx.Linear(
        width, mlp_dim, dtype=dtype,
        kernel_init=nnx.initializers.xavier_uniform(),
        bias_init=nnx.initializers.normal(1e-6), rngs=rngs)
    self.mlp_out = nnx.Linear(
        mlp_dim, width, dtype=dtype,
        kernel_init=nnx.initializers.xavier_uniform(),
        bias_init=nnx.initializers.normal(1e-6), rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate)

  def __call__(self, x, *, train: bool, dropout_key=None,
               drop_path_rate=None):
    attn_key, mlp_key = (jax.random.split(dropout_key) if train
                         else (None, None))
    y = self.attention(self.ln1(x))
    y = self.dropout(y, deterministic=not train, rngs=attn_key)
    x = x + drop.drop_path(y, drop_path_rate, dropout_key, 0, train)
    y = self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(x)),
                              approximate=self.gelu_approximate))
    y = self.dropout(y, deterministic=not train, rngs=mlp_key)
    return x + drop.drop_path(y, drop_path_rate, dropout_key, 1, train)


class ViT(classifier.Classifier):
  """Vision Transformer: patchify, position embedding, one scanned encoder.

  With `distillation_token` (DeiT's, arXiv:2012.12877), a second learned
  token after the class token and a second head on it: in training the
  model returns (class head's logits, distillation head's logits), else
  their mean, as DeiT and timm's `VisionTransformerDistilled` do.
  """

  def __init__(self, num_classes, *, patch_size, width, depth, num_heads,
               mlp_dim, image_size, in_channels=3, pool='gap',
               posemb='sincos2d', pre_logits=False, dropout_rate=0.0,
               gelu='tanh', dtype=jnp.float32, stack_options=None,
               drop_path_rate=0.0, feature_batch_norm=False,
               distillation_token=False, rngs: nnx.Rngs):
    problem = image_size_problem(image_size, patch_size)
    if problem:
      raise ValueError(f'ViT cannot take image_size {image_size}: {problem}')
    if pool not in ('gap', 'cls'):
      raise ValueError(f"unknown vit_pool {pool!r}; valid: 'gap', 'cls'")
    if posemb not in ('sincos2d', 'learn'):
      raise ValueError(
          f"unknown vit_posemb {posemb!r}; valid: 'sincos2d', 'learn'")
    if distillation_token and (pool != 'cls' or feature_batch_norm):
      raise ValueError(
          'vit_distillation_token needs a class token and no feature norm: '
          'set --config.vit_pool=cls and --config.feature_batch_norm=False')
    self.dtype = dtype
    self.pool = pool
    grid = image_size // patch_size
    self.patch_embed = nnx.Conv(
        in_channels, width, (patch_size, patch_size),
        strides=(patch_size, patch_size), padding='VALID', dtype=dtype,
        rngs=rngs)
    if posemb == 'sincos2d':
      self.posemb = nnx.Variable(sincos_2d_position_embedding(grid, grid,
                                                              width))
    else:
      self.posemb = nnx.Param(
          nnx.initializers.normal(1 / np.sqrt(width))(
              rngs.params(), (1, grid * grid, width)))
    self.cls = (nnx.Param(jnp.zeros((1, 1, width))) if pool == 'cls'
                else None)
    self.dist = (nnx.Param(jnp.zeros((1, 1, width))) if distillation_token
                 else None)
    self.encoder = stacked.StackedBlocks(
        lambda r: EncoderBlock(width, num_heads, mlp_dim, dropout_rate,
                               gelu=gelu, dtype=dtype, rngs=r),
        depth, rngs=rngs, **(stack_options or {}),
        drop_path_rates=(drop.drop_path_rates(drop_path_rate, depth)
                         if drop_path_rate else None))
    self.encoder_norm = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    # big_vision's `rep_size=True`: a width x width layer and tanh between
    # the pooled representation and the head.
    self.pre_logits = (nnx.Linear(width, width, dtype=dtype, rngs=rngs)
                       if pre_logits else None)
    self.feature_norm = norms.feature_norm(width, feature_batch_norm, dtype,
                                           rngs)
    self.head = nnx.Linear(width, num_classes, dtype=dtype,
                           kernel_init=nnx.initializers.zeros, rngs=rngs)
    self.head_dist = (nnx.Linear(width, num_classes, dtype=dtype,
                                 kernel_init=nnx.initializers.zeros,
                                 rngs=rngs)
                      if distillation_token else None)

  def __call__(self, x, *, train: bool, dropout_key=None):
    tokens = self._encode(x, train=train, dropout_key=dropout_key)
    logits = self.record(self, stacked.LOGITS, self.classify(
        self.head, self._pre_logits(self._pooled(tokens)), train))
    if self.head_dist is None:
      return logits
    distilled = self.classify(self.head_dist,
                              self._pre_logits(tokens[:, 1]), train)
    # DeiT's: both heads to train, their mean to evaluate.
    return ((logits, distilled) if train else
            classifier.mean_of_heads(logits, distilled))

  def features(self, x, *, train: bool = False, dropout_key=None):
    """The pooled pre-logit features (N, D) the head reads (before the
    feature BatchNorm, which belongs to the head): what few-shot linear
    probes fit."""
    return self._pre_logits(self._pooled(self._encode(
        x, train=train, dropout_key=dropout_key)))

  def _encode(self, x, *, train: bool, dropout_key):
    """The encoder's normalised tokens: class and distillation tokens (if
    any) first, then the patches."""
    x = self.patch_embed(x.astype(self.dtype))
    n, h, w, c = x.shape
    x = x.reshape(n, h * w, c) + self.posemb[...].astype(self.dtype)
    tokens = [token for token in (self.cls, self.dist) if token is not None]
    if tokens:
      x = jnp.concatenate(
          [jnp.broadcast_to(token[...].astype(self.dtype), (n, 1, c))
           for token in tokens] + [x], axis=1)
    x = self.record(self, stacked.STEM_OUTPUT, x)
    x = self.encoder(x, train=train, dropout_key=dropout_key)
    return self.encoder_norm(x)

  def _pooled(self, tokens):
    return tokens[:, 0] if self.pool == 'cls' else jnp.mean(tokens, axis=1)

  def _pre_logits(self, x):
    return jnp.tanh(self.pre_logits(x)) if self.pre_logits is not None else x

  def layer_depth(self, name: str):
    """The depth of parameter `name` (its '/'-joined path) for layer-wise
    learning-rate decay, as BEiT and MAE number a ViT's layers: 0 for the
    patch and position embeddings and the tokens, 1 to L for the
    encoder's blocks (a vector along the stack's layer axis), L + 1 for the
    final norm, pre-logits and head."""
    top = name.split('/')[0]
    if top in ('patch_embed', 'posemb', 'cls', 'dist'):
      return 0
    if top == 'encoder':
      return 1 + np.arange(self.encoder.num_layers)
    return self.encoder.num_layers + 1
