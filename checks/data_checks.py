"""Every data set a run reads, checked before anything is written: the
main `dataset` and each of `config.evals` (classification data sets, ReaL's
label file, few-shot data sets). What is missing is refused in one line
that lists all of it, each with its config key and how to prepare it, so
that one launch says everything a new machine lacks.
"""

from data import datasets
from evaluators import evaluator_checks
from runtime import paths

# Where ReaL's labels come from (docs/data.md).
REAL_LABELS_SOURCE = ('real.json of github.com/google-research/'
                      'reassessed-imagenet')


def needed_data(config) -> list[tuple[str, str, tuple | None]]:
  """(config key, data set, its split folders if image folders: None for
  train/ and an evaluation folder) of every data set `config` reads."""
  needed = [('dataset', config.dataset, None)]
  for name, settings in config.evals.items():
    settings = evaluator_checks.evaluator_settings(name, settings)
    if settings['type'] == 'classification':
      needed.append((f'evals.{name}.dataset', settings['dataset'],
                     (settings['split'],)))
      continue
    for key, spec in settings['datasets'].items():
      if isinstance(spec, str):  # a name alone: the usual splits
        needed.append((f'evals.{name}.datasets.{key}', spec, None))
      else:
        dataset, train_split, test_split = evaluator_checks.fewshot_splits(
            name, key, spec)
        needed.append((f'evals.{name}.datasets.{key}', dataset,
                       (train_split, test_split)))
  return needed


def missing_label_files(evals) -> list[str]:
  """What is missing of the ReaL label files of `evals`, with their keys
  and where the file comes from."""
  missing = []
  for name, settings in evals.items():
    path = settings.get('real_labels_file', '')
    if (settings.get('labels') == 'real' and
        not (path and paths.path(path).is_file())):
      missing.append(f'evals.{name}.real_labels_file {path!r} is not a file: '
                     f'download {REAL_LABELS_SOURCE} there')
  return missing


def check_data(config) -> None:
  """Raises ValueError, in one line listing every data set `config` reads
  that is not there (each with its key and how to prepare it), before
  anything is written. An unknown data set name raises as it is met; so
  does an image_size that the data set's fixed size contradicts."""
  fixed = datasets.FIXED_IMAGE_SIZES.get(config.dataset)
  if fixed and config.image_size != fixed:
    raise ValueError(
        f'dataset {config.dataset!r} holds {fixed}x{fixed} images, not '
        f'image_size {config.image_size}: set --config.image_size={fixed}, '
        'or train on image folders or a TFDS data set')
  missing = [absent for key, dataset, folders in needed_data(config)
             if (absent := datasets.missing_data(key, dataset,
                                                 config.data_dir, folders))]
  missing += missing_label_files(config.evals)
  if not missing:
    return
  count = (f'{len(missing)} data sets are' if len(missing) > 1
           else 'a data set is')
  raise ValueError(
      f'{count} missing: {"; ".join(missing)}. Prepare each (see '
      'docs/data.md), point config.data_dir or TFDS_DATA_DIR at the '
      'directory where the TFDS ones are prepared, or set its key to data '
      'you have')
