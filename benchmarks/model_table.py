"""Every model name with its parameters and forward FLOPs, as a table.

  python benchmarks/model_table.py

For each name of `models.MODEL_NAMES` at 1000 classes and 224x224 RGB
images (the small default model at its default config: 8x8 one-channel
digits, 10 classes): parameters counted on the abstract model
(`nnx.eval_shape`, nothing allocated), forward GFLOPs per image as XLA's
cost analysis counts them with every layer of every scanned stack counted
(`training/flop_count.py`; lowered only, nothing runs), and the published
figures of the weights the model reads: parameters in millions and
multiply-adds (GMACs; XLA counts two FLOPs per multiply-add). Models whose
published figures are for another image size get a second row at that
size (AT_PUBLISHED_SIZE).
"""

import os
import sys

from absl import app
from absl import flags
from flax import nnx
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top,g-bad-import-order
from configs import default
import models
from runtime import console
from training import flop_count
# pylint: enable=g-import-not-at-top,g-bad-import-order

FLAGS = flags.FLAGS

# name: (its shape in a few words, the published weights of that shape,
# their parameters in millions, their GMACs at 224 px). The published
# figures are those of timm's model cards (huggingface.co/timm/<name>) and
# the papers' tables: ResNet-50 4.1 GMACs as torchvision and timm count it,
# DeiT's Table 1 for the ViTs' GMACs (its ViT-S/16 4.6; timm's cards count
# 4.3 without the attention products), ConvNeXt's, ConvNeXt V2's and Swin's
# Table 1, RegNet's (Radosavovic et al.) Table for RegNetY. None: no
# published figure to compare with.
PUBLISHED = {
    'ResNet18': ('basic blocks 2-2-2-2, widths 64-512', 'resnet18', 11.7, 1.8),
    'ResNet34': ('basic blocks 3-4-6-3, widths 64-512', 'resnet34', 21.8, 3.7),
    'ResNet50': ('bottlenecks 3-4-6-3, widths 256-2048', 'resnet50', 25.6,
                 4.1),
    'ResNet101': ('bottlenecks 3-4-23-3, widths 256-2048', 'resnet101', 44.5,
                  7.8),
    'ResNet152': ('bottlenecks 3-8-36-3, widths 256-2048', 'resnet152', 60.2,
                  11.6),
    'ResNet200': ('bottlenecks 3-24-36-3, widths 256-2048', 'resnet200', None,
                  None),
    'ViT_Ti16': ('12 blocks, width 192, 3 heads, MLP 768',
                 'vit_tiny_patch16_224', 5.7, 1.3),
    'ViT_S16': ('12 blocks, width 384, 6 heads, MLP 1536',
                'vit_small_patch16_224', 22.1, 4.6),
    'ViT_B16': ('12 blocks, width 768, 12 heads, MLP 3072',
                'vit_base_patch16_224', 86.6, 17.6),
    'ViT_L16': ('24 blocks, width 1024, 16 heads, MLP 4096',
                'vit_large_patch16_224', 304.3, None),
    models.SMALL_RESNET: ('3x3 stem, 1 + 8 basic blocks, width 32',
                          None, None, None),
    'ConvNeXt_Atto': ('2-2-6-2, widths 40-320', 'convnext_atto', 3.7, 0.6),
    'ConvNeXt_T': ('3-3-9-3, widths 96-768', 'convnext_tiny', 28.6, 4.5),
    'ConvNeXt_S': ('3-3-27-3, widths 96-768', 'convnext_small', 50.2, 8.7),
    'ConvNeXt_B': ('3-3-27-3, widths 128-1024', 'convnext_base', 88.6, 15.4),
    'ConvNeXt_L': ('3-3-27-3, widths 192-1536', 'convnext_large', 197.8,
                   34.4),
    'ConvNeXtV2_Atto': ('2-2-6-2, widths 40-320, GRN', 'convnextv2_atto',
                        3.7, 0.6),
    'ConvNeXtV2_T': ('3-3-9-3, widths 96-768, GRN', 'convnextv2_tiny', 28.6,
                     4.47),
    'ConvNeXtV2_B': ('3-3-27-3, widths 128-1024, GRN', 'convnextv2_base',
                     88.7, 15.4),
    'Swin_T': ('2-2-6-2, widths 96-768, heads 3-24',
               'swin_tiny_patch4_window7_224', 28.3, 4.5),
    'Swin_S': ('2-2-18-2, widths 96-768, heads 3-24',
               'swin_small_patch4_window7_224', 49.6, 8.7),
    'Swin_B': ('2-2-18-2, widths 128-1024, heads 4-32',
               'swin_base_patch4_window7_224', 87.8, 15.4),
    'RegNetY_200MF': ('13 blocks in 4 stages, widths 24-368, SE',
                      'regnety_002', 3.2, 0.2),
    'RegNetY_4GF': ('22 blocks in 4 stages, widths 128-1088, SE',
                    'regnety_040', 20.6, 4.0),
    'RegNetY_16GF': ('18 blocks in 4 stages, widths 224-3024, SE',
                     'regnety_160', 83.6, 16.0),
    # Patch 14. DINOv2's figures are at 518 px (AT_PUBLISHED_SIZE); CLIP's
    # ViT-L/14 at 224 from timm's inference benchmark
    # (results/benchmark-infer-amp-nchw-pt240-cu124-rtx3090.csv, columns
    # param_count and infer_gmacs, unchanged in its later runs; the same
    # files count ViT-S/16 at 4.61 GMACs, as DeiT does).
    'ViT_S14': ('12 blocks, width 384, 6 heads, MLP 1536, patch 14',
                'vit_small_patch14_dinov2', None, None),
    'ViT_B14': ('12 blocks, width 768, 12 heads, MLP 3072, patch 14',
                'vit_base_patch14_dinov2', None, None),
    'ViT_L14': ('24 blocks, width 1024, 16 heads, MLP 4096, patch 14',
                'vit_large_patch14_clip_224', 304.2, 81.08),
}
# name: (image size, parameters in millions, GMACs) of the weights of
# PUBLISHED[name] at the only size they were published at: DINOv2's 518 px
# in timm's inference benchmark (the file above).
AT_PUBLISHED_SIZE = {
    'ViT_S14': (518, 22.06, 46.76),
    'ViT_B14': (518, 86.58, 151.71),
}


