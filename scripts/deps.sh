#!/usr/bin/env bash
# Installs the Debian packages dlua builds and tests with; does nothing when all are there.
#   deps.sh        what the build and the main job need
#   deps.sh test   also the independent references the tests compare against (PyTorch, torchvision)
#                  and python3-venv (a venv for test-only PyPI tools such as safetensors)
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libluajit-5.1-dev libedit-dev zlib1g-dev
  libopenblas-dev libdnnl-dev libturbojpeg0-dev libjpeg62-turbo-dev libpng-dev libgloo-dev libcjson-dev gnuplot-nox
  libopenmpi-dev openmpi-bin
  check lua-busted python3 dataset-fashion-mnist
)
if [ "${1:-}" = test ]; then packages+=(python3-torch python3-torchvision python3-venv); fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
