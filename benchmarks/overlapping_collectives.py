"""Executions of one collective program in flight together on two processes:
do they hang?

  python3 benchmarks/overlapping_collectives.py

The evaluation's pattern, stripped to its collective. Two processes of four
CPU devices each (gloo collectives, as the tests run) repeat `--rounds`
times: `calls` executions of one jitted program that sums a batch-sharded
array into a replicated result (an all-reduce across the processes), the
results added up with `jnp.add`, then read and checked. Issued back to back,
the executions do not depend on each other, so several can be running at
once. Waiting for each result before issuing the next execution (what
`evaluators/common.py` `step_outputs` does) runs them one at a time. A last row
alternates two different all-reducing programs, process 1 in the opposite
order, as a collective issued from a second thread (say, a checkpointing
one) can be.

A row that finishes no round for `--stall_seconds` hangs (its processes
are killed). Prints, per row: executions per round, issue order,
rounds finished by both processes, hung or not, seconds.
"""

import os
import re
import sys
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from runtime import console  # pylint: disable=g-import-not-at-top
from tests import processes  # pylint: disable=g-import-not-at-top

flags.DEFINE_integer('rounds', 20, 'Evaluations per row.')
flags.DEFINE_list('calls', ['5', '10', '20', '50', '200'],
                  'Executions per evaluation, one row pair each.')
flags.DEFINE_integer('stall_seconds', 30, 'A row that finishes no round '
                     'for this long hangs.')
flags.DEFINE_integer('worker', None, 'Internal: run as this process.')
flags.DEFINE_integer('port', None, 'Internal: the coordinator port.')
flags.DEFINE_integer('worker_calls', None, 'Internal: executions per round.')
flags.DEFINE_enum('worker_order', None, ['back_to_back', 'waiting',
                                          'opposite'],
                  'Internal: how the executions are issued (see ORDERS).')
FLAGS = flags.FLAGS

DEVICES_PER_PROCESS = 4
ROWS_PER_DEVICE = 64
ORDERS = {
    'back_to_back': 'back to back',
    'waiting': 'each waits for the one before',
    # Two programs (the sum above, and sums of 64 columns: a longer
    # all-reduce), alternating, process 1 starting with the other one: what
    # a collective issued from a second thread can do.
    'opposite': 'two programs, alternating, in opposite orders',
}


def run_worker() -> None:
  """One process: `--rounds` evaluations; prints a line after each."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(f'127.0.0.1:{FLAGS.port}', 2, FLAGS.worker)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  spec = jax.sharding.PartitionSpec
  rows = DEVICES_PER_PROCESS * ROWS_PER_DEVICE
  local = np.arange(rows, dtype=np.float32) + 1000 * FLAGS.worker
  batch = jax.make_array_from_process_local_data(
      jax.sharding.NamedSharding(mesh, spec('data')), local, (2 * rows,))
  replicated = jax.sharding.NamedSharding(mesh, spec())
  sums_step = jax.jit(lambda x: {'sum': jnp.sum(x)}, out_shardings=replicated)
  column_sums_step = jax.jit(
      lambda x: {'sum': jnp.sum(x.reshape(-1, 64), axis=0)},
      out_shardings=replicated)
  steps = [sums_step]
  if FLAGS.worker_order == 'opposite':
    steps = [sums_step, column_sums_step][::1 if FLAGS.worker == 0 else -1]
  expected = FLAGS.worker_calls * float(
      2 * np.arange(rows).sum() + 1000 * rows)
  for round_index in range(FLAGS.rounds):
    totals = [None] * len(steps)
    for call in range(FLAGS.worker_calls):
      index = call % len(steps)
      if FLAGS.worker_order == 'waiting' and totals[index] is not None:
        jax.block_until_ready(totals[index])
      sums = steps[index](batch)
      totals[index] = (sums if totals[index] is None else
                       jax.tree.map(jnp.add, totals[index], sums))
    total = sum(float(np.sum(jax.device_get(t)['sum'])) for t in totals)
    assert total == expected, (round_index, total, expected)
    print(f'round {round_index} finished', file=sys.stderr, flush=True)


def rounds_finished(workers: processes.Processes) -> int:
  return min(len(re.findall(r'^round \d+ finished$', workers.log(i), re.M))
             for i in range(2))


def run_row(calls: int, order: str) -> tuple[int, str, float]:
  """Rounds both processes finished, whether they hung ('yes', 'no' or
  the exit codes of a failure), seconds."""
  command = [sys.executable, os.path.abspath(__file__),
             f'--rounds={FLAGS.rounds}', f'--port={processes.free_port()}',
             f'--worker_calls={calls}', f'--worker_order={order}']
  start = last_progress = time.monotonic()
  with processes.Processes(
      [[*command, f'--worker={i}'] for i in range(2)],
      [processes.cpu_environment(DEVICES_PER_PROCESS)] * 2) as workers:
    finished = 0
    while any(worker.poll() is None for worker in workers.popens):
      now_finished = rounds_finished(workers)
      if now_finished > finished:
        finished, last_progress = now_finished, time.monotonic()
      if time.monotonic() - last_progress > FLAGS.stall_seconds:
        return finished, 'yes', time.monotonic() - start
      time.sleep(0.1)
    codes = workers.wait(timeout=60)
    finished = rounds_finished(workers)
  outcome = 'no' if codes == [0, 0] else f'no: failed, exit codes {codes}'
  return finished, outcome, time.monotonic() - start


def main(argv):
  del argv
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  if FLAGS.worker is not None:
    run_worker()
    return
  print(f'2 processes x {DEVICES_PER_PROCESS} CPU devices, gloo; '
        f'{FLAGS.rounds} rounds per row; a hang: no round finished in '
        f'{FLAGS.stall_seconds} s.')
  print('| executions per round | issued | rounds finished | hung | s |')
  print('| ---: | --- | ---: | --- | ---: |')
  rows = [(int(calls), order) for calls in FLAGS.calls
          for order in ('back_to_back', 'waiting')]
  for calls, order in rows + [(2, 'opposite')]:
    finished, hung, seconds = run_row(calls, order)
    print(f'| {calls} | {ORDERS[order]} | {finished} of {FLAGS.rounds} | '
          f'{hung} | {seconds:.0f} |', flush=True)


if __name__ == '__main__':
  app.run(main)
