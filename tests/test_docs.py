"""The README and docs/ name files, modules, functions and config keys that
exist, and the README documents every config key, module and TensorBoard
tag."""

import glob
import importlib
import os
import re

import ml_collections
import pytest

from configs import default
from data import datasets
import train
from helpers import REPO
from helpers import read_events
from helpers import tiny_config
from helpers import write_checkpoint

DOCS = ['README.md'] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, 'docs',
                                                              '*.md')))
MODULES = sorted(name[:-3] for name in os.listdir(REPO)
                 if name.endswith('.py'))


def read(path):
  with open(os.path.join(REPO, path)) as f:
    return f.read()


def code_spans(text):
  return re.findall(r'`([^`\n]+)`', text)


# Files of the anchors that the recipe tables cite by their own paths.
ANCHOR_FILES = {'configs/tpu.py', 'configs/vit_s16_i1k.py'}


@pytest.mark.parametrize('doc', DOCS)
def test_files_of_this_project_the_docs_name_exist(doc):
  text = read(doc)
  named = {path for path in re.findall(
      r'(?<![\w/])((?:configs|benchmarks|tests|docs)/[\w/.-]+\.(?:py|md|sh))',
      text)}
  named |= {f'docs/{path}' for path in re.findall(r'\]\(([\w.-]+\.md)', text)}
  named -= ANCHOR_FILES
  named = {p for p in named if 'NAME' not in p}  # `configs/NAME.py`
  assert [p for p in named if not os.path.exists(os.path.join(REPO, p))] == []


@pytest.mark.parametrize('doc', DOCS)
def test_module_attributes_the_docs_name_exist(doc):
  names = set()
  for span in code_spans(read(doc)):
    match = re.fullmatch(r'(\w+)\.(\w+)(?:\.(\w+))?(?:\(.*\))?', span)
    if match and match[1] in MODULES and match[2] not in ('py', 'md'):
      names.add(match.group(0).split('(')[0])
  for name in sorted(names):
    module_name, *attributes = name.split('.')
    value = importlib.import_module(module_name)
    for attribute in attributes:
      assert hasattr(value, attribute), f'{doc} names {name}'
      value = getattr(value, attribute)


def readme_key_table():
  """The config keys the README's key table documents."""
  text = read('README.md')
  table = text[text.index('## Config keys'):]
  table = table[:table.index('\n## ', 1)]
  keys = set()
  for row in re.findall(r'^\| (.+?) \|', table, flags=re.M):
    keys |= set(re.findall(r'`([\w.]+)`', row))
  return keys


def config_keys(config, prefix=''):
  for key, value in config.items():
    if hasattr(value, 'items') and value:
      yield from config_keys(value, f'{prefix}{key}.')
    else:
      yield prefix + key


def test_readme_documents_every_config_key_and_only_those():
  documented, keys = readme_key_table(), set(config_keys(default.get_config()))
  assert keys - documented == set()
  assert documented - keys == set()


def test_readme_layout_names_every_module():
  text = read('README.md')
  layout = text[text.index('## Layout'):]
  layout = layout[:layout.index('\n## ', 1)]
  listed = set(re.findall(r'`(\w+)\.py`', layout))
  assert set(MODULES) - listed == set()


def test_readme_is_at_most_20_kb():
  """A user reads it in ten minutes; details live in docs/."""
  assert len(read('README.md').encode()) <= 20_000


# What the README's tag names stand for. CAUSE: the goodput causes it lists.
TAG_PLACEHOLDERS = {'NAME': r'[\w.]+', 'DATASET': r'[\w.]+',
                    'STACK': r'[\w.]+', 'POINT': r'.+', 'K': r'\d+',
                    'SEED': r'\d+',
                    '*': r'.*', '...': r'.+'}
# Code spans of the tag paragraphs that are not tags: config keys, evaluator
# settings and their values, paths, the reader's methods.
NOT_TAGS = {'config.evals', 'real.json', 'DIR/checkpoints/STEP',
            'classification', 'fewshot', 'dataset', 'datasets', 'split',
            'class_map', 'index', 'name', 'real_labels_file', 'shots',
            'l2_reg', 'seed', 'num_seeds', 'knn', 'k', 'temperature',
            'every_steps', 'teacher_model',
            'teacher_init_from', 'init_from', 'skip_nonfinite_steps',
            'intermediate_grads_every_steps', 'EventAccumulator.Tensors',
            '.Scalars'}
