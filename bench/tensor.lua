-- dlua side of bench/tensor: prints `name<TAB>value` lines (GB/s or GFLOP/s).
local dlua = require 'dlua'

local threads, n = tonumber(arg[1]), tonumber(arg[2])
local sizes = {}
for s in arg[3]:gmatch('%d+') do sizes[#sizes + 1] = tonumber(s) end
dlua.set_num_threads(threads)
dlua.manual_seed(0)
local now = dlua.perf_counter

local function best(fn, reps)
  fn() -- warm-up: first touch of pages, caches
  local t = math.huge
  for _ = 1, reps do
    local t0 = now()
    fn()
    t = math.min(t, now() - t0)
  end
  return t
end

local a, b, c = dlua.rand(n), dlua.rand(n), dlua.rand(n)
print(('add\t%.3f'):format(3 * 4 * n / best(function() (a + b):free() end, 5) / 1e9))
print(('add_\t%.3f'):format(3 * 4 * n / best(function() a:add_(b, 1e-9) end, 5) / 1e9))
print(('fma\t%.3f'):format(4 * 4 * n / best(function() a:addcmul_(b, c, 1e-9) end, 5) / 1e9))
print(('sum\t%.3f'):format(4 * n / best(function() a:sum() end, 5) / 1e9))
a:free(); b:free(); c:free()
for _, s in ipairs(sizes) do
  local x, y = dlua.rand(s, s), dlua.rand(s, s)
  local reps = s >= 2048 and 3 or 10
  print(('sgemm%d\t%.3f'):format(s, 2 * s ^ 3 / best(function() dlua.mm(x, y):free() end, reps) / 1e9))
  x:free(); y:free()
end
