#!/usr/bin/env bash
# Resume bit-exactness through the recipes: a straight 2-rank run against --stop-after + --resume auto (twice, once
# saving asynchronously), comparing every printed loss and the final `parameters crc32`; then the same checkpoint
# resumed on 1 and on 3 ranks. fashion_mnist (small_cnn) and resnet50_ddp (resnet18), tiny sizes.
# usage: ckpt_resume.sh path/to/dlua
set -u
DLUA=$(readlink -f "${1:?usage: ckpt_resume.sh path/to/dlua}")
cd "$(dirname "$0")/../.."
export CUDA_VISIBLE_DEVICES=
work=$(mktemp -d /tmp/dlua-ckpt-resume.XXXXXX)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
check() { if [ "$2" = 0 ]; then passed=$((passed + 1)); echo "ok   - $1"; else failed=$((failed + 1)); echo "FAIL - $1"; echo "$3" | sed 's/^/       /'; fi; }
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${DLUA_FASHION_MNIST_ROOT:-}" ]; then
  echo "skip - dataset-fashion-mnist is not installed"
  exit 0
fi
# What must match: rank 0's loss lines and epoch lines without their timings (img/s, ETA), and the checksum.
losses() { sed -n 's/^\[0\] //p' "$@" | grep -E '^(epoch .*loss|parameters crc32)' | sed -E 's/ +[0-9.]+ img\/s.*$//; s/ +img\/s [0-9.]+$//' ; }

run() {  # name nproc recipe args...
  local name=$1 n=$2; shift 2
  timeout 300 "$DLUA" --nproc "$n" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || { echo "FAIL - $name exited $rc"; tail -20 "$work/$name.log" | sed 's/^/       /'; failed=$((failed + 1)); }
  return $rc
}

# ---- fashion_mnist: 2 ranks x 256 images, batch 32: 8 steps per epoch, 2 epochs
fm=(recipes/fashion_mnist.lua --model small_cnn --limit 512 --batch 32 --epochs 2 --eval-batch 1000 --print-every 1 --threads 1)
run fm_straight 2 "${fm[@]}"
run fm_a 2 "${fm[@]}" --save "$work/fm" --save-every 3 --keep 2 --stop-after 5          # mid epoch 1
run fm_b 2 "${fm[@]}" --save "$work/fm" --save-every 3 --keep 2 --stop-after 12 --save-async --resume auto  # across the epoch end
cp -r "$work/fm/step-000012" "$work/fm12"  # for the runs on 1 and 3 ranks below (rotation removes it)
run fm_c 2 "${fm[@]}" --save "$work/fm" --save-every 3 --keep 2 --resume auto
straight=$(losses "$work/fm_straight.log")
resumed=$(losses "$work/fm_a.log" "$work/fm_b.log" "$work/fm_c.log" | grep -v '^parameters' ; losses "$work/fm_c.log" | grep '^parameters')
[ -n "$straight" ] && [ "$straight" = "$resumed" ] && [ "$(grep -c '^epoch' <<<"$straight")" -ge 18 ]
check "fashion_mnist: stop at 5, resume, stop at 12 (async), resume = the straight run (every loss, the crc)" $? "$(diff <(echo "$straight") <(echo "$resumed"))"
grep -q "resumed from $work/fm/step-000005: step 5, epoch 1" "$work/fm_b.log" && grep -q "resumed from $work/fm/step-000012: step 12, epoch 2" "$work/fm_c.log"
check "fashion_mnist: each resume names its checkpoint, step and epoch" $? "$(grep resumed "$work"/fm_*.log)"
[ "$(ls "$work/fm" | grep '^step-' | tr '\n' ' ')" = "step-000015 step-000016 " ] && [ "$(cat "$work/fm/latest")" = step-000016 ]
check "fashion_mnist: --keep 2 left two checkpoints, latest the last" $? "$(ls "$work/fm"; cat "$work/fm/latest")"
# the step-12 checkpoint (2 ranks, mid epoch 2) on 1 and on 3 ranks: the cursor re-split, run to the end
for n in 1 3; do
  run fm_on$n $n "${fm[@]}" --resume "$work/fm12"
  grep -q "resumed from $work/fm12: step [0-9]*, epoch 2 (saved by 2 ranks, now $n)" "$work/fm_on$n.log" \
    && grep -Eq '^\[0\] parameters crc32 [0-9a-f]{8}$' "$work/fm_on$n.log" && grep -q '^\[0\] epoch 2  train loss' "$work/fm_on$n.log"
  check "fashion_mnist: a 2-rank checkpoint resumes on $n rank(s) and trains to the end" $? "$(tail -5 "$work/fm_on$n.log")"
done

# ---- resnet50_ddp (resnet18): 2 ranks x 64 images, batch 16, accumulate 2: 2 steps per epoch, 2 epochs
rn=(recipes/resnet50_ddp.lua --model resnet18 --limit 128 --batch 16 --accumulate 2 --image-size 28 --eval-limit 64 --epochs 2
  --print-every 1 --threads 1)
run rn_straight 2 "${rn[@]}"
run rn_a 2 "${rn[@]}" --save "$work/rn" --stop-after 3
run rn_b 2 "${rn[@]}" --save "$work/rn" --resume auto
straight=$(losses "$work/rn_straight.log")
resumed=$(losses "$work/rn_a.log" "$work/rn_b.log" | grep -v '^parameters'; losses "$work/rn_b.log" | grep '^parameters')
[ -n "$straight" ] && [ "$straight" = "$resumed" ] && grep -q '^parameters' <<<"$straight"
check "resnet50_ddp: stop at 3 (mid epoch 2), resume = the straight run (every loss, the crc)" $? "$(diff <(echo "$straight") <(echo "$resumed"))"

# ---- a compressor's state (top-k residuals; PowerSGD's residuals, Q and step, from its step 10) and the f16 loss
# scaler resume too: stop, resume, the straight run's every loss and crc (#22, #20)
resume_same() {  # tag stop-step args...
  local tag=$1 stop=$2; shift 2
  run "${tag}_straight" 2 "$@" && run "${tag}_a" 2 "$@" --save "$work/$tag" --stop-after "$stop" \
    && run "${tag}_b" 2 "$@" --save "$work/$tag" --resume auto || return 1
  local straight resumed
  straight=$(losses "$work/${tag}_straight.log")
  resumed=$(losses "$work/${tag}_a.log" "$work/${tag}_b.log" | grep -v '^parameters'; losses "$work/${tag}_b.log" | grep '^parameters')
  [ -n "$straight" ] && [ "$straight" = "$resumed" ] && grep -q '^parameters' <<<"$straight" && grep -q "resumed from $work/$tag/$(printf step-%06d "$stop")" "$work/${tag}_b.log" \
    || { diff <(echo "$straight") <(echo "$resumed"); return 1; }
}
out=$(resume_same fm_topk 5 "${fm[@]}" --compress topk:0.05); check "fashion_mnist --compress topk:0.05: stop at 5, resume = the straight run" $? "$out"
out=$(resume_same fm_psgd 12 "${fm[@]}" --compress powersgd:1); check "fashion_mnist --compress powersgd:1: stop at 12 (after its start), resume = the straight run" $? "$out"
out=$(resume_same fm_f16 5 "${fm[@]}" --amp f16); check "fashion_mnist --amp f16: stop at 5, resume = the straight run (the scaler's state)" $? "$out"
out=$(resume_same rn_topk 3 "${rn[@]}" --compress topk:0.05); check "resnet50_ddp --compress topk:0.05: stop at 3, resume = the straight run" $? "$out"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
