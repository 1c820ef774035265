#!/usr/bin/env bash
# Hangs explained, live jobs inspected, failed ranks restarted (#29), through the real launcher on 127.0.0.1: the flight
# recorder's dumps and diagnosis (a rank stalled in Lua, one inside a C call, SIGUSR1, attach --dump), `dlua attach`
# (read the loss, change the learning rate at one step on both ranks, stop; refuse a wrong token and another user),
# --max-restarts (a rank killed mid-epoch: the same checksum as an uninterrupted run; start-up failures not restarted;
# the budget), and the NaN guard in a recipe.
set -u
DLUA=$(readlink -f "${1:?usage: test_hang.sh path/to/dlua}")
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
cd "$here/../.."
export CUDA_VISIBLE_DEVICES=
export DLUA_RUN_DIR=$work/run  # the jobs' private directories (and `dlua attach PID`'s lookup), inside the scratch folder
wait_for() {  # FILE PATTERN SECONDS: until an (extended) pattern shows up in the file
  local i
  for i in $(seq $(($3 * 10))); do
    grep -qaE -- "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# ---- the flight recorder: a rank stalled in a compute loop (compiled Lua), then one inside a C call -------------------
cp "$here/stall.lua" "$work/stall.lua"  # run from the scratch folder: no_strays finds what is left of it
start=$(date +%s%N)
out=$(DLUA_FLIGHT_DIR="$work/flight" timeout 60 "$DLUA" --nproc 2 "$work/stall.lua" 2>&1); rc=$?
took=$(( ($(date +%s%N) - start) / 1000000 ))
expect "stall: the job fails (exit 1)" '[ $rc -eq 1 ]' "$out"
expect "stall: the dump and diagnosis come at the 3 s timeout, the job ends within 15 s ($took ms)" '[ $took -lt 15000 ]' "$out"
expect "stall: the launcher says where the dumps are" \
  'grep -qF "dlua: flight recorder (a collective timed out on rank 0): $work/flight/flight-rank{0..1}.json" <<<"$out"' "$out"
expect "stall: rank 1 is behind, at its last collective, with the one rank 0 issued" \
  'grep -qE "^dlua:   group pg0 \((gloo|shm)\): rank 1 is behind: its last collective is all_reduce #2 on \(4\) float32 at .*stall.lua:5 \(completed\); rank 0 issued all_reduce #3 on \(4\) float32 at .*stall.lua:10$" <<<"$out"' "$out"
expect "stall: rank 1 is named at its Lua line (a compiled loop)" \
  'grep -qE "^dlua:   rank 1: not in a collective; running Lua at .*stall.lua:8$" <<<"$out"' "$out"
expect "stall: rank 0 waits in all_reduce #3" 'grep -qE "^dlua:   rank 0: (waiting in|its) all_reduce #3 " <<<"$out"' "$out"
expect "stall: then the timeout's verdict, once" '[ "$(grep -c "^dlua: rank 0 failed (exit code 1): .*timed out after 3000 ms" <<<"$out")" = 1 ]' "$out"
dump=$("$DLUA" -e "local d = require('dlua.flight').load('$work/flight', 1)
  local e = d.entries[#d.entries]
  print(d.rank, #d.entries, e.op, e.seq, e.state, e.dtype, e.shape[1], e.site:match('[^/]*$'), e.group, d.where.state)" 2>&1)
expect "stall: rank 1's dump: 2 collectives, the last all_reduce #2 (4) float32 at stall.lua:5, completed; in Lua" \
  '[ "$dump" = "1	2	all_reduce	2	completed	float32	4	stall.lua:5	pg0	lua" ]' "$dump"
wait_s=$("$DLUA" -e "local d = require('dlua.flight').load('$work/flight', 0)
  local e = d.entries[#d.entries]
  print(e.seq, string.format('%.1f', d.time - e.issued))" 2>&1)
read -r wseq wsec <<<"$wait_s"
expect "stall: rank 0 dumped within 3 s of its all_reduce #3 timing out ($wsec s after issuing it)" \
  '[ "$wseq" = 3 ] && [ "$(awk -v t="$wsec" "BEGIN { print (t >= 3 && t < 6) }")" = 1 ]' "$wait_s"
no_strays "stall"

cat >"$work/cstall.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init({ timeout = 3 })
local t = dlua.ones({ 4 })
dist.all_reduce(t)
if dist.rank() == 1 then  -- blocks inside one C call (a store read that never gets its key)
  local store = require('bindings.store').connect(os.getenv('MASTER_ADDR'), tonumber(os.getenv('MASTER_PORT')),
    os.getenv('DLUA_JOB_TOKEN'), 30)
  store:get('never/set', 30)
end
dist.all_reduce(t)
LUA
out=$(DLUA_FLIGHT_DIR="$work/flight2" timeout 60 "$DLUA" --nproc 2 "$work/cstall.lua" 2>&1); rc=$?
expect "inside C: the job fails (exit 1)" '[ $rc -eq 1 ]' "$out"
expect "inside C: rank 1 is behind at all_reduce #1" 'grep -qE "^dlua:   group pg0 .*rank 1 is behind: its last collective is all_reduce #1 " <<<"$out"' "$out"
expect "inside C: rank 1's C stack, its frames named" \
  'grep -A1 "^dlua:   rank 1: not in a collective; inside a C call:$" <<<"$out" | grep -qE "^dlua:       [^ ]+\+0x[0-9a-f]+ \(" ' "$out"
no_strays "inside C"

# ---- dlua attach on a running 2-rank DDP job ------------------------------------------------------------------------
cat >"$work/train.lua" <<'LUA'
-- Every rank prints each step's learning rate and loss; dlua.monitor is the step boundary attach talks to.
local dlua = require 'dlua'
local nn, optim, dist = dlua.nn, dlua.optim, dlua.dist
local monitor = require 'dlua.monitor'
dist.init({ timeout = 60 })
dlua.manual_seed(1)
local net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
local model = dist.DDP(net)
local sgd = optim.SGD(model, { lr = 0.01 })
local mon = monitor.Monitor({ model = model, optimizer = sgd, schedule = function() return 0.01 end })
local crit = nn.MSELoss()
local g = dlua.Generator(100 + dist.rank())
local x, y = dlua.randn({ 32, 8 }, { generator = g }), dlua.randn({ 32, 1 }, { generator = g })
for step = 0, tonumber(arg[1]) - 1 do
  sgd:set_lr(mon:lr(step))
  sgd:zero_grad()
  local out = model:forward(x)
  local loss = mon:check_loss(crit:forward(out, y), x)
  model:backward(x, crit:backward(out, y))
  sgd:step()
  print(string.format('step %d lr %s loss %s', step + 1, tostring(sgd:get_lr()), tostring(loss)))
  if mon:step(step + 1, loss) then
    print('stopped after step ' .. (step + 1))
    break
  end
  os.execute('sleep 0.02')
end
dist.destroy()
LUA
log=$work/attach.log
"$DLUA" --nproc 2 "$work/train.lua" 4000 >"$log" 2>&1 &
bg=$!
wait_for "$log" '^\[1\] step 5 ' 30
lp=$(ls "$work/run" 2>/dev/null | head -1)
jd=$work/run/$lp
expect "attach: the job directory is the launcher's pid, mode 700; its socket and token 600" \
  '[ "$lp" = "$bg" ] && [ "$(stat -c %a "$jd")" = 700 ] && [ "$(stat -c %a "$jd/attach.sock")" = 600 ] && [ -S "$jd/attach.sock" ] && [ "$(stat -c %a "$jd/token")" = 600 ]' \
  "$(ls -la "$jd" 2>&1)"
a=$("$DLUA" attach "$lp" -e 'print(step, loss)' 2>&1); rc=$?
read -r s l <<<"$a"
expect "attach: rank 0's step and loss, as the rank printed them" '[ $rc -eq 0 ] && [ -n "$l" ] && grep -qxF "[0] step $s lr 0.01 loss $l" "$log"' "$a"
a=$("$DLUA" attach "$jd" --rank 1 -e 'print(step, loss)' 2>&1); rc=$?
read -r s l <<<"$a"
expect "attach --rank 1 (by directory): rank 1's step and loss" '[ $rc -eq 0 ] && [ -n "$l" ] && grep -qxF "[1] step $s lr 0.01 loss $l" "$log"' "$a"
a=$("$DLUA" attach "$lp" -e ':lr 0.05' 2>&1); rc=$?
at=$(sed -n 's/^applied at step \([0-9]*\) on ranks 0-1$/\1/p' <<<"$a")
expect "attach :lr: applied at one step on both ranks, effective from the next" \
  '[ $rc -eq 0 ] && [ -n "$at" ] && grep -qxF "ranks 0-1: lr 0.05 from step $((at + 1)) on" <<<"$a"' "$a"
wait_for "$log" "^\[0\] step $((at + 3)) " 20
wait_for "$log" "^\[1\] step $((at + 3)) " 20
for r in 0 1; do
  first=$(grep -a "^\[$r\] step [0-9]* lr 0.05 " "$log" | head -1 | awk '{print $3}')
  expect "attach :lr: rank $r steps $at at 0.01, from $((at + 1)) at 0.05" \
    '[ "$first" = $((at + 1)) ] && grep -qa "^\[$r\] step $at lr 0.01 " "$log"' "$(grep -a "^\[$r\] step $at \|^\[$r\] step $((at + 1)) " "$log")"
done
kill -USR1 "$lp"
wait_for "$log" '^dlua: flight recorder \(SIGUSR1 to the launcher\)' 10
wait_for "$log" '^dlua:   rank 1: ' 5
n=$(grep -ac '^\[0\] step ' "$log")
wait_for "$log" "^\[0\] step $((n + 3)) " 20
expect "SIGUSR1 to the launcher: every rank dumped, the diagnosis printed, training goes on" \
  'grep -qa "^dlua:   rank 0: " "$log" && grep -qa "^dlua:   rank 1: " "$log" && [ -f "$jd/flight-rank0.json" ] && [ -f "$jd/flight-rank1.json" ] && grep -qa "^\[0\] step $((n + 3)) " "$log"' \
  "$(grep -a '^dlua' "$log")"
a=$("$DLUA" attach "$lp" --dump 2>&1); rc=$?
expect "attach --dump: the diagnosis of a new dump of both ranks" \
  '[ $rc -eq 0 ] && grep -qF "flight recorder (dlua attach --dump): $jd/flight-rank{0..1}.json" <<<"$a" && grep -q "^rank 0: " <<<"$a" && grep -q "^rank 1: " <<<"$a"' "$a"
a=$("$DLUA" attach "$lp" --token not-the-token -e '=loss' 2>&1); rc=$?
expect "attach with a wrong token: refused" '[ $rc -eq 1 ] && grep -qx "dlua attach: refused: wrong token" <<<"$a"' "$a"
if [ "$(id -u)" = 0 ] && id nobody >/dev/null 2>&1 && command -v setpriv >/dev/null; then
  a=$(setpriv --reuid=nobody --regid="$(id -g nobody)" --clear-groups "$DLUA" attach "$jd" --token "$(cat "$jd/token")" -e '=loss' 2>&1); rc=$?
  expect "attach as another user (nobody): cannot reach the job's directory" '[ $rc -eq 1 ] && grep -q "Permission denied" <<<"$a"' "$a"
else
  echo "skip attach as another user: needs root, a user 'nobody' and setpriv"
fi
a=$("$DLUA" attach "$lp" -e ':stop' 2>&1); rc=$?
st=$(sed -n 's/^applied at step \([0-9]*\) on ranks 0-1$/\1/p' <<<"$a")
( sleep 30; kill -9 "$bg" 2>/dev/null ) & watchdog=$!
wait "$bg"; jrc=$?
kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
expect "attach :stop: both ranks stop after the same step, the job exits 0" \
  '[ $rc -eq 0 ] && [ -n "$st" ] && [ $jrc -eq 0 ] && grep -qxF "[0] stopped after step $st" "$log" && grep -qxF "[1] stopped after step $st" "$log"' \
  "$a / rc $jrc / $(grep -a stopped "$log")"
expect "the job directory is kept for its dumps, and says so" \
  'grep -qxF "dlua: flight-recorder dumps kept in $jd" "$log" && [ ! -e "$jd/attach.sock" ] && [ ! -e "$jd/token" ]' "$(ls -la "$jd"; grep -a '^dlua' "$log")"
no_strays "attach"

# a launcher killed with SIGKILL leaves its directory behind; the next launcher removes it
"$DLUA" --nproc 1 -e 'while true do end' >/dev/null 2>&1 &
kp=$!
for _ in $(seq 100); do [ -S "$work/run/$kp/attach.sock" ] && break; sleep 0.1; done
kill -9 "$kp"
wait "$kp" 2>/dev/null
left=$([ -S "$work/run/$kp/attach.sock" ] && echo yes)
"$DLUA" --nproc 1 -e 'print(1)' >/dev/null 2>&1
expect "a killed launcher's directory: left behind, then swept by the next launcher" '[ "$left" = yes ] && [ ! -e "$work/run/$kp" ]' "$(ls -la "$work/run")"
no_strays "killed launcher"

# the socket itself refuses a client of another user (root passes the directory's mode; the launcher checks its peer)
if [ "$(id -u)" = 0 ] && id nobody >/dev/null 2>&1 && command -v setpriv >/dev/null; then
  nb=$(mktemp -d /tmp/dlua-hang-nobody.XXXXXX)
  chmod 755 "$nb"
  mkdir -m 700 "$nb/run" && chown nobody "$nb/run"
  printf 'for _ = 1, 200 do os.execute("sleep 0.1") end\n' >"$nb/idle.lua"
  setpriv --reuid=nobody --regid="$(id -g nobody)" --clear-groups env DLUA_RUN_DIR="$nb/run" "$DLUA" --nproc 1 "$nb/idle.lua" \
    >"$nb/log" 2>&1 &
  nbg=$!
  for _ in $(seq 100); do [ -S "$nb/run/$nbg/attach.sock" ] && break; sleep 0.1; done
  a=$("$DLUA" attach "$nb/run/$nbg" -e '=1' 2>&1); rc=$?
  expect "attach to another user's job over its socket: refused" \
    '[ $rc -eq 1 ] && grep -qx "dlua attach: refused: the job belongs to another user" <<<"$a"' "$a / $(cat "$nb/log")"
  kill -9 "$nbg" 2>/dev/null
  wait "$nbg" 2>/dev/null
  sleep 0.3
  expect "another user's job: no stray processes" '! pgrep -f "$nb" >/dev/null' "$(pgrep -af "$nb")"
  rm -rf "$nb"
else
  echo "skip the socket's own check of another user: needs root, a user 'nobody' and setpriv"
fi

# ---- --max-restarts -------------------------------------------------------------------------------------------------
# A rank killed mid-epoch (SIGKILL by itself, right after step 7, in the first run only): the job restarts, resumes from
# the step-6 checkpoint and ends with the checksum of an uninterrupted run.
fm=(recipes/fashion_mnist.lua --model small_cnn --limit 512 --batch 32 --epochs 2 --eval-batch 1000 --print-every 1 --threads 1)
if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || [ -n "${DLUA_FASHION_MNIST_ROOT:-}" ]; then
  timeout 300 "$DLUA" --nproc 2 "${fm[@]}" >"$work/fm_straight.log" 2>&1; rc=$?
  crc=$(sed -n 's/^\[0\] parameters crc32 //p' "$work/fm_straight.log")
  expect "restart: the uninterrupted run" '[ $rc -eq 0 ] && [ -n "$crc" ]' "$(tail -5 "$work/fm_straight.log")"
  kill7='if os.getenv("RANK") == "1" and os.getenv("DLUA_RESTART_COUNT") == "0" then
    local m = require("dlua.monitor"); local make = m.Monitor
    m.Monitor = function(o)
      local mon = make(o); local step = mon.step
      mon.step = function(self, s, ...) local r = step(self, s, ...); if s == 7 then os.execute("kill -9 $PPID") end; return r end
      return mon
    end
  end'
  timeout 300 "$DLUA" --nproc 2 --max-restarts 2 -e "$kill7" "${fm[@]}" --save "$work/fmr" --save-every 3 >"$work/fm_restart.log" 2>&1; rc=$?
  r=$work/fm_restart.log
  expect "restart: rank 1 killed at step 7, named; the job restarted once and exits 0" \
    '[ $rc -eq 0 ] && grep -qx "dlua: rank 1 failed (killed by signal 9 (SIGKILL))" "$r" && [ "$(grep -c "^dlua: restarting" "$r")" = 1 ] && grep -qx "dlua: restarting the job (restart 1 of 2); it had finished step 7" "$r"' \
    "$(grep -a "^dlua" "$r"; tail -3 "$r")"
  expect "restart: the log says where it resumed and how many steps were lost" \
    'grep -qxF "[0] restart 1 of 2: resumed from $work/fmr/step-000006 at step 6; 1 step lost (the failed run had finished step 7)" "$r"' \
    "$(grep -a "restart\|resumed" "$r")"
  expect "restart: the same parameters as the uninterrupted run (crc32 $crc)" \
    'grep -qxF "[0] parameters crc32 $crc" "$r"' "$(grep -a crc32 "$r")"
  no_strays "restart"
else
  echo "skip the restart of a recipe: dataset-fashion-mnist is not installed"
fi

cat >"$work/fails.lua" <<'LUA'
-- arg[1] 'start': rank 1 fails before any step; 'later': after every rank finished step 1.
local dlua = require 'dlua'
local mon = require('dlua.monitor').Monitor()
dlua.dist.init()
if arg[1] == 'later' then
  mon:step(1)
  dlua.dist.barrier()
end
if dlua.dist.rank() == 1 then error('broken on purpose in run ' .. os.getenv('DLUA_RESTART_COUNT')) end
dlua.dist.barrier()
LUA
out=$(timeout 60 "$DLUA" --nproc 2 --max-restarts 3 "$work/fails.lua" start 2>&1); rc=$?
expect "a job failing at start-up is not restarted, and says why" \
  '[ $rc -eq 1 ] && [ "$(grep -c "^dlua: rank 1 failed" <<<"$out")" = 1 ] && ! grep -q "^dlua: restarting" <<<"$out" && grep -q "^dlua: not restarting: the job failed during start-up" <<<"$out"' "$out"
out=$(timeout 60 "$DLUA" --nproc 2 --max-restarts 2 "$work/fails.lua" later 2>&1); rc=$?
expect "a job failing after its first step: 2 restarts (the whole job's budget), then it ends" \
  '[ $rc -eq 1 ] && [ "$(grep -c "^dlua: rank 1 failed" <<<"$out")" = 3 ] && grep -q "^dlua: restarting the job (restart 2 of 2)" <<<"$out" && grep -q "failed (exit code 1): .*broken on purpose in run 2" <<<"$out" && grep -qx "dlua: not restarting: 2 restarts of the job used (--max-restarts 2)" <<<"$out"' "$out"
no_strays "restarts"

# ---- the NaN guard in a recipe --------------------------------------------------------------------------------------
if [ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || [ -n "${DLUA_FASHION_MNIST_ROOT:-}" ]; then
  out=$(timeout 120 "$DLUA" --nproc 2 "${fm[@]}" --lr 1e4 2>&1); rc=$?
  expect "NaN guard: a diverging run stops, naming the step and the first non-finite module" \
    '[ $rc -eq 1 ] && grep -qE "^dlua: rank [01] failed \(exit code 1\): [^ ]*(recipes/fashion_mnist|dlua/recipe/trainer).lua:[0-9]+: loss is (nan|inf|-inf) at step [0-9]+; the first module whose output went non-finite: [0-9.]+ \([A-Za-z0-9]+\); " <<<"$out"' \
    "$(grep '^dlua' <<<"$out")"
  no_strays "NaN guard"
fi
finish "dist/hang"
