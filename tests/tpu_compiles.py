"""Train steps compiled for TPU topologies by libtpu in a process of their
own (`run`), as `main.py --mode=compile` compiles them
(`train.compile_for_topology`'s train step): what the tests of
tests/test_accelerator_compile.py read of them, as JSON on stdout.

  python3 tests/tpu_compiles.py JOB_JSON...

Each job is {'topology': NAME, 'num_slices': N, 'config': overrides of
configs/default.py, 'count_flops': bool (default true)}; for each, the
train step's peak bytes per chip, with `count_flops` its FLOPs with and
without the remat policy's recomputation, and the names of the collectives
its cross-slice transfers (TPU multislice: host transfers through the
megascale runtime) rendezvous for. The train step alone is compiled: the
tests read nothing of the run's other programs (the evaluation step took
as long to compile as the train step), which `main.py --mode=compile`'s
own tests compile and report.
"""

import json
import os
import re
import subprocess
import sys

# The repository root, where this file's process imports the project from.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def user_environment() -> dict:
  """This environment as a user's shell has it: without the suite's
  XLA:CPU flags, which would reach libtpu too, and without its choice of
  the CPU backend alone (JAX looks for a TPU first, as on a user's
  machine with libtpu installed)."""
  environment = {**os.environ, 'XLA_FLAGS': ''}
  environment.pop('JAX_PLATFORMS', None)
  return environment


def run(jobs: list[dict]) -> list[dict]:
  """What `main` prints for `jobs`, from a process of its own with the
  environment of a user's shell."""
  result = subprocess.run(
      [sys.executable, __file__, *(json.dumps(job) for job in jobs)],
      cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
      env=user_environment())
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def main(*job_jsons: str):
  sys.path.insert(0, REPO)
  # pylint: disable=g-import-not-at-top
  import jax
  jax.config.update('jax_platforms', 'cpu')
  from checks import memory_budget
  from configs import default
  from runtime import accelerators
  import train
  # pylint: enable=g-import-not-at-top
  results = []
  for job in map(json.loads, job_jsons):
    topology = accelerators.topology(job['topology'], job['num_slices'])
    config = memory_budget.with_values(default.get_config(), **job['config'])
    mesh, run, _, batch, learning_rate_fn = train.abstract_topology_run(
        config, topology)
    step_kwargs = train.train_step_kwargs(config, run.graphdef, run.tx,
                                          learning_rate_fn,
                                          run.teacher_graphdef)
    _, (_, step, _, _) = train.compile_train_step(
        config.step_mode, mesh, step_kwargs, run, batch)
    result = {
        'peak': accelerators.memory_in_use(step)['peak'],
        'cross_slice': re.findall(
            r'MegascaleRendezvousKeyName="([a-z-]+)', step.as_text()),
    }
    if job.get('count_flops', True):
      result.update(train.step_flops(run, step_kwargs, batch))
    results.append(result)
  print(json.dumps(results))


if __name__ == '__main__':
  main(*sys.argv[1:])
