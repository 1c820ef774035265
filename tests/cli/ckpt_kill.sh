#!/usr/bin/env bash
# kill -9 of a process while it writes checkpoints, at random moments, again and again: every time the previous checkpoint still loads (all checksums), latest names a complete one, rotation keeps its promise.
# usage: ckpt_kill.sh path/to/dlua [rounds]
set -u
DLUA=$(readlink -f "${1:?usage: ckpt_kill.sh path/to/dlua [rounds]}")
rounds=${2:-8}
work=$(mktemp -d /tmp/dlua-ckpt-kill.XXXXXX)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0
check() { if [ "$2" = 0 ]; then passed=$((passed + 1)); echo "ok   - $1"; else failed=$((failed + 1)); echo "FAIL - $1"; echo "$3" | sed 's/^/       /'; fi; }

# The writer: resumes from the newest checkpoint (or starts), then saves step after step, sync and
# async in turn, keep = 2. Every tensor of step s holds s, so a load can tell which step it got.
cat >"$work/writer.lua" <<'LUA'
local dlua = require 'dlua'
local ckpt = dlua.ckpt
local root = arg[1]
local state = { w = dlua.zeros(2, 1024, 1024), m = dlua.zeros(1024, 1024, { dtype = 'float64' }), progress = { step = 0 } }
if ckpt.latest(root) then ckpt.load(root, state) end
io.stdout:setvbuf('line')
while true do
  local s = state.progress.step + 1
  state.w:fill_(s)
  state.m:fill_(s)
  state.progress.step = s
  ckpt.save(root, state, { step = s, keep = 2, async = s % 2 == 0 })
  print('saving ' .. s)
end
LUA
# The checker: what latest names loads whole; its tensors hold its step; at most 2 complete ones.
cat >"$work/check.lua" <<'LUA'
local dlua = require 'dlua'
local ckpt = dlua.ckpt
local root = arg[1]
local f = assert(io.open(root .. '/latest'), 'no latest file')
local name = f:read('*l')
f:close()
local state = { w = dlua.zeros(2, 1024, 1024), m = dlua.zeros(1024, 1024, { dtype = 'float64' }), progress = {} }
local info = ckpt.load(root .. '/' .. name, state)
local s = state.progress.step
assert(info.step == s, 'index step ' .. info.step .. ' vs progress ' .. s)
assert(state.w:min():item() == s and state.w:max():item() == s and state.m:min():item() == s, 'tensors of another step')
local newest = ckpt.latest(root)
local complete = 0
for _, c in ipairs(ckpt.list(root)) do if c.complete then complete = complete + 1 end end
assert(complete <= 3, complete .. ' complete checkpoints with keep = 2')
print(string.format('latest %s loads (step %d); newest complete %s; %d complete', name, s, newest, complete))
LUA
root="$work/ckpt"
cut=0
for r in $(seq 1 "$rounds"); do
  "$DLUA" "$work/writer.lua" "$root" >"$work/log" 2>&1 &
  pid=$!
  # wait until this round has started a save, then kill at a random moment up to 0.6 s later
  for _ in $(seq 1 200); do grep -q saving "$work/log" 2>/dev/null && break; sleep 0.02; done
  sleep "0.$(printf '%03d' $((RANDOM % 600)))"
  kill -9 $pid 2>/dev/null
  wait $pid 2>/dev/null
  # evidence that the kill cut a save: a step directory without its index, or a temporary file
  was_cut=0
  for d in "$root"/step-*; do
    [ -f "$d/index.json" ] || was_cut=1
    ls -A "$d" | grep -q '\.tmp-' && was_cut=1
  done
  cut=$((cut + was_cut))
  out=$("$DLUA" "$work/check.lua" "$root" 2>&1); rc=$?
  check "round $r: killed after '$(tail -1 "$work/log")': the latest checkpoint loads whole" $rc "$out
$(cat "$work/log" | tail -5)
$(ls -la "$root" "$root"/step-* 2>&1)"
done
[ "$cut" -gt 0 ]
check "$cut of $rounds kills cut a save in the middle (a step directory without index.json, or a temporary file)" $? ""
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
