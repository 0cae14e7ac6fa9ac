"""Image sizes a model cannot take, refused before anything is written in
one line naming the sizes it can; each family's rule against what its
layers really do with an image."""

import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from families import convnext
from families import regnet
from families import resnet
from families import swin
import processes
from runtime import config_error
import train
from helpers import REPO
from helpers import random_model
from helpers import tiny_config

CONVNEXT_FIX = 'use a multiple of 4, at least 32'
CONVNEXT_TOO_SMALL = ('its stem of stride 4 and 3 downsamplings of stride 2 '
                      f'leave no pixel of it; {CONVNEXT_FIX}')
PADDED_RULE = ('its padded convolutions need a pixel; use any size of at '
               'least 1')
# 4 px patches, then maps of a quarter, an eighth, ... of the image: each a
# multiple of the window 7 or at most 7, each halved evenly: 224 = 4 * 7 * 8
# and its multiples.
SWIN_SIZES = (224, 448, 672, 896)


@pytest.mark.parametrize('overrides, line', [
    (dict(model='ResNet50', image_size=0), f'ResNet50 cannot take image_size '
     f'0: {PADDED_RULE}'),
    (dict(model='SmallResNet', image_size=0), 'SmallResNet cannot take '
     f'image_size 0: {PADDED_RULE}'),
    (dict(model='ViT_Ti16', image_size=20), 'ViT_Ti16 cannot take image_size '
     '20: it is cut into patches of 16; use a multiple of 16, at least 16'),
    (dict(model='ConvNeXt_T', image_size=16),
     f'ConvNeXt_T cannot take image_size 16: {CONVNEXT_TOO_SMALL}'),
    (dict(model='ConvNeXtV2_T', image_size=34),
     'ConvNeXtV2_T cannot take image_size 34: its stem of stride 4 leaves '
     f'its last 2 rows and columns unseen; {CONVNEXT_FIX}'),
    (dict(model='Swin_T', image_size=256), 'Swin_T cannot take image_size '
     '256: its patches of 4, 3 patch merges and windows of 7 tile only '
     f'{", ".join(map(str, SWIN_SIZES))} of the sizes up to 1024; use one of '
     'them'),
    (dict(model='RegNetY_4GF', image_size=-8), 'RegNetY_4GF cannot take '
     f'image_size -8: {PADDED_RULE}'),
    (dict(teacher_model='ConvNeXt_T', distillation_type='soft',
          teacher_init_from='teacher.safetensors'),
     f'teacher_model ConvNeXt_T cannot take image_size 8: {CONVNEXT_TOO_SMALL}'),
])
def test_a_size_the_model_cannot_take_is_one_line_before_anything_is_written(
    tmp_path, overrides, line):
  workdir = tmp_path / 'run'
  with pytest.raises(config_error.ConfigError) as error:
    train.train_and_evaluate(tiny_config(**overrides), str(workdir))
  assert str(error.value) == line
  assert not workdir.exists()


def pixels_all_reach_the_logits(model, size: int) -> bool:
  """Whether the logits of an image of `size` square are finite and depend
  on its last row and its last column (what an unpadded strided layer
  drops, unless a layer before it mixed them into the rows it keeps)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def logits_and_grad(state, x):
    return jax.value_and_grad(lambda state, x: jnp.sum(nnx.merge(
        graphdef, state, copy=True)(x, train=False) ** 2), argnums=1)(state, x)

  x = jax.random.normal(jax.random.key(0), (1, size, size, 3))
  logits, grad = logits_and_grad(state, x)
  grad = np.abs(np.asarray(grad))
  return bool(np.isfinite(np.asarray(logits)) and
              grad[:, -1].sum() > 0 and grad[:, :, -1].sum() > 0)


# Tiny members of the convolutional families at random parameters (no
# residual branch starts at zero), one block per stage.
TINY_CONVNEXT = lambda: random_model(lambda: convnext.ConvNeXt(
    (1, 1, 1, 1), (8, 8, 8, 8), 3, rngs=nnx.Rngs(0)))
TINY_RESNET = lambda padding: random_model(lambda: resnet.ResNet(
    [1, 1, 1, 1], resnet.BasicBlock, 3, width=4, padding=padding,
    rngs=nnx.Rngs(0)))
TINY_REGNET = lambda: random_model(lambda: regnet.RegNet(
    tuple(regnet.Stage(8, 1, 8) for _ in range(4)), 3, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize('build, rule, sizes', [
    (TINY_CONVNEXT, lambda n: convnext.image_size_problem(n, 4),
     (16, 34, 40)),
    (lambda: TINY_RESNET('same'), resnet.image_size_problem, (1, 5)),
    (lambda: TINY_RESNET('symmetric'), resnet.image_size_problem, (5,)),
    (TINY_REGNET, regnet.image_size_problem, (1, 7)),
])
def test_each_family_takes_exactly_the_sizes_its_layers_see_whole(
    build, rule, sizes):
  model = build()
  for size in sizes:
    assert (rule(size) is None) == pixels_all_reach_the_logits(model, size), (
        size)


def test_swin_takes_the_sizes_it_lists_and_refuses_their_neighbours():
  for size in range(1, 1025):
    problem = swin.image_size_problem(size, 7, 4)
    assert (problem is None) == (size in SWIN_SIZES), size
  # Each listed size builds and runs (shapes only) a Swin of 4 stages.
  for size in SWIN_SIZES:
    logits = jax.eval_shape(
        lambda x: swin.Swin((2, 2, 2, 2), (1, 1, 1, 1), 3, embed_dim=4,
                            window=7, image_size=x.shape[1],
                            rngs=nnx.Rngs(0))(x, train=False),
        jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32))
    assert logits.shape == (1, 3)


@pytest.mark.slow
def test_the_command_refuses_a_convnext_below_its_size_and_writes_nothing(
    tmp_path):
  workdir = tmp_path / 'run'
  result = subprocess.run(
      processes.main_command(workdir, dict(model='ConvNeXt_T',
                                           image_size=16)),
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1] == (
      f'Error: ConvNeXt_T cannot take image_size 16: {CONVNEXT_TOO_SMALL}')
  assert not workdir.exists()
