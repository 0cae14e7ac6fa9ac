"""JAX's persistent compilation cache for every program a run compiles.

A relaunch after a fault, a resume, `--mode=eval` and a second run of the
same config load their programs (the train step, the evaluation step, the
summary step and the small ones) from the cache instead of compiling them.
JAX keys each entry by the program (its shapes and shardings), jaxlib's
version, the backend's, the compile options (the device assignment) and the
devices, so an entry of another jax release or another device count or kind
is never loaded: that program is compiled again, without a warning. In a
run of several processes only process 0 writes.

The train step's FLOPs count (`training/flop_count.py`, a second lowering of
the whole step) is kept beside the programs too, one small file per
program (`kept_flops`).
"""

import collections
import json
import math
import os
from typing import Callable
import warnings

from absl import logging
import jax
from jax import monitoring

from runtime import paths

# The default: one cache per user, shared by every run of this machine.
DEFAULT_DIR = os.path.join(
    os.environ.get('XDG_CACHE_HOME', os.path.join('~', '.cache')),
    'jax_compilation_cache')
# The FLOPs counts' folder in the cache directory: JAX's own entries are
# files beside it.
FLOPS_DIR = 'step_flops'
# JAX's warning, once per entry, when an entry cannot be read.
_READ_ERROR = 'Error reading persistent compilation cache entry'

_events = collections.Counter()
# FLOPs counts read back from the directory or counted ('read', 'counted').
_flops = collections.Counter()
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
  try:
    if paths.is_remote(directory):
      # JAX reaches the bucket through epath too: gcsfs, chosen here.
      paths.path(directory)
    else:
      directory = os.path.abspath(os.path.expanduser(directory))
      os.makedirs(directory, exist_ok=True)
      probe = os.path.join(directory, f'.writable-{os.getpid()}')
      with open(probe, 'w'):
        pass
      os.remove(probe)
  except (OSError, ValueError) as e:
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
  line = (f'Compilation cache {_state["directory"]}: {loaded} programs '
          f'loaded, {compiled} compiled')
  if unreadable:
    line += f' ({unreadable} unreadable entries)'
  if _flops:  # a train run: its FLOPs count, read back or counted
    line += (f'; step_flops: {_flops["read"]} read back, '
             f'{_flops["counted"]} counted')
  return line + '.'


def kept_flops(program_key: str, count: Callable[[], float]) -> float:
  """The FLOPs of the program of `program_key` (`compiling.program_key`),
  as `count()` counts them, kept in the directory JAX keeps programs in.

  The first launch of a program counts and (process 0) writes them, into
  one file per key; a relaunch of the same program reads them back
  (`report` says which). Without a cache directory every launch counts; a
  file that cannot be read or holds no count is counted again and
  replaced.
  """
  directory = (jax.config.jax_compilation_cache_dir
               if jax.config.jax_enable_compilation_cache else None)
  if not directory:
    return count()
  file = paths.path(directory) / FLOPS_DIR / f'{program_key}.json'
  flops = _read_flops(file)
  if flops is not None:
    _flops['read'] += 1
    return flops
  flops = count()
  _flops['counted'] += 1
  if jax.process_index() == 0:
    # As JAX does with its own entries, a cache that fails costs a warning,
    # never the run: errors differ by file system (a gs:// path through
    # TensorFlow raises TensorFlow's).
    try:
      file.parent.mkdir(parents=True, exist_ok=True)
      paths.replace_file(file, json.dumps({'flops': flops}).encode())
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('Could not keep the FLOPs count in %s (%s); the next '
                      'launch counts them again.', file, e)
  return flops


def _read_flops(file) -> float | None:
  """The count kept in `file`; None if there is none (a warning if the
  file is there but unreadable or holds no count)."""
  try:
    if not file.exists():
      return None
    flops = json.loads(file.read_text())['flops']
  except Exception as e:  # pylint: disable=broad-except  (as when writing)
    flops = e
  if isinstance(flops, float) and math.isfinite(flops) and flops >= 0:
    return flops
  logging.warning('Compilation cache: %s holds no FLOPs count (%r); counting '
                  'them again.', file, flops)
  return None
