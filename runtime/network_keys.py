"""Which config keys define the network, by model family ('resnet',
'vit', 'convnext', 'swin', 'regnet': `models.family`).

- ARRAY_KEYS define the network's arrays: another value makes arrays of
  other shapes, or other arrays.
- PRESENCE_KEYS define the network's arrays by being set or None (a
  ConvNeXt's layer_scale_init: None leaves its layer scales out); any
  other value of theirs is only an initial one.
- COMPUTE_KEYS define what the network computes from the same arrays:
  another value leaves every shape as it is and changes every output.
- STATE_KEYS define the train state's arrays beyond what the model's
  keys say: the head's (the data set's classes) and the optimizer's.

Any other key only defines training (data, schedule, regularisation,
initial values) or how the same network runs (precision, rematerialisation,
scans). A resume that changes a key of these is refused
(`checkpoint_compatibility`), as is a `--mode=eval` override of the
network's (`training/run_state.py`), and a start from this project's
weights whose network keys differ from theirs, but for its size
(`weights/project_files.py`); `predict.py` and `export.py` build the
checkpoint's own network.
"""

_EVERY_FAMILY = ('model', 'feature_batch_norm')
ARRAY_KEYS = {
    'resnet': (*_EVERY_FAMILY, 'num_layers', 'width'),
    'vit': (*_EVERY_FAMILY, 'num_layers', 'image_size', 'vit_pool',
            'vit_posemb', 'vit_pre_logits', 'vit_distillation_token',
            'vit_layer_scale', 'vit_registers', 'vit_norm_pre',
            'vit_projection'),
    'convnext': _EVERY_FAMILY,
    'swin': (*_EVERY_FAMILY, 'image_size', 'swin_window'),
    'regnet': _EVERY_FAMILY,
}
PRESENCE_KEYS = {'convnext': ('layer_scale_init',)}
COMPUTE_KEYS = {
    'resnet': ('resnet_padding',),
    'vit': ('vit_gelu', 'vit_norm_eps'),
    'convnext': (), 'swin': (), 'regnet': (),
}
STATE_KEYS = ('dataset', 'optimizer')


def network_keys(family: str) -> tuple[str, ...]:
  """The keys that define a network of `family`: its arrays and what it
  computes."""
  return (*ARRAY_KEYS[family], *PRESENCE_KEYS.get(family, ()),
          *COMPUTE_KEYS[family])


def same_network(key: str, a, b) -> bool:
  """Whether values `a` and `b` of network key `key` define the same
  network."""
  if any(key in keys for keys in PRESENCE_KEYS.values()):
    return (a is None) == (b is None)
  return a == b