# Tags the README names that a run on this machine cannot write, and why.
NOT_WRITTEN_HERE = {
    'mfu': 'needs the bfloat16 peak of a known TPU or GPU',
    'data_skipped_*': 'counts unreadable files in image folders',
}


def readme_tag_names():
  """The tag names of the README's TensorBoard and evaluator paragraphs,
  continuations (`_loss` after `eval_NAME_accuracy`, `.../rms` after
  `intermediate_grads/POINT/l2_norm`) completed and `badput/CAUSE` expanded
  over the causes listed after it."""
  text = read('README.md')
  paragraphs = ''.join(
      text[text.index(title):text.index('\n## ', text.index(title) + 3)]
      for title in ('## Evaluators and distillation', '## TensorBoard'))
  # The examples of POINT and NAME are not tags of their own.
  paragraphs = re.sub(r'\((?:POINT|NAME):[^)]*\)', '', paragraphs)
  causes = re.search(r'`badput/CAUSE` \(([^)]*)\)', paragraphs)[1]
  paragraphs = paragraphs.replace(causes, '')
  names, previous = [], ''
  for span in code_spans(paragraphs):
    if span in NOT_TAGS or not re.fullmatch(r'[\w./*]+', span):
      continue
    if span.startswith('_'):  # a metric of the previous NAME
      span = previous[:previous.rindex('NAME') + 4] + span
    elif span.startswith('.../'):
      span = previous[:previous.rindex('/')] + span[3:]
    else:
      previous = span
    if span == 'badput/CAUSE':
      names += [f'badput/{c}' for c in code_spans(causes)]
    elif span not in names:
      names.append(span)
  return names


def tag_regex(name):
  parts = re.split(r'(NAME|DATASET|STACK|POINT|SEED|K(?=shot)|\*|\.\.\.)',
                   name)
  return ''.join(TAG_PLACEHOLDERS[p] if p in TAG_PLACEHOLDERS else re.escape(p)
                 for p in parts)


@pytest.fixture(scope='module')
def every_kind_of_tag(tmp_path_factory):
  """The tags of a short run with each feature that adds tags on a CPU: a
  moving average, a teacher, a named classification evaluator, a few-shot
  probe over two seeds, a k-NN evaluator, skipping of non-finite steps,
  float16 and gradient summaries."""
  teacher = tmp_path_factory.mktemp('teacher')
  write_checkpoint(teacher, tiny_config(seed=5), datasets.load_digits().info,
                   noise=0.3)
  config = tiny_config(
      num_train_steps=2, log_every_steps=1, eval_every_steps=2,
      checkpoint_every_steps=2, steps_per_eval=1, ema_decay=0.5,
      teacher_model='SmallResNet', teacher_init_from=str(teacher),
      distillation_type='soft', skip_nonfinite_steps=1, half_precision=True,
      half_precision_dtype='float16', intermediate_grads_every_steps=2)
  config.evals.copy = ml_collections.ConfigDict(
      dict(type='classification', dataset='digits'))
  config.evals.probe = ml_collections.ConfigDict(
      dict(type='fewshot', datasets={'digits': 'digits'}, shots=(1,),
           num_seeds=2))
  config.evals.knn = ml_collections.ConfigDict(
      dict(type='knn', datasets={'digits': 'digits'}))
  workdir = tmp_path_factory.mktemp('every_tag')
  train.train_and_evaluate(config, str(workdir))
  return {tag for tag in read_events(str(workdir))
          if not tag.startswith('_hparams_')}


def test_readme_names_every_tag_a_run_writes_and_each_is_written(
    every_kind_of_tag):
  names = readme_tag_names()
  assert len(names) > 30
  patterns = {name: re.compile(tag_regex(name)) for name in names}
  unnamed = sorted(tag for tag in every_kind_of_tag
                   if not any(p.fullmatch(tag) for p in patterns.values()))
  assert unnamed == []
  unwritten = sorted(name for name, p in patterns.items()
                     if not any(p.fullmatch(t) for t in every_kind_of_tag))
  assert unwritten == sorted(NOT_WRITTEN_HERE)
