#!/usr/bin/env bash
# DDP bucket_mb = 'auto': tests/dist/ddp_auto.lua on 2 ranks through the launcher.
set -u
DLUA=${1:?usage: test_ddp_auto.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
export CUDA_VISIBLE_DEVICES=

out=$(timeout 240 "$DLUA" --nproc 2 "$here/ddp_auto.lua" 2>&1); rc=$?
expect "bucket_mb = 'auto' on 2 ranks: a plan kept, the same result as that plan fixed; comm_wait_s counts a late peer" '[ $rc -eq 0 ] && [ "$(grep -c "ddp auto checks passed (4)" <<<"$out")" = 2 ]' "$out"
expect "the choice is reported once, by rank 0" '[ "$(grep -c "DDP bucket_mb=auto: keeping" <<<"$out")" = 2 ] && ! grep -q "^\[1\] DDP bucket_mb=auto" <<<"$out"' "$out"
no_strays "ddp_auto"

finish ddp_auto
