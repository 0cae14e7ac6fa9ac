"""Ahead-of-time compiling of a step function for the mesh."""

import hashlib
import time

import jax
import jaxlib


def compile_step(step_fn, state_sharding, batch_sharding, state, batch, *,
                 out_shardings, donate_state: bool):
  """AOT-compiles `step_fn(state, batch)`; returns it and compile seconds."""
  compiled, seconds, _ = lower_and_compile(
      jax.jit(step_fn, in_shardings=(state_sharding, batch_sharding),
              out_shardings=out_shardings,
              donate_argnums=(0,) if donate_state else ()), state, batch)
  return compiled, seconds


def lower_and_compile(jitted, *args):
  """`jitted` (a jit or pmap function) lowered for `args` and compiled: the
  executable, the seconds both took and the lowering itself."""
  start = time.perf_counter()
  lowered = jitted.lower(*args)
  compiled = lowered.compile()
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
