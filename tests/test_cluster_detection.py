"""A machine that looks like a Cloud TPU VM but has no metadata server (a TPU
machine in a container, on a cluster, in a notebook): JAX's detection asks
the server and fails. Here libtpu is installed and JAX_FORCE_TPU_INIT makes
JAX take this machine for a Cloud TPU VM; the metadata server's address is a
closed port, so the detection fails as it does there."""

import os
import subprocess
import sys

import processes
from helpers import REPO


def without_metadata_server(**variables) -> dict:
  """One CPU device, on a machine JAX takes for a Cloud TPU VM whose
  metadata server does not answer."""
  closed_port = processes.free_port()
  return processes.cpu_environment(
      1, JAX_FORCE_TPU_INIT='1', GCE_METADATA_IP=f'127.0.0.1:{closed_port}',
      **variables)


def run_main(workdir, env, *overrides) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, 'main.py', '--config=configs/default.py',
       f'--workdir={workdir}', *overrides],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_a_failed_detection_on_one_host_trains_as_one_process(tmp_path):
  result = run_main(tmp_path, without_metadata_server(
      TPU_WORKER_HOSTNAMES='localhost'),
                    '--config.num_train_steps=2', '--config.num_layers=1',
                    '--config.eval_every_steps=2', '--config.log_every_steps=1')
  assert result.returncode == 0, result.stderr[-3000:]
  warnings = [line for line in result.stderr.splitlines()
              if 'No multi-process run detected' in line]
  assert len(warnings) == 1, result.stderr[-3000:]
  assert 'ConnectionError' in warnings[0]
  assert '--coordinator_address' in warnings[0]
  assert 'process 0 of 1' in result.stderr
  assert 'Traceback' not in result.stderr
  assert os.path.isdir(tmp_path / 'checkpoints' / '2')


def test_a_failed_detection_among_several_hosts_is_one_line_naming_flags(
    tmp_path):
  workdir = tmp_path / 'run'
  result = run_main(workdir, without_metadata_server(
      TPU_WORKER_HOSTNAMES='worker-0,worker-1'))
  assert result.returncode == 1
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  line = result.stderr.strip()
  assert line.startswith('Error: a multi-process run could not be detected '
                         '(ConnectionError: ')
  assert 'TPU_WORKER_HOSTNAMES (Cloud TPU on GKE) names 2' in line
  assert line.endswith('pass --coordinator_address=HOST:PORT (process '
                       "0's), --num_processes and --process_id on every "
                       'process')
  assert not workdir.exists()
