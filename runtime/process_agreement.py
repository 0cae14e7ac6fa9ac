"""Answers that every process of a run must agree on, shared through JAX's
coordination service.

Each process posts its answer under a key named after the question and
reads every other's. The service matches keys by name, in any order, so
this can be asked from any point of a program, unlike a device collective,
which must reach every process in one order (see docs/reliability.md, no
hangs). On one process there is nothing to share.
"""

import jax
# The coordination service's client: JAX has no public handle to it (orbax
# reaches it the same way).
from jax._src import distributed


def share(question: str, answer: str, timeout_ms: int) -> list[str]:
  """Every process's `answer` to `question`, in process order; the same
  list on every process. Raises RuntimeError naming the question when a
  process has not answered within `timeout_ms`."""
  if jax.process_count() == 1:
    return [answer]
  client = distributed.global_state.client
  prefix = f'trainer/{question}/'
  client.key_value_set(prefix + str(jax.process_index()), answer)
  try:
    return [client.blocking_key_value_get(prefix + str(i), timeout_ms)
            for i in range(jax.process_count())]
  except Exception as e:  # pylint: disable=broad-except
    # jaxlib raises its own runtime error type, e.g. DEADLINE_EXCEEDED.
    raise RuntimeError(
        f'not every process answered {question!r} within '
        f'{timeout_ms // 1000} s ({str(e).splitlines()[0]})') from e


def forget(question: str) -> None:
  """Deletes this process's answer to `question` (once every process has
  read it)."""
  if jax.process_count() > 1:
    distributed.global_state.client.key_value_delete(
        f'trainer/{question}/{jax.process_index()}')
