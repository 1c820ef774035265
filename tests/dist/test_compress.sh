#!/usr/bin/env bash
# Gradient compression hooks: tests/dist/compress.lua on 2 ranks through the launcher.
set -u
DLUA=${1:?usage: test_compress.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
export CUDA_VISIBLE_DEVICES=

out=$(timeout 240 "$DLUA" --nproc 2 "$here/compress.lua" "$work/ckpt" 2>&1); rc=$?
expect "fp16/bf16/top-k/PowerSGD hooks on 2 ranks: exact equalities, residuals, same ranks, resume, ZeRO, specs" \
  '[ $rc -eq 0 ] && [ "$(grep -c "compress checks passed" <<<"$out")" = 2 ]' "$out"
printf '%s\n' "$out" | grep '^\[0\]' | grep -v 'passed'
no_strays "compress"

finish compress
