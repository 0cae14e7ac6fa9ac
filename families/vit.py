"""The Vision Transformer family: patchify, position embedding, one
`StackedBlocks` encoder, and the options of the published backbones:
layer scale (CaiT, DeiT III, DINOv2), register tokens (DINOv2 with
registers), a norm before the encoder and quick GELU (CLIP), attention
pooling (SigLIP's MAP head) and an image projection before the head
(CLIP)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import attention
from layers import classifier
from layers import drop
from layers import layer_scale
from layers import norms
from layers import stacked


# The ViT MLP's GELU: 'tanh' is the approximation (Flax's default, big_vision);
# 'exact' uses erf (PyTorch's nn.GELU, timm); 'quick' is x * sigmoid(1.702 x)
# (OpenAI's CLIP).
VIT_GELUS = ('tanh', 'exact', 'quick')
# How the encoder's tokens become one vector: the mean of the patch tokens,
# the class token, or a learned query attending to them all (MAP).
VIT_POOLS = ('gap', 'cls', 'map')


def gelu(x, kind: str):
  """The GELU of `VIT_GELUS` named `kind`."""
  if kind == 'quick':
    return x * jax.nn.sigmoid(1.702 * x)
  return nnx.gelu(x, approximate=kind == 'tanh')


def mlp_block(width, mlp_dim, dtype, rngs):
  """The two linear layers of a Transformer MLP."""
  return (nnx.Linear(width, mlp_dim, dtype=dtype,
                     kernel_init=nnx.initializers.xavier_uniform(),
                     bias_init=nnx.initializers.normal(1e-6), rngs=rngs),
          nnx.Linear(mlp_dim, width, dtype=dtype,
                     kernel_init=nnx.initializers.xavier_uniform(),
                     bias_init=nnx.initializers.normal(1e-6), rngs=rngs))


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
  """Pre-LN Transformer block: attention and MLP, each with a residual;
  with `layer_scale_init`, each residual branch times a learned
  per-channel factor starting there (CaiT's layer scale)."""

  def __init__(self, width, num_heads, mlp_dim, dropout_rate=0.0, *,
               gelu='tanh', layer_scale_init=None, norm_eps=1e-6,
               float32_logits=True, dtype=jnp.float32, rngs: nnx.Rngs):
    self.gelu = gelu
    self.ln1 = nnx.LayerNorm(width, epsilon=norm_eps, dtype=dtype, rngs=rngs)
    self.attention = attention.MultiHeadAttention(
        width, num_heads, dtype=dtype, float32_logits=float32_logits,
        rngs=rngs)
    self.ln2 = nnx.LayerNorm(width, epsilon=norm_eps, dtype=dtype, rngs=rngs)
    self.mlp_in, self.mlp_out = mlp_block(width, mlp_dim, dtype, rngs)
    self.dropout = nnx.Dropout(dropout_rate)
    scale = lambda: (None if layer_scale_init is None else nnx.Param(
        jnp.full((width,), layer_scale_init, jnp.float32)))
    self.attention_scale, self.mlp_scale = scale(), scale()

  def __call__(self, x, *, train: bool, dropout_key=None,
               drop_path_rate=None):
    attn_key, mlp_key = (jax.random.split(dropout_key) if train
                         else (None, None))
    y = self.attention(self.ln1(x))
    y = self._scaled(self.attention_scale,
                     self.dropout(y, deterministic=not train, rngs=attn_key))
    x = x + drop.drop_path(y, drop_path_rate, dropout_key, 0, train)
    y = gelu(self.mlp_in(self.ln2(x)), self.gelu)
    y = (self.mlp_out(y) if self.mlp_scale is None else
         layer_scale.scaled_linear(self.mlp_out, y, self.mlp_scale[...]))
    y = self.dropout(y, deterministic=not train, rngs=mlp_key)
    return x + drop.drop_path(y, drop_path_rate, dropout_key, 1, train)

  @staticmethod
  def _scaled(scale, y):
    return y if scale is None else y * scale[...].astype(y.dtype)


class MAPHead(nnx.Module):
  """Multihead attention pooling (big_vision's `MAPHead`, timm's
  `AttentionPoolLatent`): a learned probe attends to every token, then an
  MLP with a residual; the probe's output is the pooled vector."""

  def __init__(self, width, num_heads, mlp_dim, *, gelu='exact',
               norm_eps=1e-6, dtype=jnp.float32, rngs: nnx.Rngs):
    self.gelu = gelu
    self.probe = nnx.Param(nnx.initializers.xavier_uniform()(
        rngs.params(), (1, 1, width)))
    self.attention = attention.MultiHeadAttention(width, num_heads,
                                                  dtype=dtype, rngs=rngs)
    self.norm = nnx.LayerNorm(width, epsilon=norm_eps, dtype=dtype,
                              rngs=rngs)
    self.mlp_in, self.mlp_out = mlp_block(width, mlp_dim, dtype, rngs)

  def __call__(self, tokens):
    n, _, width = tokens.shape
    probe = jnp.broadcast_to(self.probe[...].astype(tokens.dtype),
                             (n, 1, width))
    x = self.attention(probe, tokens)
    x = x + self.mlp_out(gelu(self.mlp_in(self.norm(x)), self.gelu))
    return x[:, 0]


def options_problem(*, pool, posemb, gelu, registers, projection,
                    pre_logits, norm_eps, layer_scale_init,
                    distillation_token, feature_batch_norm) -> str | None:
  """What is wrong with these ViT options, naming the fix; None when
  nothing is."""
  if pool not in VIT_POOLS:
    return f'unknown vit_pool {pool!r}; valid: {", ".join(VIT_POOLS)}'
  if posemb not in ('sincos2d', 'learn'):
    return f"unknown vit_posemb {posemb!r}; valid: 'sincos2d', 'learn'"
  if gelu not in VIT_GELUS:
    return f'unknown vit_gelu {gelu!r}; valid names: {", ".join(VIT_GELUS)}'
  if distillation_token and (pool != 'cls' or feature_batch_norm):
    return ('vit_distillation_token needs a class token and no feature norm: '
            'set --config.vit_pool=cls and --config.feature_batch_norm=False')
  if not isinstance(registers, int) or registers < 0:
    return (f'vit_registers {registers!r} must be a whole number >= 0 '
            '(0 = none; DINOv2 with registers has 4)')
  if not isinstance(projection, int) or projection < 0:
    return (f'vit_projection {projection!r} must be a whole number >= 0 '
            "(0 = none; CLIP's ViT-B has 512)")
  if projection and pre_logits:
    return ('vit_projection and vit_pre_logits are two layers before the '
            'head; set --config.vit_pre_logits=False or '
            '--config.vit_projection=0')
  if not norm_eps > 0:
    return f'vit_norm_eps {norm_eps!r} must be > 0 (timm: 1e-6, CLIP: 1e-5)'
  if layer_scale_init is not None and not layer_scale_init > 0:
    return (f'layer_scale_init {layer_scale_init!r} must be > 0 with '
            '--config.vit_layer_scale=True (DINOv2: 1e-5, DeiT III: 1e-6)')
  return None


class ViT(classifier.Classifier):
  """Vision Transformer: patchify, position embedding, one scanned encoder.

  The tokens are the class token (`pool='cls'`), DeiT's distillation token
  (`distillation_token`), `registers` register tokens (arXiv:2309.16588),
  then the patches; only the patches have a position embedding (a file
  that gives the class token one has it added to the token itself). With
  `norm_pre` a LayerNorm follows the embedding (CLIP; the patch
  convolution then has no bias, as in timm). `pool='map'` pools with a
  `MAPHead`; `projection` > 0 is a linear map of the pooled vector to that
  many features before the head (CLIP's image projection).
  `float32_logits=False` computes the attention's logits and softmax in
  `dtype` instead of float32 (`layers/attention.py`).

  With `distillation_token` (DeiT's, arXiv:2012.12877), a second head on
  that token: in training the model returns (class head's logits,
  distillation head's logits), else their mean, as DeiT and timm's
  `VisionTransformerDistilled` do.
  """

  def __init__(self, num_classes, *, patch_size, width, depth, num_heads,
               mlp_dim, image_size, in_channels=3, pool='gap',
               posemb='sincos2d', pre_logits=False, dropout_rate=0.0,
               gelu='tanh', dtype=jnp.float32, stack_options=None,
               drop_path_rate=0.0, feature_batch_norm=False,
               distillation_token=False, layer_scale_init=None,
               registers=0, norm_pre=False, projection=0, norm_eps=1e-6,
               float32_logits=True, rngs: nnx.Rngs):
    problem = image_size_problem(image_size, patch_size)
    if problem:
      raise ValueError(f'ViT cannot take image_size {image_size}: {problem}')
    problem = options_problem(
        pool=pool, posemb=posemb, gelu=gelu, registers=registers,
        projection=projection, pre_logits=pre_logits, norm_eps=norm_eps,
        layer_scale_init=layer_scale_init,
        distillation_token=distillation_token,
        feature_batch_norm=feature_batch_norm)
    if problem:
      raise ValueError(problem)
    self.dtype = dtype
    self.pool = pool
    grid = image_size // patch_size
    self.patch_embed = nnx.Conv(
        in_channels, width, (patch_size, patch_size),
        strides=(patch_size, patch_size), padding='VALID',
        use_bias=not norm_pre, dtype=dtype, rngs=rngs)
    if posemb == 'sincos2d':
      self.posemb = nnx.Variable(sincos_2d_position_embedding(grid, grid,
                                                              width))
    else:
      self.posemb = nnx.Param(
          nnx.initializers.normal(1 / np.sqrt(width))(
              rngs.params(), (1, grid * grid, width)))
    token = lambda count: nnx.Param(jnp.zeros((1, count, width)))
    self.cls = token(1) if pool == 'cls' else None
    self.dist = token(1) if distillation_token else None
    self.registers = token(registers) if registers else None
    norm = lambda: nnx.LayerNorm(width, epsilon=norm_eps, dtype=dtype,
                                 rngs=rngs)
    self.pre_norm = norm() if norm_pre else None
    self.encoder = stacked.StackedBlocks(
        lambda r: EncoderBlock(width, num_heads, mlp_dim, dropout_rate,
                               gelu=gelu, layer_scale_init=layer_scale_init,
                               norm_eps=norm_eps,
                               float32_logits=float32_logits, dtype=dtype,
                               rngs=r),
        depth, rngs=rngs, **(stack_options or {}),
        drop_path_rates=(drop.drop_path_rates(drop_path_rate, depth)
                         if drop_path_rate else None))
    self.encoder_norm = norm()
    self.map_head = (MAPHead(width, num_heads, mlp_dim, gelu=gelu,
                             norm_eps=norm_eps, dtype=dtype, rngs=rngs)
                     if pool == 'map' else None)
    self.projection = (nnx.Linear(width, projection, dtype=dtype, rngs=rngs)
                       if projection else None)
    features = projection or width
    # big_vision's `rep_size=True`: a width x width layer and tanh between
    # the pooled representation and the head.
    self.pre_logits = (nnx.Linear(width, width, dtype=dtype, rngs=rngs)
                       if pre_logits else None)
    self.feature_norm = norms.feature_norm(features, feature_batch_norm,
                                           dtype, rngs)
    head = lambda: nnx.Linear(features, num_classes, dtype=dtype,
                              kernel_init=nnx.initializers.zeros, rngs=rngs)
    self.head = head()
    self.head_dist = head() if distillation_token else None

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
    """The encoder's normalised tokens: class, distillation and register
    tokens (those the model has) first, then the patches."""
    x = self.patch_embed(x.astype(self.dtype))
    n, h, w, c = x.shape
    x = x.reshape(n, h * w, c) + self.posemb[...].astype(self.dtype)
    prefix = self._prefix_tokens()
    if prefix:
      x = jnp.concatenate(
          [jnp.broadcast_to(token[...].astype(self.dtype),
                            (n, token.shape[1], c)) for token in prefix]
          + [x], axis=1)
    if self.pre_norm is not None:
      x = self.pre_norm(x)
    x = self.record(self, stacked.STEM_OUTPUT, x)
    x = self.encoder(x, train=train, dropout_key=dropout_key)
    return self.encoder_norm(x)

  def _prefix_tokens(self) -> list:
    return [token for token in (self.cls, self.dist, self.registers)
            if token is not None]

  def _pooled(self, tokens):
    if self.pool == 'cls':
      return tokens[:, 0]
    if self.pool == 'map':
      return self.map_head(tokens)
    prefix = sum(token.shape[1] for token in self._prefix_tokens())
    return jnp.mean(tokens[:, prefix:], axis=1)

  def _pre_logits(self, x):
    if self.projection is not None:
      return self.projection(x)
    return jnp.tanh(self.pre_logits(x)) if self.pre_logits is not None else x

  def layer_depth(self, name: str):
    """The depth of parameter `name` (its '/'-joined path) for layer-wise
    learning-rate decay, as BEiT and MAE number a ViT's layers: 0 for the
    patch and position embeddings, the tokens and the norm after them, 1
    to L for the encoder's blocks (a vector along the stack's layer axis),
    L + 1 for the final norm, pooling, projection, pre-logits and head."""
    top = name.split('/')[0]
    if top in ('patch_embed', 'posemb', 'cls', 'dist', 'registers',
               'pre_norm'):
      return 0
    if top == 'encoder':
      return 1 + np.arange(self.encoder.num_layers)
    return self.encoder.num_layers + 1
