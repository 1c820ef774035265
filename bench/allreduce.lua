-- dlua side of bench/allreduce: dlua.dist.all_reduce('sum') on float32 tensors of each size, under `dlua --nproc N`.
-- usage: dlua --nproc N bench/allreduce.lua <sizes in bytes, comma-separated> <repeats>
-- Rank 0 prints `bytes<TAB>seconds<TAB>busbw GB/s` per size; seconds = median over repeats of the slowest rank.
local dlua = require 'dlua'
local dist = dlua.dist

local sizes, repeats = {}, tonumber(arg[2]) or 20
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

for _, bytes in ipairs(sizes) do
  local t = dlua.ones(math.floor(bytes / 4))
  local k = reps(bytes)
  for _ = 1, (bytes >= 64 * 2 ^ 20) and 1 or 3 do dist.all_reduce(t, 'sum') end  -- warm-up: connections, pages
  local times = {}
  dist.barrier()
  for i = 1, k do  -- back to back, as nccl-tests time them (no barrier between repeats)
    local t0 = dlua.perf_counter()
    dist.all_reduce(t, 'sum')
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
    print(('%d\t%.6g\t%.4f'):format(bytes, med, 2 * (n - 1) / n * bytes / med / 1e9))
  end
  t:free()
  dist.barrier()
end
dist.destroy()
