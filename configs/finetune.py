"""Fine-tuning and linear probes of published weights.

    python main.py --config=configs/finetune.py --workdir=DIR \
        --config.init_from=resnet50-11ad3fa6.pth

starts from torchvision's ResNet-50 (IMAGENET1K_V2 weights, PyTorch's
symmetric padding) and fine-tunes it on Oxford Flowers 102 (TFDS
`oxford_flowers102`: 1,020 training images of 102 classes; its validation
split evaluates) at 224 px. `--config=configs/finetune.py:vit_s16` does the
same from timm's ViT-S/16 (`vit_small_patch16_224.augreg_in21k_ft_in1k`
model.safetensors: class token, learned position embedding, exact GELU);
`:convnext_t`, `:swin_t` and `:regnety_040` from timm's `convnext_tiny`,
`swin_tiny_patch4_window7_224` and `regnety_040` files; `:dinov2_b14`,
`:clip_b16` and `:siglip_b16` from timm's `vit_base_patch14_dinov2`,
`vit_base_patch16_clip_224.openai` (computed with OpenAI's quick GELU, as
timm's `vit_base_patch16_clip_quickgelu_224` computes it) and
`vit_base_patch16_siglip_224` (docs/models.md has their settings).
Their recipe is the usual one for small transfer sets (BiT, ViT): SGD with
momentum, no weight decay, 500 steps at batch 512 with a short warmup and
cosine decay, gradient clipping at norm 1, a learning rate far below
training from scratch. The head is new: the weights' 1000-class head does
not fit 102 classes, so it starts from zeros (the log says so). No accuracy
was measured for these eight: they are starting points.

`:vit_b16_mae` is MAE's ImageNet fine-tuning of its pretrained ViT-B/16
(`mae_pretrain_vit_base.pth`), value by value from facebookresearch/mae
FINETUNE.md and `main_finetune.py`'s defaults: batch 1024, 100 epochs (5
warmup) of AdamW at 5e-4 per 256 examples (2e-3), weight decay 0.05 as
PyTorch's AdamW applies it, layer-wise learning-rate decay 0.65, stochastic
depth 0.1, RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25, mixup 0.8
and CutMix 1.0 switched at 0.5, label smoothing 0.1, cosine to 1e-6.
Published: 83.6% top-1 (83.57 +- 0.08 over four seeds).

`,linear_probe` after any of them (`:linear_probe` alone: the ResNet-50)
trains the head alone on the frozen network, as MAE's and MoCo v3's linear
probes do: a BatchNorm without scale or bias before the head, LARS at 0.1
per 256 examples without weight decay, light augmentation (crops and
flips), no label smoothing. With `vit_b16_mae` it is MAE's ImageNet probe:
batch 16384, 90 epochs (10 warmup); published: 68.0% top-1 (67.8% in
PyTorch). docs/pretrained.md has the download commands and the
differences that remain.
"""

from configs import default
from configs import deit_s16
from configs import imagenet

# timm's ViTs: class token, learned position embedding, exact GELU.
TIMM_VIT = dict(vit_pool='cls', vit_posemb='learn', vit_gelu='exact')
# Per preset: the model, the conventions its published weights compute
# with, and what its recipe sets beside the transfer recipe's defaults.
PRESETS = {
    'resnet50': dict(model='ResNet50', resnet_padding='symmetric',
                     learning_rate=0.01),
    'vit_s16': dict(model='ViT_S16', vit_pool='cls', vit_posemb='learn',
                    vit_gelu='exact', learning_rate=0.003),
    # MAE fine-tunes with global pooling by default; FINETUNE.md reports
    # the class token performing similarly, and it uses the file's final
    # norm instead of starting a new one.
    'vit_b16_mae': dict(model='ViT_B16', vit_pool='cls', vit_posemb='learn',
                        vit_gelu='exact'),
    # timm's `convnext_tiny`, `swin_tiny_patch4_window7_224`, `regnety_040`:
    # the families compute as those files do (exact GELU, PyTorch's
    # padding); a ConvNeXt file's layer scale needs one in the model. Rates
    # (not measured): the LayerNorm networks take the ViT's, the BatchNorm
    # RegNet the ResNet's; at batch 512 (0.006, 0.02) both lie in the ViT
    # paper's SGD fine-tuning grid, 0.001-0.03.
    'convnext_t': dict(model='ConvNeXt_T', layer_scale_init=1e-6,
                       learning_rate=0.003),
    'swin_t': dict(model='Swin_T', learning_rate=0.003),
    'regnety_040': dict(model='RegNetY_4GF', learning_rate=0.01),
    # timm's `vit_base_patch14_dinov2` (518 px: its position embedding is
    # resampled to 224 px), `vit_base_patch16_clip_224.openai` (its head,
    # CLIP's image projection, gives way to the new head, as timm's
    # `openai_ft_*` fine-tunings have none; with the quick GELU OpenAI
    # trained it with, as timm's `vit_base_patch16_clip_quickgelu_224`
    # computes the same file) and `vit_base_patch16_siglip_224` (the MAP
    # head pools). Rates: the ViT's (not measured).
    'dinov2_b14': dict(model='ViT_B14', vit_layer_scale=True,
                       layer_scale_init=1e-5, **TIMM_VIT,
                       learning_rate=0.003),
    'clip_b16': dict(model='ViT_B16', vit_norm_pre=True, vit_norm_eps=1e-5,
                     vit_pool='cls', vit_posemb='learn', vit_gelu='quick',
                     learning_rate=0.003),
    'siglip_b16': dict(model='ViT_B16', vit_pool='map', vit_posemb='learn',
                       vit_gelu='exact', learning_rate=0.003),
}
OPTIONS = ('linear_probe',)


