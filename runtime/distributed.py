"""Joining a multi-process run: from the command's flags, or detected.

`jax.distributed.initialize()` detects Cloud TPU (its metadata server or
GKE's variables), SLURM and Open MPI. A detection can fail half way: a TPU
machine in a container, on a cluster or in a notebook looks like a Cloud TPU
VM but has no metadata server to ask. Such a machine describes one host, and
one host is one process; a machine whose variables name several processes
cannot guess its place among them, and says which flags to set.
"""

import os

from absl import logging
import jax

# The environment variables that name a run's processes (or hosts), by the
# cluster that sets them: any of them above 1 describes several processes.
PROCESS_COUNT_VARIABLES = {
    'TPU_WORKER_HOSTNAMES': 'Cloud TPU on GKE',
    'TPU_PROCESS_ADDRESSES': 'Cloud TPU on GKE',
    'MEGASCALE_NUM_SLICES': 'Cloud TPU multislice',
    'SLURM_NTASKS': 'SLURM',
    'OMPI_COMM_WORLD_SIZE': 'Open MPI',
}
FLAGS_FIX = ('pass --coordinator_address=HOST:PORT (process 0\'s), '
             '--num_processes and --process_id on every process')


class DetectionError(Exception):
  """The environment names several processes but the run's place among them
  could not be detected."""


def described_processes() -> dict[str, int]:
  """{variable: the number of processes (or hosts, or slices) it names} for
  each of `PROCESS_COUNT_VARIABLES` set on this machine."""
  counts = {}
  for variable in PROCESS_COUNT_VARIABLES:
    value = os.environ.get(variable, '').strip()
    if not value:
      continue
    counts[variable] = (len(value.split(',')) if variable.startswith('TPU_')
                        else int(value) if value.isdigit() else 2)
  return counts


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None, heartbeat_timeout_seconds: int) -> None:
  """Joins the run the flags describe; with none given, the run the cluster
  describes, or none (a plain machine: one process).

  A detection that fails on a machine that describes one host runs as one
  process, saying so in one line; one that fails where the environment names
  several processes raises DetectionError naming the flags that set them.
  """
  # CPU devices of different processes talk through gloo; GPUs and TPUs
  # have their own collectives and ignore this.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  explicit = dict(coordinator_address=coordinator_address,
                  num_processes=num_processes, process_id=process_id)
  timeout = dict(heartbeat_timeout_seconds=heartbeat_timeout_seconds)
  if any(value is not None for value in explicit.values()):
    jax.distributed.initialize(**explicit, **timeout)
    return
  try:
    jax.distributed.initialize(**timeout)
  except ValueError as e:  # no cluster detected: one process
    logging.debug('No cluster detected (%s); one process.', e)
  except Exception as e:  # pylint: disable=broad-except
    # The detectors raise what their sources raise: requests' errors for an
    # absent metadata server, KeyError for a missing SLURM variable...
    reason = f'{type(e).__name__}: {_first_line(e)}'
    several = {variable: count for variable, count
               in described_processes().items() if count > 1}
    if several:
      named = ', '.join(f'{variable} ({PROCESS_COUNT_VARIABLES[variable]}) '
                        f'names {count}' for variable, count in several.items())
      raise DetectionError(
          f'a multi-process run could not be detected ({reason}) where '
          f'{named}; {FLAGS_FIX}') from e
    logging.warning('No multi-process run detected (%s); this machine '
                    'describes one host: one process. For a multi-process '
                    'run, %s.', reason, FLAGS_FIX)


def _first_line(error: Exception, limit: int = 200) -> str:
  line = (str(error).strip().splitlines() or [''])[0]
  return line if len(line) <= limit else line[:limit] + '...'
