"""The scanned stack `scan(remat(Block))` and what it is made of: the remat
policies by name, and the recording points of intermediate gradients.

Every deep part of a model is a `StackedBlocks`: L identical blocks whose
parameters (and BatchNorm statistics) carry a leading layer axis, applied by
`nnx.scan` over `nnx.remat(block)`.
"""

import math
from typing import Callable

from flax import nnx
import jax
import jax.numpy as jnp


def saves_products(prim, *operands, **params) -> bool:
  """The policy of `none` in a rolled scan: keep the output of every
  convolution, matrix product and reduction (BatchNorm's and LayerNorm's
  statistics, the softmax's maximum and sum), recompute the elementwise
  rest (norms applied, activations, residual sums, the softmax's
  exponentials) from them in the backward pass; and recompute the
  attention logits once the tokens outnumber a head's channels
  (`expands`).

  That is what XLA keeps of an unrolled network, where it fuses the cheap
  elementwise work into the backward pass; across a rolled scan's loop it
  cannot, and without a policy every residual JAX's differentiation names
  (float32 copies of each BatchNorm and LayerNorm input, masks, GELU's
  parts) is stacked per layer and kept whole: 1.8-3.6x the memory of the
  unrolled step (docs/accelerators.md). The statistics are small (one
  number per channel, token or query) and recomputing them would cost a
  pass over each activation per layer: 7% of a ResNet-50 or ViT-S/16 step
  on a TPU v5e (docs/performance.md).
  """
  if prim is jax.lax.dot_general_p:
    return not expands(operands, params['dimension_numbers'])
  return prim in (jax.lax.conv_general_dilated_p, jax.lax.reduce_sum_p,
                  jax.lax.reduce_max_p)


