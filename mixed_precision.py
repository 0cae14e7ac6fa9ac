"""Mixed precision: the compute dtype, and dynamic loss scaling for float16.

Parameters and optimizer state stay float32; with `half_precision` the model
computes in `half_precision_dtype`. bfloat16 has float32's exponent range and
needs nothing more. float16 gradients underflow, so the loss is multiplied by
a scale before differentiation and the gradients divided by it after; a step
whose gradients are not finite is skipped and halves the scale, and every
`growth_interval` finite steps in a row double it (as in NVIDIA's apex/amp).
"""

import flax
import jax
import jax.numpy as jnp

HALF_PRECISION_DTYPES = {'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


def compute_dtype(config):
  """The dtype the model computes in under `config`."""
  if config.half_precision_dtype not in HALF_PRECISION_DTYPES:
    raise ValueError(
        f'unknown half_precision_dtype {config.half_precision_dtype!r}; '
        f'valid names: {", ".join(HALF_PRECISION_DTYPES)}')
  if not config.half_precision:
    return jnp.float32
  return HALF_PRECISION_DTYPES[config.half_precision_dtype]


@flax.struct.dataclass
class DynamicLossScale:
  """The current loss scale and the count of finite steps taken at it."""
  scale: jax.Array
  good_steps: jax.Array
  growth_interval: int = flax.struct.field(pytree_node=False, default=2000)


def create_loss_scale(config):
  """A DynamicLossScale for float16 compute, else None (no scaling)."""
  if compute_dtype(config) != jnp.float16:
    return None
  return DynamicLossScale(scale=jnp.asarray(2.0**15, jnp.float32),
                          good_steps=jnp.zeros((), jnp.int32))


def scale_loss(loss_scale, loss):
  """The loss to differentiate: multiplied by the scale, if any."""
  return loss if loss_scale is None else loss * loss_scale.scale


def unscale(loss_scale, scaled_loss, grads):
  """The true loss and gradients, and whether the gradients are finite."""
  if loss_scale is None:
    return scaled_loss, grads, None
  grads = jax.tree.map(lambda g: g / loss_scale.scale, grads)
  finite = jnp.all(jnp.asarray(
      [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
  return scaled_loss / loss_scale.scale, grads, finite


def adjust(loss_scale, finite):
  """The scale for the next step: halved after non-finite gradients,
  doubled after `growth_interval` finite steps in a row."""
  grow = loss_scale.good_steps + 1 >= loss_scale.growth_interval
  scale = jnp.where(finite, jnp.where(grow, loss_scale.scale * 2.0,
                                      loss_scale.scale),
                    jnp.maximum(loss_scale.scale / 2.0, 1.0))
  good_steps = jnp.where(finite & ~grow, loss_scale.good_steps + 1, 0)
  return loss_scale.replace(scale=scale, good_steps=good_steps)


def skip_nonfinite(finite, new_state, old_state):
  """`new_state` with an adjusted loss scale, or, when the gradients were
  not finite, `old_state`'s parameters, statistics and optimizer state (the
  step counter still advances, so the next batch is a new one)."""
  if finite is None:
    return new_state
  kept = jax.tree.map(
      lambda new, old: jnp.where(finite, new, old),
      (new_state.params, new_state.model_state, new_state.opt_state),
      (old_state.params, old_state.model_state, old_state.opt_state))
  return new_state.replace(params=kept[0], model_state=kept[1],
                           opt_state=kept[2],
                           loss_scale=adjust(old_state.loss_scale, finite))
