"""JAX's persistent compilation cache for every program a run compiles.

A relaunch after a fault, a resume, `--mode=eval` and a second run of the
same config load their programs (the train step, the evaluation step, the
summary step and the small ones) from the cache instead of compiling them.
JAX keys each entry by the program, the jax and jaxlib versions and the
devices, so entries of another version or device kind are never loaded;
in a run of several processes only process 0 writes.
"""

import collections
import os
import warnings

from absl import logging
import jax
from jax import monitoring

# The default: one cache per user, shared by every run of this machine.
DEFAULT_DIR = os.path.join(
    os.environ.get('XDG_CACHE_HOME', os.path.join('~', '.cache')),
    'jax_compilation_cache')
# JAX's warning, once per entry, when an entry cannot be read.
_READ_ERROR = 'Error reading persistent compilation cache entry'

_events = collections.Counter()
_state = {'directory': '', 'unreadable': 0}


def default_directory() -> str:
  """JAX's own setting (JAX_COMPILATION_CACHE_DIR or
  --jax_compilation_cache_dir) if given, else DEFAULT_DIR."""
  return jax.config.jax_compilation_cache_dir or DEFAULT_DIR


def enable(directory: str) -> None:
  """Keeps every compiled program of this process in `directory` ('' = no
  cache). A local directory that cannot be written costs one warning line
  and the run compiles as without a cache."""
  if not directory:
    jax.config.update('jax_compilation_cache_dir', None)
    return
  if '://' not in directory:
    directory = os.path.abspath(os.path.expanduser(directory))
    try:
      os.makedirs(directory, exist_ok=True)
      probe = os.path.join(directory, f'.writable-{os.getpid()}')
      with open(probe, 'w'):
        pass
      os.remove(probe)
    except OSError as e:
      logging.warning('Compilation cache %s is not usable (%s); compiling '
                      "every program. Pass --compilation_cache_dir=DIR "
                      "(writable) or '' for none.", directory, e)
      jax.config.update('jax_compilation_cache_dir', None)
      return
  jax.config.update('jax_compilation_cache_dir', directory)
  # Every program, however quick to compile or small: on a TPU slice the
  # small ones add up to seconds of every restart too.
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
  _state['directory'] = directory
  monitoring.register_event_listener(_count)
  warnings.showwarning = _quiet_read_errors(warnings.showwarning)


def _count(event: str, **_) -> None:
  if event.startswith('/jax/compilation_cache/'):
    _events[event.rsplit('/', 1)[1]] += 1


def _quiet_read_errors(showwarning):
  """`showwarning` that turns JAX's warning per unreadable entry (a
  truncated or garbage file) into one warning line for the whole run."""
  def show(message, category, filename, lineno, file=None, line=None):
    if not str(message).startswith(_READ_ERROR):
      return showwarning(message, category, filename, lineno, file, line)
    _state['unreadable'] += 1
    if _state['unreadable'] == 1:
      # JAX never overwrites an entry, so a damaged one stays until the
      # directory is removed.
      logging.warning('Compilation cache %s holds an unreadable entry '
                      '(damaged or cut short; %s); compiling its program '
                      'again. Remove the directory to rebuild the cache.',
                      _state['directory'], message)
  return show


def report() -> str:
  """What the cache did in this process, for the log: '' without one."""
  if not _state['directory']:
    return ''
  loaded = _events['cache_hits']
  compiled = _events['compile_requests_use_cache'] - loaded
  unreadable = _state['unreadable']
  return (f'Compilation cache {_state["directory"]}: {loaded} programs '
          f'loaded, {compiled} compiled' +
          (f' ({unreadable} unreadable entries)' if unreadable else '') +
          '.')
