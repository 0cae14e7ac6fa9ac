"""timm's files: its VisionTransformers of patches 16 and 14 (DeiT's
distilled ones: `dist_token`, `head_dist`; layer scale `ls1`, `ls2`;
registers `reg_token`; CLIP's `norm_pre` and projection head; SigLIP's
`attn_pool`), its plain ResNets (torchvision's names), its ConvNeXts, its
Swins and its RegNets."""

import json
import re

import numpy as np

from weights import records
from weights import state_dict_formats
from weights import timm_convnext
from weights import timm_regnet
from weights import timm_swin
from weights import torch_files
from weights import torch_resnet


# The metadata of this project's timm files (`export.py --format=timm`):
# timm's model name, and its `create_model` arguments as JSON.
MODEL_KEY = 'timm_model'
ARGS_KEY = 'timm_model_args'


def read_timm(path: str, target: dict) -> records.Weights:
  """timm's `model.safetensors` (or `.pth`) of a ResNet or a ViT with
  16 x 16 patches; also MAE's `.pth` files (timm's names, without the
  pretraining decoder), ConvNeXts (`timm_convnext`), Swins (`timm_swin`)
  and RegNets (`timm_regnet`)."""
  state_dict = torch_files.read_state_dict(path)
  detected = state_dict_formats.state_dict_format(state_dict)
  if detected == 'timm_swin':
    return timm_swin.from_state_dict(state_dict)
  if detected == 'timm':
    metadata = (torch_files.safetensors_header(path)[0]
                if path.endswith('.safetensors') else {})
    return _timm_vit(state_dict, target, metadata)
  if detected == 'timm_convnext':
    return timm_convnext.from_state_dict(state_dict)
  if detected == 'timm_regnet':
    return timm_regnet.from_state_dict(state_dict)
  return torch_resnet.from_state_dict(state_dict, 'a timm ResNet')


def _timm_vit(state_dict: dict, target: dict,
              metadata: dict) -> records.Weights:
  """timm's VisionTransformer names; q, k and v split into heads. Its head
  is the model's image projection when the model has one (CLIP's, which
  timm keeps as the head). The file's `metadata` may name its model
  (MODEL_KEY, ARGS_KEY)."""
  # (layers, width, heads, head_dim); one head when the model is no ViT,
  # which `fit` refuses with its own message.
  heads = target.get('encoder.layers.attention.query.kernel', (1,) * 4)[-2]
  head = 'projection' if 'projection.kernel' in target else 'head'
  arrays, unmatched = {}, []
  for key, value in state_dict.items():
    if key == 'mask_token' or key.startswith('decoder_'):
      continue  # MAE's pretraining decoder: fine-tuning drops it
    m = re.fullmatch(r'blocks\.(\d+)\.(.+)', key)
    if m:
      found = _block_arrays(m[2], value, heads)
      prefix = f'encoder.blocks.{m[1]}.'
    elif key.startswith('attn_pool.'):
      found = _map_head_arrays(key[len('attn_pool.'):], value, heads)
      prefix = 'map_head.'
    else:
      found = _top_arrays(key, value, head)
      prefix = ''
    if found is None:
      unmatched.append(key)
    else:
      arrays.update({prefix + name: array for name, array in found.items()})
  records.separate_class_token_position(arrays)
  norm_pre = 'pre_norm.scale' in arrays
  conventions = {
      'vit_pool': ('cls' if 'cls' in arrays else
                   'map' if 'map_head.probe' in arrays else 'gap'),
      'vit_posemb': 'learn', 'vit_pre_logits': False,
      'vit_distillation_token': 'dist' in arrays,
      'vit_layer_scale': 'encoder.blocks.0.attention_scale' in arrays,
      'vit_registers': arrays['registers'].shape[1]
                       if 'registers' in arrays else 0,
      'vit_norm_pre': norm_pre}
  activation, choices = _activation_and_norms(norm_pre, metadata)
  conventions.update(activation)
  # OpenAI's CLIP files (timm's `.openai`) keep CLIP's image projection as
  # the head, its bias timm's zeros; a fine-tuned CLIP's classifier has one.
  projection = (norm_pre and MODEL_KEY not in metadata and
                'head.bias' in arrays and not np.any(arrays['head.bias']))
  return records.Weights(arrays, 'a timm ViT', 'vit', conventions, unmatched,
                         choices=choices,
                         head_is="CLIP's image projection" if projection
                         else '')


# timm's `act_layer` names of this project's `vit_gelu`s (None: its default).
_ACT_LAYERS = {None: 'exact', 'gelu_tanh': 'tanh', 'quick_gelu': 'quick'}


