"""Swin-T on ImageNet with Swin's recipe (arXiv:2103.14030).

microsoft/Swin-Transformer's `config.py` defaults, its
`configs/swin/swin_tiny_patch4_window7_224.yaml` and get_started.md's
Swin-T command (8 GPUs x 128 = a global batch of 1024): 300 epochs;
Inception crops of 8-100% resized bicubic, flips, RandAugment
`rand-m9-mstd0.5-inc1`, random erasing 0.25, mixup 0.8 and CutMix 1.0
switched per batch at 0.5, label smoothing 0.1; stochastic depth 0.2;
AdamW with learning rate 5e-4 and floor 5e-6 per 512 examples (1e-3 and
1e-5 at 1024: Swin's main.py scales both by the batch), weight decay 0.05
as PyTorch's AdamW applies it, 20 warmup epochs, cosine per step,
gradient clipping at global norm 5. Anchor: 81.2% top-1 (MODELHUB.md);
docs/recipes.md lists every value with its source and the differences
that remain.
"""

from configs import imagenet


def get_config(options: str = ''):
  """`options`: see configs/imagenet.py (real_v2, fewshot)."""
  config = imagenet.get_config(options)
  config.update(imagenet.TIMM_TRAINING)
  config.model = 'Swin_T'  # the standard stages, 2-2-6-2
  config.drop_path_rate = 0.2

  # BASE_LR and MIN_LR, each per 512 examples as Swin's main.py scales
  # them: 1e-3 and 1e-5 at batch 1024.
  config.update(batch_size=1024, learning_rate=5e-4,
                learning_rate_base_batch_size=512, warmup_epochs=20.0,
                min_learning_rate=5e-6)
  config.scale_min_learning_rate = True
  config.grad_clip_norm = 5.0
  config.ema_decay = 0.0  # Swin keeps no moving average
  # One epoch at batch 1024.
  config.eval_every_steps = config.checkpoint_every_steps = 1251
  return config
