"""Pretrained weights loaded into a model of this project: the entry point.

`--config.init_from=PATH` starts a new run (step 0, fresh optimizer) from
the weights of PATH, read by one of `factory.READERS`
(`--config.init_format`, `auto` to tell from the file) into one flat dict
{name: array} in this project's names, then fitted to the model
(`fitting.fit`: stacked as the model holds them, names and shapes checked,
position embedding resampled, a new head of zeros when the classes differ).
Scanned, unrolled and segmented models share one layout, so they all load
the same file.

Every mistake is one ValueError line naming the fix, raised before anything
is written.
"""

from absl import logging
from flax import nnx
import jax
import numpy as np

from data import datasets
from runtime import checkpointing
from weights import factory
from weights import fitting


def load(path: str, init_format: str, settings: dict, states: list,
         new_head: bool = True) -> list:
  """`states` (nnx.States: parameters, BatchNorm statistics, ...) of the
  model of `settings` (`models.settings`) with the weights of `path`;
  every array keeps its sharding. With `new_head`, a
  head that does not fit the file's starts from zeros; the log says so.
  """
  target = fitting.model_shapes(states)
  weights = factory.read(path, init_format, target)
  arrays, notes = fitting.fit(weights, target, settings, new_head)
  logging.info('Initialised %d arrays from %s (%s)%s', len(arrays), path,
               weights.source, ''.join(f'; {n}' for n in notes if n))
  return [place_arrays(state, arrays) for state in states]


def place_arrays(state, arrays: dict):
  """`state` with the arrays named in `arrays` (fitted: `fitting.fit`),
  placed like the old ones."""
  def new_value(path, variable):
    name = '.'.join(map(str, path))
    if name not in arrays:
      return variable
    old = variable.get_value()
    value = arrays[name].astype(old.dtype)
    return variable.replace(jax.make_array_from_callback(
        value.shape, old.sharding, lambda index: value[index]))
  return nnx.from_flat_state([(path, new_value(path, variable))
                              for path, variable in nnx.to_flat_state(state)])


def load_into_model(model: nnx.Module, settings: dict, path: str,
                    init_format: str = 'auto') -> None:
  """Loads the weights of `path` into `model` (built from `settings`:
  `models.settings`)."""
  graphdef, *states = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
  nnx.update(model, *load(path, init_format, settings, states))
  del graphdef


def initialize(state, workdir: str, retry_seconds: float, *, init_from: str,
               init_format: str, settings: dict, new_head: bool = True):
  """The train state with the weights of `init_from` when it is set and
  the run starts fresh: `workdir` holds no finished checkpoint to resume
  (looked for during `retry_seconds` of storage outage; see `load` for
  the rest)."""
  if (not init_from or
      checkpointing.checkpoint_dir(workdir, retry_seconds) is not None):
    return state
  return with_init_from(state, init_from=init_from, init_format=init_format,
                        settings=settings, new_head=new_head)


def with_init_from(state, *, init_from: str, init_format: str,
                   settings: dict, new_head: bool = True):
  """The train state with the weights of `init_from` (see `load`)."""
  params, model_state = load(init_from, init_format, settings,
                             [state.params, state.model_state], new_head)
  return state.replace(params=params, model_state=model_state)


def class_names(workdir: str, dataset: str, data_dir: str) -> list[str]:
  """The class names of the model in `workdir`'s newest checkpoint, index by
  index: those saved with it, or (a checkpoint that predates them) those of
  `dataset` (in `data_dir`), the one it was trained on."""
  saved = checkpointing.saved_class_names(
      checkpointing.checkpoint_dir(workdir))
  return saved or datasets.label_names(dataset, data_dir)


def trained_arrays(model: nnx.Module) -> dict:
  """{name: float32 array} of a model's parameters and BatchNorm
  statistics, in the names every reader produces (stacked layout)."""
  return {name: np.asarray(variable.get_value(), np.float32)
          for name, variable in fitting.named_variables(model).items()
          if isinstance(variable, (nnx.Param, nnx.BatchStat))}

