"""The Flax ImageNet example, imported from a checkout of it, for the
benchmarks that measure the project beside it: its `examples/imagenet`
folder of `git clone https://github.com/google/flax`."""

import importlib
import importlib.util
import os
import sys

from absl import app

# The example's own modules, whose names the project's modules share.
EXAMPLE_MODULES = ('input_pipeline', 'models', 'train')


def load(directory: str):
  """The Flax ImageNet example's train.py module from `directory` (with its
  own input_pipeline.py and models.py; the project's modules of the same
  names stay) and its default config."""
  missing = [name for name in ('input_pipeline.py', 'models.py', 'train.py',
                               'configs/default.py')
             if not os.path.isfile(os.path.join(directory, name))]
  if missing:
    raise app.UsageError(
        f'--flax_example_dir={directory!r} has no {", ".join(missing)}: set '
        'it to examples/imagenet of `git clone https://github.com/google/flax`')
  project = {name: sys.modules.pop(name) for name in EXAMPLE_MODULES
             if name in sys.modules}
  sys.path.insert(0, directory)
  # By its path: the project has a configs package too.
  spec = importlib.util.spec_from_file_location(
      'flax_example_config', os.path.join(directory, 'configs', 'default.py'))
  config = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(config)
  try:
    return importlib.import_module('train'), config.get_config()
  finally:
    sys.path.remove(directory)
    for name in EXAMPLE_MODULES:
      sys.modules.pop(name, None)
    sys.modules.update(project)
