-- DDP bucket_mb = 'auto': it times each candidate plan in the first steps, every rank keeps the same plan (the fastest by
-- the slowest rank's step), and training ends bit for bit where the same steps with that plan fixed end; comm_wait_s
-- counts time blocked on a late peer; bad options named.
-- Run: dlua --nproc N tests/dist/ddp_auto.lua
local dlua = require 'dlua'
local nn = require 'dlua.nn'
local optim = require 'dlua.optim'
local dist = dlua.dist
dist.init{ timeout = 60 }
local rank, world = dist.rank(), dist.world_size()
local function fail(fmt, ...) error(string.format('rank %d: ' .. fmt, rank, ...), 2) end

-- An MLP of 256 KB layers: with a 0.1 MB first bucket, caps of 0.1, 0.6 and 64 MB cut it into 5, 3 and 2 buckets.
local function net()
  dlua.manual_seed(5)
  local layers = { nn.Linear(64, 256), nn.ReLU() }
  for _ = 1, 4 do layers[#layers + 1] = nn.Linear(256, 256); layers[#layers + 1] = nn.ReLU() end
  layers[#layers + 1] = nn.Linear(256, 10)
  return nn.Sequential(unpack(layers)):input_grad(false)
end

local B = 4
local function batch(s)
  local g = dlua.Generator(100 + s)
  local x = dlua.randn({ B * world, 64 }, { generator = g })
  local y = dlua.randint(1, 11, { B * world }, { generator = g, dtype = 'int64' })
  return x:narrow(1, rank * B + 1, B):contiguous(), y:narrow(1, rank * B + 1, B):contiguous()
end

local STEPS = 9  -- 1 warm-up + 3 candidates x 2 timed steps = 7 before the choice, 2 after
local function train(opts, accumulate)
  local m = net()
  opts.accumulate = accumulate
  opts.first_bucket_mb = 0.1
  local ddp = dist.DDP(m, opts)
  local sgd = optim.SGD(ddp, { lr = 0.05, momentum = 0.9 })
  local crit = nn.CrossEntropyLoss()
  local plans_seen = {}
  for s = 1, STEPS do
    sgd:zero_grad()
    for k = 1, accumulate do
      local x, y = batch(s * 10 + k)
      local out = ddp:forward(x)
      crit:forward(out, y)
      ddp:backward(x, crit:backward(out, y))
    end
    local cuts = {}
    for i, b in ipairs(ddp:bucket_plan()) do cuts[i] = b.offset end
    plans_seen[table.concat(cuts, ',')] = true
    sgd:step()
  end
  ddp:wait()
  return m:flatten().params.float32:clone(), ddp, plans_seen
end

local checks = 0
for _, acc in ipairs({ 1, 2 }) do
  local candidates = { 0.1, 0.6, 64, 128 }  -- 64 and 128 MB cut alike: timed once
  local p_auto, ddp, seen = train({ bucket_mb = 'auto', auto = { candidates = candidates, steps = 2, warmup = 1 } }, acc)
  local choice = ddp:bucket_choice()
  if choice == nil then fail('accumulate %d: no plan chosen after %d steps', acc, STEPS) end
  if #choice.candidates ~= 3 then fail('accumulate %d: %d candidates timed, expected 3 (64 and 128 MB are one plan)', acc, #choice.candidates) end
  local n = 0
  for _ in pairs(seen) do n = n + 1 end
  if n ~= 3 then fail('accumulate %d: the steps ran %d different plans, expected 3', acc, n) end
  -- the fastest candidate, and the same one on every rank
  for _, c in ipairs(choice.candidates) do
    if c.seconds < choice.seconds then fail('accumulate %d: kept %g MB (%g s) but %g MB took %g s', acc, choice.bucket_mb,
      choice.seconds, c.bucket_mb, c.seconds) end
  end
  local mine = dlua.tensor({ choice.bucket_mb, choice.buckets }, { dtype = 'float64' })
  local all = dlua.tensor({ choice.bucket_mb, choice.buckets }, { dtype = 'float64' })
  dist.all_reduce(all, 'max')
  if all[1] ~= mine[1] or all[2] ~= mine[2] then fail('accumulate %d: the ranks kept different plans', acc) end
  if ddp.bucket_mb ~= choice.bucket_mb or #ddp:bucket_plan() ~= choice.buckets then fail('the plan in use is not the one reported') end
  if choice.first_step ~= 2 or choice.last_step ~= 7 then fail('timed steps %s-%s, expected 2-7', tostring(choice.first_step), tostring(choice.last_step)) end
  -- the same run with the kept plan fixed from the start ends at the same parameters, bit for bit
  local p_fixed = train({ bucket_mb = choice.bucket_mb }, acc)
  if not p_auto:eq(p_fixed):all():item() then
    fail('accumulate %d: auto and bucket_mb = %g differ (max |diff| %g)', acc, choice.bucket_mb, (p_auto - p_fixed):abs():max():item())
  end
  checks = checks + 1
end

-- ddp.comm_wait_s counts the time blocked on the buckets: rank 1 starts its backward 0.3 s late, so
-- rank 0 waits that long for the all-reduce in its optimizer step (and rank 1 hardly at all)
do
  local m = net()
  local ddp = dist.DDP(m)
  local sgd = optim.SGD(ddp, { lr = 0.05 })
  local crit = nn.CrossEntropyLoss()
  local x, y = batch(1)
  local out = ddp:forward(x)
  crit:forward(out, y)
  if rank == 1 then
    local t = dlua.perf_counter() + 0.3
    while dlua.perf_counter() < t do end
  end
  local before = ddp.comm_wait_s
  ddp:backward(x, crit:backward(out, y))
  sgd:step()
  local waited = ddp.comm_wait_s - before
  if rank == 0 and waited < 0.2 then fail('comm_wait_s grew by %.3f s, expected about 0.3 s', waited) end
  if rank == 1 and waited > 0.2 then fail('comm_wait_s grew by %.3f s on the late rank', waited) end
  checks = checks + 1
end

-- bad options say what is wrong
local function err_of(opts)
  local ok, e = pcall(dist.DDP, net(), opts)
  if ok then fail('DDP accepted %s', dlua.json.encode(opts)) end
  return tostring(e)
end
if not err_of({ bucket_mb = 'fast' }):find("bucket_mb must be a positive number or 'auto'", 1, true) then fail('bucket_mb = fast') end
if not err_of({ bucket_mb = 25, auto = {} }):find("auto option needs bucket_mb = 'auto'", 1, true) then fail('auto without auto') end
if not err_of({ bucket_mb = 'auto', auto = { candidates = { 1, -2 } } }):find('auto.candidates[2] must be a positive', 1, true) then
  fail('a negative candidate')
end
if not err_of({ bucket_mb = 'auto', auto = { step = 2 } }):find("unknown auto option 'step'", 1, true) then fail('auto.step') end
checks = checks + 1
dist.destroy()
print(('ddp auto checks passed (%d)'):format(checks))
