"""Ahead-of-time compiling of a step function for the mesh."""

import time

import jax


def compile_step(step_fn, state_sharding, batch_sharding, state, batch, *,
                 out_shardings, donate_state: bool):
  """AOT-compiles `step_fn(state, batch)`; returns it and compile seconds."""
  start = time.perf_counter()
  compiled = jax.jit(
      step_fn, in_shardings=(state_sharding, batch_sharding),
      out_shardings=out_shardings,
      donate_argnums=(0,) if donate_state else ()).lower(state, batch).compile()
  return compiled, time.perf_counter() - start
