"""DeiT-S/16 on ImageNet with DeiT's recipe (arXiv:2012.12877).

facebookresearch/deit's `main.py` defaults and its README's DeiT-small
command (4 GPUs x 256 = a global batch of 1024): 300 epochs; Inception
crops of 8-100% resized bicubic, flips, RandAugment `rand-m9-mstd0.5-inc1`,
random erasing 0.25, mixup 0.8 and CutMix 1.0 switched per batch at 0.5,
label smoothing 0.1, repeated augmentation (3 copies); class-token pooling,
a learned position embedding, exact GELU, stochastic depth 0.1; AdamW with
learning rate 5e-4 per 512 examples (1e-3 at 1024), weight decay 0.05 as
PyTorch's AdamW applies it, 5 warmup epochs, cosine to 1e-5; an EMA of the
weights at 0.99996. Anchor: 79.8% top-1 (the paper), 79.85% for the
released weights; docs/recipes.md lists every value with its source and
the differences that remain.

`configs/deit_s16.py:distilled` is DeiT-S distilled (DeiT's README:
81.2%): the same recipe with DeiT's distillation token and hard
distillation from a RegNetY-16GF teacher, DeiT's `regnety_160-a5fe301d.pth`
(`main.py`'s `--teacher-model regnety_160 --distillation-type hard`,
`--distillation-alpha 0.5 --distillation-tau 1.0`).
"""

from configs import imagenet


def get_config(options: str = ''):
  """`options`, comma-separated: `distilled` (DeiT-S distilled) and those
  of configs/imagenet.py (real_v2, fewshot)."""
  names = [name for name in options.split(',') if name]
  valid = ('distilled', *imagenet.OPTIONS)
  unknown = sorted(set(names) - set(valid))
  if unknown:
    raise ValueError(f'unknown config option {unknown[0]!r}; valid names: '
                     f'{", ".join(valid)}')
  config = imagenet.get_config(
      ','.join(name for name in names if name != 'distilled'))
  config.update(imagenet.TIMM_TRAINING)
  config.repeated_augments = 3
  config.model = 'ViT_S16'  # the standard depth, 12
  config.vit_pool = 'cls'
  config.vit_posemb = 'learn'
  config.vit_gelu = 'exact'
  # The exact GELU's erf kept for the backward pass: on a TPU v5e the
  # scanned step 2.7% faster (unrolled 3% slower; docs/performance.md).
  config.remat_policy = 'keep_erf'
  config.drop_path_rate = 0.1

  # DeiT's linear scaling rule: 5e-4 per 512 examples.
  config.update(batch_size=1024, learning_rate=5e-4,
                learning_rate_base_batch_size=512, warmup_epochs=5.0,
                min_learning_rate=1e-5)
  config.grad_clip_norm = 0.0  # DeiT does not clip
  config.ema_decay = 0.99996
  # One epoch at batch 1024.
  config.eval_every_steps = config.checkpoint_every_steps = 1251
  if 'distilled' in names:
    distil(config)
  return config


def distil(config) -> None:
  """DeiT's distillation: the token, and hard distillation from DeiT's
  RegNetY-16GF (download dl.fbaipublicfiles.com/deit/regnety_160-a5fe301d.pth
  and point teacher_init_from at it, local or gs://)."""
  config.vit_distillation_token = True
  config.teacher_model = 'RegNetY_16GF'
  config.teacher_init_from = 'regnety_160-a5fe301d.pth'
  config.teacher_init_format = 'auto'  # timm's RegNet names
  config.distillation_type = 'hard'
  config.distillation_alpha = 0.5
  config.distillation_tau = 1.0
