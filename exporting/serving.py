"""`export.py --format=serving`: a trained model as programs that classify
images without this project, its evaluation preprocessing inside. The
output is a new directory:

    DIR/saved_model/       TensorFlow SavedModel, signature serving_default:
                           images (string [batch]: JPEG, PNG, BMP, GIF or
                           WebP files' bytes) -> classes (string [batch,
                           k]), indices (int32 [batch, k]), probabilities
                           (float32 [batch, k]), most probable first
    DIR/model.jax_exported a serialized `jax.export.Exported`: uint8
                           [batch, S, S, channels] images -> (indices,
                           probabilities) as above
    DIR/labels.json        the class names, index by index
    DIR/serving.json       this contract: S, k, the preprocessing, the step

k is 5 (fewer classes: all of them). The SavedModel decodes, crops,
resizes and normalises each image with the functions of the evaluation
pipeline (`image_preprocessing.eval_image`), so it answers as predict.py
does. `model.jax_exported` cannot decode: it takes images of side S, the
smallest whose central evaluation crop is the model's image size (256 for
224: an image resized so and centre-cropped square), and crops and
normalises them as that preprocessing does. Both hold the model as jax2tf
and jax.export serialize it (StableHLO, batch size symbolic) for CPU, GPU
and TPU.
"""

import dataclasses
import json
import logging
import math
import os
import shutil
import uuid

import jax
from jax.experimental import jax2tf
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from data import datasets
from data import image_preprocessing
from input_pipeline import EVAL_CROP_FRACTION
from input_pipeline import Preprocessing
from runtime import paths
from training import run_state

SAVED_MODEL = 'saved_model'
JAX_EXPORTED = 'model.jax_exported'
LABELS = 'labels.json'
CONTRACT = 'serving.json'
SIGNATURE = 'serving_default'
FORMAT_VERSION = 1
TOP_K = 5
PLATFORMS = ('cpu', 'cuda', 'tpu')
# The evaluation resizes that leave an image of the target size as it is
# (measured in TensorFlow: within 3e-5 of 255), so that
# `model.jax_exported`, whose crop is that size, need not resize.
SAME_SIZE_KEPT = ('bilinear', 'bicubic', 'area', 'lanczos3', 'lanczos5',
                  'nearest')


@dataclasses.dataclass(frozen=True)
class Exportable:
  """What a serving export is made of: a trained model (`nnx.split`), how
  its evaluation sees images, and its classes."""
  graphdef: object
  state: object
  preprocessing: Preprocessing
  channels: int
  dtype: object  # the compute dtype, as predict.py casts images to it
  class_names: tuple
  model: str
  step: int

  @property
  def top_k(self) -> int:
    return min(TOP_K, len(self.class_names))


def problem(config) -> str | None:
  """Why the run of `config` cannot be exported for serving; None when it
  can."""
  if config.dataset in (datasets.DIGITS, datasets.DIGITS_0TO4):
    return ("the digits' evaluation preprocessing (datasets.digit_image) runs "
            'in Pillow, not in TensorFlow')
  if config.eval_resize_method not in SAME_SIZE_KEPT:
    return (f'eval_resize_method={config.eval_resize_method!r} changes even '
            f'an image of the model\'s size, which {JAX_EXPORTED} takes as '
            f'it is (kept by {", ".join(SAME_SIZE_KEPT)})')
  return None


def output_problem(output: str, overwrite: bool = False) -> str | None:
  """What is wrong with `output` as the directory to write (with
  `overwrite`, an existing serving export may be replaced); None when
  nothing is."""
  if paths.is_remote(output):
    return ('--format=serving writes a local directory; write it here and '
            'copy it (gcloud storage cp -r DIR gs://...)')
  if output.endswith('.safetensors'):
    return '--format=serving writes a directory: name a new DIR'
  if os.path.lexists(output):
    if not overwrite:
      return 'exists; pass --overwrite to replace it, or name a new directory'
    # Never a directory of anything else: --overwrite deletes what it
    # replaces.
    if not os.path.isfile(os.path.join(output, CONTRACT)):
      return (f'exists and is not a serving export (no {CONTRACT}); '
              '--overwrite replaces only an export: name a new directory')
  parent = os.path.dirname(os.path.abspath(output))
  if not os.path.isdir(parent):
    return f'directory {parent} does not exist; create it or choose another'
  if not os.access(parent, os.W_OK | os.X_OK):
    return f'directory {parent} is not writable; choose another --output'
  return None


