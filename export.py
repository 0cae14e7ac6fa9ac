"""Exports a trained model: `python export.py --workdir=DIR --output=PATH
[--format=project|timm|serving]`.

`project` (the default) writes the float32 parameters and BatchNorm
statistics of DIR's newest checkpoint to one `.safetensors` file, named as
in this project's models (a stack's arrays keep their leading layer axis,
e.g. `stages.0.rest.layers.conv1.kernel`), with the config the model was
trained with (JSON), its class names (JSON) and its step as metadata.
`timm` writes the same arrays in timm's names and layout, with timm's model
name as metadata (`exporting/timm_files.py`). `--config.init_from=FILE`
reads either back, bit for bit. FILE may be in a bucket
(gs://BUCKET/NAME.safetensors). `serving` writes a new directory of
programs that classify image files or pixels without this project, the
evaluation preprocessing inside (`exporting/serving.py`).
"""

import json
import sys

from absl import app
from absl import flags
from flax import nnx
import safetensors.numpy

from configs import default
from exporting import timm_files
from input_pipeline import Preprocessing
from runtime import checkpointing
from runtime import console
from runtime import mixed_precision
from runtime import paths
from training import run_state
from weights import fitting
from weights import pretrained
from weights import project_files

FLAGS = flags.FLAGS


FORMATS = ('project', 'timm', 'serving')


def export(workdir: str, output: str, ema: bool = False,
           file_format: str = 'project') -> dict:
  """Writes the newest checkpoint of `workdir` (its weights, or with `ema`
  their moving average) to `output` in `file_format` (FORMATS); returns
  the arrays written. Nothing is written when it raises ValueError."""
  if file_format not in FORMATS:
    raise ValueError(f'unknown --format={file_format!r}; valid names: '
                     f'{", ".join(FORMATS)}')
  if file_format == 'serving':
    return export_serving(workdir, output, ema)
  if not output.endswith('.safetensors'):
    raise ValueError(f'--output={output!r}: name the file FILE.safetensors')
  file = paths.path(output)  # a bucket that does not answer is said here
  if not paths.is_remote(output) and not file.parent.is_dir():
    raise ValueError(f'--output={output!r}: directory {file.parent} does not '
                     'exist; create it or choose another')
  config, run = run_state.load_trained(workdir, default.get_config(),
                                       ema=ema)
  model = run.model()
  arrays = pretrained.trained_arrays(model)
  if file_format == 'timm':
    problem = timm_files.problem(config)
    if problem:
      raise ValueError(f'--format=timm: {problem}; export it with --format='
                       f'{" or ".join(f for f in FORMATS if f != "timm")}')
    metadata = timm_files.metadata(config, arrays)
    arrays = timm_files.state_dict(model, config)
  else:
    metadata = {project_files.EXPORT_CONFIG_KEY: config.to_json()}
  metadata.update({project_files.EXPORT_STEP_KEY: str(run.step),
                   project_files.EXPORT_CLASSES_KEY: json.dumps(
                       pretrained.class_names(workdir, config))})
  # Never a partial file, locally or in a bucket.
  paths.replace_file(file, safetensors.numpy.save(arrays, metadata=metadata))
  return arrays


def export_serving(workdir: str, output: str, ema: bool = False) -> dict:
  """`export` to `--format=serving`'s directory `output`."""
  # TensorFlow and jax2tf only for this format.
  from exporting import serving  # pylint: disable=g-import-not-at-top
  if problem := serving.output_problem(output):
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
  shapes = fitting.model_shapes(model)
  serving.write(output, serving.Exportable(
      graphdef, state, Preprocessing.from_config(config),
      channels=shapes.get('stem.kernel', shapes.get('patch_embed.kernel'))[2],
      dtype=mixed_precision.compute_dtype(config),
      class_names=tuple(pretrained.class_names(workdir, config)),
      model=config.model, step=run.step))
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
  flags.DEFINE_string('output', None, 'The .safetensors file to write '
                      '(--format=serving: the new directory).')
  flags.DEFINE_bool('ema', False, 'Export the moving average of the weights '
                    '(a run with ema_decay > 0).')
  flags.DEFINE_string('format', 'project', 'What to write: ' + ', '.join(
      FORMATS) + ' (README, docs/pretrained.md).')
  flags.mark_flags_as_required(['workdir', 'output'])


if __name__ == '__main__':
  define_flags()
  app.run(main)
