"""Default config: a small scanned ResNet on scikit-learn's 8x8 digits.

Runs in a couple of minutes on a laptop CPU; every other config starts from
this one, so every key of the contract exists everywhere.

Options (`--config=configs/default.py:knn`; also for finetune.py) add
evaluators by type, named after it, on the run's own data set, with every
setting a key: `knn`, `fewshot`, `classification`
(`--config.evals.knn.k=10`, `--config.evals.knn.datasets.data=folder:PATH`).
"""

import ml_collections

from evaluators import evaluator_types

# The config options that add an evaluator: its type's names.
EVALUATOR_OPTIONS = tuple(evaluator_types.SETTINGS)


def add_evaluator(config, kind: str) -> None:
  """`config.evals.KIND`: an evaluator of type `kind` on the run's own data
  set (following `--config.dataset`), every setting of its type a key."""
  own_data = config.get_ref('dataset')
  settings = dict(evaluator_types.SETTINGS[kind], type=kind)
  if 'datasets' in settings:  # few-shot, k-NN: named data sets
    settings['datasets'] = ml_collections.ConfigDict({'data': own_data})
  else:
    settings['dataset'] = own_data
  config.evals[kind] = ml_collections.ConfigDict(settings)


def get_config(options: str = ''):
  """`options`: comma-separated names of EVALUATOR_OPTIONS."""
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Data: 'digits' (embedded in scikit-learn), 'fake', a TFDS name, or
  # 'folder:PATH' (image folders PATH/train/<class>/, PATH/val/<class>/).
  config.dataset = 'digits'
  config.data_dir = ''  # TFDS data dir; '' = $TFDS_DATA_DIR or the default
  config.image_size = 8
  # TFDS splits: training, and evaluation ('' = 'validation', else 'test').
  config.train_split = 'train'
  config.eval_split = ''
  # Preprocessing of TFDS and folder images. Training: an Inception-style crop of at least this
  # fraction of the image, resized with `resize_method`; evaluation: the
  # central crop, resized with `eval_resize_method`. Pixels normalised with
  # ImageNet's mean and deviation ('imagenet') or to [-1, 1]
  # ('minus_one_to_one').
  config.crop_min_area = 0.1
  config.resize_method = 'bicubic'
  config.eval_resize_method = 'bicubic'
  config.normalization = 'imagenet'
  # RandAugment (0 layers = off) on training images; mixup of training
  # batches with a Beta(mixup_alpha, mixup_alpha) ratio (0 = off).
  config.randaug_num_layers = 0
  config.randaug_magnitude = 10
  # big_vision's RandAugment by default. DeiT's, timm's rand-m9-mstd0.5-inc1:
  # randaug_magnitude=9, randaug_magnitude_std=0.5 (each op's magnitude
  # drawn from Normal(9, 0.5) clipped to [0, 10]), randaug_apply_prob=0.5
  # (each chosen op applied with this probability) and
  # randaug_ops='timm_increasing' (timm's `inc1` ops).
  config.randaug_magnitude_std = 0.0  # 0 = every op at randaug_magnitude
  config.randaug_apply_prob = 1.0
  config.randaug_ops = 'big_vision'
  config.mixup_alpha = 0.0
  # Random erasing (timm's, mode 'pixel'): with this probability, one box
  # of 2%-1/3 of a training image (aspect 0.3-3.3) becomes normal noise on
  # the normalised image; TFDS and image folders (0 = off).
  config.random_erase_prob = 0.0
  # CutMix (timm's): a box of side ratio sqrt(1 - lam), lam ~ Beta(a, a),
  # pasted from another image, the labels weighted by its area (0 = off);
  # with mixup on too, CutMix for a batch with probability mixup_switch_prob.
  config.cutmix_alpha = 0.0
  config.mixup_switch_prob = 0.5
  # Repeated augmentation (DeiT's): every example of an epoch's order
  # appears this many times in a row, each copy augmented on its own and
  # placed about batch_size / k rows from the others; an epoch keeps its
  # steps, so it sees 1 / k of the data set (1 = off).
  config.repeated_augments = 1

  # Model.
  config.model = 'SmallResNet'
  config.num_layers = 8  # depth of the scanned stack (small model and ViTs)
  config.width = 32  # channels of the small model
  config.dropout_rate = 0.0  # ViT blocks
  # Stochastic depth (0 = off): block i of the model's N blocks (a ResNet's
  # counted across its stages) drops its residual branch per example with
  # probability drop_path_rate * i / (N - 1), as timm does.
  config.drop_path_rate = 0.0
  # ConvNeXt's layer scale: each block's residual branch times a learned
  # per-channel factor starting here (0 = none); V2 has none.
  config.layer_scale_init = 1e-6
  config.vit_pool = 'gap'  # 'gap', 'cls' or 'map' (SigLIP's attention pool)
  config.vit_posemb = 'sincos2d'  # 'sincos2d' or 'learn'
  config.vit_pre_logits = False  # a width x width tanh layer before the head
  # DeiT's distillation token: a second token and head (needs vit_pool
  # 'cls'); training puts the distillation loss on its head, evaluation,
  # predict and export use the mean of the two heads.
  config.vit_distillation_token = False
  # The published ViT backbones' options (docs/models.md): layer scale
  # starting at layer_scale_init (DINOv2, DeiT III); register tokens
  # (DINOv2 with registers: 4); a LayerNorm after the embedding (CLIP); a
  # linear image projection to that many features before the head (CLIP:
  # 0 = none); the LayerNorms' epsilon (CLIP's 1e-5).
  config.vit_layer_scale = False
  config.vit_registers = 0
  config.vit_norm_pre = False
  config.vit_projection = 0
  config.vit_norm_eps = 1e-6
  # The ViTs' attention logits and softmax in float32 (as
  # jax.nn.dot_product_attention); False: in the compute dtype (bfloat16
  # under half_precision), faster on TPUs (docs/performance.md).
  config.vit_float32_logits = True
  # The Swins' attention window (7; 12 for the 384 px weights). A file of
  # another window has its relative position bias tables resized.
  config.swin_window = 7
  # A BatchNorm without scale or bias between the pooled features and the
  # head: MoCo v3's and MAE's linear probes (it trains with the probe).
  config.feature_batch_norm = False
  # Conventions of published weights (see docs/pretrained.md): 'same' or
  # 'symmetric' (PyTorch's) ResNet padding; the ViT's 'tanh', 'exact' or
  # 'quick' (OpenAI's CLIP) GELU.
  config.resnet_padding = 'same'
  config.vit_gelu = 'tanh'
  # Start a new run from these weights: a workdir or checkpoint of this
  # project, its export, or a published file; '' = from scratch.
  config.init_from = ''
  config.init_format = 'auto'  # 'auto': from the file (docs/pretrained.md)
  # Knowledge distillation (docs/recipes.md): a frozen teacher, any model
  # name ('' = no teacher), with the weights of teacher_init_from (any file
  # or workdir init_from reads; its conventions come from the file), run in
  # evaluation mode on the student's augmented batch. distillation_type:
  # 'none', DeiT's 'soft' (KL at distillation_tau, summed, x tau^2 / number
  # of logits) or 'hard' (cross-entropy against the teacher's top-1), or
  # big_vision's 'kl' (per-example KL at tau, x tau^2, averaged); the loss
  # is (1 - distillation_alpha) x base + distillation_alpha x distillation.
  config.teacher_model = ''
  config.teacher_init_from = ''
  config.teacher_init_format = 'auto'
  config.distillation_type = 'none'
  config.distillation_alpha = 0.5
  config.distillation_tau = 1.0
  # Train only the parameters whose '/'-joined names (e.g. head/kernel) the
  # regular expression fully matches; the others stay frozen, with no
  # gradient or optimizer state (a BatchNorm with both frozen uses and keeps
  # its running statistics). '' = train everything.
  config.trainable = ''
  # Layer-wise learning-rate decay (BEiT, MAE; 1 = off): the update of depth
  # d (ViT: patch embedding 0, blocks 1..L, head L + 1; ResNet: stem 0,
  # stages 1-4, head 5) is scaled by layer_decay ** (head's depth - d).
  config.layer_decay = 1.0

  # The scanned stacks.
  config.remat_policy = 'full'
  config.scan_layers = True
  # Layers (and micro-batches of grad_accum_steps) per loop iteration:
  # XLA:CPU runs convolution gradients inside a rolled scan far slower than
  # unrolled (see README), so unroll on CPU.
  config.scan_unroll = 64  # >= num_layers: fully unrolled
  # k > 1: an outer scan over k remat'ed segments of depth / k layers each
  # (sqrt(depth) activation memory at k ~ sqrt(depth)); must divide depth.
  config.scan_segments = 1
  # Parameters stay float32; half_precision computes in this dtype:
  # 'bfloat16', or 'float16' (with dynamic loss scaling, for GPUs).
  config.half_precision = False
  config.half_precision_dtype = 'bfloat16'

  # Parallelism: the device mesh (data replicas x FSDP shards within a
  # slice; -1 fills, the product is a slice's device count; dcn_data: the
  # slices, TPU slices or else processes, that the data axis spans over the
  # data-centre network, 1 = one mesh over every device) and how the train
  # step is compiled.
  config.mesh = ml_collections.ConfigDict(
      {'data': -1, 'fsdp': 1, 'dcn_data': 1})
  config.step_mode = 'jit'  # 'jit' (sharded over the mesh) or 'pmap'

  # Optimisation.
  config.batch_size = 64  # global, over all devices and processes
  # k > 1: each update's gradient is the mean over k micro-batches of
  # batch_size / k, computed one after the other (the memory of one
  # micro-batch); 1: off.
  config.grad_accum_steps = 1
  config.num_epochs = 15.0
  config.num_train_steps = -1  # -1: from num_epochs
  # 'sgd' (Nesterov momentum 0.9), 'adamw' or 'lars' (linear probes).
  config.optimizer = 'sgd'
  # Peak learning rate (after warmup) for a global batch of
  # learning_rate_base_batch_size; the run uses learning_rate x batch_size /
  # learning_rate_base_batch_size (0: learning_rate as it is).
  config.learning_rate = 0.1
  config.learning_rate_base_batch_size = 64
  config.warmup_epochs = 2.0
  config.warmup_steps = -1  # >= 0: overrides warmup_epochs
  # The cosine decays to this rate: absolute (timm's and DeiT's min_lr), or
  # with scale_min_learning_rate per learning_rate_base_batch_size as
  # learning_rate is (Swin's MIN_LR): min_learning_rate x batch_size /
  # learning_rate_base_batch_size.
  config.min_learning_rate = 0.0
  config.scale_min_learning_rate = False
  # An exponential moving average of the weights (parameters and BatchNorm
  # statistics), updated after every step as timm's ModelEma does:
  # ema = ema_decay x ema + (1 - ema_decay) x weights (0 = off). Every
  # evaluation evaluates it too (eval_ema_*).
  config.ema_decay = 0.0
  # On kernels only. sgd: L2, weight_decay x kernel added to the gradient;
  # adamw: decoupled, in weight_decay_form 'big_vision' kernel -= lr(t) /
  # peak lr x weight_decay x kernel, in 'pytorch' (PyTorch's AdamW, DeiT)
  # kernel -= lr(t) x weight_decay x kernel.
  config.weight_decay = 1e-4
  config.weight_decay_form = 'big_vision'
  config.label_smoothing = 0.0
  config.grad_clip_norm = 0.0  # 0: no clipping
  # Non-finite steps (NaN/Inf loss or gradients) to skip in a row before
  # stopping; 0: stop at the first. A skipped step changes no parameters.
  config.skip_nonfinite_steps = 0

  # Logging, evaluation, checkpoints.
  config.log_every_steps = 50
  config.eval_every_steps = 500
  config.steps_per_eval = -1  # -1: the whole held-out split
  # Named evaluators beside the main evaluation (README: type
  # 'classification', 'fewshot' or 'knn' and their settings), e.g.
  # config.evals.v2 = ml_collections.ConfigDict(dict(
  #     type='classification', dataset='folder:/data/imagenetv2',
  #     class_map='index')).
  config.evals = ml_collections.ConfigDict()
  config.checkpoint_every_steps = 500
  config.keep_checkpoints = 3
  # How long a restore reads again after storage errors (HTTP 5xx, lost
  # connections, timeouts; the storage clients' own retries included)
  # before the launch stops, having moved nothing.
  config.restore_retry_seconds = 120
  # One profiler trace per (re)start, into DIR/plugins/profile: of
  # profile_num_steps steps, from profile_delay_steps steps after the start.
  config.profile = False
  config.profile_delay_steps = 5
  config.profile_num_steps = 5
  config.intermediate_grads_every_steps = 0  # 0: off
  for name in [name for name in options.split(',') if name]:
    if name not in EVALUATOR_OPTIONS:
      raise ValueError(f'configs/default.py:{options}: unknown option '
                       f'{name}; valid: evaluators '
                       f'{", ".join(EVALUATOR_OPTIONS)}')
    add_evaluator(config, name)
  return config