def input_size(image_size: int) -> int:
  """S, the side of `model.jax_exported`'s images: the smallest whose
  central evaluation crop is `image_size` pixels (256 for 224), so that
  the crop is resized by nothing."""
  return math.ceil(image_size / EVAL_CROP_FRACTION)


def top_classes(graphdef, state, images, top_k: int):
  """(indices int32 [batch, top_k], probabilities float32) of the most
  probable classes of `images`, most probable first, ties by lower index
  (as predict.py's stable sort)."""
  probabilities = jax.nn.softmax(run_state.eval_logits(graphdef, state,
                                                       images))
  # A stable sort rather than lax.top_k, whose StableHLO (a composite op)
  # is newer than what TensorFlow's XlaCallModule reads.
  order = jnp.argsort(-probabilities, axis=-1, stable=True)[:, :top_k]
  return (order.astype(jnp.int32),
          jnp.take_along_axis(probabilities, order, -1).astype(jnp.float32))


def classify_pixels(exportable: Exportable, pixels):
  """`top_classes` of uint8 images [batch, S, S, channels]: their central
  evaluation crop, normalised, in the compute dtype."""
  side = exportable.preprocessing.image_size
  start = (input_size(side) - side + 1) // 2  # as `_central_window`
  scale, offset = image_preprocessing.normalization_scale_and_offset(
      exportable.channels, exportable.preprocessing.normalization)
  # Each of the 256 values of each channel normalised here, by two
  # roundings as TensorFlow's ops make them: a compiler fusing x * scale
  # + offset into one rounding changes some pixels by an ulp, and a
  # half-precision cast magnifies it.
  table = jnp.asarray(np.arange(256, dtype=np.float32)[:, None] * scale +
                      offset)
  crop = pixels[:, start:start + side, start:start + side]
  images = table[crop.astype(jnp.int32), jnp.arange(exportable.channels)
                 ].astype(exportable.dtype)
  return top_classes(exportable.graphdef, exportable.state, images,
                     exportable.top_k)


def write(output: str, exportable: Exportable) -> None:
  """Writes the serving export of `exportable` to the directory `output`
  (`output_problem` is None), replacing an export there: in a temporary
  directory beside it, renamed when complete, so that nothing partial is
  left."""
  target = os.path.abspath(output)
  temporary = os.path.join(os.path.dirname(target),
                           f'.{os.path.basename(target)}-{uuid.uuid4().hex}')
  os.mkdir(temporary)
  try:
    _write_jax_exported(os.path.join(temporary, JAX_EXPORTED), exportable)
    _write_saved_model(os.path.join(temporary, SAVED_MODEL), exportable)
    with open(os.path.join(temporary, LABELS), 'w') as f:
      json.dump(list(exportable.class_names), f, indent=1)
    with open(os.path.join(temporary, CONTRACT), 'w') as f:
      json.dump(_contract(exportable), f, indent=1)
    replaced = None
    if os.path.lexists(target):
      replaced = f'{temporary}-replaced'
      os.rename(target, replaced)
    os.rename(temporary, target)
    if replaced:
      shutil.rmtree(replaced)
  except BaseException:
    shutil.rmtree(temporary, ignore_errors=True)
    raise


def _contract(exportable: Exportable) -> dict:
  size, channels = input_size(exportable.preprocessing.image_size), (
      exportable.channels)
  return {
      'format': 'serving', 'version': FORMAT_VERSION,
      'model': exportable.model, 'step': exportable.step,
      'num_classes': len(exportable.class_names), 'top_k': exportable.top_k,
      'saved_model': {'directory': SAVED_MODEL, 'signature': SIGNATURE,
                      'inputs': {'images': 'string [batch]'},
                      'outputs': {'classes': 'string [batch, top_k]',
                                  'indices': 'int32 [batch, top_k]',
                                  'probabilities': 'float32 [batch, top_k]'}},
      'jax_exported': {'file': JAX_EXPORTED,
                       'input': f'uint8 [batch, {size}, {size}, {channels}]',
                       'outputs': ['indices int32 [batch, top_k]',
                                   'probabilities float32 [batch, top_k]']},
      'preprocessing': dataclasses.asdict(exportable.preprocessing),
      'channels': channels,
      'compute_dtype': np.dtype(exportable.dtype).name,
      'platforms': list(PLATFORMS),
  }


