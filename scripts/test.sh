#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, build, then every test under CTest; then the CUDA
# backend once more on the CPU emulator (build-emu, -DDLUA_CUDA=EMU, docs/cuda.md#emulator) where the CUDA
# toolkit's headers are, with the Lua specs run again there (a device present). Arguments go to both ctest
# runs (e.g. -R name).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh test  # PyTorch for the tests that compare against it (they say why when it is missing)
bash scripts/build.sh
rc=0
ctest --test-dir build --output-on-failure --timeout 1200 "$@" || rc=1
if [ -f "${CUDAToolkit_ROOT:-/usr/local/cuda}/include/cuda_runtime_api.h" ]; then
  DLUA_BUILD_DIR=build-emu DLUA_CMAKE_ARGS="-DDLUA_CUDA=EMU" bash scripts/build.sh dlua test_fake_cublaslt test_fake_cudnn test_cuemu
  # the emulator's tests, and the Lua specs again: with a CUDA device present, as on a GPU machine
  ctest --test-dir build-emu --output-on-failure --timeout 1200 -L 'emu|lua' "$@" || rc=1
else
  echo "CUDA emulator tests skipped: no CUDA toolkit headers under ${CUDAToolkit_ROOT:-/usr/local/cuda}/include"
fi
exit $rc
