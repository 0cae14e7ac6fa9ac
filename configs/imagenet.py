"""ResNet-50 on ImageNet with the Flax ImageNet example's recipe.

SGD with Nesterov momentum 0.9; learning rate 0.1 per 256 examples (0.4 at
batch 1024, and it follows --config.batch_size), 5 warmup epochs, cosine
decay to 0; L2 weight decay 1e-4 on kernels; global batch 1024; 100 epochs
at 224 px in bfloat16; Inception crops and flips, bicubic resizing,
ImageNet mean/deviation. Anchor: 76.37% top-1 in 4.4 h on a TPU v3-8 (the
README's "Reproducing the published numbers" lists every value with its
source). Reads TFDS imagenet2012 from `data_dir`.

Options (`--config=configs/imagenet.py:real_v2,fewshot`; also for
imagenet_vit.py, deit_s16.py, convnext_t.py and swin_t.py) add evaluators (docs/data.md prepares
their data): `real_v2`, ImageNet-v2 (matched frequency, as its release's
class folders 0..999: `evals.v2`) and ReaL labels of the validation images
as folders (`evals.real`); `fewshot`, big_vision's few-shot probes on six
TFDS data sets (`evals.fewshot`, every 12,510 steps: 10 epochs at
batch 1024).
"""

import ml_collections

from configs import default

OPTIONS = ('real_v2', 'fewshot')
# big_vision's `configs/common_fewshot.py` data sets, versions and splits:
# cars196 pinned to 2.1.0 (the release whose split information TFDS
# fixed), the others TFDS's current version.
FEWSHOT_DATASETS = {
    'caltech': ('caltech101', 'train', 'test'),
    'cars': ('cars196:2.1.0', 'train', 'test'),
    'cifar100': ('cifar100', 'train', 'test'),
    'dtd': ('dtd', 'train', 'test'),
    'pets': ('oxford_iiit_pet', 'train', 'test'),
    'uc_merced': ('uc_merced', 'train[:1000]', 'train[1000:]'),
}

# timm's ImageNet training recipe's data side, as DeiT, ConvNeXt and Swin
# train with it (their `main.py` defaults): Inception crops of 8-100%
# resized bicubic, RandAugment `rand-m9-mstd0.5-inc1`, random erasing 0.25,
# mixup 0.8 and CutMix 1.0 switched per batch at 0.5, label smoothing 0.1.
TIMM_AUGMENTATION = dict(
    crop_min_area=0.08,  # torchvision's RandomResizedCrop scale
    resize_method='bicubic', eval_resize_method='bicubic',
    normalization='imagenet',
    # timm's rand-m9-mstd0.5-inc1.
    randaug_num_layers=2, randaug_magnitude=9, randaug_magnitude_std=0.5,
    randaug_apply_prob=0.5, randaug_ops='timm_increasing',
    random_erase_prob=0.25, mixup_alpha=0.8, cutmix_alpha=1.0,
    mixup_switch_prob=0.5, label_smoothing=0.1)

# What DeiT, ConvNeXt and Swin train with alike: timm's augmentation, the
# model at its standard depth without remat, 300 epochs of AdamW with
# weight decay 0.05 as PyTorch's AdamW applies it.
TIMM_TRAINING = dict(
    TIMM_AUGMENTATION, num_layers=0, remat_policy='none', num_epochs=300.0,
    optimizer='adamw', weight_decay=0.05, weight_decay_form='pytorch')


def add_evaluators(config, options: str) -> None:
  """The evaluators `options` (comma-separated names of OPTIONS) ask for."""
  names = [name for name in options.split(',') if name]
  unknown = sorted(set(names) - set(OPTIONS))
  if unknown:
    raise ValueError(f'unknown config option {unknown[0]!r}; valid names: '
                     f'{", ".join(OPTIONS)}')
  if 'real_v2' in names:
    config.evals.v2 = ml_collections.ConfigDict(dict(
        type='classification', class_map='index',
        dataset='folder:/data/imagenetv2-matched-frequency-format-val'))
    config.evals.real = ml_collections.ConfigDict(dict(
        type='classification', dataset='folder:/data/imagenet', split='val',
        labels='real', real_labels_file='/data/real.json'))
  if 'fewshot' in names:
    config.evals.fewshot = ml_collections.ConfigDict(dict(
        type='fewshot', datasets=FEWSHOT_DATASETS, every_steps=12510))


def get_config(options: str = ''):
  config = default.get_config()
  add_evaluators(config, options)
  config.update(dataset='imagenet2012:5.*.*', train_split='train',
                eval_split='validation', image_size=224)
  # The Flax example's crop: 8-100% of the area and at least 10% of the
  # image covered, i.e. 10-100%.
  config.update(crop_min_area=0.1, resize_method='bicubic',
                eval_resize_method='bicubic', normalization='imagenet')

  config.model = 'ResNet50'
  config.num_layers = 0  # ResNets have fixed stage depths
  # Batch 128 per device fits 16 GB without remat: recompute nothing.
  config.remat_policy = 'none'
  # A rolled scan compiles faster than the unrolled stack; on a
  # TPU v5e it steps at 0.82x (docs/performance.md). Unroll only on CPU.
  config.scan_unroll = 1
  config.half_precision = True

  config.update(batch_size=1024, num_epochs=100.0, optimizer='sgd',
                learning_rate=0.1, learning_rate_base_batch_size=256,
                warmup_epochs=5.0, weight_decay=1e-4, label_smoothing=0.0)

  config.log_every_steps = 100
  # One epoch at batch 1024.
  config.eval_every_steps = config.checkpoint_every_steps = 1251
  return config
