"""A ResNet-50 student distilled by function matching, big_vision's
"patient and consistent" recipe (arXiv:2106.05237;
`big_vision/configs/proj/distill/bit_i1k.py`).

The loss is the distillation loss alone (`distillation_type='kl'` at
temperature 1, `distillation_alpha=1.0`: big_vision's trainer
differentiates `distill_loss` only); every batch is mixed (mixup with
Beta(1, 1)) and the teacher sees the student's mixed images, in the
compiled step. Adam with learning rate 0.03 at batch 4096, decoupled weight
decay 3e-4, clipping at norm 1, 5000 warmup steps, cosine; 1200 epochs.
big_vision's teacher is BiT-M R152x2 and its student BiT-R50x1 (GroupNorm,
weight standardisation): here the student is the project's ResNet50 and the
teacher any model with a file, by default torchvision's ResNet-152
(`resnet152-f82ba261.pth`, IMAGENET1K_V2). docs/recipes.md lists every value
with its source and the differences that remain.
"""

from configs import imagenet


def get_config():
  config = imagenet.get_config()
  # big_vision's inception_crop (area 5-100%) and flips; pixels in [-1, 1].
  config.update(crop_min_area=0.05, normalization='minus_one_to_one')
  config.mixup_alpha = 1.0  # mixup(p=1.0): every batch, ratio ~ Beta(1, 1)
  config.label_smoothing = 0.0

  config.model = 'ResNet50'
  config.update(teacher_model='ResNet152',
                teacher_init_from='resnet152-f82ba261.pth',
                teacher_init_format='auto')
  config.update(distillation_type='kl', distillation_tau=1.0,
                distillation_alpha=1.0)

  config.update(batch_size=4096, num_epochs=1200.0, optimizer='adamw',
                learning_rate=0.03, learning_rate_base_batch_size=4096,
                warmup_epochs=0.0, warmup_steps=5000, weight_decay=3e-4,
                weight_decay_form='big_vision', grad_clip_norm=1.0)
  config.eval_every_steps = config.checkpoint_every_steps = 1000
  return config
