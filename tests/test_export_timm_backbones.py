"""`export.py --format=timm` of the ViTs `configs/finetune.py` starts from:
each preset's run (and DeiT III's and DINOv2-with-registers' options) is
written as the timm model its weights came from, which timm builds from the
file's metadata alone, loads strictly and runs to the project's logits; the
file reads back bit for bit, and so does timm's own save of the model it
builds (DINOv2, CLIP, SigLIP and DeiT III at full depth, exported by the
command); timm's data config and transforms, from the metadata, classify
image files as predict.py does; and timm's own models have the architecture
the table of timm's ViT names says."""

from flax import nnx
import numpy as np
import PIL.Image
import pytest
import safetensors
import safetensors.numpy

from configs import default
from configs import finetune
import export
from exporting import timm_files
from exporting import timm_vits
import input_pipeline
import models
import predict
from training import run_state
from weights import pretrained
from weights import timm_vit
from exported_runs import CLASSES
from exported_runs import NUM_CLASSES
from exported_runs import assert_close_to_scale
from exported_runs import assert_reads_back_bit_for_bit
from exported_runs import export_command
from exported_runs import images
from exported_runs import initial_state
from exported_runs import run_config
from exported_runs import timm_model
from exported_runs import write_run
from helpers import evaluation_logits
from helpers import import_timm
from helpers import random_model
from helpers import torch_logits
from image_data import image_pixels
from image_data import save_image

torch = pytest.importorskip('torch')

pytestmark = pytest.mark.xdist_group('export_timm_backbones')

# Per case: the preset, the overrides that shrink it (a small image: 7 x 7
# patches of 16 or 2 x 2 of 14, sides image_size / crop_pct whole; the
# options' cases two blocks), and timm's model it is written as. One case
# of each published backbone's kind at its model's full depth: DINOv2's as
# its small member (ViT-S/14, 12 blocks), CLIP's and SigLIP's ViT-B/16,
# DeiT III's ViT-S/16.
CASES = {
    'dinov2_b14': ('dinov2_b14', dict(model='ViT_S14', num_layers=0,
                                      image_size=28),
                   'vit_small_patch14_dinov2'),
    'dinov2_b14_reg4': ('dinov2_b14', dict(vit_registers=4, num_layers=2,
                                           image_size=28),
                        'vit_base_patch14_reg4_dinov2'),
    'clip_b16': ('clip_b16', dict(num_layers=0, image_size=112),
                 'vit_base_patch16_clip_quickgelu_224'),
    'siglip_b16': ('siglip_b16', dict(num_layers=0, image_size=112),
                   'vit_base_patch16_siglip_224'),
    'vit_s16': ('vit_s16', dict(num_layers=2, image_size=112),
                'vit_small_patch16_224'),
    'deit3_s16': ('vit_s16', dict(vit_layer_scale=True, num_layers=0,
                                  image_size=112), 'deit3_small_patch16_224'),
    'vit_b16_mae': ('vit_b16_mae', dict(num_layers=2, image_size=112),
                    'vit_base_patch16_224'),
}
# The full-depth cases, exported by the command as users run it, each its
# own process; the others by its `export` function.
FULL_DEPTH = ('dinov2_b14', 'clip_b16', 'siglip_b16', 'deit3_s16')


def preset_config(preset, **overrides):
  """`configs/finetune.py:PRESET` on fake data with `overrides`, computing
  in float32 as timm does (the presets compute in bfloat16; every format
  writes float32 weights)."""
  config = finetune.get_config(preset)
  config.update(dataset='fake', scan_unroll=1, half_precision=False,
                **overrides)
  return config


# Each case's export, made once for every test of it.
_EXPORTED = {}


@pytest.fixture(scope='module', params=list(CASES))
def exported(request, tmp_path_factory):
  """(case, config, workdir, timm file) of each case's run (random weights),
  exported to timm."""
  return exported_once(request.param, tmp_path_factory)


@pytest.fixture(scope='module', params=FULL_DEPTH)
def exported_at_full_depth(request, tmp_path_factory):
  """`exported` of the FULL_DEPTH cases alone."""
  return exported_once(request.param, tmp_path_factory)


def exported_once(case, tmp_path_factory):
  if case not in _EXPORTED:
    _EXPORTED[case] = export_case(case, tmp_path_factory.mktemp(case))
  return _EXPORTED[case]


