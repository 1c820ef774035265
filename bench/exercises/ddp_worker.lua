-- The ranks' side of `dlua experiment backends|buckets`: all-reduce bus bandwidth per size, and DDP step time per bucket plan.
--   dlua --nproc 2 bench/exercises/ddp_worker.lua --backend gloo --sizes 1048576,16777216 --model resnet18 --plans 25:1,1:1
-- Rank 0 prints tab-separated lines: `backend NAME TRANSPORT`, `allreduce BYTES SECONDS BUSBW_GBS`,
-- `ddp BUCKET_MB FIRST_MB BUCKETS SECONDS [same]` (the fastest step, each step as long as its slowest rank; `same`:
-- the plan cuts as an earlier one did, whose time it repeats), or
-- `missing BACKEND WHY` when this build has no such backend.
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local cli = require 'dlua.cli'
local resnet = require 'models.resnet'
local dist = dlua.dist

local opt = cli.parse(arg, { backend = 'gloo', sizes = { 1048576 }, repeats = 10, model = 'resnet18', image = 32, batch = 16,
  steps = 3, plans = { '25:1' }, threads = 0 }, { description = 'dlua experiment backends/buckets: the ranks\' part' })
if opt.threads > 0 then dlua.set_num_threads(opt.threads) end

-- A backend this build lacks (mpi before #26 lands, nccl without GPUs) is a line, not a failure.
local ok, err = pcall(dist.init, { backend = opt.backend })
if not ok then
  local rank = tonumber(os.getenv('RANK') or os.getenv('OMPI_COMM_WORLD_RANK') or '0')
  if rank == 0 then print(('missing\t%s\t%s'):format(opt.backend, tostring(err):gsub('^[^:]*:%d+: ', ''):gsub('[\t\n]', ' '))) end
  os.exit(0)
end
local rank, n = dist.rank(), dist.world_size()
local function say(...) if rank == 0 then print(table.concat({ ... }, '\t')) end end
say('backend', dist.backend(), tostring(dist.transport()))

-- Bus bandwidth as nccl-tests define it: 2 (n - 1) / n of the bytes per second.
local device = dist.device()
for _, bytes in ipairs(opt.sizes) do
  local t = dlua.ones(math.floor(bytes / 4), { device = device })
  for _ = 1, 2 do dist.all_reduce(t, 'sum') end
  dist.barrier()
  local times = {}
  for i = 1, opt.repeats do
    local t0 = dlua.perf_counter()
    dist.all_reduce(t, 'sum')
    times[i] = dlua.perf_counter() - t0
  end
  local all = dlua.tensor(times, { dtype = 'float64' })
  dist.all_reduce(all, 'max')
  local m = {}
  for i = 1, opt.repeats do m[i] = all[i] end
  table.sort(m)
  local med = m[math.floor((#m + 1) / 2)]
  say('allreduce', tostring(bytes), ('%.6g'):format(med), ('%.4f'):format(2 * (n - 1) / n * bytes / med / 1e9))
  t:free()
end

if #opt.plans > 0 and opt.steps > 0 then
  dlua.manual_seed(0)
  local net = resnet[opt.model]({ in_channels = 3, num_classes = 10 }):input_grad(false):to(device)
  local model = dist.DDP(net)
  local sgd = optim.SGD(model, { lr = 0.01, momentum = 0.9 })
  local crit = nn.CrossEntropyLoss()
  dlua.manual_seed(1 + rank)
  local x = dlua.randn({ opt.batch, 3, opt.image, opt.image }, { device = device }):contiguous('channels_last')
  local y = dlua.randint(1, 11, { opt.batch }, { device = device })
  local ddp = require 'dlua.ddp'
  local function step()
    sgd:zero_grad()
    local out = model:forward(x)
    crit:forward(out, y)
    model:backward(x, crit:backward(out, y))
    sgd:step()
  end
  step()  -- warm-up: buffers, connections
  local mb = 0
  for _, g in pairs(net:flatten().grads) do mb = mb + g:numel() * g:element_size() / 2 ^ 20 end
  say('gradients', ('%.2f'):format(mb))
  local timed = {}  -- plans that cut alike are one plan: timed once
  for _, p in ipairs(opt.plans) do
    local bmb, fmb = tostring(p):match('^([%d.]+):([%d.]+)$')
    if not bmb then error(('--plans: expected BUCKET_MB:FIRST_MB, got %s'):format(p), 0) end
    local plan = ddp.plan(model.arena.entries, tonumber(fmb) * 2 ^ 20, tonumber(bmb) * 2 ^ 20)
    local cuts = {}
    for i, b in ipairs(plan) do cuts[i] = b.dtype .. b.offset end
    local sig = table.concat(cuts, ',')
    if timed[sig] then
      say('ddp', bmb, fmb, tostring(#plan), ('%.6g'):format(timed[sig]), 'same')
      goto continue
    end
    model:set_buckets(plan)
    step()  -- the first step of a plan: its buffers
    local times = {}
    for i = 1, opt.steps do
      dist.barrier()
      local t0 = dlua.perf_counter()
      step()
      model:wait()
      times[i] = dlua.perf_counter() - t0
    end
    local all = dlua.tensor(times, { dtype = 'float64' })
    dist.all_reduce(all, 'max')  -- the job's pace is its slowest rank's
    local best = math.huge
    for i = 1, opt.steps do best = math.min(best, all[i]) end
    timed[sig] = best
    say('ddp', bmb, fmb, tostring(#model:bucket_plan()), ('%.6g'):format(best))
    ::continue::
  end
end
dist.destroy()
