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
  config.train_split = 'train'
  config.eval_split = 'validation'
  config.image_size = 224
  imagenet.timm_augmentation(config)
  config.repeated_augments = 1

  config.model = 'ConvNeXt_T'
  config.num_layers = 0  # the standard stages, 3-3-9-3
  config.drop_path_rate = 0.1
  config.layer_scale_init = 1e-6
  config.layer_decay = 1.0
  config.remat_policy = 'none'

  config.batch_size = 4096
  config.grad_accum_steps = 1
  config.num_epochs = 300.0
  config.optimizer = 'adamw'
  # ConvNeXt's --lr is the rate of its batch of 4096; other batches scale
  # it linearly from there.
  config.learning_rate = 4e-3
  config.learning_rate_base_batch_size = 4096
  config.warmup_epochs = 20.0
  config.warmup_steps = -1
  config.min_learning_rate = 1e-6
  config.scale_min_learning_rate = False  # --min_lr is absolute
  config.weight_decay = 0.05
  config.weight_decay_form = 'pytorch'
  config.grad_clip_norm = 0.0  # --clip_grad None
  config.ema_decay = 0.9999

  config.eval_every_steps = 312  # one epoch at batch 4096
  config.checkpoint_every_steps = 312
  return config
