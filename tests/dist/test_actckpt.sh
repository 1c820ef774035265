#!/usr/bin/env bash
# Activation checkpointing under DDP: tests/dist/actckpt.lua on 2 ranks through the launcher.
set -u
DLUA=${1:?usage: test_actckpt.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
export CUDA_VISIBLE_DEVICES=

out=$(timeout 240 "$DLUA" --nproc 2 "$here/actckpt.lua" 2>&1); rc=$?
expect "checkpointed blocks under DDP on 2 ranks" '[ $rc -eq 0 ] && [ "$(grep -c "activation checkpointing checks passed" <<<"$out")" = 2 ]' "$out"
no_strays "actckpt"

finish actckpt
