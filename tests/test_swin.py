"""The Swin Transformer family: scanned against a Python loop, against a
PyTorch Swin written here from the published definition (timm's and the
original release's names, `.safetensors` and `.pth`), the shifted window's
mask against a brute-force construction, stochastic depth and layer-decay
numbering as the papers' code sets them, the published sizes.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from families import swin
import models
from training import intermediate_grads
from training import layer_decay
from weights import factory
from weights import fitting
from weights import pretrained
from helpers import default_config
from helpers import images
from helpers import loaded_logits
from helpers import random_model
from helpers import torch_logits
from helpers import training_loss_and_grads

# Tests share compiled programs (in memory): one worker runs them all.
pytestmark = pytest.mark.xdist_group('swin')

# The reference's four stages at 64 px, maps 16, 8, 4, 2 with window 4:
# two shifted stages, one that is a single window, one smaller than it.
EMBED_DIM = 8
DEPTHS = (2, 4, 2, 2)
HEADS = (1, 2, 2, 4)
WINDOW = 4
IMAGE_SIZE = 64
# One stage for the tests of the stacks alone, where compiling dominates:
# a map of 8, shifted windows, two pairs.
STACK_DEPTHS = (4,)
STACK_HEADS = (2,)
STACK_IMAGE_SIZE = 32
NUM_CLASSES = 5
NAMES = ('Swin_T', 'Swin_S', 'Swin_B')


def tiny_swin(depths=DEPTHS, heads=HEADS, image_size=IMAGE_SIZE,
              **stack_options):
  """A small Swin at random parameters."""
  return random_model(lambda: swin.Swin(
      depths, heads, NUM_CLASSES, embed_dim=EMBED_DIM, window=WINDOW,
      image_size=image_size, stack_options=stack_options,
      drop_path_rate=0.3, rngs=nnx.Rngs(0)))


def test_scanned_stacks_match_a_python_loop_outputs_and_gradients():
  x = images(STACK_IMAGE_SIZE)
  small = dict(depths=STACK_DEPTHS, heads=STACK_HEADS,
               image_size=STACK_IMAGE_SIZE)
  scanned = training_loss_and_grads(tiny_swin(**small), x)
  looped = training_loss_and_grads(tiny_swin(scan_layers=False, **small), x)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-5, atol=1e-5), scanned, looped)


# ------------------------------------------------------ the window geometry


def brute_force_mask(map_size, window, shift):
  """Token pairs of a window of the map rolled by -shift: masked when one
  token wrapped around an axis in the roll and the other did not."""
  rolled = np.arange(map_size)
  wrapped = rolled >= map_size - shift  # came from the map's first rows
  per_side = map_size // window
  masks = []
  for wy in range(per_side):
    for wx in range(per_side):
      tokens = [(wy * window + i, wx * window + j)
                for i in range(window) for j in range(window)]
      masks.append([[0.0 if (wrapped[a[0]] == wrapped[b[0]] and
                             wrapped[a[1]] == wrapped[b[1]]) else -100.0
                     for b in tokens] for a in tokens])
  return np.asarray(masks, np.float32)


@pytest.mark.parametrize('map_size, window', [(8, 4), (12, 4), (14, 7),
                                              (9, 3)])
def test_shifted_window_mask_matches_a_brute_force_construction(map_size,
                                                                window):
  shift = window // 2
  np.testing.assert_array_equal(
      swin.shifted_window_mask(map_size, window, shift),
      brute_force_mask(map_size, window, shift))


def test_windows_merge_back_into_the_map():
  x = jax.random.normal(jax.random.key(0), (2, 8, 12, 3))
  windows = swin.partition_windows(x, 4)
  assert windows.shape == (2 * 2 * 3, 16, 3)
  np.testing.assert_array_equal(windows[1].reshape(4, 4, 3), x[0, :4, 4:8])
  np.testing.assert_array_equal(swin.merge_windows(windows, 4, 8, 12), x)


def test_a_map_no_larger_than_the_window_is_one_unshifted_window():
  assert swin.window_and_shift(7, 7) == (7, 0)
  assert swin.window_and_shift(4, 7) == (4, 0)
  assert swin.window_and_shift(14, 7) == (7, 3)


def test_a_window_that_does_not_tile_the_maps_is_refused_in_one_line():
  with pytest.raises(ValueError, match='tile only 224, 448, 672, 896 of the '
                     'sizes up to 1024; use one of them') as error:
    nnx.eval_shape(lambda: models.create_model(
      'Swin_T', 10, 3, image_size=256, rngs=nnx.Rngs(0)))
  assert '\n' not in str(error.value)


# ------------------------------------------------- the PyTorch reference


def torch_window_attention(torch):
  """The window attention of `torch_swin`: its relative position bias
  table indexed by token pairs, the shift's mask added per window."""
  nn = torch.nn

  class WindowAttention(nn.Module):
    def __init__(self, dim, heads, w):
      super().__init__()
      self.heads = heads
      self.relative_position_bias_table = nn.Parameter(
          torch.zeros((2 * w - 1) ** 2, heads))
      coords = torch.stack(torch.meshgrid(
          torch.arange(w), torch.arange(w), indexing='ij')).flatten(1)
      rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
      rel = rel + (w - 1)
      self.register_buffer('relative_position_index',
                           rel[:, :, 0] * (2 * w - 1) + rel[:, :, 1])
      self.qkv = nn.Linear(dim, 3 * dim)
      self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask):
      b, n, c = x.shape
      q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(
          2, 0, 3, 1, 4).unbind(0)
      attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1)
      bias = self.relative_position_bias_table[
          self.relative_position_index.view(-1)].view(n, n, -1)
      attn = attn + bias.permute(2, 0, 1)[None]
      if mask is not None:
        num_windows = mask.shape[0]
        attn = attn.view(-1, num_windows, self.heads, n, n) + mask[None, :,
                                                                   None]
        attn = attn.view(-1, self.heads, n, n)
      return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n,
                                                                       c))

  return WindowAttention


