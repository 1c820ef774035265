#!/usr/bin/env bash
# SyncBatchNorm end to end: tests/dist/syncbn.lua on 2 and 3 ranks through the launcher (DDP + SyncBatchNorm = one process on the whole batch).
set -u
DLUA=${1:?usage: test_syncbn.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
pass=0 failn=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { failn=$((failn + 1)); echo "FAIL $1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | sed 's/^/     | /'; }
expect() { if eval "$2"; then ok "$1"; else bad "$1" "$3"; fi; }
export CUDA_VISIBLE_DEVICES=

for n in 2 3; do
  out=$(timeout 240 "$DLUA" --nproc $n "$here/syncbn.lua" 2>&1); rc=$?
  expect "SyncBatchNorm on $n ranks" '[ $rc -eq 0 ] && [ "$(grep -c "SyncBatchNorm checks passed" <<<"$out")" = $n ]' "$out"
done

echo "syncbn: $pass passed, $failn failed"
[ $failn -eq 0 ]
