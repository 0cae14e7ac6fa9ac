"""The ConvNeXt family: scanned against a Python loop, against a PyTorch
ConvNeXt written here from the published definition (timm's and
facebookresearch's names, `.safetensors` and `.pth`), stochastic depth and
layer-decay numbering as the papers' code sets them, the published sizes.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from families import convnext
import models
from training import intermediate_grads
from training import layer_decay
from weights import factory
from helpers import default_config
from helpers import images
from helpers import loaded_logits
from helpers import random_model
from helpers import torch_logits
from helpers import training_loss_and_grads

# Tests share compiled programs (in memory): one worker runs them all.
pytestmark = pytest.mark.xdist_group('convnext')

# The reference's four stages; two for the tests of the stacks alone,
# where compiling dominates.
DEPTHS = (1, 2, 1, 1)
WIDTHS = (8, 16, 32, 64)
IMAGE_SIZE = 32
STACK_DEPTHS = (2, 3)
STACK_WIDTHS = (8, 16)
NUM_CLASSES = 5
NAMES = ('ConvNeXt_Atto', 'ConvNeXt_T', 'ConvNeXt_S', 'ConvNeXt_B',
         'ConvNeXt_L', 'ConvNeXtV2_Atto', 'ConvNeXtV2_T', 'ConvNeXtV2_B')


def tiny_convnext(v2=False, layer_scale_init=1e-6, depths=DEPTHS,
                  widths=WIDTHS, **stack_options):
  """A small ConvNeXt at random parameters (GRN's too: at its initial
  zeros GRN is the identity); its stacks' scans fully unrolled unless told
  otherwise (XLA:CPU runs a convolution's gradient in a rolled scan many
  times slower)."""
  stack_options = dict(scan_unroll=max(depths)) | stack_options
  return random_model(lambda: convnext.ConvNeXt(
      depths, widths, NUM_CLASSES, grn=v2,
      layer_scale_init=None if v2 else layer_scale_init,
      stack_options=stack_options, drop_path_rate=0.3, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize('v2', [False, True])
def test_scanned_stacks_match_a_python_loop_outputs_and_gradients(v2):
  x = images(16)
  small = dict(depths=STACK_DEPTHS, widths=STACK_WIDTHS)
  scanned = training_loss_and_grads(tiny_convnext(v2, 0.5, **small), x)
  looped = training_loss_and_grads(
      tiny_convnext(v2, 0.5, scan_layers=False, **small), x)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-5, atol=1e-5), scanned, looped)


# ------------------------------------------------- the PyTorch reference


def torch_convnext(torch, v2):
  """A ConvNeXt (V2: GRN, no layer scale) in PyTorch, channels first, as
  timm's convnext.py names its parameters."""
  nn = torch.nn

  class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
      return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

  class Mlp(nn.Module):
    def __init__(self, dim):
      super().__init__()
      self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
      if v2:
        self.grn = nn.Module()
        self.grn.weight = nn.Parameter(torch.zeros(4 * dim))
        self.grn.bias = nn.Parameter(torch.zeros(4 * dim))

    def forward(self, x):
      x = nn.functional.gelu(self.fc1(x))
      if v2:
        g = x.norm(p=2, dim=(1, 2), keepdim=True)
        x = x + self.grn.bias + self.grn.weight * x * (
            g / (g.mean(dim=-1, keepdim=True) + 1e-6))
      return self.fc2(x)

  class Block(nn.Module):
    def __init__(self, dim):
      super().__init__()
      self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
      self.norm = nn.LayerNorm(dim, eps=1e-6)
      self.mlp = Mlp(dim)
      if not v2:
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
      y = self.mlp(self.norm(self.conv_dw(x).permute(0, 2, 3, 1)))
      if not v2:
        y = y * self.gamma
      return x + y.permute(0, 3, 1, 2)

  class Stage(nn.Module):
    def __init__(self, i):
      super().__init__()
      self.downsample = (nn.Sequential(
          LayerNorm2d(WIDTHS[i - 1], eps=1e-6),
          nn.Conv2d(WIDTHS[i - 1], WIDTHS[i], 2, stride=2)) if i else
                         nn.Identity())
      self.blocks = nn.Sequential(*[Block(WIDTHS[i])
                                    for _ in range(DEPTHS[i])])

    def forward(self, x):
      return self.blocks(self.downsample(x))

  class ConvNeXt(nn.Module):
    def __init__(self):
      super().__init__()
      self.stem = nn.Sequential(nn.Conv2d(3, WIDTHS[0], 4, stride=4),
                                LayerNorm2d(WIDTHS[0], eps=1e-6))
      self.stages = nn.Sequential(*[Stage(i) for i in range(len(DEPTHS))])
      self.head = nn.Module()
      self.head.norm = nn.LayerNorm(WIDTHS[-1], eps=1e-6)
      self.head.fc = nn.Linear(WIDTHS[-1], NUM_CLASSES)

    def forward(self, x):
      x = self.stages(self.stem(x)).mean(dim=(2, 3))
      return self.head.fc(self.head.norm(x))

  torch.manual_seed(0)
  model = ConvNeXt().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      # Random everything, norms' scales about 1, so each layer matters.
      base = 1.0 if 'norm' in name and name.endswith('weight') else 0.0
      p.copy_(base + 0.2 * torch.randn_like(p))
  return model


