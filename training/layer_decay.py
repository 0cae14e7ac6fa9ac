"""`config.layer_decay`: layer-wise learning-rate decay (BEiT, MAE, timm's
`--layer-decay`), the fine-tuning rule that trains layers near the input
less than those near the head.

The model numbers its layers (`layer_depth` of ResNet and ViT): a ViT's
patch embedding is depth 0, its blocks 1 to L, its head L + 1; a ResNet's
stem 0, its stages 1 to 4, its head 5. The update of a parameter at depth d
is the optimizer's update times `layer_decay ** (top - d)`, top the head's
depth, so weight decay follows the same scale (as in timm's and MAE's
parameter groups, whose learning rate scales the decay too). A scanned
stack's blocks are one array per parameter with a leading layer axis, so
its scale is a vector along that axis, not a parameter group.
"""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from training import trainable


def layer_depths(model: nnx.Module) -> dict[str, np.ndarray]:
  """{parameter name: its depth}, an integer array: a scalar, or one depth
  per layer of a scanned stack."""
  params = nnx.state(model, nnx.Param)
  return {trainable.param_name(path): np.asarray(model.layer_depth(
      trainable.param_name(path)))
          for path, _ in jax.tree_util.tree_leaves_with_path(params)}


def layer_scales(depths: dict[str, np.ndarray],
                 layer_decay: float) -> dict[str, np.ndarray]:
  """{parameter name: layer_decay ** (top - depth)} in float32."""
  top = max(int(depth.max()) for depth in depths.values())
  return {name: (layer_decay ** (top - depth.astype(np.float64))).astype(
      np.float32) for name, depth in depths.items()}


def scale_by_layer(scales: dict[str, np.ndarray]
                   ) -> optax.GradientTransformation:
  """Multiplies each parameter's update by its scale, a vector of one scale
  per layer broadcast along a stack's leading layer axis."""
  def scale(path, update):
    factor = scales[trainable.param_name(path)]
    factor = factor.reshape(factor.shape + (1,) * (update.ndim - factor.ndim))
    return update * jnp.asarray(factor, update.dtype)

  return optax.stateless(lambda updates, params=None: (
      jax.tree_util.tree_map_with_path(scale, updates)))


def describe(depths: dict[str, np.ndarray], layer_decay: float) -> str:
  """One line: each depth (or run of a stack's depths) with its parameters'
  top-level names and the scale of their updates."""
  top = max(int(depth.max()) for depth in depths.values())
  scale = lambda depth: f'{layer_decay ** (top - depth):.3g}'
  groups = {}
  for name, depth in depths.items():
    span = (int(depth.min()), int(depth.max()))
    groups.setdefault(span, set()).add(name.split('/')[0])
  parts = []
  for (low, high), names in sorted(groups.items()):
    where = (f'depth {low} x{scale(low)}' if low == high else
             f'depths {low}-{high} x{scale(low)} to x{scale(high)}')
    parts.append(f'{where} ({", ".join(sorted(names))})')
  return (f'layer_decay={layer_decay:g}: updates at depth d scaled by '
          f'{layer_decay:g}^({top} - d); ' + '; '.join(parts) + '.')
