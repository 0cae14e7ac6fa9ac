"""The checks of `config.evals` (evaluators/evaluator_checks.py): settings
refused before a run starts, tags two evaluators would write, data-dependent
mistakes as each evaluator opens its data, ReaL's file in a bucket (a GCS
emulator), and the ImageNet presets' evaluators."""

import importlib
import json
import os
import uuid

import ml_collections
import numpy as np
import pytest

from data import datasets
from evaluators import evaluator_types
from evaluators import registry
import input_pipeline
import train
from runtime import paths
from checks import config_values
from runtime import config_error
from checks import data_checks
from evaluators import evaluator_checks
from tests import gcs_emulator
from helpers import tiny_config
from image_data import write_class_folders


def evaluator(**settings) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(settings)


@pytest.mark.parametrize('settings, message', [
    (dict(type='linear'), r"unknown type 'linear'; valid names: "
     'classification, fewshot, knn'),
    (dict(type='classification', dataset='digits', clas_map='index'),
     "has no setting 'clas_map'"),
    (dict(type='classification'), 'dataset is not set'),
    (dict(type='classification', dataset='folder:/x', class_map='sorted'),
     "class_map 'sorted': valid names"),
    (dict(type='classification', dataset='imagenet2012', labels='real',
          real_labels_file='real.json'), 'set dataset to folder:PATH'),
    (dict(type='classification', dataset='folder:/x', labels='real',
          real_labels_file='/nowhere/real.json'), 'is not a file'),
    (dict(type='fewshot', datasets={}), 'datasets is empty'),
    (dict(type='fewshot', datasets={'d': 'digits'}, shots=(0, 5)),
     'must be whole numbers >= 1'),
    (dict(type='fewshot', datasets={'d': ('digits', 'train')}),
     'or \\(name, training split, test split\\)'),
    (dict(type='fewshot', datasets={'d': 'digits'}, num_seeds=0),
     'num_seeds must be a whole number >= 1'),
    (dict(type='knn', datasets={}), 'datasets is empty'),
    (dict(type='knn', datasets={'d': 'digits'}, k=0),
     'k must be a whole number >= 1'),
    (dict(type='knn', datasets={'d': 'digits'}, temperature=0.0),
     'temperature must be > 0'),
    (dict(type='knn', datasets={'d': 'digits'}, shots=(1,)),
     "has no setting 'shots'"),
])
def test_bad_evaluator_settings_are_refused_in_one_line(tmp_path, settings,
                                                        message):
  config = tiny_config()
  config.evals.bad = evaluator(**settings)
  with pytest.raises(config_error.ConfigError, match=message) as error:
    train.train_and_evaluate(config, str(tmp_path))
  assert '\n' not in str(error.value)
  assert os.listdir(tmp_path) == []


def probe(shots=(1, 5), **datasets_by_key):
  return evaluator(type='fewshot', datasets=datasets_by_key, shots=shots)


@pytest.mark.parametrize('evals, line', [
    (dict(ema=evaluator(type='classification', dataset='digits')),
     'the main evaluation and evals.ema both write the TensorBoard tag '
     'eval_ema_loss; rename evals.ema'),
    (dict(teacher=evaluator(type='classification', dataset='digits')),
     'the main evaluation and evals.teacher both write the TensorBoard tag '
     'eval_teacher_accuracy; rename evals.teacher'),
    (dict(v2=evaluator(type='classification', dataset='digits'),
          v2_top5=evaluator(type='classification', dataset='digits')),
     'evals.v2 and evals.v2_top5 both write the TensorBoard tag '
     'eval_v2_top5_accuracy; rename evals.v2 or evals.v2_top5'),
    (dict(a=probe(pets='oxford_iiit_pet'),
          b=probe(shots=(5, 25), pets='oxford_iiit_pet')),
     'evals.a (data set pets) and evals.b (data set pets) both write the '
     'TensorBoard tag fewshot_pets_5shot; rename evals.a.datasets.pets or '
     'evals.b.datasets.pets'),
    (dict(a=probe(pets='oxford_iiit_pet'), b=probe(cars='cars196')),
     'evals.a and evals.b both write the TensorBoard tag fewshot_mean_1shot; '
     "list both evaluators' data sets in one of them, or give them different "
     'shots'),
    (dict(a=evaluator(type='knn', datasets={'pets': 'oxford_iiit_pet'}),
          b=evaluator(type='knn', datasets={'pets': 'oxford_iiit_pet'})),
     'evals.a (data set pets) and evals.b (data set pets) both write the '
     'TensorBoard tag knn_pets_top1; rename evals.a.datasets.pets or '
     'evals.b.datasets.pets'),
    (dict(a=probe(pets='oxford_iiit_pet', ema_pets='oxford_iiit_pet')),
     'evals.a (data set ema_pets) and evals.a (data set pets) both write the '
     'TensorBoard tag fewshot_ema_pets_1shot; rename evals.a.datasets.ema_pets '
     'or evals.a.datasets.pets'),
])
def test_evaluators_writing_one_tag_are_refused_in_one_line(evals, line):
  config = tiny_config()
  config.evals = ml_collections.ConfigDict(evals)
  with pytest.raises(config_error.ConfigError) as error:
    config_values.validate_config(config)
  assert str(error.value) == line


