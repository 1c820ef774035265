#!/usr/bin/env bash
# The launcher end to end: `dlua --nproc N` on 127.0.0.1, output tags, failures, signals, multi-node, no strays.
set -u
DLUA=${1:?usage: test_launch.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"

cat >"$work/env.lua" <<'LUA'
print(string.format('rank=%s world=%s local=%s lws=%s arg=%s', os.getenv('RANK'), os.getenv('WORLD_SIZE'),
  os.getenv('LOCAL_RANK'), os.getenv('LOCAL_WORLD_SIZE'), tostring(arg[1])))
io.stderr:write('to stderr ' .. os.getenv('RANK') .. '\n')
LUA
cat >"$work/fail.lua" <<'LUA'
local r = tonumber(os.getenv('RANK'))
if r == tonumber(arg[2] or 1) then
  local mode = arg[1]
  if mode == 'error' then error('boom on purpose') end
  if mode == 'exit' then os.exit(7) end
  if mode == 'kill' then os.execute('kill -9 ' .. io.open('/proc/self/stat'):read('*n')) end
end
print('rank ' .. r .. ' waiting')
local t0 = os.time()
while os.time() - t0 < 60 do os.execute('sleep 0.2') end
print('rank ' .. r .. ' was not stopped')
LUA

out=$(timeout 30 "$DLUA" --nproc 3 "$work/env.lua" hello 2>"$work/err"); rc=$?
expect "3 ranks exit 0" '[ $rc -eq 0 ]' "$out"
for r in 0 1 2; do
  expect "rank $r tagged with its variables" 'grep -qx "\[$r\] rank=$r world=3 local=$r lws=3 arg=hello" <<<"$out"' "$out"
  expect "rank $r stderr tagged on stderr" 'grep -qx "\[$r\] to stderr $r" "$work/err"' "$(cat "$work/err")"
done

out=$(timeout 30 "$DLUA" --nproc 3 --ranks-output 0 "$work/env.lua" 2>&1); rc=$?
expect "--ranks-output 0 shows rank 0 only" '[ $rc -eq 0 ] && grep -q "^\[0\] rank=0" <<<"$out" && ! grep -q "^\[[12]\]" <<<"$out"' "$out"
out=$(timeout 30 "$DLUA" --nproc=2 --ranks-output=1 "$work/env.lua" 2>&1)
expect "--opt=value forms" 'grep -q "^\[1\] rank=1 world=2" <<<"$out" && ! grep -q "^\[0\]" <<<"$out"' "$out"

for mode in error exit kill; do
  start=$(date +%s)
  out=$(timeout 30 "$DLUA" --nproc 3 "$work/fail.lua" $mode 2>&1); rc=$?
  took=$(( $(date +%s) - start ))
  case $mode in
    error) want='dlua: rank 1 failed \(exit code 1\): .*fail.lua:4: boom on purpose' ;;
    exit) want='dlua: rank 1 failed \(exit code 7\)' ;;
    kill) want='dlua: rank 1 failed \(killed by signal 9 \(SIGKILL\)\)' ;;
  esac
  expect "rank 1 $mode: job exits 1" '[ $rc -eq 1 ]' "$out"
  expect "rank 1 $mode: within 10 s ($took s)" '[ $took -le 10 ]' "$out"
  expect "rank 1 $mode: names the rank and how, once" '[ "$(grep -cE "$want" <<<"$out")" = 1 ]' "$out"
  expect "rank 1 $mode: says the others were stopped" 'grep -q "dlua: stopped ranks 0, 2" <<<"$out"' "$out"
  expect "rank 1 $mode: no rank ran on" '! grep -q "was not stopped" <<<"$out"' "$out"
  no_strays "rank 1 $mode"
done

# Whom the launcher blames: rank 1 fails before a barrier the others wait in, which then fails on them
# too ("a peer closed its connection"), often within the same millisecond. The verdict must name rank 1
# with its own error and line, every time, and list the others as stopped.
cat >"$work/barrier.lua" <<'LUA'
local dlua = require 'dlua'
dlua.dist.init()
if dlua.dist.rank() == 1 then
  if arg[1] == 'error' then error('rank one broke') end
  if arg[1] == 'exit' then os.exit(3) end
  if arg[1] == 'kill' then os.execute('kill -9 ' .. io.open('/proc/self/stat'):read('*n')) end