def preset_fitting(fixes: dict, config) -> str:
  """'; configs/finetune.py:NAME sets them all' when the config values an
  error names as its fix (`ConfigError.fixes`: those of a weights file
  that does not fit the model) are a preset's (its depth aside: a preset's
  model has its standard one)."""
  needed = {key: value for key, value in fixes.items() if key != 'num_layers'}
  if not needed:
    return ''
  needed.setdefault('model', config.model)
  for name, values in PRESETS.items():
    if all(key in values and values[key] == value
           for key, value in needed.items()):
      return f'; configs/finetune.py:{name} sets them all'
  return ''


def get_config(options: str = 'resnet50'):
  """`options`: a preset of PRESETS, `linear_probe` and evaluators to add
  (default.EVALUATOR_OPTIONS), comma-separated."""
  names = options.split(',')
  presets = [name for name in names if name in PRESETS]
  unknown = [name for name in names if name not in
             (*PRESETS, *OPTIONS, *default.EVALUATOR_OPTIONS)]
  if unknown or len(presets) > 1:
    what = (f'unknown preset or option {",".join(unknown)}' if unknown else
            f'more than one preset ({",".join(presets)})')
    raise ValueError(
        f'configs/finetune.py:{options}: {what}; valid: one preset of '
        f'{", ".join(PRESETS)}, then optionally {", ".join(OPTIONS)} (e.g. '
        ':vit_b16_mae,linear_probe) and evaluators '
        f'{", ".join(default.EVALUATOR_OPTIONS)} (e.g. :dinov2_b14,knn)')
  preset = presets[0] if presets else 'resnet50'
  config = (mae_finetuning() if preset == 'vit_b16_mae' else
            transfer_finetuning())
  config.update(PRESETS[preset])
  if 'linear_probe' in names:
    linear_probe(config, imagenet=preset == 'vit_b16_mae')
  for name in names:
    if name in default.EVALUATOR_OPTIONS:
      default.add_evaluator(config, name)
  return config


def transfer_finetuning():
  """Every parameter, on Oxford Flowers 102 at 224 px."""
  config = imagenet.get_config()
  config.update(dataset='oxford_flowers102:2.*.*', image_size=224)
  config.num_layers = 0  # the standard depth of the pretrained model
  config.init_format = 'auto'

  config.update(batch_size=512, num_train_steps=500, optimizer='sgd',
                warmup_steps=50, weight_decay=0.0, grad_clip_norm=1.0,
                label_smoothing=0.0)
  config.log_every_steps = 10
  config.eval_every_steps = config.checkpoint_every_steps = 100
  return config


def mae_finetuning():
  """MAE's ImageNet fine-tuning (FINETUNE.md, ViT-B): DeiT's augmentation
  and regularisation without repeated augmentation or a moving average,
  AdamW with layer-wise decay."""
  config = deit_s16.get_config()
  config.update(repeated_augments=1, ema_decay=0.0, drop_path_rate=0.1)
  # MAE's blr, 5e-4, per 256 examples.
  config.update(batch_size=1024, num_epochs=100.0, warmup_epochs=5.0,
                learning_rate=5e-4, learning_rate_base_batch_size=256,
                min_learning_rate=1e-6, weight_decay=0.05,
                weight_decay_form='pytorch', layer_decay=0.65,
                grad_clip_norm=0.0)
  return config


def linear_probe(config, imagenet: bool) -> None:
  """The head alone, on normalised frozen features, with LARS; on ImageNet
  MAE's probe's batch and length."""
  config.update(trainable='head/.*', feature_batch_norm=True)
  config.update(optimizer='lars', learning_rate=0.1,
                learning_rate_base_batch_size=256, weight_decay=0.0,
                layer_decay=1.0, min_learning_rate=0.0, grad_clip_norm=0.0)
  # Crops and flips alone, no regularisation.
  config.update(drop_path_rate=0.0, label_smoothing=0.0, mixup_alpha=0.0,
                cutmix_alpha=0.0, randaug_num_layers=0, random_erase_prob=0.0,
                repeated_augments=1, crop_min_area=0.08)
  if imagenet:
    config.update(batch_size=16384, num_epochs=90.0, num_train_steps=-1,
                  warmup_epochs=10.0, warmup_steps=-1)
    config.eval_every_steps = config.checkpoint_every_steps = 78  # an epoch