def torch_block(torch):
  """The block of `torch_swin`: window attention over the map rolled by
  its shift (with the -100 mask), then the MLP, each after a LayerNorm."""
  nn = torch.nn
  WindowAttention = torch_window_attention(torch)

  def partition(x, w):
    b, h, wd, c = x.shape
    x = x.view(b, h // w, w, wd // w, w, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, w * w, c)

  def reverse(windows, w, h, wd):
    x = windows.view(-1, h // w, wd // w, w, w, windows.shape[-1])
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, h, wd, windows.shape[-1])

  class Mlp(nn.Module):
    def __init__(self, dim):
      super().__init__()
      self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
      return self.fc2(nn.functional.gelu(self.fc1(x)))

  class Block(nn.Module):
    def __init__(self, dim, heads, size, shift):
      super().__init__()
      self.w, self.shift = WINDOW, shift
      if size <= self.w:
        self.w, self.shift = size, 0
      self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
      self.attn = WindowAttention(dim, heads, self.w)
      self.mlp = Mlp(dim)
      mask = None
      if self.shift:
        img = torch.zeros(1, size, size, 1)
        bands = (slice(0, -self.w), slice(-self.w, -self.shift),
                 slice(-self.shift, None))
        for i, (hs, ws) in enumerate((hs, ws) for hs in bands
                                     for ws in bands):
          img[:, hs, ws, :] = i
        regions = partition(img, self.w)[..., 0]
        mask = regions[:, None, :] - regions[:, :, None]
        mask = mask.masked_fill(mask != 0, -100.0)
      self.register_buffer('attn_mask', mask)

    def forward(self, x):
      _, h, w, c = x.shape
      y = self.norm1(x)
      y = torch.roll(y, (-self.shift, -self.shift), (1, 2))
      y = self.attn(partition(y, self.w), self.attn_mask)
      y = torch.roll(reverse(y, self.w, h, w), (self.shift, self.shift),
                     (1, 2))
      x = x + y
      return x + self.mlp(self.norm2(x))

  return Block


def torch_patch_merging(torch):
  """The patch merging of `torch_swin`: each 2 x 2 patch's four tokens
  concatenated, normalised and projected to twice the width."""
  nn = torch.nn

  class PatchMerging(nn.Module):
    def __init__(self, dim):
      super().__init__()
      self.norm = nn.LayerNorm(4 * dim)
      self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x):
      x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2],
                     x[:, 1::2, 1::2]], -1)
      return self.reduction(self.norm(x))

  return PatchMerging


