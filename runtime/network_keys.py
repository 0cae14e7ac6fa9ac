"""Which config keys define the network, by model family ('resnet',
'vit', 'convnext', 'swin', 'regnet': `models.family`).

- ARRAY_KEYS define the network's arrays: another value makes arrays of
  other shapes, or other arrays.
- COMPUTE_KEYS define what the network computes from the same arrays:
  another value leaves every shape as it is and changes every output.
- STATE_KEYS define the train state's arrays beyond what the model's
  keys say: the head's (the data set's classes) and the optimizer's.

Any other key only defines training (data, schedule, regularisation,
initial values) or how the same network runs (precision, rematerialisation,
scans). A resume that changes a key of the three is refused
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
COMPUTE_KEYS = {
    'resnet': ('resnet_padding',),
    'vit': ('vit_gelu', 'vit_norm_eps'),
    'convnext': (), 'swin': (), 'regnet': (),
}
STATE_KEYS = ('dataset', 'optimizer')


def network_keys(family: str) -> tuple[str, ...]:
  """The keys that define a network of `family`: its arrays and what it
  computes."""
  return (*ARRAY_KEYS[family], *COMPUTE_KEYS[family])