def original_name(timm_name: str) -> str:
  """facebookresearch/ConvNeXt's name of an array timm names `timm_name`."""
  parts = timm_name.split('.')
  if parts[0] == 'stem':
    return '.'.join(['downsample_layers', '0', *parts[1:]])
  if parts[0] == 'head':
    return '.'.join(['norm' if parts[1] == 'norm' else 'head', parts[-1]])
  if parts[2] == 'downsample':
    return '.'.join(['downsample_layers', parts[1], *parts[3:]])
  inner = '.'.join(parts[4:]).replace('conv_dw', 'dwconv').replace(
      'mlp.fc1', 'pwconv1').replace('mlp.fc2', 'pwconv2').replace(
          'mlp.grn.weight', 'grn.gamma').replace('mlp.grn.bias', 'grn.beta')
  return f'stages.{parts[1]}.{parts[3]}.{inner}'


def file_logits(path, v2, scan_layers=True, init_format='auto'):
  """The tiny ConvNeXt's logits on `images` with the weights in `path`."""
  return loaded_logits(
      tiny_convnext(v2, scan_layers=scan_layers),
      default_config(model='ConvNeXtV2_T' if v2 else 'ConvNeXt_T'), path,
      images(IMAGE_SIZE), init_format)


# Each file read once: by a scanned model and `auto`, or by a Python loop
# over the same stacks and `timm`, which reads timm's ConvNeXts too.
@pytest.mark.parametrize('v2, scan_layers, init_format', [
    (False, True, 'auto'), (True, False, 'timm')])
def test_timm_safetensors_compute_the_torch_network(tmp_path, v2,
                                                    scan_layers, init_format):
  torch = pytest.importorskip('torch')
  model = torch_convnext(torch, v2)
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(state, path)
  assert factory.detect_format(path) == 'timm_convnext'
  expected = torch_logits(torch, model, images(IMAGE_SIZE))
  assert np.abs(expected).max() > 1  # a network whose layers all count
  logits = file_logits(path, v2, scan_layers, init_format)
  assert np.abs(logits - expected).max() < 1e-5


@pytest.mark.parametrize('v2', [False, True])
def test_pth_in_timms_and_the_original_names_compute_the_torch_network(
    tmp_path, v2):
  torch = pytest.importorskip('torch')
  model = torch_convnext(torch, v2)
  expected = torch_logits(torch, model, images(IMAGE_SIZE))
  state = model.state_dict()
  timm_path = str(tmp_path / 'timm.pth')
  torch.save(state, timm_path)
  # The original releases: {'model': state dict}, GRN's arrays (1, 1, 1, C).
  original = {original_name(k): v.reshape(1, 1, 1, -1) if '.grn.' in k else v
              for k, v in state.items()}
  original_path = str(tmp_path / 'convnext_original.pth')
  torch.save({'model': original}, original_path)
  for path in (timm_path, original_path):
    assert factory.detect_format(path) == 'timm_convnext'
    assert np.abs(file_logits(path, v2) - expected).max() < 1e-5


def test_a_v1_file_is_refused_by_a_v2_model_in_one_line(tmp_path):
  torch = pytest.importorskip('torch')
  state = {k: v.numpy() for k, v in torch_convnext(torch, False).state_dict(
      ).items()}
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(state, path)
  with pytest.raises(ValueError, match='missing in the file:.*grn') as error:
    file_logits(path, v2=True)
  assert '\n' not in str(error.value)


