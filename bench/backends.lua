-- dlua side of bench/backends: all_reduce 'sum' bus bandwidth on float32 tensors of each size, over the backend
-- asked for, under `dlua --nproc N` (gloo: shared memory, or TCP with DLUA_SHM=0) or `mpirun -np N dlua` (mpi).
-- usage: bench/backends.lua <sizes in bytes, comma-separated> <repeats> <gloo|mpi|nccl>
-- Rank 0 prints `what<TAB>backend<TAB>transport` once, then `bytes<TAB>seconds<TAB>busbw GB/s` per size;
-- seconds = median over repeats of the slowest rank (as bench/allreduce.lua). nccl: tensors on this rank's GPU.
local dlua = require 'dlua'
local dist = dlua.dist

local sizes, repeats, backend = {}, tonumber(arg[2]) or 20, arg[3] or 'gloo'
for s in (arg[1] or '4096'):gmatch('[^,]+') do sizes[#sizes + 1] = tonumber(s) end
dist.init{ backend = backend }
local n, rank = dist.world_size(), dist.rank()
local device = backend == 'nccl' and dist.device() or 'cpu'
if rank == 0 then print(('what\t%s\t%s'):format(dist.backend(), (dist.transport()))) end

local function reps(bytes)  -- the schedule of bench/allreduce.lua
  if bytes >= 256 * 2 ^ 20 then return math.max(3, math.floor(repeats / 6)) end
  if bytes >= 64 * 2 ^ 20 then return math.max(3, math.floor(repeats / 3)) end
  if bytes >= 16 * 2 ^ 20 then return math.max(5, math.floor(repeats / 2)) end
  return repeats
end

local factor = 2 * (n - 1) / n
for _, bytes in ipairs(sizes) do
  local t = dlua.ones(math.floor(bytes / 4)):to(device)
  local k = reps(bytes)
  for _ = 1, (bytes >= 64 * 2 ^ 20) and 1 or 3 do dist.all_reduce(t, 'sum') end  -- warm-up
  local times = {}
  dist.barrier()
  for i = 1, k do  -- back to back, as nccl-tests time them
    local t0 = dlua.perf_counter()
    dist.all_reduce(t, 'sum')
    if device ~= 'cpu' then dlua.cuda.synchronize() end
    times[i] = dlua.perf_counter() - t0
  end
  local all = dlua.tensor(times, { dtype = 'float64' }):to(device)
  dist.all_reduce(all, 'max')
  all = all:to('cpu')
  local m = {}
  for i = 1, k do m[i] = all[i] end
  table.sort(m)
  local med = k % 2 == 1 and m[(k + 1) / 2] or (m[k / 2] + m[k / 2 + 1]) / 2
  if rank == 0 then print(('%d\t%.6g\t%.4f'):format(bytes, med, factor * bytes / med / 1e9)) end
  t:free()
  dist.barrier()
end
dist.destroy()
