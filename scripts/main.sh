#!/usr/bin/env bash
# The main job on a fresh machine: install, build, then train ResNet-20 on Fashion-MNIST
# (the built-in data, Debian's dataset-fashion-mnist) for one epoch; arguments go to the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
build/dlua recipes/hello.lua
build/dlua recipes/fashion_mnist.lua --epochs 1 "$@"