def _activation_and_norms(norm_pre: bool, metadata: dict
                          ) -> tuple[dict, dict]:
  """(conventions, choices: see `records.Weights`) of a ViT file's GELU and
  LayerNorm epsilon. A file that names its timm model (this project's
  exports) has the GELU of its `act_layer` or name, the epsilon of its
  name: CLIP's 1e-5, the others' 1e-6. Otherwise a norm before the
  encoder is CLIP's, epsilon 1e-5, whose files timm computes with exact
  GELU (`_clip_` names) and OpenAI's quick GELU (`_clip_quickgelu_`) alike;
  the other ViTs have exact GELU and 1e-6."""
  if MODEL_KEY in metadata:
    name = metadata[MODEL_KEY]
    act_layer = json.loads(metadata.get(ARGS_KEY, '{}')).get(
        'act_layer', 'quick_gelu' if '_quickgelu_' in name else None)
    return {'vit_gelu': _ACT_LAYERS[act_layer],
            'vit_norm_eps': 1e-5 if '_clip_' in name else 1e-6}, {}
  if norm_pre:
    return {'vit_norm_eps': 1e-5}, {'vit_gelu': ('quick', 'exact')}
  return {'vit_gelu': 'exact', 'vit_norm_eps': 1e-6}, {}


_BLOCK_LAYERS = {'norm1': 'ln1', 'norm2': 'ln2', 'mlp.fc1': 'mlp_in',
                 'mlp.fc2': 'mlp_out'}
_NORM = {'weight': 'scale', 'bias': 'bias'}
_LAYER_SCALES = {'ls1': 'attention_scale', 'ls2': 'mlp_scale'}


def _block_arrays(name: str, value: np.ndarray, heads: int) -> dict | None:
  """{name in the block: array} of one block's parameter `name` (timm's,
  after `blocks.N.`), None when no rule maps it."""
  layer, _, kind = name.rpartition('.')
  if kind == 'gamma' and layer in _LAYER_SCALES:  # layer scale
    return {_LAYER_SCALES[layer]: value}
  if layer in ('norm1', 'norm2'):
    return {f'{_BLOCK_LAYERS[layer]}.{_NORM[kind]}': value}
  if layer in _BLOCK_LAYERS:
    return _linear(_BLOCK_LAYERS[layer], kind, value)
  if layer == 'attn.qkv':
    return _attention_inputs(('query', 'key', 'value'), kind, value, heads)
  if layer == 'attn.proj':
    return _attention_out(kind, value, heads)
  return None


def _map_head_arrays(name: str, value: np.ndarray, heads: int
                     ) -> dict | None:
  """The MAP head's arrays of timm's `AttentionPoolLatent` parameter `name`
  (after `attn_pool.`)."""
  if name == 'latent':
    return {'probe': value}
  layer, _, kind = name.rpartition('.')
  if layer == 'q':
    return _attention_inputs(('query',), kind, value, heads)
  if layer == 'kv':
    return _attention_inputs(('key', 'value'), kind, value, heads)
  if layer == 'proj':
    return _attention_out(kind, value, heads)
  if layer == 'norm':
    return {f'norm.{_NORM[kind]}': value}
  if layer in ('mlp.fc1', 'mlp.fc2'):
    return _linear(_BLOCK_LAYERS[layer], kind, value)
  return None


def _top_arrays(key: str, value: np.ndarray, head: str) -> dict | None:
  """The arrays of timm's parameter `key` outside the blocks and the
  attention pool; the head's under `head`."""
  tokens = {'cls_token': 'cls', 'dist_token': 'dist',  # DeiT's distilled
            'reg_token': 'registers', 'pos_embed': records.POSEMB}
  if key in tokens:
    return {tokens[key]: value}
  if key == 'patch_embed.proj.weight':
    return {'patch_embed.kernel': records.conv_kernel(value)}
  if key == 'patch_embed.proj.bias':
    return {'patch_embed.bias': value}
  m = re.fullmatch(r'(norm|norm_pre)\.(weight|bias)', key)
  if m:
    norm = 'encoder_norm' if m[1] == 'norm' else 'pre_norm'
    return {f'{norm}.{_NORM[m[2]]}': value}
  m = re.fullmatch(r'(head|head_dist)\.(weight|bias)', key)
  if m:
    return _linear(head if m[1] == 'head' else m[1], m[2], value)
  return None


def _linear(layer: str, kind: str, value: np.ndarray) -> dict:
  """PyTorch's Linear `weight` (outputs x inputs) or `bias` as Flax's."""
  return {f'{layer}.{records.param_name(kind)}':
          value.T if kind == 'weight' else value}


def _attention_inputs(names: tuple, kind: str, value: np.ndarray,
                      heads: int) -> dict:
  """timm's fused input projections (len(names) x width outputs, head-major
  within each) as nnx.MultiHeadAttention kernels (width, heads, head_dim)
  or biases."""
  if value.ndim == 2:  # outputs x inputs
    parts = value.reshape(len(names), heads, -1, value.shape[1]).transpose(
        0, 3, 1, 2)
  else:
    parts = value.reshape(len(names), heads, -1)
  return {f'attention.{name}.{records.param_name(kind)}': part
          for name, part in zip(names, parts)}


