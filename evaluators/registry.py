"""The named evaluators of `config.evals`: each built by its type's module
(`evaluator_types.MODULES`), what every evaluator is built from, and their
schedule.

Each type's module has `create(name, settings, context)`: `settings` are the
evaluator's own (`evaluator_checks.evaluator_settings`), `context` what the run
gives every evaluator (`Context`), never the whole config. An evaluator's
`run(state, ema=False)` returns its tagged metrics: one line on the console
and a set of TensorBoard tags per evaluator and evaluation.
"""

import dataclasses
import importlib

from jax.sharding import Mesh

from evaluators import evaluator_checks
from evaluators import evaluator_types
import input_pipeline
from runtime import config_error

@dataclasses.dataclass(frozen=True)
class Context:
  """What the run gives every evaluator: the mesh, the model (graph
  definition and a state with its shardings, for compiling), the global
  batch size, the compute dtype, how images become inputs, the TFDS data
  dir, the training data set's class names (index by index) and the
  model's input shape (height, width, channels)."""
  mesh: Mesh
  graphdef: object
  state: object
  state_sharding: object
  batch_size: int
  dtype: object
  preprocessing: input_pipeline.Preprocessing
  data_dir: str
  class_names: tuple
  image_shape: tuple


@dataclasses.dataclass
class Scheduled:
  """An evaluator and the steps it runs at: every `every_steps` (0: the
  main evaluation's `eval_every_steps`) and the last."""
  evaluator: object
  every_steps: int

  def due(self, step: int, eval_every_steps: int, last_step: bool) -> bool:
    return last_step or step % (self.every_steps or eval_every_steps) == 0


def create(name: str, settings, context: Context):
  """Evaluator `name` of `settings` (its type's module builds it)."""
  settings = evaluator_checks.evaluator_settings(name, settings)
  module = importlib.import_module(
      evaluator_types.MODULES[settings['type']])
  return module.create(name, settings, context)


def create_all(evals, context: Context) -> dict[str, Scheduled]:
  """Every evaluator of `config.evals`, by name, with its schedule; a
  data-dependent mistake (a folder, a label file, a class without
  training examples) as a ConfigError naming the fix."""
  with config_error.as_config_error():
    return {name: Scheduled(create(name, settings, context),
                            int(settings.get('every_steps', 0)))
            for name, settings in evals.items()}
