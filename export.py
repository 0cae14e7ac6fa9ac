"""Exports a trained model: `python export.py --workdir=DIR --output=PATH
[--format=project|timm|onnx|serving] [--overwrite]`.

`project` (the default) writes the float32 parameters and BatchNorm
statistics of DIR's newest checkpoint to one `.safetensors` file, named as
in this project's models (a stack's arrays keep their leading layer axis,
e.g. `stages.0.rest.layers.conv1.kernel`), with the config the model was
trained with (JSON), its class names (JSON) and its step as metadata.
`timm` writes the same arrays in timm's names and layout, with timm's model
name as metadata (`exporting/timm_files.py`). `--config.init_from=FILE`
reads either back, bit for bit. FILE may be in a bucket
(gs://BUCKET/NAME.safetensors). `onnx` writes the model's eval-mode
forward pass, weights inside, as one `.onnx` file for any batch size
(`exporting/onnx_files.py`). `serving` writes a new directory of programs
that classify image files or pixels without this project, the evaluation
preprocessing inside (`exporting/serving.py`). Every format refuses an
existing PATH unless --overwrite is given.
"""

# First: while the modules below import, Python's collector pauses and
# their libraries' optional imports are left out (runtime/lean_imports.py).
from runtime import lean_imports  # pylint: disable=g-bad-import-order
lean_imports.before_imports()

import json
import sys

from absl import app
from absl import flags
from flax import nnx
import safetensors.numpy

from configs import default
from exporting import timm_files
from input_pipeline import Preprocessing
from runtime import checkpoint_reads
from runtime import checkpointing
from runtime import console
from runtime import paths
from training import run_state
from weights import fitting
from weights import pretrained
from weights import project_files

FLAGS = flags.FLAGS


FORMATS = ('project', 'timm', 'onnx', 'serving')
# The jax2onnx that --format=onnx was verified with.
JAX2ONNX_VERSION = '0.17.1'
# What takes a model that --format=timm or onnx refuses (ONNX takes any
# model of this project).
REFUSED_FORMATS_TAKEN_BY = {'timm': 'project or onnx', 'onnx': 'project'}
# The file name each single-file format's --output ends with.
SUFFIXES = {'project': '.safetensors', 'timm': '.safetensors',
            'onnx': '.onnx'}


def export(workdir: str, output: str, ema: bool = False,
           file_format: str = 'project', overwrite: bool = False) -> dict:
  """Writes the newest checkpoint of `workdir` (its weights, or with `ema`
  their moving average) to `output` in `file_format` (FORMATS), replacing
  an existing `output` only with `overwrite`; returns the arrays written.
  Nothing is written when it raises ValueError."""
  if file_format not in FORMATS:
    raise ValueError(f'unknown --format={file_format!r}; valid names: '
                     f'{", ".join(FORMATS)}')
  if file_format == 'serving':
    return export_serving(workdir, output, ema, overwrite)
  suffix = SUFFIXES[file_format]
  if not output.endswith(suffix):
    raise ValueError(f'--output={output!r}: name the file FILE{suffix} '
                     f'(--format={file_format})')
  file = paths.path(output)  # a bucket that does not answer is said here
  if not paths.is_remote(output) and not file.parent.is_dir():
    raise ValueError(f'--output={output!r}: directory {file.parent} does not '
                     'exist; create it or choose another')
  if file.is_dir():
    raise ValueError(f'--output={output!r}: is a directory; name a file')
  if file.exists() and not overwrite:
    raise ValueError(f'--output={output!r}: exists; pass --overwrite to '
                     'replace it, or name a new file')
  onnx_files = _onnx_files() if file_format == 'onnx' else None
  config, run = run_state.load_trained(workdir, default.get_config(),
                                       ema=ema)
  model = run.model()
  arrays = pretrained.trained_arrays(model)
  problem = (timm_files.problem(config) if file_format == 'timm' else
             onnx_files.problem(config, arrays) if onnx_files else None)
  if problem:
    raise ValueError(f'--format={file_format}: {problem}; export it with '
                     f'--format={REFUSED_FORMATS_TAKEN_BY[file_format]}')
  class_names = pretrained.class_names(workdir, config.dataset,
                                       config.data_dir)
  metadata = {project_files.EXPORT_STEP_KEY: str(run.step),
              project_files.EXPORT_CLASSES_KEY: json.dumps(class_names)}
  if file_format == 'timm':
    metadata.update(timm_files.metadata(config, arrays))
    arrays = timm_files.state_dict(model, config)
  else:
    metadata[project_files.EXPORT_CONFIG_KEY] = config.to_json()
  contents = (onnx_files.onnx_file(config, model, metadata) if onnx_files
              else safetensors.numpy.save(arrays, metadata=metadata))
  # Never a partial file, locally or in a bucket.
  paths.replace_file(file, contents)
  return arrays


