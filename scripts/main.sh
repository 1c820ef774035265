#!/usr/bin/env bash
# The main job on a fresh machine: install, build, then run the demo on the built-in data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
build/dlua -v
build/dlua recipes/hello.lua "$@"
