"""Fine-tuning published ImageNet weights on a small TFDS data set.

    python main.py --config=configs/finetune.py --workdir=DIR \
        --config.init_from=resnet50-11ad3fa6.pth

starts from torchvision's ResNet-50 (IMAGENET1K_V2 weights, PyTorch's
symmetric padding) and fine-tunes it on Oxford Flowers 102 (TFDS
`oxford_flowers102`: 1,020 training images of 102 classes; its validation
split evaluates) at 224 px. `--config=configs/finetune.py:vit_s16` does the
same from timm's ViT-S/16 (`vit_small_patch16_224.augreg_in21k_ft_in1k`
model.safetensors: class token, learned position embedding, exact GELU).
docs/pretrained.md has the download commands.

The recipe is the usual one for small transfer sets (BiT, ViT): SGD with
momentum, no weight decay, 500 steps at batch 512 with a short warmup and
cosine decay, gradient clipping at norm 1, a learning rate far below
training from scratch. The head is new: the weights' 1000-class head does
not fit 102 classes, so it starts from the model's initialisation (the log
says so). No accuracy was measured for this config: it is a starting point.
"""

from configs import imagenet

# Per preset: the model, the conventions its published weights compute
# with, and the peak learning rate.
PRESETS = {
    'resnet50': dict(model='ResNet50', resnet_padding='symmetric',
                     learning_rate=0.01),
    'vit_s16': dict(model='ViT_S16', vit_pool='cls', vit_posemb='learn',
                    vit_gelu='exact', learning_rate=0.003),
}


def get_config(preset: str = 'resnet50'):
  if preset not in PRESETS:
    raise ValueError(f'configs/finetune.py:{preset}: unknown preset; valid: '
                     f'{", ".join(PRESETS)}')
  config = imagenet.get_config()
  config.dataset = 'oxford_flowers102:2.*.*'
  config.image_size = 224
  config.num_layers = 0  # the standard depth of the pretrained model
  config.init_format = 'auto'
  config.update(PRESETS[preset])

  config.batch_size = 512
  config.num_train_steps = 500
  config.optimizer = 'sgd'
  config.warmup_steps = 50
  config.weight_decay = 0.0
  config.grad_clip_norm = 1.0
  config.label_smoothing = 0.0

  config.log_every_steps = 10
  config.eval_every_steps = 100
  config.checkpoint_every_steps = 100
  return config
