#!/usr/bin/env bash
# dist.ZeRO through the launcher: stages 1-3 equal DDP on 1-4 ranks (tests/dist/zero.lua), offload's CPU no-op message, checkpoints saved on N ranks at one stage and loaded on M at another (and into DDP).
set -u
DLUA=${1:?usage: zero.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
export CUDA_VISIBLE_DEVICES=

for n in 1 2 3 4; do
  out=$(timeout 180 "$DLUA" --nproc $n "$here/zero.lua" 2>&1); rc=$?
  expect "ZeRO stages 1-3 equal DDP on $n ranks" '[ $rc -eq 0 ] && [ "$(grep -c "zero checks passed" <<<"$out")" = $n ]' "$out"
  grep 'zero: worst' <<<"$out" | sed "s/^\[0\] /     $n ranks: /"
  if [ $n = 2 ]; then
    expect "offload on CPU says it is a no-op, once" '[ "$(grep -c "offload = true is a no-op" <<<"$out")" = 1 ]' "$out"
  fi
done

# over TCP (gloo's ring reductions: another summation order, every case held to the tolerance)
out=$(DLUA_SHM=0 timeout 180 "$DLUA" --nproc 3 "$here/zero.lua" 2>&1); rc=$?
expect "ZeRO stages 1-3 equal DDP on 3 ranks over TCP" '[ $rc -eq 0 ] && [ "$(grep -c "zero checks passed" <<<"$out")" = 3 ]' "$out"
grep 'zero: worst' <<<"$out" | sed "s/^\[0\] /     3 ranks, TCP: /"

# save (ranks stage how) -> loads (ranks stage ...)
ck() {
  local name=$1 n=$2 s=$3 how=$4; shift 4
  out=$(timeout 120 "$DLUA" --nproc $n "$here/zero.lua" save "$work/$name" $s $how 2>&1); rc=$?
  expect "stage $s on $n ranks saves a $how checkpoint" '[ $rc -eq 0 ] && [ -f "$work/$name/step-000010/index.json" ]' "$out"
  while [ $# -gt 0 ]; do
    local m=$1 t=$2; shift 2
    out=$(timeout 120 "$DLUA" --nproc $m "$here/zero.lua" load "$work/$name" $t 2>&1); rc=$?
    expect "  ... loads on $m ranks at stage $t" '[ $rc -eq 0 ] && [ "$(grep -c "parameters and optimizer state agree" <<<"$out")" = $m ]' "$out"
  done
}
ck z2 2 2 sharded  3 3  1 1  2 0
ck z3 3 3 full     2 2  4 1
ck ddp 2 0 sharded 3 3
no_strays "zero"
finish "dist/zero"
