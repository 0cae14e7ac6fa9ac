"""Mixed precision: the half-precision dtypes, and dynamic loss scaling for
float16.

Parameters and optimizer state stay float32; with `half_precision` the model
computes in `half_precision_dtype`. bfloat16 has float32's exponent range and
needs nothing more. float16 gradients underflow, so the loss is multiplied by
a scale before differentiation and the gradients divided by it after, by
Flax's `DynamicScale` (as in the Flax ImageNet example): a step whose
gradients are not finite is skipped and halves the scale, and the finite
step after `growth_interval` (2000) finite steps in a row doubles it.
"""

from flax.training import dynamic_scale
import jax
import jax.numpy as jnp

HALF_PRECISION_DTYPES = {'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


def create_loss_scale(dtype):
  """Flax's DynamicScale for float16 compute (`dtype`), else None (no
  scaling)."""
  if dtype != jnp.float16:
    return None
  # Explicit dtypes: the scale's arrays keep them through every step.
  return dynamic_scale.DynamicScale(
      fin_steps=jnp.zeros((), jnp.int32),
      scale=jnp.asarray(2.0**16, jnp.float32))


def value_and_grad(loss_fn, loss_scale, axis_name=None):
  """`jax.value_and_grad(loss_fn, has_aux=True)` with the gradients averaged
  over the devices of `axis_name` (pmap), and under a loss scale scaled.

  Returns a function of the parameters giving (next loss scale, whether
  the gradients are finite, (loss, aux), gradients); without a loss scale
  the first two are None.
  """
  if loss_scale is not None:
    return loss_scale.value_and_grad(loss_fn, has_aux=True,
                                     axis_name=axis_name)

  def unscaled(params):
    value, grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    if axis_name is not None:
      grads = jax.lax.pmean(grads, axis_name)
    return None, None, value, grads
  return unscaled


def skip_nonfinite(finite, new_state, old_state):
  """`new_state`, or, when the gradients were not finite, `old_state`'s
  parameters, statistics and optimizer state with `new_state`'s (halved)
  loss scale; the step counter still advances, so the next batch is a new
  one."""
  if finite is None:
    return new_state
  kept = jax.tree.map(
      lambda new, old: jnp.where(finite, new, old),
      (new_state.params, new_state.model_state, new_state.opt_state),
      (old_state.params, old_state.model_state, old_state.opt_state))
  return new_state.replace(params=kept[0], model_state=kept[1],
                           opt_state=kept[2])
