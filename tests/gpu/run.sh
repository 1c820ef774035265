#!/usr/bin/env bash
# The GPU checks (DESIGN.md, tests/gpu): on a machine with an NVIDIA GPU and no network, builds dlua
# if needed and runs every CUDA test, writing a report: the allocator suite, the CUDA spec, every CUDA op
# against the CPU (tests/backend/run.lua cuda), ResNet-50 steps against the CPU (tests/gpu/resnet50.lua), then a table of
# ResNet-50 training img/s and GEMM TFLOP/s, dlua beside PyTorch on the same GPU (bench/gpu_resnet50.py).
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

# A bundle from scripts/gpu_bundle.sh (bundle/dlua-gpu.tar.xz) stands in for a build: binaries and their
# non-CUDA libraries; if this machine's glibc is older than the binary needs, dlua runs through the
# bundle's own dynamic loader and glibc (sys/), behind a wrapper that --nproc also uses (DLUA_EXE).
# DLUA_BUNDLE: another bundle file; DLUA_BUNDLE_LOADER=1: use the bundled glibc even if not needed (tests).
bundle=${DLUA_BUNDLE:-$root/bundle/dlua-gpu.tar.xz}
if [ ! -x "$build/dlua" ] && [ -f "$bundle" ]; then
  say "unpacking $bundle into $build (commit $(tar -xJOf "$bundle" ./COMMIT 2>/dev/null))"
  tar -C "$build" -xJf "$bundle" || { echo "cannot unpack the bundle"; exit 1; }
fi
if [ -d "$build/lib" ] && [ -d "$build/sys" ]; then
  export LD_LIBRARY_PATH="$build/lib:$LD_LIBRARY_PATH"
  why=""
  if [ -x "$build/sys/ld-linux-x86-64.so.2" ]; then
    if [ -e "$build/dlua.bin" ]; then
      why="set up by an earlier run"
    elif [ "${DLUA_BUNDLE_LOADER:-0}" = 1 ]; then
      why="DLUA_BUNDLE_LOADER=1"
    elif ! "$build/dlua" -v >/dev/null 2>"$build/native.err"; then
      why="the bundled binary does not start with this machine's libraries: $(head -c 300 "$build/native.err")"
    fi
  fi
  if [ -n "$why" ]; then
    echo "running dlua through the bundle's glibc ($why)"
    [ -e "$build/dlua.bin" ] || mv "$build/dlua" "$build/dlua.bin"
    # dlua's root is now the loader's ../ (= $build): the Lua tree and the specs' helpers must be seen there
    for d in lua bindings models recipes; do ln -sfn "$root/$d" "$build/$d"; done
    mkdir -p "$build/tests" && ln -sfn "$root/tests/lua" "$build/tests/lua" && ln -sfn "$root/tests/gpu" "$build/tests/gpu" \
      && ln -sfn "$root/tests/backend" "$build/tests/backend"
    cat >"$build/dlua" <<WRAP
#!/bin/sh
exec "$build/sys/ld-linux-x86-64.so.2" --library-path "$build/sys:$LD_LIBRARY_PATH" "$build/dlua.bin" "\$@"
WRAP
    chmod +x "$build/dlua"
    export DLUA_EXE="$build/dlua"
  fi
fi

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
if [ -e "$build/dlua.bin" ]; then  # loader mode (above)
  "$build/sys/ld-linux-x86-64.so.2" --library-path "$build/sys:$LD_LIBRARY_PATH" "$build/tests/test_caching_alloc" || status=1
else
  "$build/tests/test_caching_alloc" || status=1
fi
( cd "$build" && "$build/dlua" "$root/tests/lua/busted.lua" "$root/tests/lua/dlua/cuda_spec.lua" ) || status=1

say "every CUDA op against the CPU backend (tests/backend/run.lua cuda: the backend test table)"
# The CPU references run on all cores; the runner prints a table per op and dtype, and each failure.
( cd "$build" && timeout 300 "$build/dlua" "$root/tests/backend/run.lua" cuda ) || { echo "FAIL: backend table"; status=1; }

say "mixed precision on CUDA: autocast bf16, f16 with the scaler, against the CPU (tests/emu/amp.lua)"
( cd "$build" && timeout 300 "$build/dlua" "$root/tests/emu/amp.lua" ) || { echo "FAIL: amp"; status=1; }
say "gradient compression hooks on CUDA buckets against the CPU hooks, 2 ranks on gloo (tests/dist/compress_cuda.lua)"
( cd "$build" && timeout 300 "$build/dlua" --nproc 2 "$root/tests/dist/compress_cuda.lua" ) || { echo "FAIL: compress_cuda"; status=1; }

say "TF32, then GEMM / bandwidth / convolution / batch-norm / sort timings (tests/gpu/timings.lua)"
( cd "$build" && timeout 240 "$build/dlua" "$root/tests/gpu/timings.lua" cuda ) || { echo "FAIL: timings"; status=1; }

say "ResNet-50 training steps on CUDA: f32 against the CPU, f32/bf16/f16 channels-last (tests/gpu/resnet50.lua)"
( cd "$build" && timeout 300 "$build/dlua" "$root/tests/gpu/resnet50.lua" check cuda ) || { echo "FAIL: resnet50 check"; status=1; }

say "benchmark: dlua vs PyTorch on this GPU (bench/gpu_resnet50.py)"
val() { awk -F'\t' -v k="$1" '$1 == k {print $2}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2fx", a / b; else print "n/a" }'; }
printf '%-44s %12s %12s %8s\n' "what" "dlua" "pytorch" "ratio"
# dlua.amp autocast (+ GradScaler for float16) against torch.autocast + GradScaler; then dlua's all-16-bit model
# with float32 master weights (PyTorch AMP's O2, DeepSpeed's bf16 optimizer) against the same torch AMP numbers
for dt in bfloat16 float16; do
  t=$(timeout 240 python3 "$root/bench/gpu_resnet50.py" resnet50 $dt 128 50 2>&1)
  ti=$(printf '%s\n' "$t" | val img/s)
  [ -n "$ti" ] || printf '%s\n' "$t" | tail -n 5
  for how in amp o2; do
    d=$(cd "$build" && timeout 240 "$build/dlua" "$root/tests/gpu/resnet50.lua" bench cuda $dt 128 50 $how 2>&1)
    di=$(printf '%s\n' "$d" | val img/s)
    [ -n "$di" ] || printf '%s\n' "$d" | tail -n 5
    printf '%-44s %12s %12s %8s\n' "ResNet-50 train img/s, b128, $dt, NHWC, $how" "${di:-fail}" "${ti:-fail}" "$(ratio "${di:-0}" "${ti:-0}")"
    printf '%-44s %12s %12s\n' "  peak memory MiB" "$(printf '%s\n' "$d" | val peak_mib)" "$(printf '%s\n' "$t" | val peak_mib)"
  done
done
dg=$(cd "$build" && timeout 120 "$build/dlua" "$root/tests/gpu/resnet50.lua" gemm cuda 2>&1 | val tflops)
tg=$(timeout 120 python3 "$root/bench/gpu_resnet50.py" gemm 2>&1 | val tflops)
printf '%-44s %12s %12s %8s\n' "GEMM 8192^3 bf16 TFLOP/s" "${dg:-fail}" "${tg:-fail}" "$(ratio "${dg:-0}" "${tg:-0}")"

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
