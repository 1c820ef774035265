-- dlua side of bench/actckpt: ResNet-50 training steps with model:checkpoint(policy); prints step ms, peak activation MiB.
-- usage: dlua bench/actckpt.lua POLICY THREADS STEPS BATCH SIZE LAYOUT   (POLICY none|stages|blocks, LAYOUT nchw|nhwc)
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local resnet = require 'models.resnet'

local policy, threads, steps, batch, size, layout = arg[1], tonumber(arg[2]), tonumber(arg[3]), tonumber(arg[4]),
  tonumber(arg[5]), arg[6]
dlua.set_num_threads(threads)
dlua.manual_seed(0)
local model = resnet.resnet50():input_grad(false) -- as torch: data needs no gradient
local plan = model:checkpoint(policy)
local opt = optim.SGD(model, { lr = 0.01, momentum = 0.9, weight_decay = 1e-4 })
local crit = nn.CrossEntropyLoss()
local x = dlua.randn(batch, 3, size, size)
if layout == 'nhwc' then x = x:contiguous('channels_last') end
local y = dlua.randint(1, 1001, batch)
for dt in pairs(opt.arena.params) do opt:buffer(dt, 'momentum') end -- the optimizer's state exists before the first step

-- the model's state (parameters, gradients, momentum, the batch): what a step holds besides activations
collectgarbage('collect'); collectgarbage('collect')
local state = dlua.memory_allocated()

local function step()
  opt:zero_grad()
  local out = model:forward(x)
  crit:forward(out, y)
  model:backward(x, crit:backward(out, y))
  opt:step()
end

for _ = 1, 2 do step() end -- warm-up: primitives, the allocator's cache, modules' fields holding a step
local peak, t, cpu = 0, 0, 0
for _ = 1, steps do
  dlua.reset_peak_memory_stats()
  local t0, c0 = dlua.perf_counter(), os.clock()
  step()
  t, cpu = t + dlua.perf_counter() - t0, cpu + os.clock() - c0
  peak = math.max(peak, dlua.memory_stats().peak_allocated - state)
end
-- cpu: the process's CPU seconds, every thread (on a loaded machine the work done, where wall time is not)
print(('ms\t%.1f\tcpu_ms\t%.1f\tpeak_mb\t%.1f\tstate_mb\t%.1f\tsegments\t%d'):format(1000 * t / steps, 1000 * cpu / steps,
  peak / 2 ^ 20, state / 2 ^ 20, #plan.segments))
