#!/usr/bin/env bash
# dlua.dist end to end: collectives through the launcher, torchrun/Slurm/Open MPI variables, timeouts, debug mode, SPMD REPL.
set -u
DLUA=${1:?usage: test_dist.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
export CUDA_VISIBLE_DEVICES=

# every collective, every dtype, 2 and 3 ranks (3: an odd world; the multi-MB case at 2 and 4)
for n in 2 3 4; do
  q=""; [ $n = 3 ] && q=quick
  out=$(timeout 240 "$DLUA" --nproc $n "$here/collectives.lua" $q 2>&1); rc=$?
  expect "collectives on $n ranks" '[ $rc -eq 0 ] && [ "$(grep -c "checks passed" <<<"$out")" = $n ]' "$out"
done
# and over gloo's TCP, as across hosts
out=$(DLUA_SHM=0 timeout 240 "$DLUA" --nproc 3 "$here/collectives.lua" quick 2>&1); rc=$?
expect "collectives on 3 ranks over TCP (DLUA_SHM=0)" '[ $rc -eq 0 ] && [ "$(grep -c "checks passed" <<<"$out")" = 3 ]' "$out"

# joining a job started by someone else: torchrun, Slurm and Open MPI variables
cat >"$work/join.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 30 }
local t = dlua.full({ 3 }, dist.rank() + 1)
dist.all_reduce(t)
print(string.format('rank %d of %d local %d sum %g', dist.rank(), dist.world_size(), dist.local_rank(), t[1]))
dist.destroy()
LUA
run_pair() {  # NAME VARS-FOR-RANK0 VARS-FOR-RANK1 (each "A=1 B=2")
  local name=$1
  env -u RANK -u WORLD_SIZE $2 timeout 60 "$DLUA" "$work/join.lua" >"$work/r0" 2>&1 &
  local p0=$!
  env -u RANK -u WORLD_SIZE $3 timeout 60 "$DLUA" "$work/join.lua" >"$work/r1" 2>&1
  local rc1=$?
  wait $p0; local rc0=$?
  expect "$name: both ranks join and all_reduce" '[ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] && grep -q "rank 0 of 2 local 0 sum 3" "$work/r0" && grep -q "rank 1 of 2 local 1 sum 3" "$work/r1"' "$(cat "$work/r0" "$work/r1")"
}
port() { echo $(( 20000 + RANDOM % 20000 )); }
p=$(port)
run_pair "torchrun variables" \
  "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$p" \
  "RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$p"
p=$(port)
run_pair "Slurm variables" \
  "SLURM_PROCID=0 SLURM_NTASKS=2 SLURM_LOCALID=0 SLURM_JOB_NODELIST=localhost SLURM_JOB_ID=77 MASTER_PORT=$p" \
  "SLURM_PROCID=1 SLURM_NTASKS=2 SLURM_LOCALID=1 SLURM_JOB_NODELIST=localhost SLURM_JOB_ID=77 MASTER_PORT=$p"
p=$(port)
run_pair "Open MPI variables" \
  "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_COMM_WORLD_LOCAL_SIZE=2 MASTER_PORT=$p" \
  "OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=1 OMPI_COMM_WORLD_LOCAL_SIZE=2 MASTER_PORT=$p"
out=$("$DLUA" -e 'print(dlua.dist._slurm_first_host("gpu[07-09,12],cpu01"), dlua.dist._slurm_first_host("n1,n2"), dlua.dist._slurm_first_host("solo"))')
expect "Slurm node list: first host" '[ "$out" = "$(printf "gpu07\tn1\tsolo")" ]' "$out"
out=$("$DLUA" -e 'local d = dlua.dist; d.init(); print(d.rank(), d.world_size()); local t = dlua.ones({2}); d.all_reduce(t); print(t[1]); d.destroy()' 2>&1)
expect "no job variables: a world of one" '[ "$out" = "$(printf "0\t1\n1")" ]' "$out"

# a rank that skips a collective: the others time out naming it
cat >"$work/skip.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 2 }
local t = dlua.ones({ 4, 5 })
dist.all_reduce(t)
if dist.rank() ~= 1 then
  dist.all_reduce(t)  -- rank 1 skips this one
end
os.execute('sleep 6')
LUA
start=$(date +%s)
out=$(timeout 60 "$DLUA" --nproc 3 "$work/skip.lua" 2>&1); rc=$?
took=$(( $(date +%s) - start ))
expect "skipped collective: the job fails ($took s)" '[ $rc -eq 1 ] && [ $took -le 20 ]' "$out"
expect "skipped collective: names all_reduce #2, its shape and rank 1" 'grep -E "all_reduce #2" <<<"$out" | grep -F "(4, 5)" | grep -q "rank 1"' "$out"

# a rank that dies inside a collective: the error names it
cat >"$work/die.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 20 }
if dist.rank() == 1 then os.exit(3) end
dist.all_reduce(dlua.ones({ 8 }))
LUA
out=$(timeout 60 "$DLUA" --nproc 2 "$work/die.lua" 2>&1); rc=$?
expect "a rank exits: the launcher names it" '[ $rc -eq 1 ] && grep -q "rank 1 failed (exit code 3)" <<<"$out"' "$out"

# DLUA_DIST_DEBUG=1: ranks calling different collectives are told where they diverge
cat >"$work/mismatch.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 20 }
local t = dlua.ones({ 3 })
if dist.rank() == 0 then
  dist.all_reduce(t)
else
  dist.broadcast(t, 0)
end
LUA
out=$(DLUA_DIST_DEBUG=1 timeout 60 "$DLUA" --nproc 2 "$work/mismatch.lua" 2>&1); rc=$?
expect "debug mode: mismatch fails the job" '[ $rc -eq 1 ]' "$out"
expect "debug mode: names both calls and their lines" 'grep -q "all_reduce" <<<"$out" && grep -q "broadcast" <<<"$out" && grep -q "mismatch.lua:6" <<<"$out" && grep -q "mismatch.lua:8" <<<"$out"' "$out"

# without debug mode, ranks passing different sizes still get a message, not a bare SIGABRT
cat >"$work/sizes.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 20 }
dist.all_reduce(dlua.ones({ dist.rank() == 0 and 1000 or 2000 }))
LUA
out=$(DLUA_SHM=0 timeout 60 "$DLUA" --nproc 2 "$work/sizes.lua" 2>&1); rc=$?
expect "different sizes over gloo: the failure says the ranks disagree and how to find where" '[ $rc -eq 1 ] && grep -q "failed (exit code 1): gloo: the ranks disagree on the size" <<<"$out" && grep -q "DLUA_DIST_DEBUG=1" <<<"$out"' "$out"
# over shared memory (the ranks share this host) every rank's call is named
out=$(timeout 60 "$DLUA" --nproc 2 "$work/sizes.lua" 2>&1); rc=$?
expect "different sizes over shared memory: each rank's call named" '[ $rc -eq 1 ] && grep -q "failed (exit code 1): .*all_reduce: collective mismatch at #1: rank 0 all_reduce #1 float32 (1000) op sum; rank 1 all_reduce #1 float32 (2000) op sum" <<<"$out"' "$out"

# the SPMD REPL driven through a pipe
out=$(printf '%s\n' 'x = dist.rank()' '=x' '1 + 1' 't = dlua.full({2}, dist.rank() + 1); dist.all_reduce(t); print(t)' \
  'if dist.rank() == 1 then error("oops") end' ':on 1 print("only", dist.rank())' 'for i = 1, 2 do' '  io.write(i, " ")' 'end print()' \
  'print("still here")' | timeout 60 "$DLUA" --nproc 2 -i 2>"$work/err"); rc=$?
err=$(cat "$work/err")
expect "SPMD REPL: exits 0 at end of input" '[ $rc -eq 0 ]' "$out
$err"
expect "SPMD REPL: per-rank values tagged" 'grep -qx "\[0\] 0" <<<"$out" && grep -qx "\[1\] 1" <<<"$out"' "$out"
expect "SPMD REPL: identical outputs collapsed" 'grep -qx "\[0-1\] 2" <<<"$out"' "$out"
expect "SPMD REPL: a collective across ranks" 'grep -qx "\[0-1\] tensor(\[3., 3.\])" <<<"$out"' "$out"
expect "SPMD REPL: an error on one rank is shown for it" 'grep -q "^\[1\] stdin:1: oops" <<<"$err"' "$err"
expect "SPMD REPL: :on 1 runs on rank 1 only" 'grep -qx "\[1\] only	1" <<<"$out" && ! grep -q "^\[0\] only" <<<"$out"' "$out"
expect "SPMD REPL: multi-line chunk" 'grep -qx "\[0-1\] 1 2 " <<<"$out"' "$out"
expect "SPMD REPL: the session goes on after an error" 'grep -qx "\[0-1\] still here" <<<"$out"' "$out"

# ':on R' chunks one after another: the rank that does not run a chunk still reads it before it is removed
# (the launcher used to delete it once rank R answered; the other rank then waited for it forever)
chunks=()
for i in $(seq 1 40); do chunks+=(":on $((i % 2)) n = (n or 0) + 1"); done
out=$(printf '%s\n' "${chunks[@]}" 'print(n)' | timeout 60 "$DLUA" --nproc 2 -i 2>&1); rc=$?
expect "SPMD REPL: 40 ':on R' chunks in a row, then one on every rank" '[ $rc -eq 0 ] && grep -qx "\[0-1\] 20" <<<"$out"' "rc=$rc: $out"

# Ctrl-C during a chunk interrupts it on every rank; the session goes on
# (a loop of C calls: os.execute would not do, system() ignores SIGINT while its child runs)
(printf '%s\n' 'while true do os.clock() end'; sleep 4; printf '%s\n' 'print("after", dist.rank())') |
  "$DLUA" --nproc 2 -i >"$work/out" 2>"$work/err" &
pid=$!  # dlua itself, the last command of the pipeline
(sleep 60; kill -9 $pid 2>/dev/null) &
watchdog=$!
sleep 2
kill -INT $pid
wait $pid; rc=$?
kill $watchdog 2>/dev/null
expect "SPMD REPL: Ctrl-C interrupts the chunk on every rank" 'grep -q "^\[0-1\] .*interrupted" "$work/err"' "$(cat "$work/out" "$work/err")"
expect "SPMD REPL: the next chunk runs after Ctrl-C" '[ $rc -eq 0 ] && grep -q "^\[0\] after	0" "$work/out" && grep -q "^\[1\] after	1" "$work/out"' "rc=$rc
$(cat "$work/out" "$work/err")"

# DDP: N ranks equal one process on the N-times batch, accumulation, no_sync, unused parameters...
for n in 2 3; do
  out=$(timeout 240 "$DLUA" --nproc $n "$here/ddp.lua" 2>&1); rc=$?
  expect "DDP on $n ranks" '[ $rc -eq 0 ] && [ "$(grep -c "DDP checks passed" <<<"$out")" = $n ]' "$out"
done
# DDP's broadcast_buffers: rank 0's batch-norm statistics before each training forward, checked by hand
for n in 2 3; do
  out=$(timeout 240 "$DLUA" --nproc $n "$here/ddp_buffers.lua" 2>&1); rc=$?
  expect "DDP broadcast_buffers on $n ranks" '[ $rc -eq 0 ] && [ "$(grep -c "DDP buffer checks passed" <<<"$out")" = $n ]' "$out"
done

finish dist
