#!/usr/bin/env bash
# GPU checks of the NCCL process group and gloo's pinned staging of CUDA tensors (docs/comm.md).
#   tests/gpu/nccl.sh <dlua binary>     (run.sh calls it; exits non-zero when a check fails)
# Every collective on every dtype against CPU-computed results: NCCL at world size 1 (nccl and auto),
# 2 ranks sharing one GPU through gloo staging, 2 ranks on NCCL when there are 2 GPUs; DDP on CUDA
# (tests/dist/ddp.lua) and a short recipes/resnet50_ddp.lua run; a rank missing
# from an NCCL join fails with a diagnostic instead of hanging; world-1 all-reduce timings.
set -u
dlua=${1:?usage: nccl.sh <dlua binary>}
root=$(cd "$(dirname "$0")/../.." && pwd)
coll=$root/tests/gpu/nccl_collectives.lua
status=0
ngpu=$("$dlua" -e 'print(dlua.cuda.device_count())' 2>/dev/null || echo 0)
step() { printf -- '-- %s\n' "$*"; }
check() {  # check <name> <timeout s> <command...>: runs it, shows its tail, records failure
  local name=$1 t=$2
  shift 2
  local out rc
  out=$(timeout "$t" "$@" 2>&1)
  rc=$?
  printf '%s\n' "$out" | tail -n 6
  if [ $rc -ne 0 ]; then
    echo "FAIL: $name (exit $rc)"
    status=1
  else
    echo "ok: $name"
  fi
}

step "NCCL, world size 1: every collective and dtype vs CPU results"
check "nccl world 1" 180 "$dlua" "$coll" nccl quick
step "auto, world size 1 (CUDA tensors go to NCCL, CPU ones to gloo)"
check "auto world 1" 180 "$dlua" -e '
  dist = dlua.dist
  dist.init{backend = "auto", timeout = 30}
  assert(dist.backend() == "gloo+nccl", dist.backend())
  local c = dlua.full({5}, 3):cuda()
  dist.all_reduce(c, "sum")
  local h = dlua.full({5}, 3)
  dist.all_reduce(h, "sum")
  assert(c:cpu():eq(h):all():item(), "cuda vs cpu")
  dist.destroy()
  print("auto: ok")'
step "gloo, 2 ranks sharing one GPU: CUDA tensors through pinned staging"
check "gloo staging 2 ranks" 240 "$dlua" --nproc 2 "$coll" gloo quick
if [ "$ngpu" -ge 2 ]; then
  step "NCCL, 2 ranks on 2 GPUs"
  check "nccl 2 ranks" 240 "$dlua" --nproc 2 "$coll" nccl quick
else
  echo "skip: NCCL with 2 ranks needs 2 GPUs (this machine has $ngpu)"
fi

ddp=$root/tests/dist/ddp.lua
step "DDP on CUDA (#7): N ranks = one process on the N-times batch, accumulation, no_sync, unused parameters, overlap"
check "ddp cuda, NCCL world 1" 180 "$dlua" "$ddp" cuda auto
check "ddp cuda, gloo staging, 2 ranks on one GPU" 240 "$dlua" --nproc 2 "$ddp" cuda gloo
check "SyncBatchNorm + DDP on cuda vs one CPU process, gloo staging, 2 ranks on one GPU" 240 "$dlua" --nproc 2 "$root/tests/dist/syncbn.lua" cuda
if [ "$ngpu" -ge 2 ]; then
  check "ddp cuda, NCCL 2 ranks" 240 "$dlua" --nproc 2 "$ddp" cuda auto
fi
step "recipes/resnet50_ddp.lua on the GPU, briefly (NCCL, channels-last)"
if [ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${DLUA_FASHION_MNIST_ROOT:-}" ]; then
  # no apt on the GPU machine: random images in Fashion-MNIST's file format, so the recipe runs as it would
  export DLUA_FASHION_MNIST_ROOT=$(mktemp -d)
  trap 'rm -rf "$DLUA_FASHION_MNIST_ROOT"' EXIT
  "$dlua" "$root/tests/data/fake_fashion_mnist.lua" "$DLUA_FASHION_MNIST_ROOT"
  echo "(no Fashion-MNIST here: random images in its format under $DLUA_FASHION_MNIST_ROOT)"
fi
check "resnet50_ddp on cuda" 240 "$dlua" "$root/recipes/resnet50_ddp.lua" --epochs 1 --limit 2048 --batch 64 \
  --eval-limit 512 --print-every 8 --device cuda

step "NCCL join with a missing rank: fails within the timeout, naming it"
port=$(( 20000 + RANDOM % 20000 ))
out=$(RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      timeout 60 "$dlua" -e 'dlua.dist.init{backend = "nccl", timeout = 5}' 2>&1)
rc=$?
printf '%s\n' "$out" | tail -n 3
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && printf '%s' "$out" | grep -q "never arrived"; then
  echo "ok: missing rank named"
else
  echo "FAIL: missing rank (exit $rc)"
  status=1
fi

step "NCCL all-reduce at world size 1 (float32, synchronous: each call waits for the GPU)"
"$dlua" -e '
  local dist = dlua.dist
  dist.init{backend = "nccl", timeout = 60}
  for _, mb in ipairs({0.004, 1, 64, 256}) do
    local n = math.floor(mb * 2^20 / 4)
    local t = dlua.zeros({n}):cuda()
    dist.all_reduce(t)
    local reps = mb < 10 and 50 or 10
    local t0 = dlua.perf_counter()
    for _ = 1, reps do dist.all_reduce(t) end
    local s = (dlua.perf_counter() - t0) / reps
    print(string.format("%10.3f MB  %9.1f us  %8.2f GB/s (algbw)", mb, s * 1e6, n * 4 / s / 1e9))
  end
  dist.destroy()' || { echo "FAIL: all-reduce timing"; status=1; }
exit $status
