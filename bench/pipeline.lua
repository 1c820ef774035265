-- The measured pipeline bubble against (p - 1)/(m + p - 1), on a balanced synthetic model, under
-- `dlua --nproc P bench/pipeline.lua [work] [ms] [max_m] [steps]` (bench/pipeline runs it for P = 2 and 4).
--   work 'wait':    each stage's forward waits `ms` milliseconds and its backward twice that (a timed
--                   wait on the job's store, no CPU used), so stages stay balanced however loaded the
--                   machine is: what is measured is the schedule and its communication
--   work 'compute': each stage is Linear layers sized to take about `ms` per forward on one thread
--                   (needs P free cores to be balanced)
-- Every micro-batch has the same rows, so an operation takes the same time for every m. Rank 0
-- prints one line per (schedule, m): `schedule<TAB>m<TAB>ideal<TAB>measured`.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local dist = dlua.dist

local work, ms = arg[1] or 'wait', tonumber(arg[2]) or 4
local max_m, steps = tonumber(arg[3]) or 16, tonumber(arg[4]) or 3
dlua.set_num_threads(1)
dist.init()
local rank, p = dist.rank(), dist.world_size()
local rows, width = 32, 256

-- A stage that takes a fixed time: forward waits ms, backward 2 ms; it passes its input on scaled by
-- a weight (so there is a parameter and a gradient).
local Timed = nn.Module:extend('Timed')
function Timed:__init(t)
  self.t = t
  self:register_parameter('weight', dlua.ones({ 1 }))
end
local store = dist.store()
local function pause(s) pcall(store.wait, store, { 'bench/pipeline/never' }, s) end
function Timed:forward(x)
  pause(self.t)
  self.output = x * self.weight[1]
  return self.output
end
function Timed:backward(x, g)
  pause(2 * self.t)
  self.grad_weight:add_((g * x):sum():reshape({ 1 }))
  self.grad_input = g * self.weight[1]
  return self.grad_input
end

local function stage_module()
  if work == 'wait' then return nn.Sequential{ Timed(ms / 1000) } end
  -- layers of rows x width x width multiply-adds: about 2 GFLOP/s on one loaded core
  local layers = math.max(1, math.floor(ms / 1000 * 2e9 / (2 * rows * width * width) + 0.5))
  local seq = nn.Sequential()
  for _ = 1, layers do seq:add(nn.Linear(width, width)); seq:add(nn.ReLU()) end
  return seq
end

dlua.manual_seed(1)
local stages = {}
for s = 1, p do stages[s] = stage_module() end
local crit = nn.MSELoss()
for _, schedule in ipairs({ 'gpipe', '1f1b' }) do
  for m = 1, max_m do
    local pipe = dist.Pipeline(stages, { chunks = m, schedule = schedule, loss = crit })
    local x = dlua.randn({ m * rows, width })
    local y = dlua.zeros({ m * rows, width })
    pipe:step(x, y)  -- the first step learns the shapes
    pipe:reset_stats()
    for _ = 1, steps do
      pipe:zero_grad()
      pipe:step(x, y)
    end
    local r = pipe:report({ print = false })
    if rank == 0 then print(string.format('%s\t%d\t%.4f\t%.4f', schedule, m, r.ideal_bubble, r.bubble)) end
  end
end
dist.destroy()
