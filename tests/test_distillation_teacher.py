"""Knowledge distillation's frozen teacher: read like init_from, never
trained, never saved, its file recorded; its evaluation tags; a resume with
another, no or a changed teacher refused; the checks of its settings."""

import hashlib
import os
import re
import shutil
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy

from data import datasets
import input_pipeline
import models
from runtime import checkpointing
from runtime import sharding
from runtime import config_error
import eval_checkpoint
from training import teacher as teacher_lib
import train
from helpers import REPO
from helpers import VIT
from helpers import assert_trees_close
from helpers import batch_sharding
from helpers import build_model
from helpers import flat_params
from helpers import masked_examples
from helpers import read_scalars
from helpers import tiny_config
from helpers import write_checkpoint
from weight_references import write_timm_vit_ti16

pytestmark = pytest.mark.xdist_group('distillation')

# The teacher of the small-model runs: another small model, noisy weights.
TEACHER = dict(num_layers=2, width=8, seed=5)
RUN = dict(distillation_type='kl', distillation_tau=2.0,
           distillation_alpha=0.7, grad_accum_steps=2,
           num_train_steps=4, eval_every_steps=4, checkpoint_every_steps=2,
           optimizer='sgd', warmup_epochs=0.0, log_every_steps=1)


@pytest.fixture(scope='module')
def teacher_dir(tmp_path_factory):
  """A small model's workdir (seed 5, noisy), the distilled runs' teacher;
  and that state."""
  directory = tmp_path_factory.mktemp('teacher')
  state = write_checkpoint(directory, tiny_config(**TEACHER),
                           datasets.load_digits().info, noise=0.3)
  return str(directory), state


def distilled_config(teacher_directory, **overrides):
  return tiny_config(**{**RUN, 'teacher_model': 'SmallResNet',
                        'teacher_init_from': teacher_directory, **overrides})


def teacher_of(config, info, mesh):
  """The teacher of a run of `config`, built as the run builds it."""
  return teacher_lib.create_teacher(
      config.teacher_model, config.teacher_init_from,
      config.teacher_init_format, models.options(config), info, mesh,
      dtype=models.compute_dtype(config), seed=config.seed)


@pytest.fixture(scope='module')
def distilled_run(tmp_path_factory, teacher_dir):
  """A distilled run of 4 steps (jit): its workdir and final state."""
  workdir = str(tmp_path_factory.mktemp('distilled'))
  state = train.train_and_evaluate(distilled_config(teacher_dir[0]), workdir)
  return workdir, state


def test_the_teacher_is_not_trained_nor_saved_and_its_file_is_recorded(
    teacher_dir, distilled_run):
  directory, saved = teacher_dir
  workdir, state = distilled_run
  # Bit for bit the file's weights after training; the student moved.
  teacher_params = flat_params(state.teacher)
  saved_params = flat_params(saved.params)
  assert teacher_params.keys() == saved_params.keys()
  for path, value in saved_params.items():
    np.testing.assert_array_equal(teacher_params[path], value)
  for step in (2, 4):
    step_dir = os.path.join(workdir, 'checkpoints', str(step))
    with ocp.PyTreeCheckpointer() as reader:
      tree = reader.metadata(os.path.join(step_dir, 'state')).item_metadata.tree
    assert not jax.tree.leaves(tree.get('teacher')), step
    recorded = checkpointing.saved_config(step_dir)['teacher_file']
    assert recorded == teacher_lib.fingerprint(directory)
  # The teacher's checkpoint by its small metadata, not its arrays.
  assert recorded == {'path': directory, 'identity': checkpointing.
                      checkpoint_identity(recorded['checkpoint']),
                      'checkpoint': os.path.join(directory, 'checkpoints',
                                                 '0')}


def held_out_top1(config, params, model_state, images) -> np.ndarray:
  """Each image's top-1 class by the model of `config` with these
  weights, computed here, outside the trainer's evaluation."""
  model = build_model(config)
  nnx.update(model, params, model_state)
  return np.argmax(np.asarray(model(images, train=False)), axis=-1)