def expands(operands, dimension_numbers) -> bool:
  """Whether a matrix product with batch dimensions has more outputs than
  either operand: attention's query-key logits (heads x tokens x tokens,
  in float32) once the tokens outnumber a head's channels. Recomputing
  them is one batched product, a few percent of a layer's; stacked per
  layer they are written, read back and copied once more across the loop:
  ViT-S/16 and DeiT-S ran 4-6% faster on a TPU v5e recomputing them, in
  30% less memory (docs/performance.md). The layers' own products (no
  batch dimensions) are kept, however wide."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  if not lhs_batch:
    return False
  lhs, rhs = (operand.shape for operand in operands[:2])
  free = lambda shape, contract, batch: math.prod(
      d for i, d in enumerate(shape) if i not in (*contract, *batch))
  outputs = (math.prod(lhs[i] for i in lhs_batch) *
             free(lhs, lhs_contract, lhs_batch) *
             free(rhs, rhs_contract, rhs_batch))
  return outputs > max(math.prod(lhs), math.prod(rhs))


def saves_products_but_qkv(prim, *operands, **params) -> bool:
  """The policy of `recompute_qkv`: `none`'s (`saves_products`), except
  that the attention's query, key and value projections
  (`projects_into_heads`) are recomputed in the backward pass from the
  block's normalised input, itself recomputed from the block's input and
  the LayerNorm's statistics. Stacked across a rolled scan, XLA writes
  each in the layout of the forward pass's logits and reads it back
  through a layout copy; recomputed, they cost three matrix products per
  layer: on a TPU v5e ViT-S/16 and DeiT-S at 256 per chip ran about 2%
  faster in 19-23% less memory (docs/performance.md). Networks without
  such projections compile as under `none`; an unrolled stack, where XLA
  lays each projection out as its readers want, applies no remat, as
  under `none`."""
  if (prim is jax.lax.dot_general_p and
      projects_into_heads(operands, params['dimension_numbers'])):
    return False
  return saves_products(prim, *operands, **params)


def saves_products_and_erf(prim, *operands, **params) -> bool:
  """The policy of `keep_erf`: `none`'s (`saves_products`), and the output
  of every `erf` and `erfc`: the exact GELU's, some 20 operations per
  element to evaluate again in the backward pass, where it is the largest
  elementwise work of a block with a wide MLP at high resolution. On a
  TPU v5e, kept, ConvNeXt-T at 128 per chip stepped 20% faster rolled and
  17% unrolled, DeiT-S 2.7% rolled but 3% slower unrolled, and Swin-T 4%
  slower rolled (docs/performance.md); its cost is one more stacked array
  per block, the width of the MLP. Networks without an exact GELU compile
  as under `none`."""
  return (prim in (jax.lax.erf_p, jax.lax.erfc_p) or
          saves_products(prim, *operands, **params))


def projects_into_heads(operands, dimension_numbers) -> bool:
  """Whether a matrix product maps tokens' channels to heads: no batch
  dimensions, one contracted, a (width, heads, head_dim) kernel
  (`layers/attention.py`'s query, key and value; its output projection
  contracts two)."""
  (_, rhs_contract), (lhs_batch, _) = dimension_numbers
  return not lhs_batch and len(rhs_contract) == 1 and operands[1].ndim == 3


# `none`: nothing but elementwise work recomputed (`saves_products` in a
# rolled scan, no remat at all unrolled); `recompute_qkv`: the attention's
# projections too (`ROLLED_ONLY` as `none`); `keep_erf`: `none`'s and the
# exact GELU's erf, unrolled too (ConvNeXt-T steps faster so either way);
# every other name is a `jax.checkpoint_policies` entry deciding what the
# backward pass may keep.
REMAT_POLICIES = {
    'none': saves_products,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.dots_saveable,
    'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'everything': jax.checkpoint_policies.everything_saveable,
    'offload_dots': jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        'device', 'pinned_host'),
    'recompute_qkv': saves_products_but_qkv,
    'keep_erf': saves_products_and_erf,
}
# The policies an unrolled stack does without: XLA keeps what they keep.
ROLLED_ONLY = ('none', 'recompute_qkv')


# Names of the recorded points (see `RecordsIntermediates`): each block's
# output in a stack, the output of a ResNet stage's first block (outside its
# stack), the stem's output (the first stack's input), the logits.
LAYER_OUTPUT = 'layer_output'
FIRST_BLOCK_OUTPUT = 'first_block_output'
STEM_OUTPUT = 'stem_output'
LOGITS = 'logits'


def remat_policy_by_name(name: str):
  """The `jax.checkpoint` policy of a config name."""
  if name not in REMAT_POLICIES:
    raise ValueError(
        f'unknown remat_policy {name!r}; valid names: '
        f'{", ".join(REMAT_POLICIES)}')
  return REMAT_POLICIES[name]


class RecordsIntermediates(nnx.Module):
  """A module with points where `intermediate_grads` reads the gradient.

  Recording is off by default, so ordinary steps trace none of it (outside
  `nnx.capture`, `perturb` and `sow` would add variables to the model);
  `nnx.view(model, record_intermediates=True)` turns it on for the summary
  step, which runs the model inside `nnx.capture`.
  """

  record_intermediates = False

  def set_view(self, record_intermediates: bool | None = None):
    """Used by `nnx.view`: turns the recording points on or off."""
    if record_intermediates is not None:
      self.record_intermediates = record_intermediates

  def record(self, module: nnx.Module, name: str, x):
    """`x` plus a zero perturbation named `name` on `module`, its L2 norm
    sown beside it; `x` itself when not recording."""
    if not self.record_intermediates:
      return x
    module.sow(nnx.Intermediate, name,
               jnp.linalg.norm(x.astype(jnp.float32)),
               reduce_fn=lambda _, norm: norm)
    return module.perturb(name, x)


def is_stacked(name: str) -> bool:
  """Whether the parameter `name` (its '/'-joined path) belongs to the
  `layers` of a StackedBlocks, whose arrays carry a leading layer axis."""
  return 'layers' in name.split('/')


class StackedBlocks(RecordsIntermediates):
  """`num_layers` identical blocks applied as `scan(remat(block))`.

  `make_block(rngs)` builds one block; `block(x, train=..., dropout_key=...,
  drop_path_rate=...)` maps an activation to one of the same shape. The
  layers are created in one go under `nnx.vmap` with split RNGs, so every
  parameter and BatchNorm statistic has a leading layer axis of size
  `num_layers`. `drop_path_rates` (one per layer, or None: no stochastic
  depth) enter the scan beside each layer's key, as scanned inputs.

  `scan_segments` = k > 1 nests the scan: an outer scan over k segments,
  each remat'ed whole (only its input is kept), runs an inner
  scan(remat(block)) over `num_layers / k` layers, so the backward pass
  holds k segment inputs plus one segment's layer inputs instead of every
  layer's input: sqrt(L) memory at k ~ sqrt(L). The parameters keep their
  (num_layers, ...) layout and are reshaped to (k, num_layers / k, ...) on
  the fly.
  """

  def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module],
               num_layers: int, *, remat_policy: str = 'none',
               scan_layers: bool = True, scan_unroll: int = 1,
               scan_segments: int = 1,
               drop_path_rates: list[float] | None = None, rngs: nnx.Rngs):
    if scan_segments < 1 or num_layers % scan_segments:
      raise ValueError(
          f'scan_segments {scan_segments} does not divide the depth '
          f'{num_layers} of a scanned stack; set --config.scan_segments to a '
          f'divisor of {num_layers} (1 = no segments)')
    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=0, out_axes=0, axis_size=num_layers)
    def create_layers(rngs):
      return make_block(rngs)

    self.layers = create_layers(rngs)
    self.num_layers = num_layers
    self.remat_policy = remat_policy
    self.scan_layers = scan_layers
    self.scan_unroll = scan_unroll
    self.scan_segments = scan_segments
    # `ROLLED_ONLY` policies unrolled need no remat (XLA recomputes the
    # elementwise work itself); set only to count what a rolled stack
    # recomputes (`unroll_for_counting`).
    self.remat_unrolled = False
    self.drop_path_rates = (None if drop_path_rates is None else
                            tuple(drop_path_rates))

  def __call__(self, x, *, train: bool, dropout_key=None):
    if dropout_key is None:
      dropout_key = jax.random.key(0)
    # Each layer's key and drop-path rate: the scan's inputs. No keys
    # outside training, where nothing is random: an evaluated program holds
    # no key arithmetic (ONNX has none).
    layer_inputs = (jax.random.split(dropout_key, self.num_layers) if train
                    else None,
                    None if self.drop_path_rates is None else
                    jnp.asarray(self.drop_path_rates, jnp.float32))

    def apply_block(block, x, inputs):
      key, rate = inputs
      # Recorded on the block, so the scan stacks it along the layer axis.
      return self.record(block, LAYER_OUTPUT, block(
          x, train=train, dropout_key=key, drop_path_rate=rate))

    rolled = self.scan_layers and self.scan_unroll < self.num_layers
    if (self.remat_policy not in ROLLED_ONLY or rolled or
        self.remat_unrolled):
      # A rolled scan keeps XLA from merging the backward pass's
      # recomputation into the forward pass; unrolled, only prevent_cse does.
      apply_block = nnx.remat(
          apply_block, policy=remat_policy_by_name(self.remat_policy),
          prevent_cse=not rolled)

    if self.scan_layers:
      @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=nnx.Carry,
                unroll=self.scan_unroll)
      def scan_over_layers(block, x, inputs):
        return apply_block(block, x, inputs)
      if self.scan_segments == 1:
        return scan_over_layers(self.layers, x, layer_inputs)
      return self._scan_over_segments(scan_over_layers, x, layer_inputs)

    # The same stacked parameters, one layer at a time in Python; the
    # updated per-layer state (BatchNorm statistics) is stacked back.
    graphdef, stacked_state = nnx.split(self.layers)
    new_states = []
    for i in range(self.num_layers):
      block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked_state))
      x = apply_block(block, x, jax.tree.map(lambda a: a[i], layer_inputs))
      new_states.append(nnx.state(block))
    nnx.update(self.layers, jax.tree.map(lambda *a: jnp.stack(a), *new_states))
    return x

  def _scan_over_segments(self, scan_over_layers, x, layer_inputs):
    """`scan_over_layers` on each of k segments, in an outer remat'ed scan."""
    k = self.scan_segments
    graphdef, stacked_state = nnx.split(self.layers)
    segments = nnx.merge(graphdef, jax.tree.map(
        lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:]), stacked_state))

    @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat(policy=jax.checkpoint_policies.nothing_saveable,
               prevent_cse=False)
    def scan_over_segments(segment, x, inputs):
      return scan_over_layers(segment, x, inputs)

    x = scan_over_segments(segments, x, jax.tree.map(
        lambda a: a.reshape(k, -1, *a.shape[1:]), layer_inputs))
    # Updated per-layer state (BatchNorm statistics) back in (L, ...) layout.
    nnx.update(self.layers, jax.tree.map(
        lambda a: a.reshape(self.num_layers, *a.shape[2:]),
        nnx.state(segments)))
    return x


def unroll_for_counting(model: nnx.Module,
                        recomputation: bool = False) -> nnx.Module:
  """`model` with every stack a Python loop, in place; without remat, or
  with `recomputation` with the remat the stack applies as it is
  (`ROLLED_ONLY` policies remat a rolled stack only).

  XLA's cost analysis counts a rolled scan's body once: lowered this way,
  every layer is counted once, and with `recomputation` each recomputed
  operation again (remat keeps its CSE barrier when unrolled). The
  parameters keep their stacked layout.
  """
  for _, module in nnx.iter_modules(model):
    if isinstance(module, StackedBlocks):
      rolled = module.scan_layers and module.scan_unroll < module.num_layers
      module.scan_layers = False
      if recomputation:
        module.remat_unrolled = rolled
      else:
        module.remat_policy = 'none'
  return model
