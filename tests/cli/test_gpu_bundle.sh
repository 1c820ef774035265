#!/usr/bin/env bash
# scripts/gpu_bundle.sh and tests/gpu/run.sh's use of it, without a GPU: the bundle is built from this
# build, unpacked by run.sh into a fresh folder, forced through the bundled glibc (the path a GPU machine
# with an older glibc takes), reports what it was built against, and --nproc starts ranks through the
# wrapper (DLUA_EXE). With no GPU run.sh then skips every GPU check and exits 0.
#   test_gpu_bundle.sh <build dir>
set -u
build=${1:?usage: test_gpu_bundle.sh <build dir>}
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
check() {  # check <name> <status> <output>
  if [ "$2" = 0 ]; then echo "ok   - $1"; passed=$((passed + 1)); else echo "FAIL - $1"; printf '%s\n' "$3" | tail -n 20; failed=$((failed + 1)); fi
}

out=$(DLUA_BUNDLE_OUT="$tmp/bundle" bash "$root/scripts/gpu_bundle.sh" "$build" 2>&1); rc=$?
[ $rc = 0 ] && [ -f "$tmp/bundle/dlua-gpu.tar.xz" ] && tar -tJf "$tmp/bundle/dlua-gpu.tar.xz" | grep -q '^./sys/libc.so.6$' \
  && tar -tJf "$tmp/bundle/dlua-gpu.tar.xz" | grep -q '^./lib/libdnnl.so'
check "gpu_bundle.sh writes a bundle with dlua, its libraries and a glibc" $? "rc=$rc: $out"

# (CUDA_VISIBLE_DEVICES empty: no GPU even where there is one, or where the build is the CUDA emulator's)
out=$(CUDA_VISIBLE_DEVICES= DLUA_BUNDLE="$tmp/bundle/dlua-gpu.tar.xz" DLUA_BUNDLE_LOADER=1 OUT="$tmp/out" timeout 300 \
  bash "$root/tests/gpu/run.sh" "$tmp/run" 2>&1); rc=$?
[ $rc = 0 ] && grep -q "unpacking" <<<"$out" && grep -q "running dlua through the bundle's glibc" <<<"$out" \
  && grep -q "^dlua [0-9]" <<<"$out" && [ -f "$tmp/out/gpu-report.txt" ]
check "run.sh unpacks the bundle and runs dlua through the bundled loader" $? "rc=$rc: $out"

printf 'local dlua = require "dlua"\ndlua.dist.init()\nlocal t = dlua.ones(3)\ndlua.dist.all_reduce(t)\nprint("sum", t[1])\ndlua.dist.destroy()\n' >"$tmp/ar.lua"
out=$(cd "$tmp" && CUDA_VISIBLE_DEVICES= DLUA_EXE="$tmp/run/dlua" timeout 120 "$tmp/run/dlua" --nproc 2 "$tmp/ar.lua" 2>&1); rc=$?
[ $rc = 0 ] && grep -q "^\[0\] sum	2" <<<"$out" && grep -q "^\[1\] sum	2" <<<"$out"
check "--nproc 2 starts its ranks through the wrapper (DLUA_EXE) and they all-reduce" $? "rc=$rc: $out"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