def export_case(case, directory):
  """The case's run written in `directory` and exported to timm: by the
  command at full depth."""
  preset, overrides, _ = CASES[case]
  config = preset_config(preset, **overrides)
  workdir, output = directory / 'run', directory / 'timm.safetensors'
  write_run(workdir, config)
  if case in FULL_DEPTH:
    result = export_command(workdir, output, '--format=timm')
    assert result.returncode == 0, result.stderr[-3000:]
  else:
    export.export(str(workdir), str(output), file_format='timm')
  return case, config, str(workdir), str(output)


def test_timm_builds_the_preset_from_the_metadata_with_the_projects_logits(
    exported):
  case, config, workdir, path = exported
  model = timm_model(path)
  assert model.pretrained_cfg['architecture'] == CASES[case][2]
  trained = run_state.load_trained(workdir, default.get_config())[1].model()
  x = images(config)
  assert_close_to_scale(torch_logits(torch, model, x),
                        np.asarray(evaluation_logits(trained, x)), 1e-5)


def test_the_preset_export_reads_back_bit_for_bit(exported):
  _, config, workdir, path = exported
  assert_reads_back_bit_for_bit(workdir, config, path)


def test_timms_own_save_of_the_export_reads_back_bit_for_bit(
    exported_at_full_depth, tmp_path):
  """timm's way round: the model timm builds from the export's metadata,
  saved as timm publishes its models (`save_for_hf`: its state dict by
  safetensors, none of the project's metadata), read by `init_from` gives
  every trained array of the run exactly."""
  _, config, workdir, path = exported_at_full_depth
  import_timm().models.save_for_hf(timm_model(path), str(tmp_path),
                                   safe_serialization=True)
  saved = str(tmp_path / 'model.safetensors')
  with safetensors.safe_open(saved, framework='numpy') as f:
    assert timm_vit.MODEL_KEY not in (f.metadata() or {})
  assert_reads_back_bit_for_bit(workdir, config, saved)


def timm_probabilities(model, paths):
  """Softmax of timm's `model` on image files, each made by timm's
  transforms of the data config it resolves from the model."""
  timm = import_timm()
  data_config = timm.data.resolve_data_config(model=model)
  transform = timm.data.create_transform(**data_config)
  x = torch.stack([transform(PIL.Image.open(path).convert('RGB'))
                   for path in paths])
  with torch.no_grad():
    return torch.softmax(model(x), dim=-1).numpy(), data_config


def test_timms_transforms_from_the_metadata_classify_as_predict(
    exported, tmp_path):
  """timm's data config is the run's evaluation preprocessing; on files of
  side image_size / crop_pct (where both crop the same pixels and resize
  none) timm gives predict.py's top-5 classes and probabilities; on a JPEG
  of another size (each library resizes its own way) the same class."""
  _, config, workdir, path = exported
  side = round(config.image_size / input_pipeline.EVAL_CROP_FRACTION)
  rng = np.random.default_rng(0)
  paths = []
  for name, height, width in (('a.png', side, side), ('b.png', side, side),
                              ('c.JPEG', 45, 60)):
    paths.append(str(tmp_path / name))
    save_image(paths[-1], image_pixels(rng, height, width))
  names, expected = predict.classify_with_run(workdir, paths, batch_size=3)
  assert names == list(CLASSES)
  probabilities, data_config = timm_probabilities(timm_model(path), paths)
  assert data_config == {  # as JSON holds them: lists
      'input_size': [3, config.image_size, config.image_size],
      'interpolation': 'bicubic', 'mean': [0.485, 0.456, 0.406],
      'std': [0.229, 0.224, 0.225], 'crop_pct': 0.875,
      'crop_mode': 'center'}
  for p, (indices, want) in zip(probabilities[:2], expected[:2]):
    top = np.argsort(-p, kind='stable')[:5]
    assert top.tolist() == indices.tolist()
    np.testing.assert_allclose(p[top], want, rtol=0, atol=1e-5)
  assert np.argmax(probabilities[2]) == expected[2][0][0]