def test_evaluation_reports_the_teachers_accuracy_and_agreement(
    tmp_path, teacher_dir, distilled_run):
  directory, saved = teacher_dir
  workdir, state = distilled_run
  scalars = read_scalars(workdir)
  # The teacher's accuracy is its own evaluation's, by another path.
  events_dir = str(tmp_path / 'teacher_eval')
  own = eval_checkpoint.evaluate_checkpoint(tiny_config(**TEACHER), directory,
                                           events_dir=events_dir)
  assert scalars['eval_teacher_accuracy'][4] == pytest.approx(
      own['eval_accuracy'], abs=1e-6)
  # The agreement: the share of the held-out digits on which the final
  # student's top-1 class is the teacher's.
  digits = datasets.load_digits()
  student_top1 = held_out_top1(distilled_config(directory), state.params,
                               state.model_state, digits.eval_images)
  teacher_top1 = held_out_top1(tiny_config(**TEACHER), saved.params,
                               saved.model_state, digits.eval_images)
  agreement = np.mean(student_top1 == teacher_top1)
  assert 0 < agreement < 1  # neither a copy of the teacher nor unrelated
  assert scalars['eval_teacher_agreement'][4] == pytest.approx(agreement,
                                                               abs=1e-6)


def test_a_distilled_step_logs_its_base_and_distillation_losses(
    distilled_run):
  workdir, _ = distilled_run
  scalars = read_scalars(workdir)
  alpha = RUN['distillation_alpha']
  assert sorted(scalars['train_base_loss']) == [1, 2, 3, 4]
  for step, loss in scalars['train_loss'].items():
    base = scalars['train_base_loss'][step]
    distilled = scalars['train_distillation_loss'][step]
    assert base > 0 and distilled > 0
    assert loss == pytest.approx((1 - alpha) * base + alpha * distilled,
                                 rel=1e-5)


def digits_accuracy(config, state) -> float:
  """Top-1 accuracy over the digits' eval split of the model of `config`
  with `state`'s weights, applied here to the whole split at once."""
  model = nnx.merge(nnx.graphdef(models.create_model(
      config.model, 10, 1, rngs=nnx.Rngs(0), **models.options(config))),
                    state.params, state.model_state)
  images, labels = masked_examples(datasets.load_digits().eval_batches(
      64, batch_sharding(1), jnp.float32))
  logits = np.asarray(model(jnp.asarray(images), train=False))
  return float(np.mean(logits.argmax(-1) == labels))


