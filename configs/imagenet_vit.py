"""ViT-S/16 on ImageNet with big_vision's recipe (arXiv:2205.01580).

big_vision's `configs/vit_s16_i1k.py`: 90 epochs on `train[:99%]` at batch
1024; Inception crops of 5-100%, flips, RandAugment(2, 10), mixup with a
Beta(0.2, 0.2) ratio, pixels in [-1, 1]; global-average pooling, sincos 2-D
position embedding, a tanh pre-logits layer, zero-initialised head; Adam
with learning rate 1e-3 (not scaled by the batch), 10k warmup steps,
cosine decay, weight decay 1e-4 decoupled from the learning rate, gradient
clipping at global norm 1. Anchor: 76.5% top-1 after 90 epochs (6-7 h on a
TPU v3-8), 80.0% after 300 (`--config.num_epochs=300`); the README's
"Reproducing the published numbers" lists every value with its source.
"""

from configs import imagenet


def get_config(options: str = ''):
  """`options`: see configs/imagenet.py (real_v2, fewshot)."""
  config = imagenet.get_config(options)
  config.train_split = 'train[:99%]'  # big_vision holds out 1% as minival
  config.update(crop_min_area=0.05, resize_method='bilinear',
                eval_resize_method='area', normalization='minus_one_to_one')
  config.update(randaug_num_layers=2, randaug_magnitude=10, mixup_alpha=0.2)

  config.model = 'ViT_S16'  # the standard depth, 12
  config.update(vit_pool='gap', vit_posemb='sincos2d', vit_pre_logits=True,
                dropout_rate=0.0)

  # The learning rate is not scaled by the batch, as big_vision's.
  config.update(batch_size=1024, num_epochs=90.0, optimizer='adamw',
                learning_rate=1e-3, learning_rate_base_batch_size=0,
                warmup_steps=10_000, weight_decay=1e-4, grad_clip_norm=1.0,
                label_smoothing=0.0)
  # One epoch of train[:99%] at batch 1024.
  config.eval_every_steps = config.checkpoint_every_steps = 1238
  return config
