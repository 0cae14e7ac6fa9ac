"""Eight host CPU devices (the CPU alone) for every test, compiled as
processes.COMPILE_FLAGS says (XLA:CPU's optimisation level 0, its older
fusion emitters, one LLVM module per program), except under `-m tpu`; the
repository root on sys.path; one persistent compilation cache for the
whole test run; Python's collector rescanning less of what stays; freed
memory kept for the next arrays; PyTorch on one thread."""

import atexit
import ctypes
import functools
import gc
import os
import shutil
import sys
import tempfile

import pytest

import processes

# gcsfs reads this when imported: by default it asks GCS's gRPC storage
# control API for each bucket's layout, which the GCS emulator that
# tests/gcs_emulator.py starts does not serve.
os.environ['GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT'] = 'false'
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def on_the_chip(config) -> bool:
  """`pytest -m tpu`: the tests of tests/test_tpu.py, whose commands run
  on the machine's TPU one at a time, from one pytest process."""
  return 'tpu' in (config.option.markexpr or '').replace('not tpu', '')


def pytest_ignore_collect(collection_path, config):
  """Under `-m tpu`, the other test modules go uncollected: they import
  the test extras (PyTorch, timm, ONNX Runtime) that a TPU machine
  installed from requirements.txt lacks, and none of their tests runs
  there."""
  if on_the_chip(config) and collection_path.name.startswith('test_'):
    return collection_path.name != 'test_tpu.py'
  return None


def pytest_configure(config):
  """The environment of every test process, set before any test module
  imports jax (xdist's workers, started later, inherit it)."""
  if on_the_chip(config):
    config.option.numprocesses, config.option.dist = 0, 'no'
    config.option.tx = []
  else:
    # The CPU alone: libtpu, which the suite installs to compile for TPU
    # topologies, would have every test process look for a TPU first.
    os.environ['JAX_PLATFORMS'] = 'cpu'
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               ' --xla_force_host_platform_device_count=8 ' +
                               processes.COMPILE_FLAGS)
  enable_compilation_cache()
  reuse_freed_memory()
  # What collection imports (TensorFlow, PyTorch, timm, jax) lives as long
  # as the process: `pytest_collection_finish` freezes it.
  gc.disable()


def pytest_collection_finish():
  """Every test process's collector, once its modules have imported: what
  they made frozen (never scanned again), and full collections rare. The
  tests trace and compile thousands of programs whose objects JAX keeps
  cached; each full collection rescanned them all, about a tenth of the
  in-process tests' CPU time (docs/performance.md)."""
  gc.freeze()
  gc.set_threshold(10_000, 10, 100)
  gc.enable()
  if 'torch' in sys.modules:
    # PyTorch computes references on one thread: three test processes
    # share two cores, and its pool of threads took more CPU time for the
    # same work (docs/performance.md).
    sys.modules['torch'].set_num_threads(1)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def reuse_freed_memory():
  """This test process's allocator (glibc's; others are left as they are)
  keeps the memory it frees for its next allocations: the tests allocate
  and free arrays of megabytes over and over (weights built, converted,
  written and read back), and by default each such array is mapped afresh,
  every page of it faulted in and zeroed by the kernel (a tenth of an
  export module's CPU time, docs/performance.md). Arrays over 32 MiB are
  still mapped; the commands that tests start keep glibc's defaults."""
  mallopt = getattr(ctypes.CDLL(None), 'mallopt', None)
  if mallopt is None:
    return
  mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest
  mallopt(_M_TRIM_THRESHOLD, 2 << 30)
  mallopt(_M_TOP_PAD, 256 << 20)


def enable_compilation_cache():
  """JAX's persistent compilation cache, read by jax when it is imported:
  the test processes and every `main.py` or benchmark a test starts load
  the programs that an earlier test or launch compiled (the same tiny
  configs recur across tests; relaunches compile nothing new) and read back
  the train steps' FLOPs counts kept beside them. Compiles of any duration
  and size are kept: this suite's programs are small and quick. A damaged
  or half-written entry makes JAX warn and compile again."""
  if 'JAX_COMPILATION_CACHE_DIR' in os.environ:
    return
  cache_dir = tempfile.mkdtemp(prefix='compilation_cache_')
  atexit.register(functools.partial(shutil.rmtree, cache_dir,
                                    ignore_errors=True))
  os.environ.update(
      JAX_COMPILATION_CACHE_DIR=cache_dir,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='-1')


_QUICK_START = []  # the one training of the quick start in this process


@pytest.fixture
def quick_start(tmp_path_factory):
  """(workdir, console lines) of the README's quick start as a user runs
  it, trained once for the tests that read it (they share the xdist group
  'quick_start', so that one worker trains it). Tests only read it."""
  if not _QUICK_START:
    from helpers import console_of  # pylint: disable=g-import-not-at-top
    workdir = tmp_path_factory.mktemp('quick_start')
    _QUICK_START.append((workdir, console_of(
        workdir, compile_flags=processes.LONG_RUN_COMPILE_FLAGS)))
  return _QUICK_START[0]


@pytest.fixture(scope='module')
def tiny_data_dir(tmp_path_factory):
  """A data dir holding `tiny_images`, prepared by TFDS from written PNGs
  (once per test module that uses it)."""
  from image_data import prepare_tiny_images  # pylint: disable=g-import-not-at-top
  return prepare_tiny_images(tmp_path_factory)[0]


@pytest.fixture(scope='module')
def bucket():
  """gs://NAME of a fresh bucket on a GCS emulator that runs for the test
  module (tests/gcs_emulator.py; its URL in STORAGE_EMULATOR_HOST)."""
  import uuid  # pylint: disable=g-import-not-at-top
  from tests import gcs_emulator  # pylint: disable=g-import-not-at-top
  name = f'trainer-{uuid.uuid4().hex[:8]}'
  with gcs_emulator.running(name):
    yield f'gs://{name}'
