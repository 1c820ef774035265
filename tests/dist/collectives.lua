-- Every collective on every dtype, sync and async, checked on each rank against a locally computed result.
-- Run: dlua --nproc N tests/dist/collectives.lua [quick] [gloo|mpi]
--      mpirun -np N dlua tests/dist/collectives.lua [quick] [mpi]   (the same checks over MPI)
local dlua = require 'dlua'
local dist = dlua.dist
local quick, backend = false, nil
for _, a in ipairs(arg) do
  if a == 'quick' then quick = true elseif a == 'gloo' or a == 'mpi' then backend = a end
end
dist.init{ timeout = 60, backend = backend }
local rank, world = dist.rank(), dist.world_size()
-- under mpirun the default is MPI (dist.init picks it from the launch), under dlua --nproc gloo
local want_backend = backend or (os.getenv('PMIX_RANK') and dist.is_mpi_available() and 'mpi') or 'gloo'
if (backend or os.getenv('PMIX_RANK')) and dist.backend() ~= want_backend then
  error(string.format('rank %d: backend %s, expected %s', rank, dist.backend(), want_backend))
end

-- Every rank is on this host: gloo all-reduces through shared memory unless DLUA_SHM=0; MPI says it shares one.
local transport, why = dist.transport()
local want_transport = want_backend == 'mpi' and 'mpi' or os.getenv('DLUA_SHM') == '0' and 'tcp' or 'shm'
if want_backend == 'mpi' and not why:find('every rank on this host', 1, true) then
  error(string.format('rank %d: mpi transport: %s', rank, why))
end
if transport ~= want_transport then
  error(string.format('rank %d: transport %s (%s), expected %s', rank, transport, why, want_transport))
end

-- memory every rank maps: all-reduces of its ranges read the peers' copies in place (nil over TCP)
do
  local sh, shwhy = dist.shared_zeros(5000, 'float64')
  if (sh ~= nil) ~= (transport == 'shm') then error(string.format('rank %d: shared_zeros gave %s (%s)', rank, tostring(sh), shwhy)) end
  if sh then
    if sh:sum():item() ~= 0 then error('shared_zeros: not zeroed') end
    sh:fill_(rank + 1)
    dist.all_reduce(sh:narrow(1, 11, 4000), 'sum')
    local want = world * (world + 1) / 2
    if sh[11] ~= want or sh[4010] ~= want or sh[10] ~= rank + 1 or sh[4011] ~= rank + 1 then
      error(string.format('rank %d: shared all_reduce gave %g %g %g %g', rank, sh[10], sh[11], sh[4010], sh[4011]))
    end
  end
end

local dtypes = { 'float32', 'float64', 'float16', 'bfloat16', 'int32', 'int64', 'uint8', 'bool' }
local counts = { 0, 1, 1009 }
local checks = 0

local function fail(fmt, ...) error(string.format('rank %d: ' .. fmt, rank, ...), 2) end

-- Values small enough to be exact in every dtype (bf16 holds integers up to 256 exactly).
-- (i % 5) + r + 1 for numbers; for bool, true where (i + r) % 3 ~= 0.
local function values(n, dtype, r)
  local base = dlua.arange(0, n, 1, { dtype = 'int64' })
  if dtype == 'bool' then return ((base + r) % 3):to('bool') end
  return ((base % 5) + (r + 1)):to(dtype)
end

local function same(got, want, what)
  checks = checks + 1
  if got:numel() ~= want:numel() then fail('%s: %d elements, expected %d', what, got:numel(), want:numel()) end
  if got.dtype ~= want.dtype then fail('%s: dtype %s, expected %s', what, got.dtype, want.dtype) end
  if got:numel() == 0 then return end
  if not got:reshape({ -1 }):eq(want:reshape({ -1 })):all():item() then
    fail('%s: got %s, expected %s', what, tostring(got:reshape({ -1 }):narrow(1, 1, math.min(8, got:numel()))),
         tostring(want:reshape({ -1 }):narrow(1, 1, math.min(8, want:numel()))))
  end
end

