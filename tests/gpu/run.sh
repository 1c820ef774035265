#!/usr/bin/env bash
# The GPU checks (DESIGN.md, tests/gpu): on a machine with an NVIDIA GPU and no network, builds dlua
# if needed and runs every CUDA test, writing a report: the allocator suite, the CUDA spec, every CUDA op
# against the CPU (tests/gpu/ops.lua, with GEMM TFLOP/s and bandwidth). ResNet-50 steps join it with cuDNN.
#   tests/gpu/run.sh [build-dir]      (report: $OUT/gpu-report.txt, or build-dir/gpu-report.txt)
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-gpu}
report=${OUT:-$build}/gpu-report.txt
mkdir -p "$(dirname "$report")" "$build"
exec > >(tee "$report") 2>&1
start=$(date +%s)
say() { printf '== %s\n' "$*"; }

say "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"

# cuDNN/cuBLAS/NCCL: the CUDA toolkit's lib64, or Python packages' nvidia/*/lib folders.
libs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && libs="$libs:$d"; done
for d in $(python3 -c 'import site,glob;print(" ".join(p for s in site.getsitepackages() for p in glob.glob(s+"/nvidia/*/lib")))' 2>/dev/null); do
  libs="$libs:$d"
done
export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if [ ! -x "$build/dlua" ]; then
  say "build ($build)"
  arch=native
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDLUA_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=$arch >/dev/null || { echo "configure failed"; exit 1; }
  ninja -C "$build" -j"$(nproc)" dlua tests/test_caching_alloc >/dev/null || { echo "build failed"; exit 1; }
fi

say "dlua -v"
"$build/dlua" -v
if ! "$build/dlua" -e 'os.exit(dlua.cuda.is_available() and 0 or 3)'; then
  echo "no CUDA device visible to dlua: every GPU check is skipped"
  exit 0
fi

status=0
say "allocator suite (fake device) and CUDA spec (real device)"
"$build/tests/test_caching_alloc" || status=1
( cd "$build" && "$build/dlua" "$root/tests/lua/busted.lua" "$root/tests/lua/dlua/cuda_spec.lua" ) || status=1

say "every CUDA op against the CPU backend, then GEMM / bandwidth numbers (tests/gpu/ops.lua)"
# The CPU references run on all cores; the comparisons print a table per op and each failure.
( cd "$build" && timeout 240 "$build/dlua" "$root/tests/gpu/ops.lua" cuda ) || status=1

say "memory statistics after the spec"
"$build/dlua" -e '
  local cuda = dlua.cuda
  local a = dlua.empty(256, 1024, 1024, {dtype = "uint8", device = "cuda"})
  a:free()
  for k, v in pairs(cuda.memory_stats()) do print(string.format("%-16s %d", k, v)) end'

say "process groups: NCCL, and gloo staging CUDA tensors (tests/gpu/nccl.sh)"
"$root/tests/gpu/nccl.sh" "$build/dlua" || status=1

say "done in $(( $(date +%s) - start )) s, status $status"
exit $status
