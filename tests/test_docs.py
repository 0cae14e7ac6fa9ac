"""The README and docs/ name files, modules, functions and config keys that
exist, and the README documents every config key and module."""

import glob
import importlib
import os
import re

import pytest

from configs import default
from helpers import REPO

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
