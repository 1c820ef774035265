#!/usr/bin/env bash
# The MPI backend under mpirun on this host: the shared collective suite on 2-4 ranks, dist.init() choosing MPI, failures and timeouts that name the rank, no stray process.
set -u
DLUA=${1:?usage: test_mpi.sh path/to/dlua}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/common.sh"
export CUDA_VISIBLE_DEVICES=
export DLUA_FLIGHT_DIR=$work/flight  # a timeout's flight-recorder dumps (every rank's, under mpirun): not the current directory
if ! command -v mpirun >/dev/null; then echo "skip: no mpirun (apt-get install openmpi-bin)"; exit 0; fi
why=$("$DLUA" -e 'local ok, why = dlua.dist.is_mpi_available(); io.write(ok and "" or why)' 2>&1)
if [ -n "$why" ]; then echo "skip: this dlua has no MPI backend: $why"; exit 0; fi
# mpirun refuses root unless told; the machine may have fewer cores than ranks; everything on loopback
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
# run N SECONDS ARGS...: mpirun -np N dlua ARGS (or $prog ARGS), bounded; sets out, rc, took (seconds until every rank had
# ended) and hung. Open MPI 4.1's mpirun now and then hangs or crashes in PMIx_server_finalize once its ranks
# have ended, mostly after an aborted job (an upstream bug, open-mpi/ompi#13650 for 5.x): given 5 s after
# the last rank, it is killed (hung=1, rc 137). Past the limit mpirun gets SIGTERM, then its ranks SIGKILL.
run() {
  local n=$1 limit=$2
  shift 2
  local start=$(date +%s) seen=0 ended="" mpid now live
  hung=0
  mpirun -np "$n" "${prog:-$DLUA}" "$@" >"$work/mpirun.out" 2>&1 &
  mpid=$!
  while kill -0 $mpid 2>/dev/null; do
    now=$(date +%s)
    live=$(ps --ppid $mpid -o stat= 2>/dev/null | grep -vc '^Z')
    [ "$live" -gt 0 ] && seen=1
    if [ $seen = 1 ] && [ "$live" = 0 ]; then
      [ -z "$ended" ] && ended=$now
      if [ $((now - ended)) -ge 5 ]; then hung=1; kill -9 $mpid 2>/dev/null; break; fi
    fi
    if [ $((now - start)) -ge "$limit" ]; then
      kill -TERM $mpid 2>/dev/null; sleep 5
      for p in $(ps --ppid $mpid -o pid= 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
      kill -9 $mpid 2>/dev/null
      break
    fi
    sleep 0.2
  done
  wait $mpid
  rc=$?
  took=$(( ${ended:-$(date +%s)} - start ))
  out=$(cat "$work/mpirun.out")
  [ $hung = 1 ] && echo "note: mpirun did not end within 5 s of its ranks (Open MPI's finalize bug): killed"
  return 0
}
# a job that must succeed: rc 0, or mpirun's finalize bug after every rank ended well
ok_rc() { [ $rc -eq 0 ] || { [ $hung = 1 ] && ! grep -q 'exited on signal\|non-zero status' <<<"$out"; }; }
passed_on() { [ "$(grep -c "checks passed ($1)" <<<"$out")" = "$2" ]; }

# the shared suite over MPI: 2 and 4 ranks in full (multi-MB included), 3 quick (an odd world)
for n in 2 3 4; do
  q=""; [ $n = 3 ] && q=quick
  run $n 300 "$here/collectives.lua" mpi $q
  expect "collectives over mpi on $n ranks" 'ok_rc && passed_on mpi $n' "rc=$rc: $out"
done
# every collective through MPI's blocking calls on the executor thread (by default only those of 4 MiB and more)
export DLUA_MPI_BLOCKING_FROM=0
run 3 300 "$here/collectives.lua" mpi quick
expect "collectives over mpi on 3 ranks, all blocking (DLUA_MPI_BLOCKING_FROM=0)" 'ok_rc && passed_on mpi 3' "rc=$rc: $out"
unset DLUA_MPI_BLOCKING_FROM
# no backend named: under mpirun dist.init() takes MPI; and gloo under mpirun finds its store over MPI
run 2 300 "$here/collectives.lua" quick
expect "dist.init() under mpirun picks mpi" 'ok_rc && passed_on mpi 2' "rc=$rc: $out"
run 2 300 "$here/collectives.lua" quick gloo
expect "gloo under mpirun (store found over MPI, shared memory)" 'ok_rc && passed_on gloo 2' "rc=$rc: $out"
# DDP and ZeRO stages 1-3 over MPI at 2 ranks: the parameters gloo trains, bit for bit (a CRC32 per case;
# ZeRO's 181 parameters make shards, and so reduce-scatter parts, of different sizes)
gl=$(timeout -k 5 120 "$DLUA" --nproc 2 --ranks-output 0 "$here/train_crc.lua" 2>&1); grc=$?
gl=$(sed 's/^\[0\] //' <<<"$gl")
run 2 120 "$here/train_crc.lua"
expect "DDP and ZeRO 1-3 over mpi at 2 ranks: gloo's parameters, bit for bit" '[ $grc -eq 0 ] && ok_rc && [ "$(grep -c "^crc " <<<"$gl")" = 7 ] && [ "$(grep "^crc " <<<"$out")" = "$(grep "^crc " <<<"$gl")" ] && grep -q "trained over mpi" <<<"$out"' "gloo (rc=$grc): $gl
     mpi (rc=$rc): $out"
# srun --mpi=pmix's environment (Slurm's variables and PMIx's, none of Open MPI's launcher): dist.init()
# takes MPI there too. (No Slurm here: mpirun starts the ranks, a wrapper swaps the variables.)
cat >"$work/srun_like.sh" <<'SH'
#!/bin/sh
export SLURM_PROCID=$OMPI_COMM_WORLD_RANK SLURM_NTASKS=$OMPI_COMM_WORLD_SIZE SLURM_LOCALID=$OMPI_COMM_WORLD_LOCAL_RANK
export SLURM_JOB_NODELIST=localhost SLURM_JOB_ID=91
for v in $(env | sed -n 's/^\(OMPI_COMM_WORLD_[A-Z_]*\)=.*/\1/p'); do unset "$v"; done
exec "$DLUA" "$@"
SH
chmod +x "$work/srun_like.sh"
DLUA=$DLUA prog="$work/srun_like.sh" run 2 120 "$here/collectives.lua" quick
expect "Slurm's variables with PMIx (srun --mpi=pmix): dist.init() picks mpi" 'ok_rc && passed_on mpi 2' "rc=$rc: $out"
no_strays "collectives"

# a world of one without mpirun (MPI's singleton), and the launcher's ranks refusing mpi
out=$(timeout -k 5 60 "$DLUA" -e 'local d = dlua.dist; d.init{backend = "mpi"}; local t = dlua.ones({3}); d.all_reduce(t, "sum"); print(d.backend(), d.rank(), d.world_size(), t[1]); d.destroy()' 2>&1); rc=$?
expect "backend mpi in a single process: a world of one" '[ $rc -eq 0 ] && grep -qx "$(printf "mpi\t0\t1\t1")" <<<"$out"' "rc=$rc: $out"
out=$(timeout -k 5 60 "$DLUA" --nproc 2 -e 'dlua.dist.init{backend = "mpi"}' 2>&1); rc=$?
expect "backend mpi under dlua --nproc: says to use mpirun" '[ $rc -eq 1 ] && grep -q "backend mpi needs ranks started by mpirun or srun" <<<"$out"' "rc=$rc: $out"

# a rank that skips a collective: the others time out naming it, and the job ends
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
run 3 60 "$work/skip.lua"
expect "skipped collective: the job fails ($took s)" '[ $rc -ne 0 ] && [ $took -le 20 ]' "rc=$rc: $out"
# (each rank's own Lua error, once: "skip.lua:7: all_reduce: ..."; the flight recorder's diagnosis may quote rank 2's
# failure too, as "rank 2: its all_reduce #2 ... failed: ...", when rank 2 failed before the dump: not counted)
skip_err() { grep -cE "skip.lua:7: all_reduce: all_reduce #2 on \(4, 5\) float32 at .*skip.lua:7 timed out after 2000 ms on rank $1 of group pg0; not arrived: rank 1 did not answer .*; arrived: rank $2" <<<"$out"; }
expect "skipped collective: ranks 0 and 2 name all_reduce #2, its shape, rank 1 missing and each other arrived" '[ "$(skip_err 0 2)" = 1 ] && [ "$(skip_err 2 0)" = 1 ]' "$out"

# the same where the collective is a blocking one on the executor, which then stays inside MPI
DLUA_MPI_BLOCKING_FROM=0 run 3 60 "$work/skip.lua"
expect "skipped blocking collective: the job fails ($took s), naming rank 1" '[ $rc -ne 0 ] && [ $took -le 20 ] && grep -q "all_reduce #2 on (4, 5) float32 at .*skip.lua:7 timed out after 2000 ms on rank 0 of group pg0; not arrived: rank 1" <<<"$out"' "rc=$rc: $out"

# a rank that exits inside a collective: mpirun ends the job, and rank 1 is the one named
cat >"$work/die.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 30 }
if dist.rank() == 1 then os.exit(3) end
dist.all_reduce(dlua.ones({ 8 }))
LUA
run 2 60 "$work/die.lua"
expect "a rank exits: the job ends, rank 1 named ($took s)" '[ $rc -ne 0 ] && [ $took -le 20 ] && grep -q "dlua: rank 1 of 2 (MPI) failed with exit status 3" <<<"$out" && ! grep -q "rank 0 of 2 (MPI) failed" <<<"$out"' "rc=$rc: $out"

# a Lua error on rank 1 while rank 0 waits in a collective: rank 1 is named, not rank 0
cat >"$work/err.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 30 }
dist.barrier()
if dist.rank() == 1 then error('rank one broke') end
dist.all_reduce(dlua.ones({ 8 }))
LUA
run 2 60 "$work/err.lua"
expect "a rank's error: the job ends, that rank named ($took s)" '[ $rc -ne 0 ] && [ $took -le 20 ] && grep -q "rank one broke" <<<"$out" && grep -q "dlua: rank 1 of 2 (MPI) failed with exit status 1" <<<"$out" && ! grep -q "rank 0 of 2 (MPI) failed" <<<"$out"' "rc=$rc: $out"

# a rank that ends normally while the other still waits for it: that one fails at once, saying so
cat >"$work/early.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 60 }
dist.all_reduce(dlua.ones({ 8 }))
if dist.rank() == 0 then dist.all_reduce(dlua.ones({ 8 })) end
dist.destroy()
LUA
run 2 90 "$work/early.lua"
expect "a peer that left: the waiting rank fails within seconds ($took s)" '[ $rc -ne 0 ] && [ $took -le 20 ] && grep -q "all_reduce #2 on (8) float32 .*failed: a peer closed its connection on rank 0 of group pg0; not arrived: rank 1 exited after 1 collective" <<<"$out"' "rc=$rc: $out"

# a rank killed by a signal: mpirun names it
cat >"$work/kill.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 30 }
dist.barrier()
if dist.rank() == 1 then
  local pid = io.open('/proc/self/stat'):read('*n')
  os.execute('kill -9 ' .. pid)
end
dist.all_reduce(dlua.ones({ 8 }))
LUA
run 2 60 "$work/kill.lua"
expect "a rank killed: the job ends, mpirun names rank 1 ($took s)" '[ $rc -ne 0 ] && [ $took -le 20 ] && grep -q "process rank 1 .* exited on signal 9" <<<"$out"' "rc=$rc: $out"

# recv from a rank that never sends: bounded by the timeout, names the peer
cat >"$work/recv.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 2 }
if dist.rank() == 0 then dist.recv(dlua.empty({ 4 }), 1, { tag = 7 }) end
os.execute('sleep 5')
LUA
run 2 60 "$work/recv.lua"
expect "recv that never matches: times out naming rank 1 ($took s)" '[ $rc -ne 0 ] && [ $took -le 20 ] && grep -q "recv from rank 1 (tag 7, (4) float32 .*timed out after 2000 ms on rank 0" <<<"$out"' "rc=$rc: $out"

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
DLUA_DIST_DEBUG=1 run 2 60 "$work/mismatch.lua"
expect "debug mode over mpi: names both calls and their lines" '[ $rc -ne 0 ] && grep -q "collective mismatch at #1: rank 0 all_reduce float32 (3) at .*mismatch.lua:6; rank 1 broadcast float32 (3) at .*mismatch.lua:8" <<<"$out"' "rc=$rc: $out"

# without debug mode, ranks passing different sizes: MPI's truncation error, and a hint to find where. (Open MPI
# may also crash on the mismatch, on either rank, before the other has said anything: then the crashing rank's
# note names the collective and the same hint.)
cat >"$work/sizes.lua" <<'LUA'
local dlua = require 'dlua'
local dist = dlua.dist
dist.init{ timeout = 20 }
dist.all_reduce(dlua.ones({ dist.rank() == 0 and 100000 or 200000 }))
LUA
run 2 60 "$work/sizes.lua"
expect "different sizes over mpi: the failure says the ranks disagree ($took s)" '[ $rc -ne 0 ] && [ $took -le 30 ] && { grep -q "MPI_ERR_TRUNCATE.*the ranks disagree on the size (DLUA_DIST_DEBUG=1 names each rank" <<<"$out" || grep -Eq "rank [01] of group pg0: [a-z ]+ inside MPI, in all_reduce #1 on \([12]00000\) float32 at .*sizes.lua:4\. MPI may crash when the ranks. calls disagree .*DLUA_DIST_DEBUG=1" <<<"$out"; }' "rc=$rc: $out"

# a fault inside a collective's MPI call: the rank's note names the call (a crash cannot be made on purpose inside
# MPI, so SIGSEGV is sent to rank 0's comm thread, "dlua-comm", while it waits in all_reduce for rank 1)
cat >"$work/crash.lua" <<'LUA'
local dlua = require 'dlua'
local ffi = require 'ffi'
ffi.cdef 'int getpid(void);'
local dist = dlua.dist
dist.init{ timeout = 30 }
if dist.rank() == 0 then
  local f = assert(io.open(arg[1] .. '/crash.pid', 'w')); f:write(ffi.C.getpid()); f:close()
  dist.all_reduce(dlua.ones({ 4, 3 }))  -- rank 1 never joins
else
  os.execute('sleep 20')
end
LUA
rm -f "$work/crash.pid"
(
  for _ in $(seq 1 150); do [ -s "$work/crash.pid" ] && break; sleep 0.1; done
  sleep 1  # into the wait
  pid=$(cat "$work/crash.pid" 2>/dev/null)
  tid=$(grep -lx dlua-comm /proc/"$pid"/task/*/comm 2>/dev/null | head -1 | cut -d/ -f5)
  [ -n "$tid" ] && python3 -c 'import ctypes, sys; ctypes.CDLL(None).tgkill(int(sys.argv[1]), int(sys.argv[2]), 11)' "$pid" "$tid"
) &
killer=$!
run 2 60 "$work/crash.lua" "$work"
wait $killer
expect "a fault inside MPI: the job fails ($took s)" '[ $rc -ne 0 ] && [ $took -le 20 ]' "rc=$rc: $out"
expect "a fault inside MPI: rank 0 names its all_reduce, shape and line, and the usual cause" 'grep -Eq "dlua: rank 0 of group pg0: segmentation fault inside MPI, in all_reduce #1 on \(4, 3\) float32 at .*crash.lua:8\. MPI may crash when the ranks. calls disagree .*DLUA_DIST_DEBUG=1" <<<"$out" && grep -q "Process received signal" <<<"$out"' "$out"

# a rank stalled in a compute loop under mpirun (no dlua launcher): rank 0's collective times out, it posts a dump
# request (the store, the flight directory), every rank's agent dumps, and rank 0 prints the launcher's diagnosis; `dlua flight
# DIR` prints the same from the files
cp "$here/stall.lua" "$work/stall.lua"  # run from the scratch folder: no_strays finds what is left of it
fl=$work/mflight
DLUA_FLIGHT_DIR=$fl run 2 60 "$work/stall.lua"
expect "stall under mpirun: the job fails ($took s)" '[ $rc -ne 0 ] && [ $took -le 20 ]' "rc=$rc: $out"
expect "stall under mpirun: rank 0 prints the diagnosis's heading" \
  'grep -qxF "dlua: flight recorder (a collective timed out on rank 0): $fl/flight-rank{0..1}.json" <<<"$out"' "$out"
expect "stall under mpirun: rank 1 is behind at all_reduce #2, rank 0 issued #3" \
  'grep -qE "^dlua:   group pg0 \(mpi\): rank 1 is behind: its last collective is all_reduce #2 on \(4\) float32 at .*stall.lua:5 \(completed\); rank 0 issued all_reduce #3 on \(4\) float32 at .*stall.lua:10$" <<<"$out"' "$out"
expect "stall under mpirun: rank 1 named at its Lua line in the loop" \
  'grep -qE "^dlua:   rank 1: not in a collective; running Lua at .*stall.lua:8$" <<<"$out"' "$out"
expect "stall under mpirun: rank 0 waits in all_reduce #3" 'grep -qE "^dlua:   rank 0: (waiting in|its) all_reduce #3 " <<<"$out"' "$out"
read -r _ rid rrank rtime _ <"$fl/flight-request"
dumps=$("$DLUA" -e "local f = require('dlua.flight')
  local a, b = f.load('$fl', 0), f.load('$fl', 1)
  print(a.dump_id == $rid and b.dump_id == $rid, b.where.state, string.format('%.1f', b.time - $rtime))" 2>&1)
read -r same where gap <<<"$dumps"
expect "stall under mpirun: rank 0 asked; both ranks dumped for its request, rank 1 in Lua, within the 3 s timeout (${gap} s after)" \
  '[ "$rrank" = 0 ] && [ "$same" = true ] && [ "$where" = lua ] && [ "$(awk -v t="$gap" "BEGIN { print (t >= 0 && t < 3) }")" = 1 ]' "$dumps / $(cat "$fl/flight-request")"
fo=$("$DLUA" flight "$fl" 2>&1); frc=$?
expect "dlua flight DIR: the diagnosis rank 0 printed, line for line" \
  '[ $frc -eq 0 ] && [ "$fo" = "$(sed -n "s/^dlua: \(flight recorder\)/\1/p; s/^dlua:   //p" <<<"$out" | grep -v "failed with exit status")" ]' \
  "dlua flight (rc $frc):
$fo
the rank printed:
$out"
# each rank dumping into a directory of its own (node-local disks): the request reaches it through the job's store,
# rank 0 says where the other dump is, and `dlua flight` on the dumps put together names rank 1's Lua line
cat >"$work/own_dir.sh" <<'SH'
#!/bin/sh
DLUA_FLIGHT_DIR=$FLIGHT_ROOT/node$OMPI_COMM_WORLD_RANK exec "$DLUA" "$@"
SH
chmod +x "$work/own_dir.sh"
FLIGHT_ROOT=$work/split DLUA=$DLUA prog="$work/own_dir.sh" run 2 60 "$work/stall.lua"
id0=$("$DLUA" -e "print(require('dlua.flight').load('$work/split/node0', 0).dump_id)" 2>&1)
id1=$("$DLUA" -e "print(require('dlua.flight').load('$work/split/node1', 1).dump_id)" 2>&1)
expect "own directories: both ranks dumped for rank 0's request, each into its own directory" \
  '[ -n "$id0" ] && [ "$id0" = "$id1" ] && [ "$id0" != nil ]' "$id0 / $id1 / $(ls -R "$work/split") / $out"
expect "own directories: rank 0 says where rank 1's dump is" \
  'grep -qxF "dlua:   rank 1 wrote its dump on host $(hostname): $work/split/node1/flight-rank1.json" <<<"$out"' "$out"
cp "$work/split/node1/flight-rank1.json" "$work/split/node0/"
fo=$("$DLUA" flight "$work/split/node0" 2>&1)
expect "own directories: dlua flight on the dumps put together: rank 1 at its Lua line" \
  'grep -qE "^rank 1: not in a collective; running Lua at .*stall.lua:8$" <<<"$fo"' "$fo"

# the request stays in the directory: the next job there (another Open MPI job id) does not answer it
before=$(stat -c %Y.%s "$fl"/flight-rank*.json)
DLUA_FLIGHT_DIR=$fl run 2 60 -e 'dlua.dist.init(); dlua.dist.barrier(); os.execute("sleep 1"); dlua.dist.barrier()'
expect "an earlier job's request: not answered by the next job in that directory" \
  'ok_rc && [ "$(stat -c %Y.%s "$fl"/flight-rank*.json)" = "$before" ]' "rc=$rc: $out"
out=$("$DLUA" flight "$work/nothing-here" 2>&1); rc=$?
expect "dlua flight on a directory without dumps: says so" '[ $rc -eq 1 ] && grep -qxF "dlua flight: no flight-recorder dump (flight-rank<r>.json) in $work/nothing-here" <<<"$out"' "$out"

no_strays "failures"
finish test_mpi
