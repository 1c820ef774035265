#!/usr/bin/env bash
# End-to-end tests of dlua's command line: exit codes, messages, arg, -e/-l/-i, stdin, Ctrl-C.
# usage: test_cli.sh path/to/dlua
set -u
DLUA=$(readlink -f "${1:?usage: test_cli.sh path/to/dlua}")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export HOME=$TMP  # the REPL's history file goes here, not into the real home
passed=0
failed=0

ok() { passed=$((passed + 1)); echo "ok   - $1"; }
fail() { failed=$((failed + 1)); echo "FAIL - $1"; shift; for l in "$@"; do echo "       $l"; done; }

# expect NAME WANT_RC WANT_OUT_REGEX WANT_ERR_REGEX -- command...
expect() {
  local name=$1 want_rc=$2 want_out=$3 want_err=$4
  shift 5
  local out err rc
  out=$("$@" 2>"$TMP/err") && rc=0 || rc=$?
  err=$(cat "$TMP/err")
  if [ "$rc" != "$want_rc" ]; then
    fail "$name" "exit code $rc, wanted $want_rc" "stdout: $out" "stderr: $err"
  elif [ -n "$want_out" ] && ! grep -Eq -- "$want_out" <<<"$out"; then
    fail "$name" "stdout does not match /$want_out/" "stdout: $out" "stderr: $err"
  elif [ -n "$want_err" ] && ! grep -Eq -- "$want_err" <<<"$err"; then
    fail "$name" "stderr does not match /$want_err/" "stdout: $out" "stderr: $err"
  else
    ok "$name"
  fi
}

cd "$TMP"
cat >args.lua <<'EOF'
local a, b = ...
print(arg[0], arg[1], arg[2], a, b, select('#', ...), arg[-1] ~= nil)
EOF
cat >err.lua <<'EOF'
local function inner()
  error('something broke')
end
inner()
EOF
mkdir -p mods
echo 'return { answer = 41 + 1 }' >mods/mymod.lua

