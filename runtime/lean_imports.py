"""Keeps a command's imports cheap: Python's collector paused while its
modules import, and TensorFlow's import kept to what the command uses.

Importing makes objects that live as long as the process (modules,
functions, registries): Python's cyclic garbage collector finds no garbage
among them, yet each of its full collections rescans every one made so far.
Paused while a command's modules import, it then freezes what they made
(`gc.freeze`: never scanned again) and collects as always: about half a
second less CPU time per launch (docs/performance.md).

TensorFlow imports Keras eagerly, and so does TensorBoard's hparams API
under CLU's writer. Keras then imports scikit-learn (SciPy's statistics
with it) and matplotlib's pyplot where they are installed, for wrappers
and plots that no command here calls; each import is optional in Keras
(it catches the ImportError). Left out, a launch's import of CLU's
writer takes about a quarter less CPU time (docs/performance.md).
Imported by anything but Keras, they import as always: the heatmaps draw
with matplotlib, the digits live in scikit-learn's package.
"""

import gc
import importlib.abc
import sys

# What Keras imports only for helpers no command calls.
_OPTIONAL_IN_KERAS = frozenset(('sklearn', 'matplotlib'))


def _imported_by_keras() -> bool:
  """Whether the import under way is a statement in one of Keras's modules
  (the first caller outside importlib's own frames)."""
  frame = sys._getframe(2)  # pylint: disable=protected-access
  while frame is not None and frame.f_code.co_filename.startswith(
      '<frozen importlib'):
    frame = frame.f_back
  if frame is None:
    return False
  module = frame.f_globals.get('__name__', '')
  return module == 'keras' or module.startswith('keras.')


class _KerasOptionalImports(importlib.abc.MetaPathFinder):
  """Answers Keras's optional imports as a missing package would."""

  def find_spec(self, name, path=None, target=None):
    del path, target  # the name alone decides
    if (name.partition('.')[0] in _OPTIONAL_IN_KERAS and
        _imported_by_keras()):
      raise ModuleNotFoundError(
          f'{name} is left out of Keras here (runtime/lean_imports.py)',
          name=name)
    return None


def leave_keras_optional_imports_out() -> None:
  """Installs the finder once per process, before TensorFlow is imported
  (a command's first line)."""
  if not any(isinstance(finder, _KerasOptionalImports)
             for finder in sys.meta_path):
    sys.meta_path.insert(0, _KerasOptionalImports())


def pause_collection() -> None:
  """Pauses Python's cyclic garbage collector while a command's modules
  import (before its other imports), until `freeze_imports`."""
  gc.disable()


def freeze_imports() -> None:
  """Freezes every object made so far, made by imports alone (the command
  has run nothing yet), and resumes collecting."""
  gc.freeze()
  gc.enable()
