"""Ahead-of-time compiling of a step function for the mesh."""

import contextlib
import functools
import hashlib
import time

import jax
import jaxlib

from runtime import sharding

# The pmap axis: every device, as the mesh's two axes are under jit.
PMAP_AXIS = 'devices'


def compile_step(step_fn, state_sharding, batch_sharding, state, batch, *,
                 out_shardings, donate_state: bool):
  """AOT-compiles `step_fn(state, batch)`; returns it and compile seconds."""
  compiled, seconds, _ = lower_and_compile(
      jax.jit(step_fn, in_shardings=(state_sharding, batch_sharding),
              out_shardings=out_shardings,
              donate_argnums=(0,) if donate_state else ()), state, batch)
  return compiled, seconds


# The executables compiled inside `compiling_each_program_once`, by
# `program_key`; None outside it.
_compiled_programs = None


@contextlib.contextmanager
def compiling_each_program_once():
  """Within it, `lower_and_compile` compiles each program once and gives
  the same executable for it again: a search that compiles a run at
  several settings (`checks/memory_budget`) compiles the programs a
  setting leaves as they were once (gradient accumulation changes the
  train step alone; each evaluation step of a large model is minutes of
  compiling). For one set of devices: the key holds the program, its
  shapes and shardings, not the devices."""
  global _compiled_programs
  outer = _compiled_programs
  _compiled_programs = {} if outer is None else outer
  try:
    yield
  finally:
    _compiled_programs = outer


def lower_and_compile(jitted, *args):
  """`jitted` (a jit or pmap function) lowered for `args` and compiled: the
  executable, the seconds both took and the lowering itself."""
  start = time.perf_counter()
  lowered = jitted.lower(*args)
  if _compiled_programs is None:
    compiled = lowered.compile()
  else:
    key = program_key(lowered)
    if key not in _compiled_programs:
      _compiled_programs[key] = lowered.compile()
    compiled = _compiled_programs[key]
  return compiled, time.perf_counter() - start, lowered


def program_key(lowered: jax.stages.Lowered) -> str:
  """A hex digest of `lowered`'s program and of what turns a program into
  counts of it (XLA's cost analysis): the jax and jaxlib versions and the
  backend.

  The program's StableHLO text leaves out source locations, so the key of
  one program traced from edited lines of Python stays the same; its
  shardings and shapes are in it, so another mesh or batch has its own.
  """
  digest = hashlib.sha256()
  for part in (jax.__version__, jaxlib.__version__, jax.default_backend(),
               lowered.as_text()):
    digest.update(part.encode())
    digest.update(b'\0')
  return digest.hexdigest()


def pmap_step(step_fn, mesh, state, batch):
  """`step_fn` through `jax.pmap` over every device, compiled once.

  It takes and returns the global arrays of the jit step (replicated state,
  global batch), split per device by a reshape that moves no data. pmap
  itself converts process-local arrays to such global ones and calls the
  same executable; calling it directly spares that round trip on several
  processes. Returns the step, its executable (for memory analysis), the
  compile seconds and the lowering.
  """
  num_devices = mesh.devices.size
  split_batch = jax.jit(
      lambda b: jax.tree.map(
          lambda x: x.reshape(num_devices, -1, *x.shape[1:]), b),
      out_shardings=sharding.batch_sharding(mesh))
  pmapped = jax.pmap(functools.partial(step_fn, axis_name=PMAP_AXIS),
                     axis_name=PMAP_AXIS, in_axes=(None, 0), out_axes=None,
                     donate_argnums=(0,))
  # Lowered for the split batch's shapes: `batch` may be shapes alone.
  compiled, seconds, lowered = lower_and_compile(
      pmapped, state, jax.eval_shape(split_batch, batch))
  return (lambda state, batch: compiled(state, split_batch(batch)),
          compiled, seconds, lowered)


def compile_train_step(step_mode: str, mesh, step_fn, state_sharding, state,
                       batch):
  """The train step of `step_mode`, its compiled executable, the compile
  seconds and the lowering (whose `program_key` keys the kept
  FLOPs count)."""
  if step_mode == 'pmap':
    return pmap_step(step_fn, mesh, state, batch)
  compiled, seconds, lowered = lower_and_compile(
      jax.jit(step_fn,
              in_shardings=(state_sharding, sharding.batch_sharding(mesh)),
              out_shardings=(state_sharding, sharding.replicated(mesh)),
              donate_argnums=(0,)), state, batch)
  return compiled, compiled, seconds, lowered