def test_eval_mode_of_a_distilled_run_reports_the_teachers_accuracy(
    tmp_path, teacher_dir, distilled_run):
  """`--mode=eval` with no override: the saved config, the teacher read
  again; its accuracy by another path, the rest as the run's own."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(distilled_run[0], workdir)
  events_dir = str(tmp_path / 'events')
  result = subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py',
       f'--workdir={workdir}', f'--events_dir={events_dir}', '--mode=eval'],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  evaluated = {tag: values[4] for tag, values in
               read_scalars(events_dir).items()}
  assert evaluated['eval_teacher_accuracy'] == pytest.approx(
      digits_accuracy(tiny_config(**TEACHER), teacher_dir[1]), abs=1e-6)
  trained = read_scalars(workdir)
  for tag in ('eval_accuracy', 'eval_loss', 'eval_teacher_agreement',
              'eval_teacher_accuracy'):
    assert evaluated[tag] == pytest.approx(trained[tag][4], rel=1e-5), tag


def test_pmap_equals_jit_with_a_teacher(tmp_path, teacher_dir, distilled_run):
  workdir, reference = distilled_run
  state = train.train_and_evaluate(
      distilled_config(teacher_dir[0], step_mode='pmap'), str(tmp_path))
  losses, reference_losses = (read_scalars(w)['train_loss']
                              for w in (str(tmp_path), workdir))
  assert sorted(losses) == [1, 2, 3, 4]
  np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                             [reference_losses[s] for s in sorted(losses)],
                             rtol=1e-5)
  assert_trees_close((state.params, state.model_state),
                     (reference.params, reference.model_state), rtol=1e-5,
                     atol=1e-5)
  assert (read_scalars(str(tmp_path))['eval_teacher_agreement'][4] ==
          pytest.approx(read_scalars(workdir)['eval_teacher_agreement'][4],
                        abs=1e-6))


def test_a_resume_from_another_teacher_workdir_is_refused(
    tmp_path, teacher_dir, distilled_run):
  workdir, _ = distilled_run
  directory = teacher_dir[0]
  resumed, copied = str(tmp_path / 'resumed'), str(tmp_path / 'copied')
  shutil.copytree(workdir, resumed)
  # A copy of the teacher's workdir is the same teacher.
  shutil.copytree(directory, copied)
  saved = checkpointing.saved_config(os.path.join(resumed, 'checkpoints',
                                                  '4'))
  teacher_lib.check_same_teacher(saved, teacher_lib.fingerprint(copied), 4)
  # Another save, of the same model and step: another teacher.
  changed = str(tmp_path / 'changed_teacher')
  write_checkpoint(changed, tiny_config(**{**TEACHER, 'seed': 6}),
                   datasets.load_digits().info, noise=0.3)
  was, now = (os.path.join(d, 'checkpoints', '0')
              for d in (directory, changed))
  with pytest.raises(config_error.ConfigError, match=re.escape(
      f"teacher_init_from '{changed}' has changed since the checkpoint at "
      f'step 4 (now the checkpoint {now}, metadata '
      f'{checkpointing.checkpoint_identity(now)[:12]}...; it recorded the '
      f'checkpoint {was}, metadata '
      f'{checkpointing.checkpoint_identity(was)[:12]}... of {directory!r}); '
      'pass the teacher it was trained with, or a new --workdir') + '$'):
    train.train_and_evaluate(distilled_config(changed, num_train_steps=6),
                             resumed)
  assert sorted(os.listdir(os.path.join(resumed, 'checkpoints'))) == [
      '2', '4']


def test_a_resume_without_its_teacher_or_with_a_new_one_is_refused(
    tmp_path, teacher_dir, distilled_run):
  workdir, _ = distilled_run
  directory = teacher_dir[0]
  resumed = str(tmp_path / 'resumed')
  shutil.copytree(workdir, resumed)
  with pytest.raises(config_error.ConfigError, match=re.escape(
      "the checkpoint at step 4 was distilled from teacher_model "
      "'SmallResNet' and this run has no teacher; resume with "
      f'--config.teacher_model=SmallResNet --config.teacher_init_from='
      f'{directory} --config.distillation_type=kl, or use a new --workdir')
                     + '$'):
    train.train_and_evaluate(tiny_config(**{
        **RUN, 'distillation_type': 'none', 'num_train_steps': 6}), resumed)
  assert sorted(os.listdir(os.path.join(resumed, 'checkpoints'))) == [
      '2', '4']
  # The teacher's own checkpoint was trained without one.
  undistilled = checkpointing.saved_config(os.path.join(
      directory, 'checkpoints', '0'))
  with pytest.raises(config_error.ConfigError, match=re.escape(
      'the checkpoint at step 4 was trained without a teacher and this run '
      f"distils from {directory!r}; resume with --config.teacher_model='' "
      '--config.distillation_type=none, or use a new --workdir (with '
      '--config.init_from to start from it)') + '$'):
    teacher_lib.check_same_teacher(undistilled,
                                   teacher_lib.fingerprint(directory), 4)
  teacher_lib.check_same_teacher(undistilled, None, 4)
  teacher_lib.check_same_teacher(None, None, 0)


def export_teacher(state, path, scale=1.0, classes=10) -> None:
  """`state`'s weights, its parameters x `scale`, its head cut to
  `classes`, as export.py writes them."""
  arrays = {'.'.join(map(str, p)): np.asarray(variable.get_value()) * (
      scale if isinstance(variable, nnx.Param) else 1)
            for part in (state.params, state.model_state)
            for p, variable in nnx.to_flat_state(part)}
  arrays['head.kernel'] = arrays['head.kernel'][:, :classes].copy()
  arrays['head.bias'] = arrays['head.bias'][:classes].copy()
  safetensors.numpy.save_file(arrays, path, metadata={
      'config': tiny_config(**TEACHER).to_json()})


def test_a_teacher_file_is_hashed_at_the_first_start_then_known_by_its_time(
    tmp_path, teacher_dir):
  """The rule: a file of the size and modification time that the
  checkpoint recorded is the recorded file, and is not read again."""
  file = str(tmp_path / 'teacher.safetensors')
  export_teacher(teacher_dir[1], file)
  first = hashlib.sha256(open(file, 'rb').read()).hexdigest()
  workdir = str(tmp_path / 'run')
  train.train_and_evaluate(distilled_config(
      file, num_train_steps=2, eval_every_steps=2), workdir)
  saved = checkpointing.saved_config(os.path.join(workdir, 'checkpoints',
                                                  '2'))
  written = os.stat(file)
  assert saved['teacher_file'] == {
      'path': file, 'size': written.st_size,
      'version': written.st_mtime_ns, 'sha256': first}
  # Another teacher of the same size, its time set back to the recorded
  # one: the recorded digest is trusted, the bytes are not read.
  export_teacher(teacher_dir[1], file, scale=2.0)
  second = hashlib.sha256(open(file, 'rb').read()).hexdigest()
  assert os.path.getsize(file) == written.st_size and second != first
  os.utime(file, ns=(written.st_atime_ns, written.st_mtime_ns))
  trusted = teacher_lib.fingerprint(file)
  teacher_lib.check_same_teacher(saved, trusted, 2)
  assert trusted['sha256'] == first
  # Written at another time: read again, and refused.
  os.utime(file, ns=(written.st_atime_ns, written.st_mtime_ns + 10**9))
  with pytest.raises(config_error.ConfigError, match=re.escape(
      f"teacher_init_from '{file}' has changed since the checkpoint at step "
      f'2 (now {written.st_size} bytes, sha256 {second[:12]}...; it '
      f'recorded {written.st_size} bytes, sha256 {first[:12]}... of '
      f"'{file}'); pass the teacher it was trained with, or a new "
      '--workdir') + '$'):
    train.train_and_evaluate(distilled_config(
        file, num_train_steps=4, eval_every_steps=2), workdir)


def test_a_teacher_workdir_that_trained_on_is_refused_until_pinned(
    tmp_path, teacher_dir, distilled_run):
  workdir, _ = distilled_run
  directory, teacher_state = teacher_dir
  resumed, growing = str(tmp_path / 'resumed'), str(tmp_path / 'growing')
  shutil.copytree(workdir, resumed)
  shutil.copytree(directory, growing)
  # The teacher's run saves a newer checkpoint.
  later = tmp_path / 'later'
  write_checkpoint(later, tiny_config(**TEACHER),
                   datasets.load_digits().info, step=6, noise=0.5)
  shutil.copytree(later / 'checkpoints' / '6',
                  os.path.join(growing, 'checkpoints', '6'))
  pinned = os.path.join(growing, 'checkpoints', '0')
  with pytest.raises(config_error.ConfigError, match=re.escape(
      f"teacher_init_from '{growing}' now holds a newer checkpoint "
      f'({growing}/checkpoints/6) than the one the checkpoint at step 4 was '
      f'distilled from; pin that one: --config.teacher_init_from={pinned}, '
      'or use a new --workdir') + '$'):
    train.train_and_evaluate(distilled_config(growing, num_train_steps=6),
                             resumed)
  # Pinned, the teacher is the recorded one: its weights, and it passes.
  saved = checkpointing.saved_config(os.path.join(resumed, 'checkpoints',
                                                  '4'))
  teacher = teacher_of(distilled_config(pinned), datasets.load_digits().info,
                       sharding.create_mesh({'data': -1, 'fsdp': 1}))
  teacher_lib.check_same_teacher(saved, teacher.fingerprint, 4)
  teacher_params = flat_params(teacher.state)
  for path, value in flat_params(teacher_state.params).items():
    np.testing.assert_array_equal(teacher_params[path], value)


# ------------------------------------------------------------------ checks


@pytest.mark.parametrize('overrides, message', [
    (dict(distillation_type='soft'),
     "distillation_type 'soft' needs a teacher: set --config.teacher_model"),
    (dict(teacher_model='ResNet50', teacher_init_from='x.pth'),
     "teacher_model 'ResNet50' is set but distillation_type is 'none'"),
    (dict(teacher_model='ResNet50', distillation_type='hard'),
     "teacher_model 'ResNet50' needs its weights: set "
     '--config.teacher_init_from'),
    (dict(teacher_model='ResNet5', distillation_type='hard',
          teacher_init_from='x.pth'), "unknown teacher_model 'ResNet5'"),
    (dict(distillation_type='feature'), "unknown distillation_type 'feature'"),
    (dict(vit_distillation_token=True),
     'vit_distillation_token needs a ViT, not --config.model=SmallResNet'),
    (dict(**VIT, vit_distillation_token=True),
     'vit_distillation_token needs the class token: set --config.vit_pool=cls'),
    (dict(distillation_alpha=1.5), r'distillation_alpha 1.5 must be in \[0, 1\]'),
    (dict(distillation_alpha=-0.1),
     r'distillation_alpha -0.1 must be in \[0, 1\]'),
    (dict(distillation_tau=0.0), 'distillation_tau 0.0 must be > 0'),
])
def test_bad_distillation_settings_are_one_line_naming_the_fix(
    tmp_path, overrides, message):
  with pytest.raises(config_error.ConfigError, match=message) as error:
    train.train_and_evaluate(tiny_config(**overrides), str(tmp_path))
  assert '\n' not in str(error.value)
  assert os.listdir(tmp_path) == []


def test_a_teacher_of_other_classes_or_another_model_is_refused(
    tmp_path, teacher_dir):
  directory, saved = teacher_dir
  five = str(tmp_path / 'five.safetensors')
  export_teacher(saved, five, classes=5)
  info = datasets.load_digits().info
  mesh = sharding.create_mesh({'data': -1, 'fsdp': 1})
  config = tiny_config(teacher_model='SmallResNet', distillation_type='soft',
                       teacher_init_from=five)
  with pytest.raises(config_error.ConfigError, match=re.escape(
      f"teacher_init_from '{five}' predicts 5 classes, the data set has 10; "
      "pass a teacher trained on this data set's classes")):
    teacher_of(config, info, mesh)
  config.update(teacher_model='ResNet18', teacher_init_from=directory)
  with pytest.raises(ValueError, match=r'^teacher: .*; set '
                     r'--config\.teacher_model=SmallResNet'):
    teacher_of(config, info, mesh)


def test_a_teacher_file_of_another_model_names_the_teachers_own_keys(
    tmp_path):
  """The teacher is built at its model's standard depth (no num_layers of
  its own): the fix names teacher_model alone, or asks for another file."""
  info = input_pipeline.DatasetInfo(10, (32, 32, 3), 100, 10)
  mesh = sharding.create_mesh({'data': -1, 'fsdp': 1})
  standard, shallow = (str(tmp_path / f'{n}.safetensors') for n in 'ab')
  write_timm_vit_ti16(standard, 12)
  write_timm_vit_ti16(shallow, 2)
  config = tiny_config(image_size=32, teacher_model='ViT_S16',
                       distillation_type='soft', teacher_init_from=standard)
  with pytest.raises(ValueError) as error:
    teacher_of(config, info, mesh)
  assert str(error.value).endswith(
      '; its model needs --config.teacher_model=ViT_Ti16'), str(error.value)
  config.update(teacher_model='ViT_Ti16', teacher_init_from=shallow)
  with pytest.raises(ValueError) as error:
    teacher_of(config, info, mesh)
  message = str(error.value)
  assert message.startswith("teacher: teacher_init_from (a timm ViT) has "
                            'other shapes than --config.teacher_model='
                            'ViT_Ti16: '), message
  assert message.endswith(
      '; the file holds a ViT_Ti16 of 2 layers, and this model is built at '
      'its standard depth; pass a file of ViT_Ti16 (or of another model) at '
      'its standard depth'), message
  assert 'num_layers' not in message and '\n' not in message