-- The reduction over every rank of values(n, dtype, r), computed here.
local function reduced(n, dtype, op)
  local acc
  for r = 0, world - 1 do
    local v = values(n, dtype, r)
    if dtype == 'bool' then
      if acc == nil then acc = v
      elseif op == 'sum' or op == 'max' then acc = acc:to('int64'):add(v:to('int64')):gt(0)
      else acc = acc:to('int64'):mul(v:to('int64')):gt(0) end
    else
      local d = v:to('float64')
      if acc == nil then acc = d
      elseif op == 'sum' or op == 'avg' then acc = acc + d
      elseif op == 'product' then acc = acc * d
      elseif op == 'max' then acc = dlua.where(acc:gt(d), acc, d)
      elseif op == 'min' then acc = dlua.where(acc:lt(d), acc, d) end
    end
  end
  if op == 'avg' then acc = acc / world end
  return acc:to(dtype)
end

for _, dtype in ipairs(dtypes) do
  local floating = dtype:find('float') ~= nil
  for _, n in ipairs(counts) do
    local tag = string.format('%s n=%d', dtype, n)
    for _, op in ipairs({ 'sum', 'max', 'min', 'product', 'avg' }) do
      if op ~= 'avg' or floating then
        local t = values(n, dtype, rank)
        dist.all_reduce(t, op)
        same(t, reduced(n, dtype, op), 'all_reduce ' .. op .. ' ' .. tag)
      end
    end
    -- broadcast from the last rank
    local b = values(n, dtype, rank)
    dist.broadcast(b, world - 1)
    same(b, values(n, dtype, world - 1), 'broadcast ' .. tag)
    -- all_gather with allocated outputs, equal sizes
    local outs = dist.all_gather(nil, values(n, dtype, rank))
    for r = 0, world - 1 do same(outs[r + 1], values(n, dtype, r), 'all_gather from ' .. r .. ' ' .. tag) end
    -- reduce_scatter: rank r gets the sum over ranks of their ins[r + 1]
    local ins = {}
    for r = 0, world - 1 do ins[r + 1] = values(n, dtype, rank + r) end
    local out = dlua.empty({ n }, { dtype = dtype })
    dist.reduce_scatter(out, ins, 'sum')
    if dtype ~= 'bool' then
      local want = values(n, 'float64', rank):zero_()
      for q = 0, world - 1 do want = want + values(n, 'float64', q + rank) end
      same(out, want:to(dtype), 'reduce_scatter ' .. tag)
    end
    -- all_to_all: rank q sends values(n, q * 10 + r) to rank r
    local sends, recvs = {}, {}
    for r = 0, world - 1 do
      sends[r + 1] = values(n, dtype, (rank * 7 + r) % 50)
      recvs[r + 1] = dlua.empty({ n }, { dtype = dtype })
    end
    dist.all_to_all(recvs, sends)
    for r = 0, world - 1 do same(recvs[r + 1], values(n, dtype, (r * 7 + rank) % 50), 'all_to_all from ' .. r .. ' ' .. tag) end
  end
end

