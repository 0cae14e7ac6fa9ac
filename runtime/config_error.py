"""The error of a value the trainer cannot run with, from the checks
before a run starts and from building its state; `main` prints it as one
line that names the fix."""

import contextlib


class ConfigError(ValueError):
  """A config value the trainer cannot run with; the message names the fix.
  `fixes`: the config values it names, when they are known as values
  ({key: value}), e.g. those that build the model a weights file fits."""

  def __init__(self, message: str, fixes: dict | None = None):
    super().__init__(message)
    self.fixes = fixes or {}


@contextlib.contextmanager
def as_config_error():
  """The checks' and factories' ValueErrors (unknown names, unusable
  workdirs, data sets), as ConfigErrors, with the fixes they name."""
  try:
    yield
  except ValueError as e:
    raise ConfigError(str(e), getattr(e, 'fixes', None)) from None
