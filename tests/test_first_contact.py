"""A new user's first commands, each run as its own process as a user runs
it: the one line a mistake prints, at once, what a shrunk recipe says it
changed, and that nothing is written where nothing should be."""

import os
import subprocess
import time

import pytest

from helpers import REPO
from helpers import import_timm
from image_data import write_folders
from weight_references import write_timm_vit_ti16
import processes

# From a launch's error line to its exit.
EXIT_SECONDS = 2.0


def error_of(workdir, overrides: dict, config='configs/default.py') -> str:
  """The last line of `main.py`'s stderr, after asserting it exited 1."""
  command = processes.main_command(workdir, overrides, config=config)
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
  assert result.returncode == 1, result.stderr[-3000:]
  return result.stderr.strip().splitlines()[-1]


def test_a_swin_size_its_windows_cannot_tile_names_the_sizes_that_work(
    tmp_path):
  workdir = tmp_path / 'run'
  assert error_of(workdir, dict(model='Swin_T', image_size=256)) == (
      'Error: Swin_T cannot take image_size 256: its patches of 4, 3 patch '
      'merges and windows of 7 tile only 224, 448, 672, 896 of the sizes up '
      'to 1024; use one of them')
  assert not workdir.exists()


def test_a_teacher_file_of_another_model_names_the_teachers_own_keys(
    tmp_path):
  workdir, teacher = tmp_path / 'run', tmp_path / 'teacher.safetensors'
  write_timm_vit_ti16(str(teacher), 12, classes=1000)  # fake data's classes
  line = error_of(workdir, dict(dataset='fake', image_size=32,
                                teacher_model='ViT_S16',
                                distillation_type='soft',
                                teacher_init_from=teacher))
  assert line.startswith('Error: teacher: '), line
  assert line.endswith('; its model needs --config.teacher_model=ViT_Ti16'), (
      line)
  assert 'num_layers' not in line
  assert not workdir.exists()


def test_a_shrunk_recipe_says_what_it_scaled_and_shortened(tmp_path):
  """DeiT-S's recipe at batch 8 for 20 steps: its floor is above the peak
  at that batch and its warmup longer than the run; the run says how each
  was made consistent, and goes on."""
  command = processes.main_command(
      tmp_path / 'run', dict(dataset='fake', batch_size=8, num_train_steps=20,
                             model='ViT_Ti16', num_layers=1, image_size=32),
      config='configs/deit_s16.py')
  with processes.Processes([command],
                           [processes.cpu_environment(8)]) as run:
    warmup = run.wait_for_line(0, lambda line: 'warmup of' in line, 300)
    log = run.log(0)
  assert ('min_learning_rate 1e-05 is not below the peak 7.8e-06 at batch 8: '
          'scaled with the batch as learning_rate is (x 8/512) to 1.6e-07.'
          ) in log, log[-3000:]
  assert warmup.rstrip().endswith(
      "is not shorter than the run's 20 steps: warmup shortened to 2 steps "
      '(10% of the run).'), warmup
  assert 'Error' not in log


def test_a_clip_files_projection_is_not_called_classes(tmp_path):
  """`configs/finetune.py:clip_b16` from timm's OpenAI CLIP file (two
  blocks, 32 px; its head CLIP's 512-wide image projection, bias zeros as
  timm converts it) on three class folders: the log says what the head
  was."""
  torch = pytest.importorskip('torch')
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  timm = import_timm()
  clip = timm.create_model('vit_base_patch16_clip_224.openai',
                           pretrained=False, depth=2, img_size=32)
  state = {name: value.detach().contiguous()
           for name, value in clip.state_dict().items()}
  state['head.bias'] = torch.zeros_like(state['head.bias'])
  path = str(tmp_path / 'clip.safetensors')
  safetensors.torch.save_file(state, path)
  write_folders(tmp_path / 'images', extras=False)
  command = processes.main_command(tmp_path / 'run', dict(
      dataset=f'folder:{tmp_path / "images"}', init_from=path,
      image_size=32, num_layers=2, batch_size=8, num_train_steps=1),
      config='configs/finetune.py:clip_b16')
  result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=processes.cpu_environment(1))
  assert result.returncode == 0, result.stderr[-3000:]
  assert ("head re-initialised to zeros: the file's head is CLIP's image "
          'projection (512 wide), no classifier; the model has 3 classes'
          ) in result.stderr, result.stderr[-3000:]
  assert '512 classes' not in result.stderr


def test_a_backbone_file_under_the_wrong_preset_names_every_fix_at_once(
    tmp_path):
  """timm's DINOv2 ViT-B/14 file (two blocks) under `configs/finetune.py`'s
  default ResNet-50 preset: one launch names the model, its depth, every
  convention the file computes with, and the preset that sets them, and
  exits at once, not after the ResNet-50 step compiling meanwhile (a
  minute here)."""
  pytest.importorskip('torch')
  import safetensors.torch  # pylint: disable=g-import-not-at-top
  dinov2 = import_timm().create_model('vit_base_patch14_dinov2',
                                      pretrained=False, depth=2,
                                      img_size=28)
  path = str(tmp_path / 'dinov2.safetensors')
  safetensors.torch.save_file({name: value.detach().contiguous() for
                               name, value in dinov2.state_dict().items()},
                              path)
  write_folders(tmp_path / 'images', extras=False)
  workdir = tmp_path / 'run'
  command = processes.main_command(
      workdir, dict(dataset=f'folder:{tmp_path / "images"}', init_from=path,
                    image_size=28, batch_size=8),
      config='configs/finetune.py')
  with processes.Processes([command], [dict(os.environ)]) as run:
    line = run.wait_for_line(0, lambda text: text.startswith('Error:'), 300)
    printed = time.monotonic()
    assert run.wait(60) == [1], run.log(0)[-3000:]
    exit_seconds = time.monotonic() - printed
  assert exit_seconds <= EXIT_SECONDS, run.log(0)[-3000:]
  assert line.strip() == (
      'Error: init_from is a timm ViT, but --config.model=ResNet50 is a '
      'ResNet; its model needs --config.model=ViT_B14 '
      '--config.num_layers=2 --config.vit_pool=cls --config.vit_posemb=learn '
      '--config.vit_layer_scale=True --config.vit_gelu=exact; '
      'configs/finetune.py:dinov2_b14 sets them all')
  assert not workdir.exists()
