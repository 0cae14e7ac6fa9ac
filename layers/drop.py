"""Stochastic depth (drop path) on residual branches, with timm's rule for
each block's rate."""

import jax
import jax.numpy as jnp


def drop_path_rates(rate: float, num_blocks: int) -> list[float]:
  """Stochastic depth's rate of each of a model's `num_blocks` blocks, as
  timm sets them: `rate * i / (num_blocks - 1)` for block i, from 0 at the
  first to `rate` at the last."""
  if num_blocks == 1:
    return [0.0]
  return [rate * i / (num_blocks - 1) for i in range(num_blocks)]


def split_key(key, count: int) -> list:
  """`count` keys from `key`, one per stage; `count` Nones without one
  (evaluation, or a run without dropout)."""
  if key is None:
    return [None] * count
  return list(jax.random.split(key, count))


def drop_path(branch, rate, key, stream: int, train: bool):
  """Stochastic depth on a residual branch: each example's `branch` is
  zeroed with probability `rate` (a scalar, traced in a scan), the kept
  ones scaled by 1 / (1 - rate). `stream` tells apart the branches of one
  block; off (`branch` itself) in evaluation and when `rate` is None."""
  if rate is None or not train:
    return branch
  keep = 1.0 - rate
  mask = jax.random.bernoulli(jax.random.fold_in(key, stream), keep,
                              (branch.shape[0],) + (1,) * (branch.ndim - 1))
  return jnp.where(mask, branch / jnp.asarray(keep, branch.dtype),
                   jnp.zeros((), branch.dtype))