def _write_jax_exported(file: str, exportable: Exportable) -> None:
  """The uint8 program, its weights inside, batch size symbolic."""
  size = input_size(exportable.preprocessing.image_size)
  shape = jax.export.symbolic_shape(
      f'batch, {size}, {size}, {exportable.channels}')
  def classify(pixels):
    # The weights as constants of this trace (NNX refuses a model whose
    # variables were made outside it).
    state = jax.tree.map(jnp.asarray, exportable.state)
    return classify_pixels(dataclasses.replace(exportable, state=state),
                           pixels)
  exported = jax.export.export(jax.jit(classify), platforms=PLATFORMS)(
      jax.ShapeDtypeStruct(shape, jnp.uint8))
  with open(file, 'wb') as f:
    f.write(exported.serialize())


def _write_saved_model(directory: str, exportable: Exportable) -> None:
  """The SavedModel: the evaluation preprocessing's TensorFlow ops, then
  the model converted by jax2tf (native serialization: its StableHLO in
  one XlaCallModule op), its weights as variables."""
  side, channels = exportable.preprocessing.image_size, exportable.channels
  leaves, treedef = jax.tree.flatten(exportable.state)
  classify = jax2tf.convert(
      lambda leaves, images: top_classes(
          exportable.graphdef, jax.tree.unflatten(treedef, leaves), images,
          exportable.top_k),
      polymorphic_shapes=[None, f'(batch, {side}, {side}, {channels})'],
      with_gradient=False, native_serialization_platforms=PLATFORMS)
  module = tf.Module()
  # Variables, not constants: a graph over 2 GB cannot be saved.
  module.arrays = [tf.Variable(np.asarray(leaf), trainable=False)
                   for leaf in leaves]
  names = tf.constant(list(exportable.class_names))
  dtype = tf.dtypes.as_dtype(np.dtype(exportable.dtype))

  def image(data):
    return tf.cast(image_preprocessing.eval_image(
        data, exportable.preprocessing, image_preprocessing.ANY, channels),
                   dtype)

  # The preprocessing's own graph, as written (no AutoGraph rewriting).
  @tf.function(input_signature=[tf.TensorSpec([None], tf.string,
                                              name='images')],
               autograph=False)
  def serve(images):
    pixels = tf.ensure_shape(
        tf.map_fn(image, images, fn_output_signature=dtype),
        [None, side, side, channels])
    indices, probabilities = classify(module.arrays, pixels)
    return {'classes': tf.gather(names, indices), 'indices': indices,
            'probabilities': probabilities}

  module.serve = serve
  # TensorFlow's save silences absl's logger, then sets it back to a level
  # of its own (WARNING): the process's INFO lines would be lost after it.
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  try:
    tf.saved_model.save(module, directory, signatures={SIGNATURE: serve})
  finally:
    absl_logger.setLevel(level)


def load(directory: str):
  """(classify, class names) of the serving export in `directory`:
  `classify(image paths)` gives their (indices, probabilities), as numpy
  arrays [len(paths), top_k], from its SavedModel."""
  contract = os.path.join(directory, CONTRACT)
  if not os.path.isfile(contract):
    raise ValueError(f'--model={directory!r} is not a serving export (no '
                     f'{CONTRACT}); write one with export.py --format=serving')
  with open(contract) as f:
    version = json.load(f).get('version')
  if version != FORMAT_VERSION:
    raise ValueError(f'--model={directory!r} is a serving export of version '
                     f'{version}, this project reads {FORMAT_VERSION}; export '
                     'it again with this version of export.py')
  with open(os.path.join(directory, LABELS)) as f:
    names = json.load(f)
  signature = tf.saved_model.load(
      os.path.join(directory, SAVED_MODEL)).signatures[SIGNATURE]

  def run(files: list[bytes]):
    outputs = signature(images=tf.constant(files))
    return outputs['indices'].numpy(), outputs['probabilities'].numpy()

  def classify(image_paths: list[str]):
    files = []
    for path in image_paths:
      if not os.path.isfile(path):
        raise ValueError(f'image {path!r} not found')
      with open(path, 'rb') as f:
        files.append(f.read())
    try:
      return run(files)
    except tf.errors.OpError:
      for path, data in zip(image_paths, files):  # which one, and why
        try:
          run([data])
        except tf.errors.OpError as e:
          if not image_preprocessing.decodes(data):
            raise ValueError(f'image {path!r}: '
                             f'{image_preprocessing.undecodable(e)}') from None
          # The image decodes: the model's program is what failed.
          reason = image_preprocessing.error_reason(e)
          fix = ('; a jax newer than this TensorFlow reads exported it: '
                 'serve it with a newer TensorFlow, or export it with an '
                 'older jax') if 'deserialize' in reason else ''
          raise ValueError(
              f'--model={directory!r} fails in TensorFlow {tf.__version__} '
              f'on {path!r}, an image it decodes: {reason}{fix}') from None
      raise
  return classify, names
