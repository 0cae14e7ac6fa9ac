"""The RegNetY family: stages derived from the design parameters as timm
publishes them, scanned against a Python loop, against a PyTorch RegNetY
written here from timm's definition (its names, `.safetensors` and `.pth`),
stochastic depth and layer-decay numbering, recording points, sizes.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from families import regnet
import models
from training import intermediate_grads
from training import layer_decay
from weights import factory
from weights import pretrained
from helpers import default_config
from helpers import images
from helpers import loaded_logits
from helpers import random_model
from helpers import torch_logits
from helpers import training_loss_and_grads

# Tests share compiled programs (in memory): one worker runs them all.
pytestmark = pytest.mark.xdist_group('regnet')

# The reference's four stages (32 px: 16, 8, 4, 2, 1 pixels after the stem
# and each stage); one for the tests of the stacks alone, where compiling
# dominates.
STAGES = (regnet.Stage(8, 1, 4), regnet.Stage(16, 2, 4),
          regnet.Stage(16, 1, 8), regnet.Stage(24, 2, 8))
STACK_STAGES = (regnet.Stage(8, 3, 4),)
IMAGE_SIZE = 32
NUM_CLASSES = 5
NAMES = ('RegNetY_200MF', 'RegNetY_4GF', 'RegNetY_16GF')


def tiny_regnet(stage_list=STAGES, **stack_options):
  """A small RegNetY at random weights and BatchNorm statistics; its
  stacks' scans fully unrolled unless told otherwise (XLA:CPU runs a
  convolution's gradient in a rolled scan many times slower)."""
  stack_options = dict(scan_unroll=max(s.depth for s in stage_list)) | (
      stack_options)
  return random_model(lambda: regnet.RegNet(
      stage_list, NUM_CLASSES, stack_options=stack_options,
      drop_path_rate=0.3, rngs=nnx.Rngs(0)))


# --------------------------------------------------- the design space


@pytest.mark.parametrize('name, widths, depths, group_size', [
    ('RegNetY_200MF', (24, 56, 152, 368), (1, 1, 4, 7), 8),
    ('RegNetY_4GF', (128, 192, 512, 1088), (2, 6, 12, 2), 64),
    ('RegNetY_16GF', (224, 448, 1232, 3024), (2, 4, 11, 1), 112)])
def test_stages_follow_from_the_design_as_timm_publishes_them(
    name, widths, depths, group_size):
  found = regnet.stages(models._REGNETS[name])  # pylint: disable=protected-access
  assert tuple(s.width for s in found) == widths
  assert tuple(s.depth for s in found) == depths
  assert {s.group_size for s in found} == {group_size}


# ---------------------------------------------------------- the stacks


def test_scanned_stacks_match_a_python_loop_outputs_and_gradients():
  x = images(16)
  scanned = training_loss_and_grads(tiny_regnet(STACK_STAGES), x)
  looped = training_loss_and_grads(
      tiny_regnet(STACK_STAGES, scan_layers=False), x)
  assert float(scanned[0]) > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-5, atol=1e-5), scanned, looped)


# ------------------------------------------------- the PyTorch reference


