"""`config.trainable`: which parameters a run trains; the rest stay frozen.

A parameter's name is its path in the params tree joined with '/' (e.g.
`head/kernel`, `encoder/layers/mlp_in/kernel`: a stack of blocks is one
array per parameter); it trains when `re.fullmatch(trainable, name)`. The
empty pattern trains everything, and then nothing here changes the step.
"""

import math
import re

from flax import nnx
import jax

from layers import norms


def param_name(path) -> str:
  """The '/'-joined dictionary keys of a params-tree path (nnx's trailing
  `.value` attribute is not part of the name)."""
  return '/'.join(str(k.key) for k in path
                  if isinstance(k, jax.tree_util.DictKey))


def trained_mask(params, pattern: str):
  """A tree of bools shaped as `params`: True where the parameter trains."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not pattern or re.fullmatch(pattern, param_name(path))
      is not None, params)


def check(params, pattern: str) -> None:
  """A ValueError naming the top-level parameters when `pattern` is not a
  regular expression or matches no parameter."""
  if not pattern:
    return
  paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  top = ', '.join(sorted({param_name(p).split('/')[0] for p in paths}))
  try:
    regex = re.compile(pattern)
  except re.error as e:
    raise ValueError(f'trainable={pattern!r} is not a regular expression '
                     f'({e}); top-level parameters: {top}') from None
  if not any(regex.fullmatch(param_name(p)) for p in paths):
    raise ValueError(f'trainable={pattern!r} matches no parameter (full '
                     f'match of names such as head/kernel); top-level '
                     f'parameters: {top}')


def split(params, pattern: str):
  """(trained leaves, frozen leaves, a function of both giving `params`):
  the split that `jax.grad` of the trained leaves alone needs."""
  leaves, treedef = jax.tree.flatten(params)
  mask = jax.tree.leaves(trained_mask(params, pattern))
  trained = [x for x, m in zip(leaves, mask) if m]
  frozen = [x for x, m in zip(leaves, mask) if not m]

  def merge(trained, frozen):
    trained, frozen = iter(trained), iter(frozen)
    return treedef.unflatten(
        [next(trained) if m else next(frozen) for m in mask])
  return trained, frozen, merge


def describe(params, pattern: str) -> str:
  """One line: how many arrays and values train and stay frozen, and the
  frozen and trained names."""
  named = [(param_name(p), math.prod(x.shape))
           for p, x in jax.tree_util.tree_leaves_with_path(params)]
  mask = jax.tree.leaves(trained_mask(params, pattern))
  trained = [(n, s) for (n, s), m in zip(named, mask) if m]
  frozen = [(n, s) for (n, s), m in zip(named, mask) if not m]
  return (f'trainable={pattern!r}: training {len(trained)} arrays '
          f'({sum(s for _, s in trained):,} values): '
          f'{", ".join(n for n, _ in trained)}; frozen {len(frozen)} arrays '
          f'({sum(s for _, s in frozen):,} values): '
          f'{", ".join(n for n, _ in frozen) or "none"}.')


def freeze_batch_norms(model: nnx.Module, pattern: str) -> None:
  """Sets `frozen` on every BatchNorm of `model` whose scale and bias
  `pattern` both leaves frozen (see `norms.BatchNorm`). One with neither
  (`feature_batch_norm`) keeps learning its statistics: they are part of
  what a linear probe trains."""
  if not pattern:
    return
  for path, module in nnx.iter_modules(model):
    if isinstance(module, norms.BatchNorm):
      name = '/'.join(map(str, path))
      params = [param for param in ('scale', 'bias')
                if getattr(module, param) is not None]
      module.frozen = bool(params) and not any(
          re.fullmatch(pattern, f'{name}/{param}') for param in params)
