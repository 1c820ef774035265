-- ZeRO's per-rank model-state memory and step time against DDP, one mode per launch:
-- `dlua --nproc N bench/zero.lua MODE [steps] [bucket_mb]`, MODE ddp|zero1|zero2|zero3 (bench/zero runs them).
-- Model: an MLP 1024 -> 2048 -> 2048 -> 2048 -> 10 (10.5M float32 parameters), AdamW, batch 8 per rank.
-- Rank 0 prints one line: mode, parameters, model-state bytes (the most any rank holds), the
-- formula's, live allocator bytes (the most any rank has, model built to after the last step, less
-- what was live before the model), the process's peak, ms per step (median), and the step's peak
-- of model states and ZeRO's buffers (zero:memory().peak: buckets in flight, gathered modules).
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local dist = dlua.dist

local mode, steps, bucket_mb = arg[1] or 'ddp', tonumber(arg[2]) or 6, tonumber(arg[3]) or 4
dlua.set_num_threads(tonumber(os.getenv('OMP_NUM_THREADS') or '1'))
dist.init()
local rank, world = dist.rank(), dist.world_size()

collectgarbage(); collectgarbage()
local base = dlua.memory_allocated()
dlua.manual_seed(1)
local net = nn.Sequential{ nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
  nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10) }:input_grad(false)
local P = net:num_parameters()
local model
if mode == 'ddp' then
  model = dist.DDP(net, { bucket_mb = bucket_mb })
else
  local stage = tonumber(mode:match('^zero(%d)$'))
  if not stage then error('mode: ddp, zero1, zero2 or zero3, got ' .. mode, 0) end
  model = dist.ZeRO(net, { stage = stage, bucket_mb = bucket_mb })
end
local opt = optim.AdamW(model, { lr = 1e-4 })
local crit = nn.CrossEntropyLoss()
local g = dlua.Generator(100 + rank)
local x = dlua.randn({ 8, 1024 }, { generator = g })
local y = dlua.randint(1, 11, { 8 }, { generator = g, dtype = 'int64' })
local times = {}
for s = 1, steps + 1 do
  dist.barrier()
  local t0 = dlua.perf_counter()
  opt:zero_grad()
  local out = model:forward(x)
  crit:forward(out, y)
  model:backward(x, crit:backward(out, y))
  opt:step()
  if mode ~= 'ddp' then model:_wait_params() end  -- the step's parameter gathers count
  if s > 1 then times[#times + 1] = (dlua.perf_counter() - t0) * 1000 end
end
collectgarbage(); collectgarbage()
local live = dlua.memory_allocated() - base

local states, step_peak
if mode == 'ddp' then
  local a = net:flatten()
  states = 0
  for dt, p in pairs(a.params) do states = states + p:numel() * 4 + a.grads[dt]:numel() * 4 end
  for _, s in pairs(opt.state) do
    for k, v in pairs(s) do if k ~= 'numel' then states = states + v:numel() * 4 end end
  end
  step_peak = states
else
  local m = model:memory()
  states, step_peak = m.model_states, m.peak
end
table.sort(times)
local t = dlua.tensor({ states, live, dlua.memory_peak(), times[math.ceil(#times / 2)], step_peak }, { dtype = 'float64' })
dist.all_reduce(t, 'max')
local N = world
local formula = ({ ddp = 16 * P, zero1 = 8 * P + 8 * P / N, zero2 = 4 * P + 12 * P / N, zero3 = 16 * P / N })[mode]
if rank == 0 then
  io.write(string.format('%s\t%d\t%d\t%d\t%d\t%d\t%.1f\t%d\n', mode, P, t[1], formula, t[2], t[3], t[4], t[5]))
end
dist.destroy()
