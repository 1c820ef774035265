#!/usr/bin/env bash
# dlua.ckpt across ranks: 2-rank saves (full, sharded, async) loaded on 1, 2 and 3 ranks (model, optimizer, data cursor; per-rank state refused, then skipped).
set -u
DLUA=${1:?usage: ckpt.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
export CUDA_VISIBLE_DEVICES=

for how in full sharded async; do
  out=$(timeout 120 "$DLUA" --nproc 2 "$here/ckpt.lua" save "$work/$how" $how 2>&1); rc=$?
  expect "2 ranks save a $how checkpoint" '[ $rc -eq 0 ] && [ -f "$work/$how/step-000005/index.json" ] && [ "$(cat "$work/$how/latest")" = step-000005 ]' "$out"
  if [ $how = sharded ]; then
    expect "sharded: one file per rank" '[ -f "$work/$how/step-000005/shard-00000-of-00002.safetensors" ] && [ -f "$work/$how/step-000005/shard-00001-of-00002.safetensors" ] && [ ! -f "$work/$how/step-000005/model.safetensors" ]' "$(ls "$work/$how/step-000005")"
  fi
  for m in 1 2 3; do
    out=$(timeout 120 "$DLUA" --nproc $m "$here/ckpt.lua" load "$work/$how" 2>&1); rc=$?
    expect "$how checkpoint of 2 ranks loads on $m" '[ $rc -eq 0 ] && grep -q "loaded 2-rank checkpoint on $m ranks: model, momentum and cursor agree" <<<"$out"' "$out"
  done
done
# a shard gone: named, nothing loaded
rm "$work/sharded/step-000005/shard-00001-of-00002.safetensors"
out=$(timeout 120 "$DLUA" --nproc 2 "$here/ckpt.lua" load "$work/sharded" 2>&1); rc=$?
expect "a missing shard is named" '[ $rc -ne 0 ] && grep -q "shard-00001-of-00002.safetensors is missing" <<<"$out"' "$out"
no_strays "ckpt"
finish "dist/ckpt"
