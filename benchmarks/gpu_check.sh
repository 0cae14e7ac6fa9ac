#!/bin/bash
# The speed tables on a machine with an NVIDIA GPU, in at most 16 minutes
# (each part has a timeout):
#   1. benchmarks/scan_remat.py's sweep in bfloat16 at GPU-sized batches,
#   2. ResNet-50 and ViT-S/16 throughput (images/s, MFU) at 224x224 on fake
#      data, then ConvNeXt-T's and Swin-T's,
#   3. the ViT-S/16 step with DeiT's parts (stochastic depth, CutMix, the
#      weights' moving average) beside big_vision's recipe, and ViT-B/16's,
#   4. ResNet-50 fine-tuning: every parameter, a linear probe, the first
#      stage frozen, layer decay,
#   5. the memory of the ResNet-50 and ViT-S/16 recipes' train steps
#      compiled for this GPU at 256 images, scanned, with full remat and
#      unrolled (the table of docs/accelerators.md; nothing is run).
# Needs the CUDA build of jax and the project's requirements (CLU and
# TensorFlow are not needed: the benchmark imports neither). Writes
# scan_remat.{md,json}, throughput.{md,json},
# throughput_families.{md,json} and accelerator_memory.{md,json} into $OUT
# (default
# /tmp/gpu_check); the .md files are the tables for docs/performance.md.
#
#   bash benchmarks/gpu_check.sh
#
# If only some packages are installed there, wheels placed in .whl/ (e.g.
# `pip download --no-deps -d .whl ml-collections==1.1.0`) are installed into
# a private directory first.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G '.whl/*.whl' > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'

# The table: every mode, depths 6-48, batches that fill a GPU a little.
timeout 180 python3 benchmarks/scan_remat.py --half_precision \
  --default_batch_size=256 --batch_size=64 --vit_image_size=64 \
  --resnet_image_size=64 --policies=full,dots,offload_dots \
  --time_rolled_conv_up_to=-1 --steps=10 --seconds=2 \
  --json="$OUT/scan_remat.json" 2>"$OUT/scan_remat.err" | tee "$OUT/scan_remat.md"
echo "scan_remat exit: $?"

# ImageNet-sized throughput of the two reference models.
timeout 100 python3 benchmarks/scan_remat.py --models= --half_precision \
  --throughput --throughput_batch_size=256 --throughput_image_size=224 \
  --throughput_policies=none,full --steps=20 --seconds=4 \
  --json="$OUT/throughput.json" 2>"$OUT/throughput.err" | tee "$OUT/throughput.md"
echo "throughput exit: $?"

# The same for ConvNeXt-T and Swin-T (rolled scans, remat full).
timeout 120 python3 benchmarks/scan_remat.py --models= --half_precision \
  --throughput --throughput_models=convnext_t,swin_t \
  --throughput_batch_size=256 --throughput_image_size=224 \
  --throughput_policies=full --steps=20 --seconds=4 \
  --json="$OUT/throughput_families.json" 2>"$OUT/throughput_families.err" \
  | tee "$OUT/throughput_families.md"
echo "throughput_families exit: $?"

# DeiT's parts on the ViT-S/16 step (A, B, A, B), then ViT-B/16.
BASE=dataset=fake,batch_size=256,half_precision=True
DEIT=$BASE,drop_path_rate=0.1,mixup_alpha=0.8,cutmix_alpha=1.0,ema_decay=0.99996
timeout 150 python3 benchmarks/step_time.py --config=configs/imagenet_vit.py \
  --steps=20 --variants="$BASE;$DEIT;$BASE;$DEIT;$BASE,model=ViT_B16" \
  2>"$OUT/deit_parts.err" | tee "$OUT/deit_parts.md"
echo "deit_parts exit: $?"

# Fine-tuning ResNet-50: full, linear probe, stem and first stage frozen,
# layer decay (A, B, A, B for its cost).
TUNE=dataset=fake,batch_size=256,half_precision=True
timeout 150 python3 benchmarks/step_time.py --config=configs/finetune.py \
  --steps=20 --variants="$TUNE;$TUNE,trainable=head/.*;$TUNE,trainable=stages/[1-3]/.*|head/.*;$TUNE,layer_decay=0.65;$TUNE;$TUNE,layer_decay=0.65" \
  2>"$OUT/finetune.err" | tee "$OUT/finetune.md"
echo "finetune exit: $?"
# The recipes' memory per GPU, compiled for this one (fake data: no
# TensorFlow).
timeout 240 python3 benchmarks/accelerator_memory.py --topologies=local \
  --configs="imagenet,dataset=fake,batch_size=256;imagenet_vit,dataset=fake,batch_size=256" \
  --policies=full --json="$OUT/accelerator_memory.json" \
  2>"$OUT/accelerator_memory.err" | tee "$OUT/accelerator_memory.md"
echo "accelerator_memory exit: $?"
tail -5 "$OUT"/*.err
