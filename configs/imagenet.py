"""ResNet-50 on ImageNet with the Flax ImageNet example's recipe.

SGD with Nesterov momentum 0.9; learning rate 0.1 per 256 examples (0.4 at
batch 1024, and it follows --config.batch_size), 5 warmup epochs, cosine
decay to 0; L2 weight decay 1e-4 on kernels; global batch 1024; 100 epochs
at 224 px in bfloat16; Inception crops and flips, bicubic resizing,
ImageNet mean/deviation. Anchor: 76.37% top-1 in 4.4 h on a TPU v3-8 (the
README's "Reproducing the published numbers" lists every value with its
source). Reads TFDS imagenet2012 from `data_dir`.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = 'imagenet2012:5.*.*'
  config.train_split = 'train'
  config.eval_split = 'validation'
  config.image_size = 224
  # The Flax example's crop: 8-100% of the area and at least 10% of the
  # image covered, i.e. 10-100%.
  config.crop_min_area = 0.1
  config.resize_method = 'bicubic'
  config.eval_resize_method = 'bicubic'
  config.normalization = 'imagenet'

  config.model = 'ResNet50'
  config.num_layers = 0  # ResNets have fixed stage depths
  # Batch 128 per device fits 16 GB without remat: recompute nothing.
  config.remat_policy = 'none'
  # Accelerators run a rolled scan at full speed; unroll only on CPU.
  config.scan_unroll = 1
  config.half_precision = True

  config.batch_size = 1024
  config.num_epochs = 100.0
  config.optimizer = 'sgd'
  config.learning_rate = 0.1
  config.learning_rate_base_batch_size = 256
  config.warmup_epochs = 5.0
  config.weight_decay = 1e-4
  config.label_smoothing = 0.0

  config.log_every_steps = 100
  config.eval_every_steps = 1251  # one epoch at batch 1024
  config.checkpoint_every_steps = 1251
  return config
