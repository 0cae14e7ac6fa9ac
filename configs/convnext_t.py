"""ConvNeXt-T on ImageNet with ConvNeXt's recipe (arXiv:2201.03545).

facebookresearch/ConvNeXt's `main.py` defaults and its TRAINING.md
ConvNeXt-T command (4 nodes x 8 GPUs x 128 per GPU x update_freq 1 = a
global batch of 4096): 300 epochs; Inception crops of 8-100% resized
bicubic, flips, RandAugment `rand-m9-mstd0.5-inc1`, random erasing 0.25,
mixup 0.8 and CutMix 1.0 switched per batch at 0.5, label smoothing 0.1;
stochastic depth 0.1, layer scale from 1e-6; AdamW at 4e-3 for the batch
of 4096, weight decay 0.05 as PyTorch's AdamW applies it, 20 warmup epochs
from 0, cosine to 1e-6 (both per step), no clipping; an EMA of the weights
at 0.9999, evaluated beside them. Anchor: 82.1% top-1 (the README's
ImageNet-1K table); docs/recipes.md lists every value with its source and
the differences that remain.
"""

from configs import imagenet


def get_config(options: str = ''):
  """`options`: see configs/imagenet.py (real_v2, fewshot)."""
  config = imagenet.get_config(options)
  config.update(imagenet.TIMM_TRAINING)
  config.model = 'ConvNeXt_T'  # the standard stages, 3-3-9-3
  config.drop_path_rate = 0.1
  config.layer_scale_init = 1e-6
  # The exact GELU's erf kept for the backward pass, not evaluated again:
  # on a TPU v5e 20% faster rolled, 17% unrolled (docs/performance.md).
  config.remat_policy = 'keep_erf'

  # ConvNeXt's --lr is the rate of its batch of 4096; other batches scale
  # it linearly from there. --min_lr is absolute.
  config.update(batch_size=4096, learning_rate=4e-3,
                learning_rate_base_batch_size=4096, warmup_epochs=20.0,
                min_learning_rate=1e-6)
  config.grad_clip_norm = 0.0  # --clip_grad None
  config.ema_decay = 0.9999
  # One epoch at batch 4096.
  config.eval_every_steps = config.checkpoint_every_steps = 312
  return config
