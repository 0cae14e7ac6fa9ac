"""`export.py --format=timm`, checked against timm itself: each family's
exported file loads strictly into the model timm builds from the file's
metadata (its name, arguments and evaluation preprocessing) and computes
the project's logits; it reads back bit for bit; what no timm model holds
is refused naming the option; and the readers of timm's files compute
timm's own models. (The ViT presets of configs/finetune.py:
test_export_timm_backbones.py.)"""

from flax import nnx
import numpy as np
import pytest
import safetensors.numpy

from configs import default
import export
from exporting import timm_files
import models
from training import run_state
from exported_runs import NUM_CLASSES
from exported_runs import RUNS
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
from helpers import loaded_logits
from helpers import random_model
from helpers import torch_logits

# One worker builds each family's exported run once for every test of it.
pytestmark = pytest.mark.xdist_group('export_timm')


@pytest.fixture(scope='module', params=list(RUNS))
def exported(request, tmp_path_factory):
  """(config, workdir, timm file) of each family's run, exported by
  `export.export` (the command line's `--format=timm`, run as its own
  process: the refusal test below)."""
  config = run_config(**RUNS[request.param])
  directory = tmp_path_factory.mktemp(request.param)
  workdir, output = directory / 'run', str(directory / 'timm.safetensors')
  write_run(workdir, config)
  export.export(str(workdir), output, file_format='timm')
  return config, str(workdir), output


def test_timm_loads_the_export_strictly_and_computes_the_projects_logits(
    exported):
  config, workdir, path = exported
  import torch  # pylint: disable=g-import-not-at-top
  model = run_state.load_trained(workdir, default.get_config())[1].model()
  x = images(config)
  expected = np.asarray(evaluation_logits(model, x))
  assert_close_to_scale(torch_logits(torch, timm_model(path), x), expected,
                        1e-5)


def test_the_timm_export_reads_back_bit_for_bit(exported):
  config, workdir, path = exported
  if models.family(config.model) == 'vit' and (
      config.vit_posemb == 'sincos2d'):
    # timm's table is learned: read back with --config.vit_posemb=learn
    # and timm's conventions, the fixed table becomes a parameter.
    pytest.skip('a fixed position embedding reads back as a learned one')
  assert_reads_back_bit_for_bit(workdir, config, path)


@pytest.mark.parametrize('model', ['ConvNeXt_T', 'ConvNeXtV2_T'])
def test_larger_convnexts_are_written_with_timms_linear_mlps(model):
  """The exports above hold the smallest ConvNeXts, whose MLPs timm keeps
  as 1x1 convolutions; the larger ones' are linear layers: every name and
  shape of the written state dict is timm's own model's."""
  timm = import_timm()
  config = run_config(model=model, image_size=32)
  graphdef, state = initial_state(config)
  written = timm_files.state_dict(
      nnx.merge(graphdef, state.params, state.model_state), config)
  name, args = timm_files.timm_model(config, 3)
  reference = timm.create_model(name, num_classes=NUM_CLASSES, **args)
  assert {key: value.shape for key, value in written.items()} == {
      key: tuple(value.shape)
      for key, value in reference.state_dict().items()}
  assert written['stages.0.blocks.0.mlp.fc1.weight'].ndim == 2


def test_a_model_timm_lacks_is_refused_in_one_line_naming_the_formats(
    tmp_path):
  config = default.get_config()
  config.update(dataset='fake', image_size=8, num_layers=1, width=8)
  write_run(tmp_path / 'run', config)
  output = tmp_path / 'timm.safetensors'
  result = export_command(tmp_path / 'run', output, '--format=timm')
  assert result.returncode != 0
  assert result.stderr.strip().splitlines()[-1] == (
      'Error: --format=timm: no timm model is written for SmallResNet '
      f'(written: {", ".join(timm_files.TIMM_MODELS)}); export it with '
      '--format=project or onnx')
  assert not output.exists()
  with pytest.raises(ValueError, match=r"unknown --format='tf'; valid names: "
                     'project, timm'):
    export.export(str(tmp_path / 'run'), str(output), file_format='tf')


@pytest.mark.parametrize('options, message', [
    (dict(vit_projection=512), "timm's ViTs have no layer between the "
     'pooled features and the head (vit_projection; timm holds CLIP\'s '
     'projection as the head)'),
    (dict(model='ViT_S14', vit_norm_eps=1e-5), 'timm has no ViT_S14 with '
     "LayerNorms of epsilon 1e-05 (vit_norm_eps; timm's ViTs: 1e-06, its "
     'CLIPs, B16 and L14: 1e-05)'),
    (dict(vit_distillation_token=True, vit_registers=4),
     "timm's distilled ViTs have no register tokens (vit_registers)"),
    (dict(model='ViT_L16', vit_distillation_token=True),
     'timm has no ViT_L16 with a distillation token'),
    (dict(eval_resize_method='gaussian'), "timm's transforms have no resize "
     "like eval_resize_method='gaussian' (theirs: bilinear, bicubic, area, "
     'lanczos3, nearest)'),
])
def test_what_no_timm_model_holds_is_refused_naming_the_option(options,
                                                               message):
  config = run_config(model='ViT_B16', vit_pool='cls', vit_posemb='learn',
                      vit_gelu='exact')
  config.update(options)
  assert timm_files.problem(config) == message


# Each family's model as timm builds it, read by this project's readers;
# a ViT with big_vision's conventions is no timm model.
@pytest.mark.parametrize('run', [run for run in RUNS if run != 'vit_gap'])
def test_the_readers_of_timm_files_compute_timms_own_models(run, tmp_path):
  import torch  # pylint: disable=g-import-not-at-top
  timm = import_timm()
  config = run_config(**RUNS[run])
  name, args = timm_files.timm_model(config, 3)
  torch.manual_seed(0)
  reference = timm.create_model(name, num_classes=NUM_CLASSES, **args)
  with torch.no_grad():  # every array counts: no zero head, no unit stats
    for key, value in reference.state_dict().items():
      if value.is_floating_point():
        value.add_(0.02 * torch.rand_like(value))
  path = str(tmp_path / 'timm.safetensors')
  safetensors.numpy.save_file(
      {key: value.numpy() for key, value in reference.state_dict().items()},
      path)
  # Random, not initialised: every array is read from the file.
  model = random_model(lambda: models.create_model(
      config.model, NUM_CLASSES, 3, rngs=nnx.Rngs(0),
      **models.options(config)))
  x = images(config)
  # 1e-4: with timm's initial weights, ConvNeXt V2-T's logits differ by
  # 3.6e-5 of their scale (measured; the other families by under 1e-5).
  assert_close_to_scale(loaded_logits(model, config, path, x),
                        torch_logits(torch, reference.eval(), x), 1e-4)
