#!/usr/bin/env bash
# SyncBatchNorm end to end: tests/dist/syncbn.lua on 2 and 3 ranks through the launcher (DDP + SyncBatchNorm = one process on the whole batch).
set -u
DLUA=${1:?usage: test_syncbn.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
export CUDA_VISIBLE_DEVICES=

for n in 2 3; do
  out=$(timeout 240 "$DLUA" --nproc $n "$here/syncbn.lua" 2>&1); rc=$?
  expect "SyncBatchNorm on $n ranks" '[ $rc -eq 0 ] && [ "$(grep -c "SyncBatchNorm checks passed" <<<"$out")" = $n ]' "$out"
done

finish syncbn
