-- dlua side of bench/allreduce: one collective (all_reduce 'sum' by default) on float32 tensors of each size,
-- under `dlua --nproc N`.
-- usage: dlua --nproc N bench/allreduce.lua <sizes in bytes, comma-separated> <repeats> [all_reduce|reduce_scatter|all_gather|broadcast]
-- Rank 0 prints `bytes<TAB>seconds<TAB>busbw GB/s` per size; seconds = median over repeats of the slowest rank;
-- bytes is the whole buffer (reduce_scatter's inputs, all_gather's outputs, each rank's part 1/N of it).
local dlua = require 'dlua'
local dist = dlua.dist

local sizes, repeats, op = {}, tonumber(arg[2]) or 20, arg[3] or 'all_reduce'
for s in (arg[1] or '4096'):gmatch('[^,]+') do sizes[#sizes + 1] = tonumber(s) end
dist.init()
local n, rank = dist.world_size(), dist.rank()

-- Fewer repeats for big tensors keep the default run short; the median is still over >= 3.
local function reps(bytes)
  if bytes >= 256 * 2 ^ 20 then return math.max(3, math.floor(repeats / 6)) end
  if bytes >= 64 * 2 ^ 20 then return math.max(3, math.floor(repeats / 3)) end
  if bytes >= 16 * 2 ^ 20 then return math.max(5, math.floor(repeats / 2)) end
  return repeats
end

-- Bus bandwidth factors as nccl-tests define them.
local factor = ({ all_reduce = 2 * (n - 1) / n, reduce_scatter = (n - 1) / n, all_gather = (n - 1) / n, broadcast = 1 })[op]
if not factor then error('bench/allreduce.lua: unknown collective ' .. op, 0) end

-- The collective on a buffer of `bytes` (float32), as a function of no arguments.
local function collective(bytes)
  local t = dlua.ones(math.floor(bytes / 4))
  local part = math.floor(bytes / 4 / n)
  local parts = {}
  for q = 1, n do parts[q] = t:narrow(1, (q - 1) * part + 1, part) end
  local mine = dlua.ones(part)
  if op == 'all_reduce' then return function() dist.all_reduce(t, 'sum') end, t end
  if op == 'broadcast' then return function() dist.broadcast(t, 0) end, t end
  if op == 'all_gather' then return function() dist.all_gather(parts, mine) end, t end
  return function() dist.reduce_scatter(mine, parts, 'sum') end, t
end

for _, bytes in ipairs(sizes) do
  local run, t = collective(bytes)
  local k = reps(bytes)
  for _ = 1, (bytes >= 64 * 2 ^ 20) and 1 or 3 do run() end  -- warm-up: connections, pages
  local times = {}
  dist.barrier()
  for i = 1, k do  -- back to back, as nccl-tests time them (no barrier between repeats)
    local t0 = dlua.perf_counter()
    run()
    times[i] = dlua.perf_counter() - t0
  end
  -- Each repeat counts as long as its slowest rank took.
  local all = dlua.tensor(times, { dtype = 'float64' })
  dist.all_reduce(all, 'max')
  local m = {}
  for i = 1, k do m[i] = all[i] end
  table.sort(m)
  local med = k % 2 == 1 and m[(k + 1) / 2] or (m[k / 2] + m[k / 2 + 1]) / 2
  if rank == 0 then
    print(('%d\t%.6g\t%.4f'):format(bytes, med, factor * bytes / med / 1e9))
  end
  t:free()
  dist.barrier()
end
dist.destroy()
