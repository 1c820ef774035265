#!/usr/bin/env bash
# The main job on a fresh machine: install, build, then train ResNet-50 data-parallel on 2 CPU
# ranks (DDP over gloo) on the built-in Fashion-MNIST (Debian's dataset-fashion-mnist): a few
# minutes on 2 cores, ending with the test accuracy it reached. Arguments go to the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
build/dlua recipes/hello.lua
build/dlua --nproc 2 recipes/resnet50_ddp.lua --epochs 2 --limit 4096 --batch 32 --lr 0.4 --warmup 0.25 \
  --eval-limit 2000 --print-every 32 "$@"
