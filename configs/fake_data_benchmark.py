"""ResNet-50 on synthetic batches made on device: the model without input.

`configs/imagenet.py`'s model, batch and optimizer for a few hundred steps
on `dataset='fake'`, so steps/s and memory measure the model step alone.
"""

from configs import imagenet


def get_config():
  config = imagenet.get_config()
  config.update(dataset='fake', num_train_steps=300, log_every_steps=50)
  # One evaluation step and one checkpoint, at the end.
  config.update(eval_every_steps=300, steps_per_eval=1,
                checkpoint_every_steps=300)
  return config