def test_fewshot_evaluators_of_other_shots_share_data_sets():
  config = tiny_config()
  config.evals = ml_collections.ConfigDict(dict(
      often=probe(shots=(1,), pets='oxford_iiit_pet'),
      rarely=probe(shots=(25,), pets='oxford_iiit_pet')))
  config_values.validate_config(config)


def context(class_names) -> registry.Context:
  """A context for the checks made as an evaluator opens its data (they
  come before anything is compiled)."""
  return registry.Context(None, None, None, None, 8, np.float32,
                          input_pipeline.Preprocessing(image_size=8), '',
                          tuple(class_names), (8, 8, 1))


def test_data_dependent_mistakes_are_refused_in_one_line(tmp_path):
  folders = tmp_path / 'folders'
  write_class_folders(str(folders / 'val'), ['0', '1', 'cat'], 2, 0)
  with open(tmp_path / 'real.json', 'w') as f:
    json.dump([[0]] * 5, f)
  cases = [
      (dict(type='classification', dataset=f'folder:{folders}', split='val',
            class_map='index'), "needs folders named 0 to 9 .* cat"),
      (dict(type='classification', dataset=f'folder:{folders}', split='val',
            class_map='name'), 'needs folders named as the training classes'),
      (dict(type='classification', dataset=f'folder:{folders}', split='val'),
       "class_map '' needs 10 class folders"),
      (dict(type='classification', dataset=f'folder:{folders}', split='val',
            labels='real', real_labels_file=str(tmp_path / 'real.json')),
       'has 5 label sets for the 6 images of the split'),
      (dict(type='classification', dataset=f'folder:{folders}',
            split='test'), 'does not exist'),
      (dict(type='fewshot', datasets={'d': (f'folder:{folders}', 'val',
                                            'val')}, shots=(1,)),
       r'd train has images of shape \(8, 8, 3\), the model takes '
       r'\(8, 8, 1\)'),
  ]
  for settings, message in cases:
    with pytest.raises(config_error.ConfigError, match=message) as error:
      registry.create_all({'bad': settings},
                          context(datasets.numbered_classes(10)))
    assert '\n' not in str(error.value)


@pytest.fixture(scope='module')
def bucket():
  """gs://NAME of a fresh bucket on an emulator that runs for this module."""
  name = f'evals-{uuid.uuid4().hex[:8]}'
  with gcs_emulator.running(name):
    yield f'gs://{name}'


def test_real_labels_file_is_read_from_a_bucket(tmp_path, bucket):
  """Its five label sets, read from the bucket, against six images."""
  folders = tmp_path / 'folders'
  write_class_folders(str(folders / 'val'), ['0', '1', '2'], 2, 0)
  labels_file = f'{bucket}/labels/real.json'
  paths.path(labels_file).write_text(json.dumps([[0]] * 5))
  settings = dict(type='classification', dataset=f'folder:{folders}',
                  split='val', labels='real', real_labels_file=labels_file)
  evaluator_checks.check_evaluators({'real': settings})
  with pytest.raises(config_error.ConfigError) as error:
    registry.create_all({'real': settings},
                        context(datasets.numbered_classes(3)))
  assert str(error.value) == (
      f'evals.real: {labels_file} has 5 label sets for the 6 images of the '
      'split; use the real.json of this validation set (50,000 for ImageNet)')
  missing = dict(settings, real_labels_file=f'{bucket}/labels/none.json')
  assert data_checks.missing_label_files({'real': missing}) == [
      f"evals.real.real_labels_file '{bucket}/labels/none.json' is not a "
      'file: download real.json of github.com/google-research/'
      'reassessed-imagenet there']


@pytest.mark.parametrize('name', ['imagenet', 'imagenet_vit', 'deit_s16',
                                  'convnext_t', 'swin_t'])
def test_imagenet_presets_add_v2_real_and_fewshot_by_option(tmp_path, name):
  config = importlib.import_module(f'configs.{name}').get_config(
      'real_v2,fewshot')
  assert sorted(config.evals) == ['fewshot', 'real', 'v2']
  assert config.evals.v2.class_map == 'index'
  assert sorted(config.evals.fewshot.datasets) == [
      'caltech', 'cars', 'cifar100', 'dtd', 'pets', 'uc_merced']
  assert config.evals.fewshot.datasets.cars[0] == 'cars196:2.1.0'
  (tmp_path / 'real.json').write_text('[]')
  config.evals.real.real_labels_file = str(tmp_path / 'real.json')
  config_values.validate_config(config)
  with pytest.raises(ValueError, match="unknown config option 'v2'; valid "
                     'names: (distilled, )?real_v2, fewshot'):
    importlib.import_module(f'configs.{name}').get_config('v2')


def test_every_type_has_a_module_and_its_settings():
  assert set(evaluator_types.MODULES) == set(evaluator_types.SETTINGS)
  for module in evaluator_types.MODULES.values():
    assert callable(importlib.import_module(module).create)
