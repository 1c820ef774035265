-- How much of DDP's communication backward hides: one model, three ways to run a step, under
-- `dlua --nproc N bench/ddp_overlap.lua [model] [image] [batch] [steps] [rounds] [bucket_mb]` (bench/ddp_overlap runs it).
--   overlap  the DDP step: each bucket's all-reduce starts as backward finishes it
--   after    backward with no communication, then every bucket all-reduced (the pre-DDP way)
--   off      no communication at all (the compute alone)
-- Rounds alternate the three; each mode's best round counts. Rank 0 prints `mode<TAB>ms per step`.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local resnet = require 'models.resnet'
local dist = dlua.dist

local name, image = arg[1] or 'resnet18', tonumber(arg[2]) or 32
local batch, steps, rounds = tonumber(arg[3]) or 16, tonumber(arg[4]) or 5, tonumber(arg[5]) or 3
local bucket_mb = tonumber(arg[6]) or 25
dlua.set_num_threads(tonumber(os.getenv('OMP_NUM_THREADS') or '1'))
dist.init()
local rank = dist.rank()
dlua.manual_seed(0)
local net = resnet[name]({ in_channels = 3, num_classes = 10 }):input_grad(false)
local model = dist.DDP(net, { bucket_mb = bucket_mb })
local opt = optim.SGD(model, { lr = 0.01, momentum = 0.9 })
local crit = nn.CrossEntropyLoss()
dlua.manual_seed(1 + rank)
local x = dlua.randn(batch, 3, image, image):contiguous('channels_last')
local y = dlua.randint(1, 11, batch)
local arena = net:flatten()

local function fwd_bwd()
  local out = model:forward(x)
  crit:forward(out, y)
  model:backward(x, crit:backward(out, y))
end

local modes = {
  overlap = function() fwd_bwd() end,
  off = function() model:no_sync(fwd_bwd) end,
  after = function()
    model:no_sync(fwd_bwd)
    for _, b in ipairs(model:bucket_plan()) do
      dist.all_reduce(arena.grads[b.dtype]:narrow(1, b.offset + 1, b.numel), 'avg')
    end
  end,
}
local order = { 'overlap', 'after', 'off' }

local function run(mode, n)
  for _ = 1, n do
    opt:zero_grad()
    modes[mode]()
    opt:step()
  end
  model:wait()
end

for _, m in ipairs(order) do run(m, 2) end -- warm-up
local best = {}
for _ = 1, rounds do
  for _, m in ipairs(order) do
    dist.barrier()
    local t0 = dlua.perf_counter()
    run(m, steps)
    local t = dlua.tensor({ (dlua.perf_counter() - t0) / steps }, { dtype = 'float64' })
    dist.all_reduce(t, 'max') -- the job's pace is its slowest rank's
    best[m] = math.min(best[m] or math.huge, t[1])
  end
end
if rank == 0 then
  local mb = 0
  for _, g in pairs(arena.grads) do mb = mb + g:numel() * g:element_size() / 2 ^ 20 end
  print(('model\t%s %dx%d batch %d, %.1f MB of gradients, %d buckets'):format(name, image, image, batch, mb,
    #model:bucket_plan()))
  for _, m in ipairs(order) do print(('%s\t%.1f'):format(m, best[m] * 1e3)) end
end
dist.destroy()