def torch_swin(torch):
  """A Swin Transformer in PyTorch, channels last inside, as timm's
  swin_transformer.py (0.9 and later) names its parameters: patch merging
  starts stages 1-3 (`layers.N.downsample`), the classifier is `head.fc`."""
  nn = torch.nn
  Block = torch_block(torch)
  PatchMerging = torch_patch_merging(torch)

  class Stage(nn.Module):
    def __init__(self, i):
      super().__init__()
      dim, size = EMBED_DIM * 2 ** i, IMAGE_SIZE // 4 // 2 ** i
      self.downsample = PatchMerging(dim // 2) if i else nn.Identity()
      self.blocks = nn.Sequential(*[
          Block(dim, HEADS[i], size, WINDOW // 2 if j % 2 else 0)
          for j in range(DEPTHS[i])])

    def forward(self, x):
      return self.blocks(self.downsample(x))

  class Swin(nn.Module):
    def __init__(self):
      super().__init__()
      self.patch_embed = nn.Module()
      self.patch_embed.proj = nn.Conv2d(3, EMBED_DIM, 4, stride=4)
      self.patch_embed.norm = nn.LayerNorm(EMBED_DIM)
      self.layers = nn.Sequential(*[Stage(i) for i in range(len(DEPTHS))])
      self.norm = nn.LayerNorm(EMBED_DIM * 2 ** (len(DEPTHS) - 1))
      self.head = nn.Module()
      self.head.fc = nn.Linear(self.norm.normalized_shape[0], NUM_CLASSES)

    def forward(self, x):
      x = self.patch_embed.norm(self.patch_embed.proj(x).permute(0, 2, 3, 1))
      return self.head.fc(self.norm(self.layers(x)).mean(dim=(1, 2)))

  torch.manual_seed(0)
  model = Swin().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      # Random everything (bias tables included), norms' scales about 1.
      base = 1.0 if 'norm' in name and name.endswith('weight') else 0.0
      p.copy_(base + 0.2 * torch.randn_like(p))
  return model


def original_names(state: dict) -> dict:
  """The original release's layout of timm's names: stage N's patch merging
  ends stage N - 1, the classifier is `head`."""
  renamed = {}
  for key, value in state.items():
    parts = key.split('.')
    if parts[0] == 'layers' and parts[2] == 'downsample':
      parts[1] = str(int(parts[1]) - 1)
    if parts[:2] == ['head', 'fc']:
      parts = ['head', *parts[2:]]
    renamed['.'.join(parts)] = value
  return renamed


def file_logits(path, scan_layers=True, init_format='auto'):
  """The tiny Swin's logits on `images` with the weights in `path`."""
  return loaded_logits(tiny_swin(scan_layers=scan_layers),
                       default_config(model='Swin_T'), path,
                       images(IMAGE_SIZE), init_format)


# Each file read once: by a scanned model and `auto`, or by a Python loop
# over the same stacks and `timm`, which reads timm's Swins too.
@pytest.mark.parametrize('scan_layers, init_format', [
    (True, 'auto'), (False, 'timm')])
def test_timm_safetensors_compute_the_torch_network(tmp_path, scan_layers,
                                                    init_format):
  torch = pytest.importorskip('torch')
  model = torch_swin(torch)
  state = {k: v.numpy() for k, v in model.state_dict().items()}
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(state, path)
  assert factory.detect_format(path) == 'timm_swin'
  expected = torch_logits(torch, model, images(IMAGE_SIZE))
  assert np.abs(expected).max() > 1  # a network whose layers all count
  logits = file_logits(path, scan_layers, init_format)
  assert np.abs(logits - expected).max() < 1e-5


def test_pth_in_timms_and_the_original_names_compute_the_torch_network(
    tmp_path):
  torch = pytest.importorskip('torch')
  model = torch_swin(torch)
  expected = torch_logits(torch, model, images(IMAGE_SIZE))
  state = model.state_dict()
  timm_path = str(tmp_path / 'timm.pth')
  torch.save(state, timm_path)
  original_path = str(tmp_path / 'swin_original.pth')
  torch.save({'model': original_names(state)}, original_path)
  for path in (timm_path, original_path):
    assert factory.detect_format(path) == 'timm_swin'
    assert np.abs(file_logits(path) - expected).max() < 1e-5


# ------------------------------------------------ rules of the papers' code


def test_drop_path_rates_are_timms_linspace_over_all_blocks():
  torch = pytest.importorskip('torch')
  model = nnx.eval_shape(lambda: models.create_model(
      'Swin_T', 1000, 3, image_size=224, drop_path_rate=0.2, rngs=nnx.Rngs(0)))
  rates = [r for stage in model.stages
           for pair in stage.blocks.drop_path_rates for r in pair]
  np.testing.assert_allclose(rates, torch.linspace(0, 0.2, 12).numpy(),
                             atol=1e-7)


def get_swin_layer(name: str, depths) -> int:
  """Swin's fine-tuning rule (SimMIM's `get_swin_layer`) in the original
  names, the head sum(depths) + 1."""
  if name.startswith('patch_embed'):
    return 0
  if name.startswith('layers'):
    stage, kind = int(name.split('.')[1]), name.split('.')[3]
    if kind in ('reduction', 'norm'):
      return sum(depths[:stage + 1])
    return sum(depths[:stage]) + int(kind) + 1
  return sum(depths) + 1


def test_layer_depths_are_swins_fine_tuning_numbers():
  depths = (2, 2, 6, 2)
  model = nnx.eval_shape(lambda: models.create_model(
      'Swin_T', 1000, 3, image_size=224, rngs=nnx.Rngs(0)))
  seen = set()
  for name, depth in layer_decay.layer_depths(model).items():
    parts = name.split('/')
    if parts[0] == 'stages' and parts[2].startswith('downsample'):
      # The original code ends stage s - 1 with stage s's merging.
      expected = get_swin_layer(
          f'layers.{int(parts[1]) - 1}.downsample.reduction.weight', depths)
    elif parts[0] == 'stages':
      parity = 0 if parts[4] == 'first' else 1
      expected = [get_swin_layer(
          f'layers.{parts[1]}.blocks.{2 * pair + parity}.norm1.weight',
          depths) for pair in range(depth.shape[0])]
    else:
      expected = get_swin_layer(
          'patch_embed.proj.weight' if parts[0].startswith('patch_embed')
          else 'head.weight', depths)
    assert depth.tolist() == expected, name
    seen.add(parts[0])
  assert seen == {'patch_embed', 'patch_embed_norm', 'stages', 'head_norm',
                  'head'}


def test_every_block_has_a_recording_point():
  model = tiny_swin(depths=STACK_DEPTHS, heads=STACK_HEADS,
                    image_size=STACK_IMAGE_SIZE)
  grads = nnx.jit(lambda model, x: intermediate_grads.recorded_grads(
      model, x, lambda logits: jnp.sum(logits**2), train=False)[1])(
          model, images(STACK_IMAGE_SIZE))
  points = {intermediate_grads.point_name(path): g.shape
            for path, g in grads.items()}
  assert points.keys() == {'stem', 'logits', 'stages.0.blocks',
                           'stages.0.blocks.first'}
  # Per pair: its shifted-window block's and its window block's.
  assert points['stages.0.blocks'][0] == 2
  assert points['stages.0.blocks.first'][0] == 2


# ------------------------------------------------------ names and sizes


# timm's published counts (224 px, 1000 classes), in millions.
@pytest.mark.parametrize('name, params_millions', zip(
    NAMES, (28.29, 49.61, 87.77)))
def test_published_parameter_counts(name, params_millions):
  model = nnx.eval_shape(lambda: models.create_model(
      name, 1000, 3, image_size=224, rngs=nnx.Rngs(0)))
  count = sum(np.prod(x.shape)
              for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert abs(count / 1e6 - params_millions) < 0.1


# ------------------------------------------ another window: timm's resizing


# Bias tables resized downward (windows of 4 at 128 px: maps 32, 16, 8, 4)
# and upward, as for 384 px fine-tuning (12 at 384 px: maps 96, 48, 24, 12).
@pytest.mark.parametrize('image_size, window', [(128, 4), (384, 12)])
def test_a_file_of_another_window_computes_timms_resized_swin(
    tmp_path, image_size, window):
  """timm's `swin_tiny_patch4_window7_224` file run with another window:
  its bias tables resized as timm resizes them (`checkpoint_filter_fn`,
  `resize_rel_pos_bias_table`), the logits those of timm's model built so
  and given the same file."""
  torch = pytest.importorskip('torch')
  from helpers import import_timm  # pylint: disable=g-import-not-at-top
  timm = import_timm()
  saved = timm.create_model('swin_tiny_patch4_window7_224', pretrained=False,
                            num_classes=5).eval()
  generator = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for key, p in saved.named_parameters():
      noise = torch.randn(p.shape, generator=generator)
      p.copy_(1 + 0.2 * noise if 'norm' in key and key.endswith('weight')
              else 0.1 * noise)
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(
      {k: v.numpy() for k, v in saved.state_dict().items()}, path)
  reference = timm.create_model('swin_tiny_patch4_window7_224',
                                pretrained=False, num_classes=5,
                                img_size=image_size,
                                window_size=window).eval()
  reference.load_state_dict(timm.models.swin_transformer.checkpoint_filter_fn(
      saved.state_dict(), reference))
  config = default_config(model='Swin_T', image_size=image_size,
                          swin_window=window)
  model = nnx.eval_shape(lambda: models.create_model(
      'Swin_T', 5, 3, rngs=nnx.Rngs(0), **models.options(config)))
  nnx.update(model, jax.tree.map(
      lambda s: jax.device_put(np.zeros(s.shape, s.dtype)),
      nnx.state(model)))
  pretrained.load_into_model(model, models.settings(config), path)
  x = np.asarray(images(image_size))
  ours = np.asarray(nnx.jit(lambda m, x: m(x, train=False))(
      model, jnp.asarray(x)))
  with torch.no_grad():
    expected = reference(torch.from_numpy(x.copy()).permute(0, 3, 1, 2)
                         ).numpy()
  scale = np.abs(expected).max()
  assert scale > 0.1
  np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5 * scale)


def test_swin_b_window_12_has_timms_parameters_at_384_px():
  """`swin_base_patch4_window12_384`: Swin_B with `swin_window=12`; a file
  of window 7 fine-tuned so (README) has its bias tables resized upward
  as timm's `checkpoint_filter_fn` resizes them."""
  torch = pytest.importorskip('torch')
  from helpers import import_timm  # pylint: disable=g-import-not-at-top
  timm = import_timm()
  table = np.random.default_rng(0).normal(size=(13 * 13, 4))
  np.testing.assert_allclose(
      fitting.resize_relative_position_table(table, 23),
      timm.layers.resize_rel_pos_bias_table(
          torch.from_numpy(table), (12, 12), (23 * 23, 4)).numpy(),
      rtol=0, atol=1e-5)
  with torch.device('meta'):
    reference = timm.create_model('swin_base_patch4_window12_384',
                                  pretrained=False)
  models.check_image_size('Swin_B', 384, swin_window=12)
  model = nnx.eval_shape(lambda: models.create_model(
      'Swin_B', 1000, 3, image_size=384, swin_window=12, rngs=nnx.Rngs(0)))
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
      nnx.state(model, nnx.Param))) == sum(
          p.numel() for p in reference.parameters())


def test_bad_swin_windows_are_refused_naming_the_fix():
  for window in (0, 2.5):
    with pytest.raises(ValueError, match=(
        f'swin_window {window} must be a whole number >= 1')):
      models.check_image_size('Swin_T', 224, swin_window=window)
  with pytest.raises(ValueError, match='Swin_T cannot take image_size 224'):
    models.check_image_size('Swin_T', 224, swin_window=12)