def torch_regnet(torch):
  """A RegNetY in PyTorch, channels first, as timm's regnet.py computes it
  and names its parameters, of the four `STAGES`."""
  nn = torch.nn

  class ConvNorm(nn.Module):
    def __init__(self, in_chs, out_chs, kernel, stride=1, groups=1):
      super().__init__()
      self.conv = nn.Conv2d(in_chs, out_chs, kernel, stride,
                            padding=kernel // 2, groups=groups, bias=False)
      self.bn = nn.BatchNorm2d(out_chs)

    def forward(self, x):
      return self.bn(self.conv(x))

  class SE(nn.Module):
    def __init__(self, chs, reduced):
      super().__init__()
      self.fc1 = nn.Conv2d(chs, reduced, 1)
      self.fc2 = nn.Conv2d(reduced, chs, 1)

    def forward(self, x):
      s = self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True))))
      return x * torch.sigmoid(s)

  class Bottleneck(nn.Module):
    def __init__(self, in_chs, stage, stride):
      super().__init__()
      width = stage.width
      self.conv1 = ConvNorm(in_chs, width, 1)
      self.conv2 = ConvNorm(width, width, 3, stride,
                            groups=width // stage.group_size)
      self.se = SE(width, round(0.25 * in_chs))
      self.conv3 = ConvNorm(width, width, 1)
      self.downsample = (ConvNorm(in_chs, width, 1, stride)
                         if stride != 1 or in_chs != width else None)

    def forward(self, x):
      y = torch.relu(self.conv1(x))
      y = self.conv3(self.se(torch.relu(self.conv2(y))))
      shortcut = x if self.downsample is None else self.downsample(x)
      return torch.relu(y + shortcut)

  class RegNet(nn.Module):
    def __init__(self):
      super().__init__()
      self.stem = ConvNorm(3, regnet.STEM_WIDTH, 3, 2)
      in_chs = regnet.STEM_WIDTH
      for i, stage in enumerate(STAGES):
        blocks = nn.Module()
        for j in range(stage.depth):
          blocks.add_module(f'b{j + 1}', Bottleneck(
              in_chs if j == 0 else stage.width, stage, 2 if j == 0 else 1))
        self.add_module(f's{i + 1}', blocks)
        in_chs = stage.width
      self.head = nn.Module()
      self.head.fc = nn.Linear(in_chs, NUM_CLASSES)

    def forward(self, x):
      x = torch.relu(self.stem(x))
      for i in range(len(STAGES)):
        for block in getattr(self, f's{i + 1}').children():
          x = block(x)
      return self.head.fc(x.mean((2, 3)))

  torch.manual_seed(0)
  model = RegNet().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      # Random everything, BatchNorm scales about 1, so each layer matters.
      base = 1.0 if '.bn.' in name and name.endswith('weight') else 0.0
      p.copy_(base + 0.3 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith('running_mean'):
        b.copy_(0.2 * torch.randn_like(b))
      elif name.endswith('running_var'):
        b.copy_(0.5 + torch.rand_like(b))
  return model


def file_logits(path, scan_layers=True, init_format='auto'):
  """The tiny RegNet's logits on `images` with the weights in `path`."""
  return loaded_logits(tiny_regnet(scan_layers=scan_layers),
                       default_config(model='RegNetY_4GF'), path,
                       images(IMAGE_SIZE), init_format)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """The PyTorch RegNetY, its logits on `images`, its state dict saved
  in timm's names as `.safetensors` and as DeiT's `.pth`
  (`{'model': state dict}`)."""
  torch = pytest.importorskip('torch')
  model = torch_regnet(torch)
  expected = torch_logits(torch, model, images(IMAGE_SIZE))
  directory = tmp_path_factory.mktemp('regnet')
  state = model.state_dict()
  safetensors_path = str(directory / 'model.safetensors')
  safetensors.numpy.save_file({k: v.numpy() for k, v in state.items()},
                              safetensors_path)
  pth_path = str(directory / 'regnety_160.pth')
  torch.save({'model': state}, pth_path)
  return expected, safetensors_path, pth_path


def test_the_reference_keys_are_timms(reference):
  keys = safetensors.numpy.load_file(reference[1]).keys()
  assert {'stem.conv.weight', 'stem.bn.running_var', 's1.b1.conv1.conv.weight',
          's1.b1.conv2.bn.weight', 's1.b1.se.fc1.weight', 's1.b1.se.fc2.bias',
          's1.b1.conv3.bn.running_mean', 's1.b1.downsample.conv.weight',
          's1.b1.downsample.bn.bias', 's2.b2.conv1.conv.weight',
          's1.b1.conv1.bn.num_batches_tracked', 'head.fc.weight'} <= set(keys)
  assert not any(k.startswith('s2.b2.downsample') for k in keys)


# Each file read once: the safetensors by a scanned model and `auto`, the
# `.pth` by a Python loop over the same stacks and `timm`, which reads
# timm's RegNets too.
@pytest.mark.parametrize('file_index, scan_layers, init_format', [
    (1, True, 'auto'), (2, False, 'timm')])
def test_timm_files_compute_the_torch_network(reference, file_index,
                                              scan_layers, init_format):
  expected, path = reference[0], reference[file_index]
  assert factory.detect_format(path) == 'timm_regnet'
  assert np.abs(expected).max() > 1  # a network whose layers all count
  logits = file_logits(path, scan_layers, init_format)
  assert np.abs(logits - expected).max() < 1e-5


def test_a_regnet_file_is_refused_by_a_resnet_in_one_line(reference):
  model = nnx.eval_shape(lambda: models.create_model(
      'ResNet50', NUM_CLASSES, 3, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match='a timm RegNet.*is a ResNet') as error:
    pretrained.load_into_model(
        model, models.settings(default_config(model='ResNet50')),
        reference[1], 'auto')
  assert '\n' not in str(error.value)


# ------------------------------------------------ rules of timm's code


def test_drop_path_rates_are_timms_linspace_over_all_blocks():
  torch = pytest.importorskip('torch')
  model = nnx.eval_shape(lambda: models.create_model(
      'RegNetY_4GF', 1000, 3, drop_path_rate=0.4, rngs=nnx.Rngs(0)))
  rates = []
  for stage in model.stages:
    rates.append(stage.first_drop_path_rate)
    rates.extend(stage.rest.drop_path_rates)
  np.testing.assert_allclose(rates, torch.linspace(0, 0.4, 22).numpy(),
                             atol=1e-7)


def test_layer_depths_are_stem_stages_head():
  model = nnx.eval_shape(lambda: models.create_model(
      'RegNetY_16GF', 1000, 3, feature_batch_norm=True, rngs=nnx.Rngs(0)))
  seen = {}
  for name, depth in layer_decay.layer_depths(model).items():
    parts = name.split('/')
    key = parts[0] if parts[0] != 'stages' else f'stages/{parts[1]}'
    seen.setdefault(key, set()).update(np.ravel(depth).tolist())
  assert seen == {'stem': {0}, 'stem_bn': {0}, 'stages/0': {1},
                  'stages/1': {2}, 'stages/2': {3}, 'stages/3': {4},
                  'head': {5}}


def test_every_block_has_a_recording_point():
  model = tiny_regnet(STACK_STAGES)
  grads = nnx.jit(lambda model, x: intermediate_grads.recorded_grads(
      model, x, lambda logits: jnp.sum(logits**2), train=False)[1])(
          model, images(16))
  points = {intermediate_grads.point_name(path): g.shape
            for path, g in grads.items()}
  stages = range(len(STACK_STAGES))
  assert points.keys() == {'stem', 'logits'} | {
      f'stages.{i}.{part}' for i in stages for part in ('first', 'rest')}
  # The stacks' points come stacked along the layer axis.
  assert [points[f'stages.{i}.rest'][0] for i in stages] == [
      stage.depth - 1 for stage in STACK_STAGES]


# ------------------------------------------------------ names and sizes


def test_unknown_model_is_refused_in_one_line_naming_every_regnet():
  with pytest.raises(ValueError, match=', '.join(NAMES)) as error:
    models.create_model('RegNetY_8GF', 10, 3,
                        rngs=nnx.Rngs(0))
  assert '\n' not in str(error.value)


# timm's published counts (1000 classes), in millions.
@pytest.mark.parametrize('name, params_millions',
                         zip(NAMES, (3.16, 20.6, 83.6)))
def test_published_parameter_counts(name, params_millions):
  model = nnx.eval_shape(lambda: models.create_model(
      name, 1000, 3, rngs=nnx.Rngs(0)))
  count = sum(np.prod(x.shape)
              for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert abs(count / 1e6 - params_millions) < 0.1