-- unequal reduce_scatter (ZeRO's shards of a bucket): part q has sizes[q % 4 + 1] elements on every rank,
-- an empty one included (its rank still takes part); sum over every dtype, avg and max of floats
do
  local sizes = { 0, 1009, 3, 17 }
  local function part(q) return sizes[q % 4 + 1] end
  local function check(dtype, op, scale, packed)
    local n = part(rank) * scale
    local ins = {}
    for q = 0, world - 1 do ins[q + 1] = values(part(q) * scale, dtype, rank + q) end
    if packed then  -- views of one flat buffer, back to back in rank order (a ZeRO bucket)
      local flat = dlua.cat(ins, 1)
      local off = 1
      for q = 0, world - 1 do
        ins[q + 1] = flat:narrow(1, off, part(q) * scale)
        off = off + part(q) * scale
      end
    end
    local out = dlua.empty({ n }, { dtype = dtype })
    dist.reduce_scatter(out, ins, op)
    -- rank r's out: op over ranks q of their ins[r + 1], which is values(n, dtype, q + r)
    local acc
    for q = 0, world - 1 do
      local v = values(n, 'float64', q + rank)
      if acc == nil then acc = v elseif op == 'max' then acc = dlua.where(acc:gt(v), acc, v) else acc = acc + v end
    end
    if op == 'avg' then acc = acc / world end
    same(out, acc:to(dtype), string.format('reduce_scatter unequal %s %s (parts of %d, %d, ...)', op, dtype,
                                           part(0) * scale, part(1) * scale))
  end
  for _, dtype in ipairs(dtypes) do
    if dtype ~= 'bool' then check(dtype, 'sum', 1) end
  end
  check('float32', 'avg', 1)
  check('float64', 'max', 1)
  check('float32', 'sum', 1, true)
  -- over 4 MiB in all (MPI: the blocking call; gloo: many ring chunks)
  if not quick then check('float32', 'avg', 1100, true) end
end

-- unequal all_gather: rank r contributes r + 2 elements
local mine = values(rank + 2, 'float32', rank)
local got = dist.all_gather(nil, mine)
for r = 0, world - 1 do same(got[r + 1], values(r + 2, 'float32', r), 'all_gather unequal from ' .. r) end

-- non-contiguous view: a column of a matrix
local m = dlua.zeros({ 7, 3 })
m:select(2, 2):copy_(values(7, 'float32', rank))
dist.all_reduce(m:select(2, 2), 'sum')
same(m:select(2, 2):contiguous(), reduced(7, 'float32', 'sum'), 'all_reduce of a strided view')
same(m:select(2, 1):contiguous(), dlua.zeros({ 7 }), 'neighbouring column untouched')

-- async: several in flight, waited in reverse order
local works, ts = {}, {}
for k = 1, 5 do
  ts[k] = values(1000 + k, 'float32', rank + k)
  works[k] = dist.all_reduce(ts[k], 'sum', { async = true })
end
for k = 5, 1, -1 do
  works[k]:wait()
  if not works[k]:is_completed() then fail('work %d not completed after wait', k) end
  local want = values(1000 + k, 'float64', 0):zero_()
  for r = 0, world - 1 do want = want + values(1000 + k, 'float64', r + k) end
  same(ts[k], want:to('float32'), 'async all_reduce ' .. k)
end
dist.barrier()
local bw = dist.barrier{ async = true }
bw:wait()

-- multi-MB: 3,000,017 floats summed
if not quick then
  local n = 3000017
  local big = dlua.full({ n }, rank + 1)
  dist.all_reduce(big, 'sum')
  local want = world * (world + 1) / 2
  if big:min():item() ~= want or big:max():item() ~= want then fail('multi-MB all_reduce: not all %g', want) end
  checks = checks + 1
end

-- send/recv between rank 0 and rank 1 (blocking and async)
if world >= 2 then
  if rank == 0 then
    dist.send(values(33, 'int64', 42), 1)
    dist.isend(values(5, 'float64', 7), 1, { tag = 3 }):wait()
  elseif rank == 1 then
    local r1 = dlua.empty({ 33 }, { dtype = 'int64' })
    dist.recv(r1, 0)
    same(r1, values(33, 'int64', 42), 'recv from rank 0')
    local r2 = dlua.empty({ 5 }, { dtype = 'float64' })
    dist.irecv(r2, 0, { tag = 3 }):wait()
    same(r2, values(5, 'float64', 7), 'irecv with a tag')
  end
end

-- sub-group of the even ranks
local evens = {}
for r = 0, world - 1, 2 do evens[#evens + 1] = r end
local g = dist.new_group(evens)
if g:is_member() then
  local t = dlua.full({ 4 }, rank)
  dist.all_reduce(t, 'sum', { group = g })
  local want = 0
  for _, r in ipairs(evens) do want = want + r end
  same(t, dlua.full({ 4 }, want), 'all_reduce in the group of even ranks')
else
  local ok, err = pcall(dist.all_reduce, dlua.zeros({ 1 }), 'sum', { group = g })
  if ok or not tostring(err):find('not a member', 1, true) then fail('non-member all_reduce: %s', tostring(err)) end
end

-- bad input
local ok, err = pcall(dist.all_reduce, dlua.zeros({ 2 }, { dtype = 'int32' }), 'avg')
if ok or not tostring(err):find('avg', 1, true) then fail('avg on int32 accepted: %s', tostring(err)) end
ok, err = pcall(dist.all_reduce, dlua.zeros({ 2 }), 'median')
if ok or not tostring(err):find("unknown reduce op 'median'", 1, true) then fail('bad op: %s', tostring(err)) end
ok, err = pcall(dist.broadcast, dlua.zeros({ 2 }), world)
if ok or not tostring(err):find('src ' .. world .. ' is not a rank', 1, true) then fail('bad src: %s', tostring(err)) end

dist.barrier()
print(string.format('rank %d of %d: %d checks passed (%s)', rank, world, checks, dist.backend()))
dist.destroy()