# ------------------------------------------------ rules of the papers' code


def test_drop_path_rates_are_timms_linspace_over_all_blocks():
  torch = pytest.importorskip('torch')
  model = nnx.eval_shape(lambda: models.create_model(
      'ConvNeXt_T', 1000, 3, drop_path_rate=0.4, rngs=nnx.Rngs(0)))
  rates = [r for stage in model.stages for r in stage.blocks.drop_path_rates]
  np.testing.assert_allclose(rates, torch.linspace(0, 0.4, 18).numpy(),
                             atol=1e-7)


def num_layer_for_convnext(var_name: str) -> int:
  """facebookresearch/ConvNeXt's `optim_factory.get_num_layer_for_convnext`
  (12 groups; the head 13)."""
  if var_name.startswith('downsample_layers'):
    stage_id = int(var_name.split('.')[1])
    return {0: 0, 1: 2, 2: 3, 3: 12}[stage_id]
  if var_name.startswith('stages'):
    stage_id, block_id = map(int, var_name.split('.')[1:3])
    if stage_id in (0, 1):
      return stage_id + 1
    return 3 + block_id // 3 if stage_id == 2 else 12
  return 13


def test_layer_depths_are_facebookresearchs_groups_for_convnext_t():
  model = nnx.eval_shape(lambda: models.create_model(
      'ConvNeXt_T', 1000, 3, rngs=nnx.Rngs(0)))
  depths = layer_decay.layer_depths(model)
  seen = set()
  for name, depth in depths.items():
    parts = name.split('/')
    if parts[0] in ('stem', 'stem_norm'):
      assert depth == num_layer_for_convnext('downsample_layers.0.0.weight')
    elif parts[0] == 'stages' and parts[2].startswith('downsample'):
      assert depth == num_layer_for_convnext(
          f'downsample_layers.{parts[1]}.0.weight'), name
    elif parts[0] == 'stages':
      assert depth.tolist() == [
          num_layer_for_convnext(f'stages.{parts[1]}.{block}.norm.weight')
          for block in range(depth.shape[0])], name
    else:
      assert depth == num_layer_for_convnext('head.weight'), name
    seen.add(parts[0])
  assert seen == {'stem', 'stem_norm', 'stages', 'head_norm', 'head'}


def test_every_block_has_a_recording_point():
  model = tiny_convnext(depths=STACK_DEPTHS, widths=STACK_WIDTHS)
  grads = nnx.jit(lambda model, x: intermediate_grads.recorded_grads(
      model, x, lambda logits: jnp.sum(logits**2), train=False)[1])(
          model, images(16))
  points = {intermediate_grads.point_name(path): g.shape
            for path, g in grads.items()}
  assert points.keys() == {'stem', 'logits', 'stages.0.blocks',
                           'stages.1.blocks'}
  assert [points[f'stages.{i}.blocks'][0] for i in range(2)] == list(
      STACK_DEPTHS)


# ------------------------------------------------------ names and sizes


def test_unknown_model_is_refused_in_one_line_naming_every_convnext():
  with pytest.raises(ValueError, match=', '.join(NAMES)) as error:
    models.create_model('ConvNeXt_XL', 10, 3,
                        rngs=nnx.Rngs(0))
  assert '\n' not in str(error.value)


def test_bad_stack_options_are_refused_naming_the_valid_values():
  with pytest.raises(ValueError, match='valid names: none, full'):
    models.create_model('ConvNeXt_T', 10, 3, remat_policy='most',
                        rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='divisor of 3'):
    nnx.eval_shape(lambda: models.create_model(
      'ConvNeXt_T', 10, 3, scan_segments=2, rngs=nnx.Rngs(0)))


# timm's published counts (224 px, 1000 classes), in millions.
@pytest.mark.parametrize('name, params_millions', zip(
    NAMES, (3.70, 28.59, 50.22, 88.59, 197.77, 3.71, 28.64, 88.72)))
def test_published_parameter_counts(name, params_millions):
  model = nnx.eval_shape(lambda: models.create_model(
      name, 1000, 3, rngs=nnx.Rngs(0)))
  count = sum(np.prod(x.shape)
              for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert abs(count / 1e6 - params_millions) < 0.1
