"""ResNet-50 on ImageNet with the Flax ImageNet example's recipe.

SGD with Nesterov momentum 0.9, learning rate 0.1 x batch / 256 with 5
warmup epochs and cosine decay, weight decay 1e-4, global batch 1024,
100 epochs at 224 px, bfloat16 compute. Reads TFDS imagenet2012 from
`data_dir` (README: preparing the data); steps per epoch come from the size
of its training split.
"""

from configs import default


def get_config():
  config = default.get_config()
  config.dataset = 'imagenet2012:5.*.*'
  config.image_size = 224
  config.model = 'ResNet50'
  config.num_layers = 0  # ResNets have fixed stage depths
  config.remat_policy = 'dots_no_batch'
  # Accelerators run a rolled scan at full speed; unroll only on CPU.
  config.scan_unroll = 1
  config.half_precision = True

  config.batch_size = 1024
  config.num_epochs = 100.0
  config.optimizer = 'sgd'
  config.learning_rate = 0.1 * config.batch_size / 256
  config.warmup_epochs = 5.0
  config.weight_decay = 1e-4

  config.log_every_steps = 100
  config.eval_every_steps = 1251  # about one epoch at batch 1024
  config.checkpoint_every_steps = 1251
  return config
