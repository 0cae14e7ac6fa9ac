"""The command line's flags and config file, read before a run starts:
a config file or override that does not parse is said in one line that
names the fix (close keys, the config option that adds an evaluator),
with exit code 1."""

import difflib
import importlib.util
import os
import re
import sys

from absl import flags
import ml_collections

from evaluators import evaluator_types


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (for `app.run(flags_parser=...)`), with config-file
  and override mistakes reported as one line and exit code 1."""
  try:
    remaining = flags.FLAGS(argv)
    _ = flags.FLAGS.config.keys()  # config_flags defers a missing file's error
  except Exception as e:  # pylint: disable=broad-except
    # config_flags raises IOError, AttributeError, KeyError, TypeError or
    # flags.Error; find the cause ourselves and name the fix.
    sys.exit(f'Error: {describe_flag_error(argv, e)}')
  return remaining


def describe_flag_error(argv: list[str], error: Exception) -> str:
  """The one-line cause and fix of a flag-parsing failure."""
  path = _flag_value(argv, 'config')
  if path is not None:
    path, _, option = path.partition(':')
    try:
      config = load_config_file(path, option)
    except ValueError as e:
      return str(e)
    for key in _override_keys(argv):
      try:
        _get_nested(config, key)
      except (KeyError, AttributeError):
        if key.startswith('evals.'):
          return unknown_evaluator_message(key, path, option)
        return unknown_key_message(key, config, path)
  return str(error).strip().splitlines()[0]


def load_config_file(path: str,
                     option: str = '') -> ml_collections.ConfigDict:
  """`get_config()` of the file at `path` (`get_config(option)` with an
  option, as `--config=PATH:OPTION` passes it), or a ValueError naming the
  fix."""
  if not os.path.isfile(path):
    raise ValueError(f'config file {path!r} not found; pass an existing '
                     'file, e.g. --config=configs/default.py')
  spec = importlib.util.spec_from_file_location('user_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not callable(getattr(module, 'get_config', None)):
    raise ValueError(f'config file {path!r} has no get_config(); define '
                     '`def get_config():` returning an ml_collections.'
                     'ConfigDict')
  config = module.get_config(option) if option else module.get_config()
  if not isinstance(config, ml_collections.ConfigDict):
    raise ValueError(f'get_config() of {path!r} returned '
                     f'{type(config).__name__}, not an ml_collections.'
                     'ConfigDict; return the config')
  return config


def unknown_key_message(key: str, config, path: str) -> str:
  keys = sorted(_flat_keys(config))
  close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
  hint = (f'close keys: {", ".join(close)}' if close
          else 'see the key table in README.md')
  return f'--config.{key}: {path} has no key {key!r}; {hint}'


def unknown_evaluator_message(key: str, path: str, option: str) -> str:
  """The fix of an override of an evaluator the config does not have: the
  config option that adds one of the type, where the config takes it."""
  name = key.split('.')[1]
  kind = name if name in evaluator_types.SETTINGS else 'knn'
  with_evaluator = f'{option},{kind}' if option else kind
  try:
    added = load_config_file(path, with_evaluator).evals
  except ValueError:
    added = {}
  if kind not in added:
    return (f'--config.{key}: {path} has no evaluator {name!r} and no option '
            'adding one; define config.evals in a config file of your own '
            '(README.md, "Evaluators and distillation")')
  config = f'{path}:{option}' if option else path
  return (f'--config.{key}: {config} has no evaluator {name!r}; add one '
          f'with --config={path}:{with_evaluator} (an option per type: '
          f'{", ".join(evaluator_types.SETTINGS)}), then set its settings '
          f'by key, e.g. --config.evals.{kind}.every_steps=100')


def _flat_keys(config, prefix: str = ''):
  for key, value in config.items():
    yield prefix + key
    if isinstance(value, ml_collections.ConfigDict):
      yield from _flat_keys(value, f'{prefix}{key}.')


def _get_nested(config, dotted: str):
  for part in dotted.split('.'):
    config = config[part]
  return config


def _flag_value(argv: list[str], name: str) -> str | None:
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{name}='):
      return arg.split('=', 1)[1]
    if arg == f'--{name}' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _override_keys(argv: list[str]) -> list[str]:
  """KEY of each --config.KEY[=VALUE] (and --noconfig.KEY) in `argv`."""
  return [m.group(1) for arg in argv
          if (m := re.match(r'--(?:no)?config\.([^=]+)', arg))]