def _onnx_files():
  """exporting/onnx_files.py, which needs jax2onnx (installed apart: its
  metadata pins an older orbax-checkpoint)."""
  try:
    from exporting import onnx_files  # pylint: disable=g-import-not-at-top
  except ModuleNotFoundError as e:
    raise ValueError(f'--format=onnx needs {e.name}, not installed: pip '
                     'install -r requirements.txt && pip install --no-deps '
                     f'jax2onnx=={JAX2ONNX_VERSION}') from None
  return onnx_files


def export_serving(workdir: str, output: str, ema: bool = False,
                   overwrite: bool = False) -> dict:
  """`export` to `--format=serving`'s directory `output`."""
  # TensorFlow and jax2tf only for this format.
  from exporting import serving  # pylint: disable=g-import-not-at-top
  if problem := serving.output_problem(output, overwrite):
    raise ValueError(f'--output={output!r}: {problem}')
  step_dir = checkpointing.checkpoint_dir(workdir)
  # Refused before the model is built (no checkpoint: load_trained says so).
  if step_dir and (problem := serving.problem(run_state.trained_config(
      step_dir, default.get_config()))):
    raise ValueError(f'--format=serving: {problem}; export it with --format='
                     f'{" or ".join(f for f in FORMATS if f != "serving")}')
  config, run = run_state.load_trained(workdir, default.get_config(),
                                       ema=ema)
  model = run.model()
  arrays = pretrained.trained_arrays(model)
  graphdef, state = nnx.split(model)
  serving.write(output, serving.Exportable(
      graphdef, state, Preprocessing.from_config(config),
      channels=fitting.image_channels(fitting.model_shapes(model)),
      dtype=run.dtype,
      class_names=tuple(pretrained.class_names(workdir, config.dataset,
                                               config.data_dir)),
      model=config.model, step=run.step))
  return arrays


def main(argv):
  lean_imports.freeze_imports()
  console.quiet(FLAGS.verbosity)
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  try:
    with checkpoint_reads.stall_bound(FLAGS.restore_retry_seconds):
      arrays = export(FLAGS.workdir, FLAGS.output, FLAGS.ema, FLAGS.format,
                      FLAGS.overwrite)
  except checkpoint_reads.RestoreError as e:
    console.exit_at_once(f'Error: {e}')
  except ValueError as e:
    sys.exit(f'Error: {e}')
  print(f'Wrote {len(arrays)} arrays '
        f'({sum(a.size for a in arrays.values()):,} numbers) to '
        f'{FLAGS.output}')


def define_flags():
  """The command line (only when run as a script: modules that import
  this one keep their own flags)."""
  flags.DEFINE_string('workdir', None, 'Workdir of a training run.')
  flags.DEFINE_string('output', None, 'The file to write: FILE.safetensors '
                      '(--format=onnx: FILE.onnx; --format=serving: a new '
                      'directory).')
  flags.DEFINE_float('restore_retry_seconds', checkpoint_reads.RETRY_SECONDS,
                     'How long the reads of the checkpoint may go without '
                     'progress (an outage) before the command stops.',
                     lower_bound=0)
  flags.DEFINE_bool('ema', False, 'Export the moving average of the weights '
                    '(a run with ema_decay > 0).')
  flags.DEFINE_string('format', 'project', 'What to write: ' + ', '.join(
      FORMATS) + ' (README, docs/pretrained.md).')
  flags.DEFINE_bool('overwrite', False, 'Replace an existing --output (a '
                    'file, or a serving export\'s directory).')
  flags.mark_flags_as_required(['workdir', 'output'])


if __name__ == '__main__':
  define_flags()
  app.run(main)