def input_spec(name: str, image_size: int):
  """(classes, channels, image size) the table builds model `name` for."""
  if name == models.SMALL_RESNET:
    return 10, 1, default.get_config().image_size
  return 1000, 3, image_size


def abstract_model(name: str, image_size: int = 224):
  """Graph definition, parameters and other state of model `name` as
  shapes only (`nnx.eval_shape`), at the default config's options."""
  num_classes, channels, size = input_spec(name, image_size)
  options = models.options(default.get_config())
  options['image_size'] = size
  if name != models.SMALL_RESNET:  # the others at their standard depths
    options['num_layers'] = 0
  model = nnx.eval_shape(lambda: models.create_model(
      name, num_classes, channels, rngs=nnx.Rngs(0), **options))
  return nnx.split(model, nnx.Param, ...)


def parameter_count(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def forward_flops_per_image(name: str, image_size: int = 224,
                            batch_size: int = 8) -> float:
  """XLA's FLOPs of one inference forward pass per image, every layer of
  every scanned stack counted (`training/flop_count.py`)."""
  graphdef, params, rest = abstract_model(name, image_size)
  _, channels, size = input_spec(name, image_size)
  images = jax.ShapeDtypeStruct((batch_size, size, size, channels),
                                jnp.float32)
  return flop_count.true_forward_flops(graphdef, params, rest,
                                  images) / batch_size


def _figure(value) -> str:
  return '-' if value is None else f'{value:g}'


def main(_):
  console.quiet(FLAGS.verbosity)  # library INFO lines off, as main.py
  print('| model | family | shape | parameters M | published M | forward '
        'GFLOPs (XLA) | published GMACs x 2 | ratio | weights |')
  print('| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |')
  rows = [(name, 224, *PUBLISHED[name]) for name in models.MODEL_NAMES]
  rows += [(name, size, f'{PUBLISHED[name][0]}, at {size} px',
            PUBLISHED[name][1], published_m, gmacs)
           for name, (size, published_m, gmacs) in AT_PUBLISHED_SIZE.items()]
  for name, size, shape, weights, published_m, gmacs in rows:
    _, params, _ = abstract_model(name, size)
    gflops = forward_flops_per_image(name, size) / 1e9
    ratio = '-' if gmacs is None else f'{gflops / (2 * gmacs):.3f}'
    print(f'| `{name}` | {models.family(name)} | {shape} | '
          f'{parameter_count(params) / 1e6:.2f} | {_figure(published_m)} | '
          f'{gflops:.2f} | {_figure(gmacs and 2 * gmacs)} | {ratio} | '
          f'{f"`{weights}`" if weights else "-"} |', flush=True)


if __name__ == '__main__':
  app.run(main)
