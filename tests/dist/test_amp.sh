#!/usr/bin/env bash
# GradScaler on 2 ranks through the launcher (DDP and ZeRO-2): a forced overflow skips exactly that step on every rank (tests/dist/amp.lua).
set -u
DLUA=${1:?usage: test_amp.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
export CUDA_VISIBLE_DEVICES=

out=$(timeout 240 "$DLUA" --nproc 2 "$here/amp.lua" 2>&1); rc=$?
expect "a forced overflow skips that step on both ranks (DDP, ZeRO-2)" '[ $rc -eq 0 ] && [ "$(grep -c "amp checks passed" <<<"$out")" = 2 ]' "$out"
no_strays "amp"

finish amp
