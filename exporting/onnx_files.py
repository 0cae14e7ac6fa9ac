"""`export.py --format=onnx`: a trained model's eval-mode forward pass as
one ONNX file, its weights inside, for any batch size:

    onnx_model = onnxruntime.InferenceSession(F)
    logits, = onnx_model.run(None, {'images': x})  # x: (N, H, W, C) float32

`x` is what the model takes: images normalised as the run's eval pipeline
normalises them (docs/pretrained.md). The model computes in float32 (the
run's `half_precision` aside), every stack unrolled, as the FLOPs counter
builds it (`eval_forward`). jax2onnx converts the JAX program that forward
traces to, primitive by primitive, so the file computes what XLA compiles;
jax2onnx's own stand-ins for Flax's layers, which it swaps in while it
traces a function itself, are never used (they read a BatchNorm's mode
from the layer, not from the call's `train`).
"""

import logging

from flax import nnx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax2onnx
import numpy as np
from onnx import helper
from onnx import numpy_helper

from layers import stacked
import models
from weights import fitting

INPUT_NAME = 'images'
OUTPUT_NAME = 'logits'
BATCH = 'batch'  # the name of the input's and output's first dimension
# ONNX's opset of the file: the newest ONNX Runtime 1.20 (late 2024) runs.
OPSET = 21
# A protobuf message, and so an ONNX file with its weights inside, holds
# less than 2 GiB.
MAX_BYTES = 2**31 - 2**24


def problem(config, arrays: dict) -> str | None:
  """Why the model `config` trained, of the parameters and statistics
  `arrays` (`pretrained.trained_arrays`), cannot be written as one ONNX
  file; None when it can."""
  num_parameters = sum(array.size for array in arrays.values())
  if 4 * num_parameters > MAX_BYTES:
    return (f'{config.model} has {num_parameters:,} float32 parameters and '
            'statistics, over the 2 GiB an ONNX file holds inside')
  return None


def eval_forward(config, model: nnx.Module, unrolled: bool = True):
  """`(forward, variables)`: the trained `model` of `config` in eval mode as
  a pure function `forward(variables, images) -> logits` of its parameters
  and statistics, computing in float32 whatever the run's precision
  settings, with every stack a Python loop when `unrolled` (the parameters
  keep their stacked layout)."""
  _, params, rest = nnx.split(model, nnx.Param, ...)
  num_classes, in_channels = _classes_and_channels(params)
  float32 = nnx.eval_shape(lambda: models.create_model(
      config.model, num_classes, in_channels, dtype=jnp.float32,
      rngs=nnx.Rngs(0), **models.options(config)))
  if unrolled:
    stacked.unroll_for_counting(float32)
  graphdef = nnx.graphdef(float32)

  def forward(variables, images):
    return nnx.merge(graphdef, *variables)(images, train=False)
  return forward, (params, rest)


def _classes_and_channels(params) -> tuple[int, int]:
  """The number of classes and of image channels of a model's
  parameters."""
  shapes = fitting.model_shapes(params)
  return shapes['head.bias'][0], fitting.image_channels(shapes)


def onnx_file(config, model: nnx.Module, metadata: dict[str, str]) -> bytes:
  """The ONNX file of the trained `model` of `config` (`problem` is None):
  input INPUT_NAME (batch, image_size, image_size, channels) float32, output
  OUTPUT_NAME (batch, classes) float32, with `metadata`."""
  forward, variables = eval_forward(config, model)
  batch, = jax.export.symbolic_shape(BATCH)
  images = jax.ShapeDtypeStruct(
      (batch, config.image_size, config.image_size,
       _classes_and_channels(variables[0])[1]), jnp.float32)
  # Traced here, where Flax's layers are Flax's own; the weights enter as
  # arguments (nnx refuses variables made outside the trace) and become
  # the file's initializers below.
  program = jax.extend.core.jaxpr_as_fun(
      jax.make_jaxpr(forward)(variables, images))
  weights = jax.tree.leaves(variables)
  # jax2onnx loads a plugin for each framework it knows, and warns with a
  # traceback for each one not installed (Equinox, dm-pix), used or not.
  logging.getLogger('jax2onnx.plugins.plugin_system').setLevel(logging.ERROR)
  # onnx_ir, writing the file, warns once for each intermediate value whose
  # shape jax2onnx recorded without a type (dozens for a 2-block ViT), and
  # leaves that optional shape out; the graph's inputs, outputs and
  # weights keep theirs.
  logging.getLogger('onnx_ir.serde').setLevel(logging.ERROR)
  converted = jax2onnx.to_onnx(
      lambda x: program(*weights, x)[0], [images], model_name=config.model,
      opset=OPSET, input_names=[INPUT_NAME], output_names=[OUTPUT_NAME])
  _pool_over_height_and_width(converted.graph)
  helper.set_model_props(converted, metadata)
  return converted.SerializeToString()


def _pool_over_height_and_width(graph) -> None:
  """Each MaxPool over (N, H, W, C), as jax2onnx writes a max pool of
  NHWC maps (an N-D pool with a window of 1 over N and C, which ONNX
  Runtime does not run), becomes the same 2-D pool on NCHW maps."""
  nodes = []
  for node in graph.node:
    attributes = {a.name: helper.get_attribute_value(a)
                  for a in node.attribute}
    kernel = list(attributes.get('kernel_shape', ()))
    if node.op_type != 'MaxPool' or len(kernel) != 4:
      nodes.append(node)
      continue
    strides = list(attributes.get('strides', [1] * 4))
    pads = list(attributes.get('pads', [0] * 8))
    dilations = list(attributes.get('dilations', [1] * 4))
    if (kernel[0] != 1 or kernel[3] != 1 or strides[0] != 1 or
        strides[3] != 1 or any(pads[i] for i in (0, 3, 4, 7)) or
        any(d != 1 for d in dilations)):
      raise ValueError(f'a max pool of window {kernel}, strides {strides} '
                       'pools over more than height and width')
    name = node.name
    axes = name + '_outer_axes'
    graph.initializer.append(numpy_helper.from_array(
        np.array([0, 1], np.int64), axes))
    nodes += [
        helper.make_node('Squeeze', [node.input[0], axes], [name + '_nhwc']),
        helper.make_node('Transpose', [name + '_nhwc'], [name + '_nchw'],
                         perm=[0, 3, 1, 2]),
        helper.make_node('MaxPool', [name + '_nchw'], [name + '_pooled'],
                         name=name, kernel_shape=kernel[1:3],
                         strides=strides[1:3],
                         pads=[pads[1], pads[2], pads[5], pads[6]]),
        helper.make_node('Transpose', [name + '_pooled'],
                         [name + '_pooled_nhwc'], perm=[0, 2, 3, 1]),
        helper.make_node('Unsqueeze', [name + '_pooled_nhwc', axes],
                         [node.output[0]])]
  del graph.node[:]
  graph.node.extend(nodes)
