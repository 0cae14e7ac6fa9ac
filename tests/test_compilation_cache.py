"""JAX's persistent compilation cache across launches of `main.py`: what a
second run and a resume load, and a damaged or unusable cache."""

import logging
import os
import re

import jax

from runtime import compilation_cache
from runtime import processes
from test_parallel import copy_checkpoint

RUN = dict(num_layers=2, width=8, batch_size=16, num_train_steps=4,
           log_every_steps=2, eval_every_steps=4, checkpoint_every_steps=2)
# main.py's last line: what the cache did in that launch.
REPORT = re.compile(r'Compilation cache (\S+): (\d+) programs loaded, '
                    r'(\d+) compiled')


def launch(workdir, cache_dir) -> tuple[int, int, str]:
  """One launch of RUN with `cache_dir`: (programs loaded, compiled, its
  log)."""
  [log] = processes.run(
      [processes.main_command(workdir, RUN,
                              f'--compilation_cache_dir={cache_dir}')],
      [processes.cpu_environment(1)])
  found = REPORT.search(log)
  assert found and found[1] == str(cache_dir), log[-3000:]
  return int(found[2]), int(found[3]), log


def cache_entries(cache_dir) -> list[str]:
  return [os.path.join(cache_dir, name) for name in os.listdir(cache_dir)
          if name.endswith('-cache')]


def test_relaunches_load_every_program_and_damaged_entries_compile_again(
    tmp_path):
  cache = tmp_path / 'cache'
  loaded, compiled, _ = launch(tmp_path / 'first', cache)
  assert loaded == 0 and compiled > 0
  entries = cache_entries(cache)
  assert len(entries) == compiled
  # Resumed after a kill at its step-2 checkpoint (a second run of the
  # config in another workdir is the same programs): every one loaded.
  copy_checkpoint(tmp_path / 'first', 2, tmp_path / 'resumed')
  loaded, compiled_again, log = launch(tmp_path / 'resumed', cache)
  assert 'Restored checkpoint at step 2' in log
  assert (loaded, compiled_again) == (compiled, 0)

  # Entries cut short or overwritten with garbage: compiled again, one
  # warning line for all of them.
  for index, path in enumerate(entries):
    with open(path, 'r+b') as f:
      if index % 2:
        f.truncate(os.path.getsize(path) // 2)
      else:
        f.write(b'not a compiled program' * 8)
  loaded, compiled_again, log = launch(tmp_path / 'damaged', cache)
  assert (loaded, compiled_again) == (0, compiled)
  assert log.count('holds an unreadable entry') == 1, log[-3000:]
  assert log.count('Error reading persistent compilation cache entry') == 1
  assert f'({len(entries)} unreadable entries)' in log
  assert 'Remove the directory to rebuild the cache.' in log


def test_an_unusable_cache_directory_is_one_warning_line_and_no_cache(
    tmp_path, caplog):
  not_a_directory = tmp_path / 'file'
  not_a_directory.write_text('')
  cache = not_a_directory / 'cache'
  suites_cache = jax.config.jax_compilation_cache_dir
  try:
    compilation_cache.enable(str(cache))
    assert jax.config.jax_compilation_cache_dir is None
  finally:
    jax.config.update('jax_compilation_cache_dir', suites_cache)
  [warning] = [r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING]
  assert warning.startswith(f'Compilation cache {cache} is not usable (')
  assert warning.endswith(
      "compiling every program. Pass --compilation_cache_dir=DIR (writable) "
      "or '' for none.")
  assert compilation_cache.report() == ''