def _attention_out(kind: str, value: np.ndarray, heads: int) -> dict:
  """timm's attention output projection as nnx.MultiHeadAttention's `out`
  (heads, head_dim, width)."""
  if kind == 'weight':
    return {'attention.out.kernel': value.T.reshape(heads, -1,
                                                    value.shape[0])}
  return {'attention.out.bias': value}


# The writer's tables: the reader's, read the other way.
_BLOCK_NAMES = records.inverse(_BLOCK_LAYERS)
_NORM_KINDS = records.inverse(_NORM)
_LAYER_SCALE_NAMES = records.inverse(_LAYER_SCALES)
_ATTENTION_INPUTS = ('query', 'key', 'value')


def to_state_dict(arrays: dict, no_embed_class: bool = False) -> dict:
  """timm's state dict of a ViT's arrays in this project's names, one entry
  per block (`fitting.unstacked_layout`): the inverse of `_timm_vit`. The
  tokens keep their own positions folded in; unless `no_embed_class`
  (timm's position embedding of the grid alone), `pos_embed` gets a zero
  entry per token before the grid's."""
  arrays = dict(arrays)
  if not no_embed_class:
    records.join_class_token_position(arrays)
  tokens = {'cls': 'cls_token', 'dist': 'dist_token',
            'registers': 'reg_token', records.POSEMB: 'pos_embed'}
  norms = {'encoder_norm': 'norm', 'pre_norm': 'norm_pre'}
  state_dict, fused = {}, {}
  for name, value in arrays.items():
    layer, _, kind = name.rpartition('.')
    block = re.fullmatch(r'encoder\.(blocks\.\d+)', layer)
    inner = re.fullmatch(r'encoder\.(blocks\.\d+)\.(.+)|map_head\.(.+)',
                         layer)
    if name in tokens:
      state_dict[tokens[name]] = value
    elif name == 'map_head.probe':
      state_dict['attn_pool.latent'] = value
    elif layer in norms:
      state_dict[f'{norms[layer]}.{_NORM_KINDS[kind]}'] = value
    elif block:  # a layer scale
      state_dict[f'{block[1]}.{_LAYER_SCALE_NAMES[kind]}.gamma'] = value
    elif inner:
      _inner_arrays(inner[1] or 'attn_pool', inner[2] or inner[3], kind,
                    value, state_dict, fused)
    else:  # patch_embed, head, head_dist
      state_dict[f'{layer}.proj.{records.torch_kind(kind)}'
                 if layer == 'patch_embed' else
                 f'{layer}.{records.torch_kind(kind)}'] = (
                     records.torch_weight(value) if kind == 'kernel'
                     else value)
  for key, parts in fused.items():
    state_dict[key] = _fused_inputs([parts[part] for part in sorted(
        parts, key=_ATTENTION_INPUTS.index)])
  return state_dict


def _inner_arrays(prefix: str, layer: str, kind: str, value: np.ndarray,
                  state_dict: dict, fused: dict) -> None:
  """Writes the array `kind` of `layer` in a block or the MAP head (timm's
  `prefix`: `blocks.N`, `attn_pool`) into `state_dict`, or, for an
  attention input, into `fused` {timm's fused name: {input: array}}."""
  torch_kind = records.torch_kind(kind)
  in_block = prefix != 'attn_pool'
  group, _, part = layer.partition('.')
  if group == 'attention' and part in _ATTENTION_INPUTS:
    name = 'attn.qkv' if in_block else 'q' if part == 'query' else 'kv'
    fused.setdefault(f'{prefix}.{name}.{torch_kind}', {})[part] = value
  elif layer == 'attention.out':
    name = 'attn.proj' if in_block else 'proj'
    state_dict[f'{prefix}.{name}.{torch_kind}'] = (
        value.reshape(-1, value.shape[-1]).T if kind == 'kernel' else value)
  elif layer in ('ln1', 'ln2', 'norm'):
    name = _BLOCK_NAMES[layer] if in_block else layer
    state_dict[f'{prefix}.{name}.{_NORM_KINDS[kind]}'] = value
  else:  # mlp_in, mlp_out
    state_dict[f'{prefix}.{_BLOCK_NAMES[layer]}.{torch_kind}'] = (
        value.T if kind == 'kernel' else value)


def _fused_inputs(parts: list) -> np.ndarray:
  """The inverse of `_attention_inputs`: the kernels (width, heads,
  head_dim) or biases (heads, head_dim) of query, key and value (or of
  some of them) as timm's fused array (len(parts) x width outputs,
  head-major within each)."""
  stacked = np.stack(parts)
  if stacked.ndim == 4:  # (inputs, width, heads, head_dim)
    return stacked.transpose(0, 2, 3, 1).reshape(-1, stacked.shape[1])
  return stacked.reshape(-1)
