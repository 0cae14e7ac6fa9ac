"""FLOPs of a train step and of a forward pass, every layer counted.

XLA's cost analysis counts a rolled scan's body once, whatever its trip
count, so each count lowers the program again with every scanned stack a
Python loop over the same parameters (`layers/stacked.py`
`unroll_for_counting`) and without remat. Lowered only: nothing runs.

The count is XLA's cost analysis of the lowering for this machine's CPU,
whatever devices the run's arrays are on: TPU's and GPU's runtimes answer
only for compiled programs (an uncompiled one's analysis is None there),
and compiling the unrolled step would cost a second full compile. The CPU
lowering of a step is the same program, op for op.
"""

import functools

from flax import nnx
import jax

from layers import stacked


def true_step_flops(train_step, graphdef, step_kwargs, state, batch,
                    recomputation: bool = False) -> float:
  """FLOPs of one step of `train_step` (`training/update.py`), every layer
  counted; with `recomputation`, every operation the stacks' remat policy
  recomputes counted again.

  XLA's cost analysis counts a rolled scan's body once, so the step is
  lowered again with the stacks as a Python loop over the same parameters
  and without remat, whose recomputation is not model work (or, with
  `recomputation`, with it), and with its loop over micro-batches
  unrolled. `train.compile_steps` keeps the count in the
  compilation cache under the key of the rolled step's program: a change
  here that leaves that program as it was finds the old counts there until
  the cache directory is removed.
  """
  distill = dict(step_kwargs['distill'] or {})
  if distill:  # the teacher's stacks too
    distill['teacher_graphdef'] = unrolled_graphdef(
        distill['teacher_graphdef'], state.teacher)
  step = functools.partial(train_step, **{
      **step_kwargs, 'distill': distill,
      'graphdef': unrolled_graphdef(graphdef, state.params,
                                     state.model_state,
                                     recomputation=recomputation),
      'accum_unroll': step_kwargs['grad_accum_steps']})
  return lowered_flops(step, state, batch)


def counting_forward(graphdef, params, model_state):
  """The inference forward pass `(params, model_state, images) -> logits`
  of the model with every stack a Python loop without remat (counted as
  `true_step_flops` counts it), with its parameters and state."""
  unrolled = unrolled_graphdef(graphdef, params, model_state)

  def forward(params, model_state, images):
    return nnx.merge(unrolled, params, model_state)(images, train=False)
  return forward, params, model_state


def true_forward_flops(graphdef, params, model_state, images) -> float:
  """FLOPs of one inference forward pass over `images` (arrays or
  `jax.ShapeDtypeStruct`s), every layer counted; lowered only, nothing
  runs."""
  forward, params, model_state = counting_forward(graphdef, params,
                                                  model_state)
  return lowered_flops(forward, params, model_state, images)


def lowered_flops(fn, *args) -> float:
  """FLOPs of `fn(*args)` (arrays or `jax.ShapeDtypeStruct`s, on any
  devices) by XLA's cost analysis of its lowering for the CPU: nothing is
  compiled or run."""
  try:
    cpu = jax.devices('cpu')[0]
  except RuntimeError as e:  # JAX_PLATFORMS without cpu
    raise RuntimeError(
        f'Counting FLOPs lowers the step for the CPU, which JAX_PLATFORMS='
        f'{jax.config.jax_platforms!r} leaves out: add it '
        f"(JAX_PLATFORMS='{jax.config.jax_platforms},cpu') or unset "
        'JAX_PLATFORMS') from e
  on_cpu = jax.sharding.SingleDeviceSharding(cpu)
  shapes = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_cpu,
                                     weak_type=getattr(x, 'weak_type', False)),
      args)
  return float(jax.jit(fn).lower(*shapes).cost_analysis()['flops'])


def unrolled_graphdef(graphdef, *states, recomputation: bool = False):
  """The graph definition of a model whose stacks are Python loops over
  the same parameters, without remat (or, with `recomputation`, with the
  remat of a rolled stack: `stacked.unroll_for_counting`)."""
  return nnx.graphdef(stacked.unroll_for_counting(
      nnx.merge(graphdef, *states), recomputation))
