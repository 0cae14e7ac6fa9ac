"""Exports a trained model: `python export.py --workdir=DIR --output=FILE
[--format=project|timm]`.

`project` (the default) writes the float32 parameters and BatchNorm
statistics of DIR's newest checkpoint to one `.safetensors` file, named as
in this project's models (a stack's arrays keep their leading layer axis,
e.g. `stages.0.rest.layers.conv1.kernel`), with the config the model was
trained with (JSON), its class names (JSON) and its step as metadata.
`timm` writes the same arrays in timm's names and layout, with timm's model
name as metadata (`exporting/timm_files.py`). `--config.init_from=FILE`
reads either back, bit for bit. `onnx` writes the model's eval-mode
forward pass, weights inside, as one `.onnx` file for any batch size
(`exporting/onnx_files.py`). FILE may be in a bucket
(gs://BUCKET/NAME.safetensors).
"""

import json
import sys

from absl import app
from absl import flags
import safetensors.numpy

from configs import default
from exporting import onnx_files
from exporting import timm_files
from runtime import console
from runtime import paths
from training import run_state
from weights import pretrained
from weights import project_files

FLAGS = flags.FLAGS


FORMATS = ('project', 'timm', 'onnx')
# The file name each format's --output ends with.
SUFFIXES = {'project': '.safetensors', 'timm': '.safetensors',
            'onnx': '.onnx'}


def export(workdir: str, output: str, ema: bool = False,
           file_format: str = 'project') -> dict:
  """Writes the newest checkpoint of `workdir` (its weights, or with `ema`
  their moving average) to `output` in `file_format` (FORMATS); returns
  the arrays exported. Nothing is written when it raises ValueError."""
  if file_format not in FORMATS:
    raise ValueError(f'unknown --format={file_format!r}; valid names: '
                     f'{", ".join(FORMATS)}')
  suffix = SUFFIXES[file_format]
  if not output.endswith(suffix):
    raise ValueError(f'--output={output!r}: name the file FILE{suffix} '
                     f'(--format={file_format})')
  file = paths.path(output)  # a bucket that does not answer is said here
  if not paths.is_remote(output) and not file.parent.is_dir():
    raise ValueError(f'--output={output!r}: directory {file.parent} does not '
                     'exist; create it or choose another')
  config, run = run_state.load_trained(workdir, default.get_config(),
                                       ema=ema)
  model = run.model()
  arrays = pretrained.trained_arrays(model)
  problem = (timm_files.problem(config) if file_format == 'timm' else
             onnx_files.problem(config, arrays) if file_format == 'onnx'
             else None)
  if problem:
    raise ValueError(f'--format={file_format}: {problem}; export it with '
                     '--format=project')
  metadata = {project_files.EXPORT_STEP_KEY: str(run.step),
              project_files.EXPORT_CLASSES_KEY: json.dumps(
                  pretrained.class_names(workdir, config))}
  if file_format == 'timm':
    metadata.update(timm_files.metadata(config, arrays))
    arrays = timm_files.state_dict(model, config)
  else:
    metadata[project_files.EXPORT_CONFIG_KEY] = config.to_json()
  if file_format == 'onnx':
    contents = onnx_files.onnx_file(config, model, metadata)
  else:
    contents = safetensors.numpy.save(arrays, metadata=metadata)
  # Never a partial file, locally or in a bucket.
  paths.replace_file(file, contents)
  return arrays


def main(argv):
  console.quiet(FLAGS.verbosity)
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  try:
    arrays = export(FLAGS.workdir, FLAGS.output, FLAGS.ema, FLAGS.format)
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
                      '(FILE.onnx for --format=onnx).')
  flags.DEFINE_bool('ema', False, 'Export the moving average of the weights '
                    '(a run with ema_decay > 0).')
  flags.DEFINE_string('format', 'project', 'What to write: ' + ', '.join(
      FORMATS) + ' (README, docs/pretrained.md).')
  flags.mark_flags_as_required(['workdir', 'output'])


if __name__ == '__main__':
  define_flags()
  app.run(main)
