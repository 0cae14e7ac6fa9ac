"""How orbax writes the train state's replicated arrays in a checkpoint.

Orbax's default, replica-parallel writing, has each replica of an array
write a slice of it, which spreads the writing over the processes that hold
replicas. In a run of one process there is nothing to spread, and each
slice is a program compiled for its shape and device: on 8 CPU devices,
about half a minute at the first save of a state of 232 arrays. There each
array is written whole from one device, as a sharded one is; the files read
back the same either way. Runs of several processes keep orbax's default.
"""

import jax
import orbax.checkpoint as ocp
# Not exported by orbax: the store its default array handler is made with
# (it records which arrays are typed PRNG keys, for their restore), and the
# registry's method that replaces a handler without logging a warning.
from orbax.checkpoint._src.metadata import array_metadata_store
from orbax.checkpoint._src.serialization import type_handler_registry


def write_whole_in_one_process() -> None:
  """In a run of one process, has orbax write each replicated array from
  one device, whole (for every checkpoint this process saves after)."""
  if jax.process_count() == 1:
    type_handler_registry.GLOBAL_TYPE_HANDLER_REGISTRY.add(
        jax.Array, ocp.type_handlers.ArrayHandler(
            use_replica_parallel=False,
            array_metadata_store=array_metadata_store.Store()),
        override=True, ignore_warnings=True)
