#!/usr/bin/env bash
# dist.Pipeline end to end: tests/dist/pipeline.lua on 4 ranks, stages that do not fit together, and the recipe's --pipeline.
set -u
DLUA=${1:?usage: test_pipeline.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
. "$here/common.sh"
export CUDA_VISIBLE_DEVICES=

out=$(timeout 240 "$DLUA" --nproc 4 "$here/pipeline.lua" 2>&1); rc=$?
expect "pipeline on 4 ranks (gradients = the unsplit model, 2x2 = one rank, activations held)" \
  '[ $rc -eq 0 ] && [ "$(grep -c "pipeline checks passed" <<<"$out")" = 4 ]' "$out"
no_strays "pipeline on 4 ranks"

# stage 2 takes 7 features, stage 1 gives 16: the job fails at once, naming the stage, both shapes and the line
cat >"$work/misfit.lua" <<'LUA'
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local dist = dlua.dist
dist.init{ timeout = 60 }
local stages = { nn.Sequential{ nn.Linear(6, 16), nn.ReLU() }, nn.Sequential{ nn.Linear(7, 3) } }
local pipe = dist.Pipeline(stages, { chunks = 2, loss = nn.MSELoss() })
pipe:step(dlua.randn({ 8, 6 }), dlua.zeros({ 8, 3 }))
LUA
start=$(date +%s)
out=$(timeout 120 "$DLUA" --nproc 2 "$work/misfit.lua" 2>&1); rc=$?
took=$(( $(date +%s) - start ))
expect "stages that do not fit: the job fails ($took s, not the 60 s timeout)" '[ $rc -eq 1 ] && [ $took -lt 40 ]' "$out"
expect "stages that do not fit: names stage 2, its input (4, 16) from stage 1, the (N, 7) it takes and the line" \
  'grep -F "rank 1 failed" <<<"$out" | grep -F "misfit.lua:7: Pipeline stage 2 of 2 (rank 1), forward of micro-batch 1 of 2, input (4, 16) float32 from stage 1: 0 (Linear) forward: expected (N, 7)" -q' "$out"
no_strays "stages that do not fit"

# the recipe: 2 pipelines of 2 stages on 4 ranks (DDP across the replicas), then one pipeline on 2 ranks by GPipe
out=$(cd "$root" && timeout 300 "$DLUA" --nproc 4 recipes/resnet50_ddp.lua --model resnet18 --limit 64 --eval-limit 32 \
  --batch 8 --image-size 16 --pipeline 2 --chunks 3 --split params 2>&1); rc=$?
expect "resnet50_ddp --pipeline 2 on 4 ranks: trains, evaluates and reports the schedule" \
  '[ $rc -eq 0 ] && grep -q "2 pipelines x 2 stages x batch 8 in 3 micro-batches (1f1b) = global batch 16" <<<"$out" && grep -q "DDP across the 2 replicas of each stage" <<<"$out" && grep -Eq "^\[0\] epoch 1  train loss [0-9.]+  test accuracy 0\.[0-9]{4} \(32 images\)" <<<"$out" && grep -q "bubble .* measured" <<<"$out"' "$out"
out=$(cd "$root" && timeout 300 "$DLUA" --nproc 4 recipes/resnet50_ddp.lua --model resnet18 --limit 32 --eval-limit 16 \
  --batch 8 --image-size 16 --pipeline 2 --chunks 2 --split params --zero 1 2>&1); rc=$?
expect "resnet50_ddp --pipeline 2 --zero 1 on 4 ranks: ZeRO-1 across the replicas" \
  '[ $rc -eq 0 ] && grep -q "ZeRO-1 across the 2 replicas of each stage" <<<"$out" && grep -Eq "^\[0\] epoch 1  train loss [0-9.]+" <<<"$out"' "$out"
out=$(cd "$root" && timeout 300 "$DLUA" --nproc 2 recipes/resnet50_ddp.lua --model resnet18 --limit 32 --eval-limit 16 \
  --batch 8 --image-size 16 --pipeline 2 --chunks 2 --schedule gpipe 2>&1); rc=$?
expect "resnet50_ddp --pipeline 2 --schedule gpipe on 2 ranks (stages by measured time)" \
  '[ $rc -eq 0 ] && grep -q "1 pipelines x 2 stages" <<<"$out" && grep -q "stage 1 (by time): conv1 .. " <<<"$out" && grep -q "Pipeline gpipe: 2 stages x 2 micro-batches" <<<"$out"' "$out"
out=$(cd "$root" && timeout 60 "$DLUA" --nproc 3 recipes/resnet50_ddp.lua --pipeline 2 2>&1); rc=$?
expect "resnet50_ddp --pipeline 2 on 3 ranks: a clear error" '[ $rc -eq 1 ] && grep -q "the 3 ranks do not divide into pipelines of 2 stages" <<<"$out"' "$out"

finish pipeline
