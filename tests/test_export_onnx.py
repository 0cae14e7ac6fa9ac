"""`export.py --format=onnx`, checked with ONNX Runtime: each family's file
computes the project's own eval-mode logits at any batch size, the
command writes a run's moving average as users run it, and what the format
cannot take is refused in one line, nothing written."""

import json
import re

from flax import nnx
import numpy as np
import onnxruntime
import pytest

import export
from exporting import onnx_files
from exported_runs import RUNS
from exported_runs import assert_close_to_scale
from exported_runs import export_command
from exported_runs import initial_state
from exported_runs import images
from exported_runs import run_config
from exported_runs import write_run
from helpers import evaluation_logits

# One worker exports each family's model once for every test of it.
pytestmark = pytest.mark.xdist_group('export_onnx')

# The families' small runs; the ResNet a ResNet-50 (bottleneck blocks, the
# default padding, whose max pool pads after only).
ONNX_RUNS = {**RUNS, 'resnet': dict(model='ResNet50', image_size=32)}
# Of the largest logit: float32 rounding of another order of operations.
TOLERANCE = 1e-4


def onnx_runtime(contents) -> onnxruntime.InferenceSession:
  """ONNX Runtime, ready to run an ONNX file (its path or contents)."""
  options = onnxruntime.SessionOptions()
  options.log_severity_level = 3  # errors only
  return onnxruntime.InferenceSession(contents, options,
                                      providers=['CPUExecutionProvider'])


@pytest.fixture(scope='module', params=list(ONNX_RUNS))
def exported(request):
  """(config, ONNX Runtime running the file `--format=onnx` writes, the
  project's eval-mode logits on `images(config, 4)`) of each family's model
  at random weights and BatchNorm statistics (`initial_state`)."""
  config = run_config(**ONNX_RUNS[request.param])
  graphdef, state = initial_state(config)
  model = nnx.merge(graphdef, state.params, state.model_state)
  contents = onnx_files.onnx_file(config, model, {})
  expected = np.asarray(evaluation_logits(model, images(config, 4)))
  return config, onnx_runtime(contents), expected


def test_onnx_runtime_computes_the_projects_logits(exported):
  config, runtime, expected = exported
  logits, = runtime.run(None, {onnx_files.INPUT_NAME: images(config, 4)})
  assert logits.dtype == np.float32
  assert_close_to_scale(logits, expected, TOLERANCE)


def test_the_onnx_file_takes_any_batch_size(exported):
  config, runtime, expected = exported
  (given,), (returned,) = runtime.get_inputs(), runtime.get_outputs()
  assert (given.name, given.type) == (onnx_files.INPUT_NAME, 'tensor(float)')
  assert given.shape == [onnx_files.BATCH, config.image_size,
                         config.image_size, 3]
  assert returned.shape == [onnx_files.BATCH, expected.shape[1]]
  x = images(config, 4)
  for rows in (slice(0, 1), slice(1, 4)):
    logits, = runtime.run(None, {onnx_files.INPUT_NAME: x[rows]})
    assert_close_to_scale(logits, expected[rows], TOLERANCE)


def test_the_export_command_writes_the_moving_average(tmp_path):
  config = run_config(model='SmallResNet', ema_decay=0.9, image_size=8)
  graphdef, state = write_run(tmp_path / 'run', config)
  output = tmp_path / 'ema.onnx'
  result = export_command(tmp_path / 'run', output, '--format=onnx',
                          '--ema')
  assert result.returncode == 0, result.stderr[-3000:]
  runtime = onnx_runtime(str(output))
  metadata = runtime.get_modelmeta().custom_metadata_map
  assert json.loads(metadata['config'])['ema_decay'] == 0.9
  assert metadata['step'] == '1'
  x = images(config, 3)
  average = nnx.merge(graphdef, state.ema['params'],
                      state.ema['model_state'])
  weights = nnx.merge(graphdef, state.params, state.model_state)
  logits, = runtime.run(None, {onnx_files.INPUT_NAME: x})
  assert_close_to_scale(logits, np.asarray(average(x, train=False)),
                        TOLERANCE)
  assert np.abs(logits - np.asarray(weights(x, train=False))).max() > 1e-3


def test_what_onnx_cannot_take_is_refused_in_one_line(tmp_path):
  config = run_config(model='SmallResNet', image_size=8)
  output = tmp_path / 'model.safetensors'
  with pytest.raises(ValueError, match=(
      r"^--output='.*model.safetensors': name the file FILE.onnx "
      r'\(--format=onnx\)$')):
    export.export(str(tmp_path / 'run'), str(output), file_format='onnx')
  assert not output.exists()
  # Over 2 GiB of float32 numbers: a zero-stride view, no memory.
  config.model = 'ViT_L16'
  arrays = {'huge': np.broadcast_to(np.float32(0), (2**29,))}
  assert onnx_files.problem(config, arrays) == (
      'ViT_L16 has 536,870,912 float32 parameters and statistics, over the '
      '2 GiB an ONNX file holds inside')


def test_every_format_refuses_an_existing_output_unless_told_to_overwrite(
    tmp_path):
  """The ONNX export of a 2-block ViT as a user runs it: one line on the
  console, no converter warnings; run again, it refuses the file it wrote
  in one line naming --overwrite, which then replaces it. Each other format
  refuses an existing output the same way."""
  config = run_config(**RUNS['vit_gap'])
  write_run(tmp_path / 'run', config)
  output = tmp_path / 'vit.onnx'
  wrote = re.compile(rf'Wrote \d+ arrays \([\d,]+ numbers\) to '
                     rf'{re.escape(str(output))}\n')
  result = export_command(tmp_path / 'run', output, '--format=onnx')
  assert result.returncode == 0, result.stderr[-3000:]
  assert wrote.fullmatch(result.stdout + result.stderr), result.stderr[-3000:]
  written = output.read_bytes()
  output.write_bytes(b'kept')
  result = export_command(tmp_path / 'run', output, '--format=onnx')
  assert (result.returncode, result.stdout) == (1, '')
  assert result.stderr == (
      f"Error: --output='{output}': exists; pass --overwrite to replace it, "
      'or name a new file\n')
  assert output.read_bytes() == b'kept'
  result = export_command(tmp_path / 'run', output, '--format=onnx',
                          '--overwrite')
  assert wrote.fullmatch(result.stdout + result.stderr), result.stderr[-3000:]
  assert output.read_bytes() == written
  for file_format, name in (('project', 'model.safetensors'),
                            ('timm', 'timm.safetensors'),
                            ('serving', 'export')):
    (tmp_path / name).mkdir() if file_format == 'serving' else (
        tmp_path / name).write_bytes(b'kept')
    with pytest.raises(ValueError, match=(
        rf"^--output='.*{name}': exists; pass --overwrite to replace it")):
      export.export(str(tmp_path / 'run'), str(tmp_path / name),
                    file_format=file_format)
