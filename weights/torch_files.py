"""PyTorch state dicts on disk: pickles (`.pth`, read by PyTorch when it is
installed) and `.safetensors` files, their header alone or all arrays.

PyTorch and safetensors are imported only when a file of theirs is read.
"""

from weights import records

TORCH_SUFFIXES = ('.pth', '.pt', '.bin')


def read_state_dict(path: str) -> dict:
  """{key: float32 array} of a PyTorch state dict in `.safetensors`, or
  in a pickle (`.pth`) read by PyTorch when it is installed."""
  if path.endswith('.safetensors'):
    return read_safetensors(path)[1]
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f'reading {path!r} needs PyTorch (pip install torch); '
                     'or pass the .safetensors file of the same weights'
                     ) from None
  try:
    state_dict = torch.load(path, map_location='cpu', weights_only=True)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'cannot read init_from {path!r} with torch.load: '
                     f'{records.first_line(e)}') from None
  if isinstance(state_dict, dict) and isinstance(state_dict.get('model'),
                                                dict):
    # MAE's and DeiT's released files: {'model': state dict}.
    state_dict = state_dict['model']
  if not isinstance(state_dict, dict) or not all(
      isinstance(value, torch.Tensor) for value in state_dict.values()):
    raise ValueError(f'init_from {path!r} is not a state dict of tensors; '
                     'save model.state_dict() alone')
  return {key: value.float().numpy() for key, value in state_dict.items()}


def read_safetensors(path: str) -> tuple[dict, dict]:
  """(metadata, {key: float32 array}) of a `.safetensors` file."""
  import safetensors  # pylint: disable=g-import-not-at-top
  try:
    # NumPy arrays (bfloat16 as ml_dtypes'): the flax framework makes a
    # JAX array of each, compiling a copy program per shape.
    with safetensors.safe_open(path, framework='numpy') as f:
      return (f.metadata() or {},
              {key: records.float32(f.get_tensor(key)) for key in f.keys()})
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'cannot read init_from {path!r} as safetensors: '
                     f'{records.first_line(e)}') from None


def safetensors_header(path: str) -> tuple[dict, set]:
  import safetensors  # pylint: disable=g-import-not-at-top
  try:
    with safetensors.safe_open(path, framework='numpy') as f:
      return f.metadata() or {}, set(f.keys())
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'cannot read init_from {path!r} as safetensors: '
                     f'{records.first_line(e)}') from None
