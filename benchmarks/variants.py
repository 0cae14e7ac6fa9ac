"""Config variants named on a benchmark's command line.

`--variants='scan_unroll=1;mesh.fsdp=8,step_mode=jit'`: ';' separates the
variants, ',' the KEY=VALUE overrides of one; dotted keys reach nested
config dicts.
"""


def _parse(value: str):
  for cast in (int, float):
    try:
      return cast(value)
    except ValueError:
      pass
  return {'True': True, 'False': False}.get(value, value)


def configs(base_config, variants: str):
  """(variant text, config with its overrides) for each variant."""
  for variant in variants.split(';'):
    config = base_config.copy_and_resolve_references()
    for item in filter(None, variant.split(',')):
      key, value = item.split('=')
      *parents, leaf = key.split('.')
      node = config
      for parent in parents:
        node = node[parent]
      node[leaf] = _parse(value)
    yield variant or 'as configured', config