expect "-e prints 2" 0 '^2$' '' -- "$DLUA" -e 'print(1+1)'
expect "stdin REPL prints 42" 0 '^42$' '' -- bash -c "printf 'x = 40\nprint(x + 2)\n' | '$DLUA' -i"
expect "script arguments in arg and ..." 0 '^args.lua	a	b	a	b	2	true$' '' -- "$DLUA" args.lua a b
expect "error exits 1 with file:line traceback" 1 '' 'err.lua:2: something broke' -- "$DLUA" err.lua
expect "traceback names the caller line" 1 '' 'err.lua:4: in main chunk' -- "$DLUA" err.lua
expect "missing script" 1 '' '^dlua: cannot open nosuch.lua \(No such file or directory\)$' -- "$DLUA" nosuch.lua
expect "-v shows versions" 0 '^dlua [0-9]+\.[0-9]+' '' -- "$DLUA" -v
expect "-v shows LuaJIT" 0 'LuaJIT 2\.' '' -- "$DLUA" --version
expect "-v shows CUDA build or no CUDA" 0 '(CUDA [0-9]+\.[0-9]+[^,]*, cuDNN [0-9.]+, NCCL [0-9.]+|no CUDA)' '' -- "$DLUA" -v
expect "-h shows usage" 0 '^usage: dlua' '' -- "$DLUA" -h
expect "unknown option rejected by name" 1 '' "unrecognized option '-x'" -- "$DLUA" -x
expect "-e without argument" 1 '' "'-e' needs an argument" -- "$DLUA" -e
expect "-- ends options" 0 '^args.lua	-e	z	-e	z	2	true$' '' -- "$DLUA" -- args.lua -e z
expect "- runs stdin with arguments" 0 '^from stdin	q$' '' -- bash -c "echo 'print(\"from stdin\", ...)' | '$DLUA' - q"
expect "no arguments, piped stdin runs it" 0 '^piped$' '' -- bash -c "echo 'print(\"piped\")' | '$DLUA'"
expect "-l loads a module from DLUA_PATH" 0 '^42$' '' -- env DLUA_PATH="$TMP/mods" "$DLUA" -l mymod -e 'print(mymod.answer)'
expect "DLUA_PATH ?-template" 0 '^42$' '' -- env DLUA_PATH="$TMP/mods/?.lua" "$DLUA" -e 'print(require("mymod").answer)'
expect "require dlua from any directory" 0 '^dlua 0' '' -- bash -c "cd / && '$DLUA' -e 'print(\"dlua \" .. require(\"dlua\").version())'"
expect "the global dlua in -e" 0 '^[0-9]+$' '' -- "$DLUA" -e 'print(dlua.get_num_threads())'
expect "C status becomes a Lua error with op and line" 1 '' 'set_num_threads: expected a positive thread count, got 0 \(host/core/runtime.c:[0-9]+\)' -- "$DLUA" -e 'dlua.set_num_threads(0)'
expect "C error reported at the caller's line" 1 '' '^dlua: \(command line\):1: set_num_threads' -- "$DLUA" -e 'dlua.set_num_threads(0)'
expect "set/get threads round trip" 0 '^3$' '' -- "$DLUA" -e 'dlua.set_num_threads(3) print(dlua.get_num_threads())'
expect "syntax error in a script" 1 '' 'bad.lua:1:' -- bash -c "echo 'x = = 1' > bad.lua; '$DLUA' bad.lua"
expect "os.exit code passes through" 7 '' '' -- "$DLUA" -e 'os.exit(7)'
expect "script then -i REPL" 0 '^from script	5$' '' -- bash -c "echo 'y = 5' > s.lua; echo 'print(\"from script\", y)' | '$DLUA' -i s.lua"
expect "REPL: bare expressions and =expr print" 0 '^3	hi$' '' -- bash -c "printf '=1+2, \"hi\"\n' | '$DLUA' -i"
expect "REPL: multi-line chunk" 0 '^6$' '' -- bash -c "printf 'local s = 0\nfor i = 1, 3 do\n  s = s + i\nend\nprint(s)\nt = 0\nfor i = 1, 3 do\n t = t + i\nend\nprint(t)\n' | '$DLUA' -i"
expect "REPL: an error does not end the session" 0 '^after$' 'stdin:1: oops' -- bash -c "printf 'error(\"oops\")\nprint(\"after\")\n' | '$DLUA' -i"
expect "REPL: tables print nested" 0 '^\{1, 2, \{a = 3, b = "x"\}\}$' '' -- bash -c "printf '{1, 2, {a = 3, b = \"x\"}}\n' | '$DLUA' -i"
expect "REPL: unfinished chunk at end of input" 0 '' "'end' expected" -- bash -c "printf 'for i = 1, 2 do\n' | '$DLUA' -i"

# Ctrl-C: a long loop that reaches Lua hook points raises "interrupted" and exits 1.
"$DLUA" -e 'local t = 0; while true do t = t + os.clock() end' >"$TMP/out" 2>"$TMP/err" &
pid=$!
sleep 1
kill -INT $pid
for _ in $(seq 50); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
if kill -0 $pid 2>/dev/null; then
  kill -9 $pid
  fail "Ctrl-C interrupts a long loop" "still running 5 s after SIGINT"
else
  wait $pid && rc=0 || rc=$?
  if [ "$rc" = 1 ] && grep -q 'interrupted' "$TMP/err"; then ok "Ctrl-C interrupts a long loop"; else fail "Ctrl-C interrupts a long loop" "rc=$rc" "$(cat "$TMP/err")"; fi
fi

# A loop compiled into one trace never reaches a hook: the second Ctrl-C ends it.
"$DLUA" -e 'local x = 0; while true do x = x + 1 end' >"$TMP/out" 2>"$TMP/err" &
pid=$!
sleep 1
kill -INT $pid
sleep 0.5
kill -INT $pid 2>/dev/null
for _ in $(seq 50); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
if kill -0 $pid 2>/dev/null; then
  kill -9 $pid
  fail "second Ctrl-C ends a compiled loop" "still running 5 s after two SIGINTs"
else
  wait $pid && rc=0 || rc=$?
  if [ "$rc" != 0 ] && grep -q 'interrupted' "$TMP/err"; then ok "second Ctrl-C ends a compiled loop"; else fail "second Ctrl-C ends a compiled loop" "rc=$rc" "$(cat "$TMP/err")"; fi
fi

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