end
dlua.dist.barrier()
print('rank ' .. dlua.dist.rank() .. ' passed the barrier')
LUA
verdicts() {  # NPROC MODE RUNS EXPECTED-VERDICT: every run's summary is exactly the verdict and the stopped ranks
  local n=$1 mode=$2 runs=$3 want=$4 stopped wrong=0 detail="" o c
  if [ "$n" = 2 ]; then stopped="dlua: stopped rank 0"; else stopped="dlua: stopped ranks 0, 2"; fi
  start=$(date +%s)
  for _ in $(seq "$runs"); do
    o=$(timeout 30 "$DLUA" --nproc "$n" "$work/barrier.lua" "$mode" 2>&1); c=$?
    if [ $c -ne 1 ] || [ "$(grep '^dlua: ' <<<"$o")" != "$want
$stopped" ] || grep -q "passed the barrier" <<<"$o"; then
      wrong=$((wrong + 1))
      detail="rc $c: $o"
    fi
  done
  took=$(( $(date +%s) - start ))
  expect "rank 1 $mode before a barrier, $n ranks: $runs of $runs verdicts name rank 1 ($took s)" '[ $wrong -eq 0 ]' "$wrong wrong; the last:
$detail"
  no_strays "rank 1 $mode before a barrier, $n ranks"
}
for n in 2 3; do
  verdicts $n error 20 "dlua: rank 1 failed (exit code 1): $work/barrier.lua:4: rank one broke"
  verdicts $n exit 5 "dlua: rank 1 failed (exit code 3)"
  verdicts $n kill 5 "dlua: rank 1 failed (killed by signal 9 (SIGKILL))"
done

# -e chunks and -l modules run on every rank, as a script does, also before one
mkdir -p "$work/mods"
echo 'return { answer = 40 + tonumber(os.getenv("RANK")) }' >"$work/mods/mymod.lua"
echo 'print("script sees", x, arg[1])' >"$work/after_e.lua"
out=$(timeout 30 "$DLUA" --nproc 2 -e 'print("e on", os.getenv("RANK"))' 2>&1); rc=$?
expect "--nproc 2 -e runs the chunk on both ranks" '[ $rc -eq 0 ] && grep -qxP "\[0\] e on\t0" <<<"$out" && grep -qxP "\[1\] e on\t1" <<<"$out"' "$out"
out=$(cd "$work" && DLUA_PATH="$work/mods" timeout 30 "$DLUA" --nproc 2 -l mymod -e 'print(mymod.answer)' 2>&1); rc=$?
expect "--nproc 2 -l mod -e on both ranks" '[ $rc -eq 0 ] && grep -qx "\[0\] 40" <<<"$out" && grep -qx "\[1\] 41" <<<"$out"' "$out"
out=$(timeout 30 "$DLUA" --nproc 2 -e 'x = 7' "$work/after_e.lua" z 2>&1); rc=$?
expect "--nproc 2 -e then a script on both ranks" '[ $rc -eq 0 ] && [ "$(grep -cP "^\[[01]\] script sees\t7\tz$" <<<"$out")" = 2 ]' "$out"
out=$(timeout 30 "$DLUA" --nproc 2 -e 'local d = dlua.dist; d.init(); if d.rank() == 1 then error("e broke") end; d.barrier()' 2>&1); rc=$?
expect "--nproc 2 -e failing on rank 1 names it" '[ $rc -eq 1 ] && grep -qx "dlua: rank 1 failed (exit code 1): (command line):1: e broke" <<<"$out"' "$out"
no_strays "--nproc with -e"

# Ctrl-C (SIGINT to the launcher) stops every rank and exits 130
"$DLUA" --nproc 2 "$work/fail.lua" none >"$work/out" 2>&1 &
pid=$!
for _ in $(seq 50); do [ "$(grep -c waiting "$work/out")" = 2 ] && break; sleep 0.1; done
kill -INT $pid
wait $pid; rc=$?
expect "Ctrl-C: exit 130" '[ $rc -eq 130 ]' "$(cat "$work/out")"
expect "Ctrl-C: says interrupted" 'grep -q "dlua: interrupted; stopped 2 ranks" "$work/out"' "$(cat "$work/out")"
no_strays "Ctrl-C"

# the launcher killed outright: its ranks die with it
"$DLUA" --nproc 2 "$work/fail.lua" none >/dev/null 2>&1 &
pid=$!
for _ in $(seq 50); do [ "$(pgrep -cf "$work/fail.lua")" -ge 3 ] && break; sleep 0.1; done
kill -9 $pid
wait $pid 2>/dev/null
no_strays "launcher SIGKILLed"

# two nodes on one machine: --nnodes 2 --node-rank K --master host:port
port=$(( 20000 + RANDOM % 20000 ))
timeout 30 "$DLUA" --nproc 2 --nnodes 2 --node-rank 1 --master 127.0.0.1:$port "$work/env.lua" >"$work/n1" 2>&1 &
n1=$!
out=$(timeout 30 "$DLUA" --nproc 2 --nnodes 2 --node-rank 0 --master 127.0.0.1:$port "$work/env.lua" 2>&1); rc=$?
wait $n1; rc1=$?
expect "2 nodes: both launchers exit 0" '[ $rc -eq 0 ] && [ $rc1 -eq 0 ]' "$out
$(cat "$work/n1")"
expect "2 nodes: node 0 runs ranks 0-1 of 4" 'grep -q "^\[0\] rank=0 world=4 local=0 lws=2" <<<"$out" && grep -q "^\[1\] rank=1 world=4 local=1" <<<"$out"' "$out"
expect "2 nodes: node 1 runs ranks 2-3 of 4" 'grep -q "^\[2\] rank=2 world=4 local=0 lws=2" "$work/n1" && grep -q "^\[3\] rank=3 world=4 local=1" "$work/n1"' "$(cat "$work/n1")"

port=$(( 20000 + RANDOM % 20000 ))
start=$(date +%s)
timeout 30 "$DLUA" --nproc 1 --nnodes 2 --node-rank 1 --master 127.0.0.1:$port "$work/fail.lua" exit 1 >"$work/n1" 2>&1 &
n1=$!
out=$(timeout 30 "$DLUA" --nproc 1 --nnodes 2 --node-rank 0 --master 127.0.0.1:$port "$work/fail.lua" exit 1 2>&1); rc=$?
wait $n1; rc1=$?
took=$(( $(date +%s) - start ))
expect "2 nodes: a rank failing on node 1 stops node 0 (rc $rc/$rc1, $took s)" '[ $rc -eq 1 ] && [ $rc1 -eq 1 ] && [ $took -le 10 ]' "$out
$(cat "$work/n1")"
expect "2 nodes: node 0 names the failed rank" 'grep -q "job failed on another node: rank 1 (node 1) failed (exit code 7)" <<<"$out"' "$out"
no_strays "2 nodes"

# bad command lines
chk_err() {  # NAME EXPECTED-MESSAGE ARGS...
  local name=$1 msg=$2; shift 2
  local o; o=$(timeout 10 "$DLUA" "$@" 2>&1); local c=$?
  expect "$name" '[ $c -eq 1 ] && grep -qF -- "$msg" <<<"$o"' "$o"
}
chk_err "--nproc 0 rejected" "--nproc '0': expected a whole number in 1..4096" --nproc 0 "$work/env.lua"
chk_err "--nproc x rejected" "--nproc 'x': expected a whole number" --nproc x "$work/env.lua"
chk_err "--nproc without a script" "--nproc needs a script to run" --nproc 2
chk_err "--nnodes without --master" "--nnodes 2 needs --master host:port" --nproc 1 --nnodes 2 "$work/env.lua"
chk_err "--node-rank out of range" "--node-rank 2: expected 0..1" --nproc 1 --nnodes 2 --node-rank 2 --master h:1 "$work/env.lua"
chk_err "--ranks-output out of range" "--ranks-output '5': expected ranks in 0..1" --nproc 2 --ranks-output 5 "$work/env.lua"
chk_err "--master without port" "--master 'host': expected host:port" --nproc 1 --master host "$work/env.lua"
chk_err "--nproc gpu without GPUs" "--nproc gpu: no CUDA device available" --nproc gpu "$work/env.lua"
chk_err "a missing script" "cannot open" --nproc 2 "$work/nosuch.lua"

finish launcher
