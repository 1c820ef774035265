# Shared by the tests/dist/*.sh scripts: a scratch folder, pass/fail bookkeeping, stray checks.
# Source it after setting DLUA; it sets `work` (removed at exit, with any process still using it).
work=$(mktemp -d /tmp/dlua-dist-test.XXXXXX)
trap 'pkill -9 -f "$work" 2>/dev/null; rm -rf "$work"' EXIT
pass=0 failn=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { failn=$((failn + 1)); echo "FAIL $1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | sed 's/^/     | /'; }
# expect NAME CONDITION DETAIL: CONDITION is evaluated; DETAIL is shown when it fails
expect() { if eval "$2"; then ok "$1"; else bad "$1" "$3"; fi; }
no_strays() {  # no process still runs a script of this test
  sleep 0.3
  if pgrep -f "$work" >/dev/null; then bad "$1: no stray processes" "$(pgrep -af "$work")"; else ok "$1: no stray processes"; fi
}
# The summary line and the exit status: finish NAME
finish() { echo "$1: $pass passed, $failn failed"; [ $failn -eq 0 ]; }
