#!/usr/bin/env bash
# Configures and builds dlua into build/ (after installing what it needs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release ${DLUA_CMAKE_ARGS:-}
fi
cmake --build build -j "$(nproc)"
