#!/usr/bin/env bash
# `dlua experiment NAME --tiny` for each of the five, `dlua plot` overlaying two runs, and the subcommands' errors.
# usage: test_experiments.sh path/to/dlua [names...]   (default: all five)
set -u
DLUA=$(readlink -f "${1:?usage: test_experiments.sh path/to/dlua [names...]}")
shift
cd "$(dirname "$0")/../.."
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(accumulation backends amp activation-checkpointing buckets)
work=$(mktemp -d /tmp/dlua-exp-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
check() { # name, condition-result, detail
  if [ "$2" = 0 ]; then passed=$((passed + 1)); echo "ok   - $1"; else failed=$((failed + 1)); echo "FAIL - $1"; echo "$3" | sed 's/^/       /'; fi
}
export CUDA_VISIBLE_DEVICES=

if ! command -v gnuplot >/dev/null; then
  out=$("$DLUA" experiment amp --tiny --out "$work/x" 2>&1); rc=$?
  [ $rc = 1 ] && grep -q "gnuplot is not installed (apt-get install gnuplot-nox" <<<"$out"
  check "without gnuplot the experiment says how to get it" $? "rc=$rc: $out"
  echo "skip - the experiments and dlua plot: gnuplot is not installed (Debian gnuplot-nox)"
  echo "experiments: $passed passed, $failed failed"
  [ $failed = 0 ]; exit
fi

png_ok() { # file: decodes, at least 640x400, more than 8 colours, 0.5%..60% ink
  local o
  o=$("$DLUA" tests/cli/check_png.lua "$1" 2>&1) || { echo "$o"; return 1; }
  awk '/^png/ { split($4, c, "="); split($5, k, "="); ok = ($2 >= 640 && $3 >= 400 && c[2] > 8 && k[2] > 0.005 && k[2] < 0.6) }
       END { exit ok ? 0 : 1 }' <<<"$o" || { echo "$o"; return 1; }
}

for n in "${names[@]}"; do
  out=$(timeout 300 "$DLUA" experiment "$n" --tiny --out "$work/$n" 2>&1); rc=$?
  [ $rc = 0 ]
  check "experiment $n --tiny runs" $? "rc=$rc: $(tail -30 <<<"$out")"
  detail=$("$DLUA" tests/cli/check_experiment.lua "$n" "$work/$n" 2>&1)
  check "experiment $n --tiny writes its table" $? "$detail
$(tail -20 <<<"$out")"
  detail=$(png_ok "$work/$n/$n.png" 2>&1)
  check "experiment $n --tiny writes a PNG that decodes and is not blank" $? "$detail"
done

# dlua plot: two runs overlaid; gnuplot's first two line colours both drawn (one run: only the first)
a=$work/run-a.jsonl b=$work/run-b.jsonl
if [ -f "$work/accumulation/accumulate-1.jsonl" ]; then
  cp "$work/accumulation/accumulate-1.jsonl" "$a"; cp "$work/accumulation/accumulate-2.jsonl" "$b"
else
  timeout 120 "$DLUA" recipes/fashion_mnist.lua --model small_cnn --limit 256 --batch 32 --epochs 1 --eval-limit 64 --metrics "$a" >/dev/null 2>&1
  timeout 120 "$DLUA" recipes/fashion_mnist.lua --model small_cnn --limit 256 --batch 32 --epochs 1 --eval-limit 64 --lr 0.02 --metrics "$b" >/dev/null 2>&1
fi
out=$("$DLUA" plot "$a" "$b" -o "$work/two.png" 2>&1); rc=$?
[ $rc = 0 ] && grep -q "two.png (2 runs" <<<"$out" && png_ok "$work/two.png"
check "dlua plot draws two runs into one PNG" $? "rc=$rc: $out"
"$DLUA" plot "$a" -o "$work/one.png" >/dev/null 2>&1
c2=$("$DLUA" tests/cli/check_png.lua "$work/two.png" 148,0,211 0,158,115 2>&1)
c1=$("$DLUA" tests/cli/check_png.lua "$work/one.png" 148,0,211 0,158,115 2>&1)
awk '/^colour/ { split($3, p, "="); n[++i] = p[2] } END { exit (n[1] > 100 && n[2] > 100) ? 0 : 1 }' <<<"$c2" &&
  awk '/^colour/ { split($3, p, "="); n[++i] = p[2] } END { exit (n[1] > 100 && n[2] < 20) ? 0 : 1 }' <<<"$c1"
check "dlua plot overlays: both runs' colours in the two-run PNG, only the first in the one-run PNG" $? "two: $c2
one: $c1"

out=$("$DLUA" plot 2>&1); rc=$?
[ $rc = 2 ] && grep -q "give at least one metrics file" <<<"$out"
check "dlua plot without files: usage, exit 2" $? "rc=$rc: $out"
out=$("$DLUA" plot "$work/nosuch.jsonl" 2>&1); rc=$?
[ $rc = 1 ] && grep -q "nosuch.jsonl" <<<"$out"
check "dlua plot names a missing file" $? "rc=$rc: $out"
printf '{"kind":"step","step":1}\n{"kind": oops}\n' >"$work/bad.jsonl"
out=$("$DLUA" plot "$work/bad.jsonl" 2>&1); rc=$?
[ $rc = 1 ] && grep -q "bad.jsonl:2: invalid JSON" <<<"$out"
check "dlua plot names the bad line of a file" $? "rc=$rc: $out"
out=$(PATH=/nonexistent "$DLUA" plot "$a" -o "$work/x.png" 2>&1); rc=$?
[ $rc = 1 ] && grep -q "gnuplot is not installed (apt-get install gnuplot-nox" <<<"$out"
check "dlua plot without gnuplot says how to get it" $? "rc=$rc: $out"
out=$("$DLUA" experimnet 2>&1); rc=$?
[ $rc = 1 ] && grep -q "^dlua: cannot open experimnet (No such file or directory; nor is it a subcommand" <<<"$out" &&
  grep -q "did you mean 'experiment'" <<<"$out" && [ "$(wc -l <<<"$out")" = 1 ]
check "an unknown subcommand: no such file, the closest subcommand" $? "rc=$rc: $out"
out=$("$DLUA" experiment bucket --tiny 2>&1); rc=$?
[ $rc = 2 ] && grep -q "no experiment 'bucket'" <<<"$out" && grep -q "did you mean 'buckets'" <<<"$out"
check "an unknown experiment is named, with the closest" $? "rc=$rc: $out"
out=$("$DLUA" experiment buckets --tiny --modle resnet18 2>&1); rc=$?
[ $rc = 2 ] && grep -q "unknown option '--modle' (did you mean '--model'?)" <<<"$out"
check "an experiment's unknown option is named, with the closest" $? "rc=$rc: $out"

echo "experiments: $passed passed, $failed failed"
[ $failed = 0 ]
