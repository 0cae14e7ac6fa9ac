"""Gradient accumulation's micro-batches: how a global batch splits into
them, their random keys, and the loop over them inside one compiled step."""

import jax
import jax.numpy as jnp


def micro_batches(batch, num_micro_batches: int):
  """The global batch as `num_micro_batches` micro-batches stacked on a new
  leading axis: micro-batch i holds examples i, i + k, i + 2k, ... (k the
  number of micro-batches).

  Strided, so that every device's own rows split into its share of each
  micro-batch: no example moves between devices, and which examples form a
  micro-batch does not depend on the device or process count.
  """
  return jax.tree.map(
      lambda x: jnp.swapaxes(
          x.reshape(-1, num_micro_batches, *x.shape[1:]), 0, 1), batch)


def micro_batch_keys(step_key, num_micro_batches: int):
  """One random key per micro-batch (mixup ratios, dropout masks); the
  step's own key when there is one micro-batch, so that a step without
  accumulation draws what it always drew."""
  if num_micro_batches == 1:
    return step_key[None]
  return jax.random.split(step_key, num_micro_batches)


def scan(body, carry, batch, step_key, num_micro_batches: int, unroll: int):
  """`jax.lax.scan(body, carry, (micro-batches, keys))`: `body(carry,
  (micro_batch, key))` returns the next carry and this micro-batch's
  outputs, which come back stacked. `unroll` micro-batches per loop
  iteration."""
  micro = (micro_batches(batch, num_micro_batches),
           micro_batch_keys(step_key, num_micro_batches))
  if num_micro_batches == 1:
    # No loop: lax.scan emits one even for a single iteration, and XLA:CPU
    # runs convolution gradients inside a loop about 20x slower.
    carry, outputs = body(carry, jax.tree.map(lambda x: x[0], micro))
    return carry, jax.tree.map(lambda x: x[None], outputs)
  return jax.lax.scan(body, carry, micro,
                      unroll=min(unroll, num_micro_batches))
