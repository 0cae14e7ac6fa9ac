"""Keeps a command's imports cheap: Python's collector paused while its
modules import, and its libraries' optional imports of packages it never
calls left out.

Importing makes objects that live as long as the process (modules,
functions, registries): Python's cyclic garbage collector finds no garbage
among them, yet each of its full collections rescans every one made so far.
Paused while a command's modules import, it then freezes what they made
(`gc.freeze`: never scanned again) and collects as always: about half a
second less CPU time per launch (docs/performance.md).

TensorFlow imports Keras eagerly, and so does TensorBoard's hparams API
under CLU's writer. Keras then imports scikit-learn (SciPy's statistics
with it) and matplotlib's pyplot where they are installed, for wrappers
and plots that no command here calls; left out, a launch's import of
CLU's writer takes about a quarter less CPU time. Flax, its
pretty-printer Treescope and Keras import IPython to ask whether they run
in its shell or to display there, about 0.3 s: a shell has
imported IPython before anything it runs, and only a package not yet
imported is left out, so the answer stays the same. Each of these imports
is optional where it is made (the ImportError is caught); imported by
anything else, the packages import as always: the heatmaps draw with
matplotlib, the digits live in scikit-learn's package
(docs/performance.md).
"""

import gc
import importlib.abc
import sys

# {importing package: the packages it imports only for helpers no command
# calls}.
_OPTIONAL_IMPORTS = {
    'keras': frozenset(('sklearn', 'matplotlib', 'IPython')),
    'flax': frozenset(('IPython',)),
    'treescope': frozenset(('IPython',)),  # Flax's pretty-printer
}
_LEFT_OUT = frozenset().union(*_OPTIONAL_IMPORTS.values())


def _importing_package() -> str:
  """The top-level package whose statement imports now (the first caller
  outside importlib's own frames)."""
  frame = sys._getframe(2)  # pylint: disable=protected-access
  while frame is not None and frame.f_code.co_filename.startswith(
      '<frozen importlib'):
    frame = frame.f_back
  if frame is None:
    return ''
  return frame.f_globals.get('__name__', '').partition('.')[0]


class _OptionalImports(importlib.abc.MetaPathFinder):
  """Answers _OPTIONAL_IMPORTS as a missing package would."""

  def find_spec(self, name, path=None, target=None):
    del path, target  # the name alone decides
    package = name.partition('.')[0]
    if package not in _LEFT_OUT:  # most imports: no frame to look at
      return None
    importer = _importing_package()
    if package in _OPTIONAL_IMPORTS.get(importer, ()):
      raise ModuleNotFoundError(
          f'{name} is left out of {importer} here '
          '(runtime/lean_imports.py)', name=name)
    return None


def leave_optional_imports_out() -> None:
  """Installs the finder once per process."""
  if not any(isinstance(finder, _OptionalImports)
             for finder in sys.meta_path):
    sys.meta_path.insert(0, _OptionalImports())


def before_imports() -> None:
  """A command's first call, before its other imports: Python's cyclic
  garbage collector paused until `freeze_imports`, and the optional
  imports left out."""
  gc.disable()
  leave_optional_imports_out()


def freeze_imports() -> None:
  """Freezes every object made so far, made by imports alone (the command
  has run nothing yet), and resumes collecting."""
  gc.freeze()
  gc.enable()