def test_timm_vit_names_have_the_architecture_the_table_says():
  """Each timm name of the table, built by timm at full depth (shapes
  only), has the tokens, pooling, layer scale, norms and GELU the table
  gives it; and a run with exactly those options is written as that name
  with no argument beyond its depth."""
  timm = import_timm()
  for model_name, names in {**timm_vits.NAMES,
                            **timm_vits.DISTILLED}.items():
    for name, own in names.items():
      args = dict(timm_vits.DEFAULTS, **own)
      with torch.device('meta'):
        model = timm.create_model(name)
      block = model.blocks[0]
      assert {
          'img_size': model.patch_embed.img_size[0],
          'class_token': model.has_class_token,
          'global_pool': model.global_pool,
          'init_values': getattr(block.ls1, 'init_values', None),
          'reg_tokens': model.num_reg_tokens,
          'no_embed_class': model.no_embed_class,
          'pre_norm': not isinstance(model.norm_pre, torch.nn.Identity),
          'act_layer': {'GELU': None, 'QuickGELU': 'quick_gelu'}[
              type(block.mlp.act).__name__],
          'norm_eps': model.norm.eps,
      } == {key: own.get(key, value) for key, value in dict(
          args, norm_eps=timm_vits.NORM_EPS).items()
            if key not in ('fc_norm', 'pool_include_prefix')}, name
      config = default.get_config()
      config.update(
          model=model_name, num_layers=1, image_size=args['img_size'],
          vit_pool={'token': 'cls', 'map': 'map'}[args['global_pool']],
          vit_posemb='learn', vit_gelu=('quick' if args['act_layer']
                                        else 'exact'),
          vit_layer_scale=args['init_values'] is not None,
          layer_scale_init=args['init_values'] or 1e-6,
          vit_registers=args['reg_tokens'], vit_norm_pre=args['pre_norm'],
          vit_norm_eps=own.get('norm_eps', timm_vits.NORM_EPS),
          vit_distillation_token=names is timm_vits.DISTILLED.get(
              model_name))
      assert timm_files.timm_model(config, 3) == (name, {'depth': 1})


def test_init_from_takes_the_gelu_and_epsilon_the_file_computes_with(
    tmp_path):
  """An export names its timm model, so `init_from` reads its GELU and
  LayerNorm epsilon from the metadata (here a combination no timm name
  has: CLIP's epsilon and quick GELU without CLIP's norm before the
  encoder); a file that names none (timm's own) with a norm before the
  encoder is CLIP's, which timm computes with quick or exact GELU."""
  config = run_config(model='ViT_B16', num_layers=1, image_size=32,
                      vit_pool='cls', vit_posemb='learn', vit_gelu='quick',
                      vit_norm_eps=1e-5)
  path = str(tmp_path / 'export.safetensors')
  save_export(config, path)
  assert timm_files.timm_model(config, 3) == (
      'vit_base_patch16_clip_quickgelu_224',
      {'img_size': 32, 'pre_norm': False, 'depth': 1})
  load_with(config, path)
  config.vit_gelu = 'exact'
  with pytest.raises(ValueError, match=(
      r"^init_from is a timm ViT with vit_gelu='quick'; set "
      r"--config.vit_gelu=quick \(the model has 'exact'\)$")):
    load_with(config, path)
  config.update(vit_norm_pre=True, vit_gelu='tanh')
  save_export(config, path, with_metadata=False)
  with pytest.raises(ValueError, match=(
      r"^init_from is a timm ViT with vit_gelu 'quick' or 'exact'; set "
      r"--config.vit_gelu=quick \(the model has 'tanh'\)$")):
    load_with(config, path)


def save_export(config, path, with_metadata=True):
  """`config`'s model at random weights as `--format=timm` writes it, or
  without `with_metadata` as a bare state dict."""
  graphdef, state = initial_state(config)
  model = nnx.merge(graphdef, state.params, state.model_state)
  metadata = (timm_files.metadata(config, pretrained.trained_arrays(model))
              if with_metadata else None)
  safetensors.numpy.save_file(timm_files.state_dict(model, config), path,
                              metadata=metadata)


def load_with(config, path):
  """Reads `path` as `init_from` into `config`'s model."""
  model = random_model(lambda: models.create_model(
      config.model, NUM_CLASSES, 3, rngs=nnx.Rngs(0),
      **models.options(config)))
  pretrained.load_into_model(model, models.settings(config), path)
