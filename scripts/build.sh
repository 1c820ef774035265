#!/usr/bin/env bash
# Configures and builds dlua into build/ (after installing what it needs).
#   DLUA_BUILD_DIR: another build folder; DLUA_CMAKE_ARGS: more configure arguments (first configure only);
#   arguments: the targets to build (default: all).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
dir=${DLUA_BUILD_DIR:-build}
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
if [ ! -f "$dir/CMakeCache.txt" ]; then
  cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release ${DLUA_CMAKE_ARGS:-}
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$dir" -j "$(nproc)" "${targets[@]}"
